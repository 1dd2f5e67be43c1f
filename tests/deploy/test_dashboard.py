"""The Grafana dashboard in deploy/grafana reads only series that nodes, gateways and the
scheduler export: a renamed metric fails here, not on an operator's empty panel."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import CollectorRegistry

from aenv.api.server import NodeAPI
from aenv.cluster.scheduler import SchedulerMetrics

DASHBOARD = Path(__file__).parents[2] / "deploy" / "grafana" / "aenv-dashboard.json"
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}


def exported(registry: CollectorRegistry) -> set[str]:
    return {family.name + suffix for family in registry.collect() for suffix in SUFFIXES[family.type]}


def test_every_series_the_dashboard_queries_is_exported() -> None:
    node = NodeAPI(None, domain="localhost:8000", limits={})  # type: ignore[arg-type]
    names = exported(node.registry) | exported(SchedulerMetrics().telemetry.registry)
    dashboard = json.loads(DASHBOARD.read_text())
    queried = {
        name
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"\baenv_[a-z_]+", target["expr"])
    }
    queried |= set(re.findall(r"\baenv_[a-z_]+", json.dumps(dashboard["templating"])))
    assert queried and queried <= names, sorted(queried - names)
    assert len({panel["id"] for panel in dashboard["panels"]}) == len(dashboard["panels"])
