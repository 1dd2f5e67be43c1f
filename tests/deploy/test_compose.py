"""deploy/compose/compose.yaml: valid by the Compose specification (the compose_spec parser,
offline), every reference resolved, and every aenv service's environment accepted by the node's
own settings loader with the services pointing at each other."""

from __future__ import annotations

import json
import re
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from compose_spec import PyCompose

from .wiring import DEPLOY, generated_secrets, image_environment, read_env_file, service_settings

COMPOSE = DEPLOY / "compose"
INTERPOLATION = re.compile(r"\$\{(\w+)(:-([^}]*))?\}")
AENV_SERVICES = ("scheduler", "gateway", "node1", "node2")
NODES = ("node1", "node2")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    """The file as Compose sees it with nothing set in the environment: defaults interpolated."""
    text = (COMPOSE / "compose.yaml").read_text()
    assert all(m.group(2) for m in INTERPOLATION.finditer(text)), "every ${VAR} needs a default"
    return yaml.safe_load(INTERPOLATION.sub(lambda m: m.group(3), text))


def environment(service: dict[str, Any]) -> dict[str, str]:
    """What the container's process sees: the image's ENV, the env files, then `environment`."""
    env = image_environment() if service["image"].startswith("localhost/aenv") else {}
    for name in service.get("env_file", []):
        env.update(generated_secrets() if name == "secrets.env" else read_env_file(COMPOSE / name))
    env.update({k: str(v) for k, v in service.get("environment", {}).items()})
    return env


def test_compose_file_follows_the_specification(compose: dict[str, Any]) -> None:
    PyCompose.from_json(json.dumps(compose)).validate()


def test_references_resolve(compose: dict[str, Any]) -> None:
    services, volumes = compose["services"], compose["volumes"]
    for name, service in services.items():
        assert set(service.get("depends_on", {})) <= set(services) - {name}, name
        named = {v.split(":", 1)[0] for v in service.get("volumes", []) if not v.startswith((".", "/"))}
        assert named <= set(volumes), name
        for env_file in service.get("env_file", []):
            assert (COMPOSE / env_file).exists() or env_file == "secrets.env", env_file
    # secrets.env is made by secrets.sh and never committed
    assert "secrets.env" in (COMPOSE / ".gitignore").read_text().split()


def port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def test_services_get_valid_settings_and_find_each_other(compose: dict[str, Any]) -> None:
    services = compose["services"]
    settings = {name: service_settings(environment(services[name])) for name in AENV_SERVICES}
    scheduler_url = f"http://scheduler:{port(settings['scheduler'].scheduler_addr)}"
    for name, s in settings.items():
        assert s.scheduler_url == scheduler_url, name
        assert urlsplit(s.redis_url).hostname == "redis", name
        assert s.cluster_secret and s.api_key, name
    published = [p.rsplit(":", 1)[1] for p in services["gateway"]["ports"]]
    assert published == [str(port(settings["gateway"].gateway_addr))]
    for name in NODES:
        node = settings[name]
        assert node.node_addr == f"http://{name}:{node.port}"
        assert node.repository.startswith("s3://") and urlsplit(node.s3_endpoint).hostname == "s3"
        assert services[name]["privileged"] and services[name]["cgroup"] == "host"
    first, second = (settings[name] for name in NODES)
    assert first.slot_first + first.slot_count <= second.slot_first, "network slot ranges overlap"
