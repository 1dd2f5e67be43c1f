"""deploy/k8s: every manifest valid by the Kubernetes API schemas (kubernetes-validate --strict,
offline), every ConfigMap, Secret and Service reference resolved, and every aenv container's
environment accepted by the node's own settings loader."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from .wiring import DEPLOY, generated_secrets, image_environment, service_settings

K8S = DEPLOY / "k8s"
VERSIONS = ("1.28.0", "1.37.0")  # the oldest Kubernetes still in wide use, the newest known here
WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet")
POD_IP = "10.0.0.7"


@pytest.fixture(scope="module")
def kustomization() -> dict[str, Any]:
    return yaml.safe_load((K8S / "kustomization.yaml").read_text())


@pytest.fixture(scope="module")
def resources(kustomization: dict[str, Any]) -> list[dict[str, Any]]:
    files = (K8S / name for name in kustomization["resources"])
    return [doc for path in files for doc in yaml.safe_load_all(path.read_text())]


def named(resources: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {r["metadata"]["name"]: r for r in resources if r["kind"] == kind}


def containers(resources: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(workload, container) for every container of every workload."""
    for r in resources:
        if r["kind"] in WORKLOADS:
            for container in r["spec"]["template"]["spec"]["containers"]:
                yield r, container


def test_every_manifest_is_listed(kustomization: dict[str, Any]) -> None:
    assert sorted(kustomization["resources"]) == sorted(
        p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml"
    )


@pytest.mark.parametrize("version", VERSIONS)
def test_manifests_validate_strictly(resources: list[dict[str, Any]], version: str) -> None:
    for resource in resources:
        kubernetes_validate.validate(resource, version, strict=True)


def test_references_resolve(resources: list[dict[str, Any]], kustomization: dict[str, Any]) -> None:
    config_maps = set(named(resources, "ConfigMap"))
    secrets = {generator["name"] for generator in kustomization["secretGenerator"]}
    for _, container in containers(resources):
        for source in container.get("envFrom", []):
            if "configMapRef" in source:
                assert source["configMapRef"]["name"] in config_maps
            if "secretRef" in source:
                assert source["secretRef"]["name"] in secrets
    workloads = [r for r in resources if r["kind"] in WORKLOADS]
    for service in named(resources, "Service").values():
        selected = [
            w for w in workloads
            if service["spec"]["selector"].items() <= w["spec"]["template"]["metadata"]["labels"].items()
        ]  # fmt: skip
        assert len(selected) == 1, service["metadata"]["name"]
        ports = {p["name"] for c in selected[0]["spec"]["template"]["spec"]["containers"] for p in c["ports"]}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= ports


def environment(resources: list[dict[str, Any]], container: dict[str, Any]) -> dict[str, str]:
    """What the container's process sees: image ENV, envFrom sources, then `env` ($(VAR) expanded)."""
    env = image_environment()
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env.update(named(resources, "ConfigMap")[source["configMapRef"]["name"]]["data"])
        else:
            env.update(generated_secrets())
    for item in container.get("env", []):
        env[item["name"]] = POD_IP if "valueFrom" in item else item["value"].replace("$(POD_IP)", POD_IP)
    return env


def test_containers_get_valid_settings_and_find_each_other(resources: list[dict[str, Any]]) -> None:
    services = {name: s["spec"]["ports"][0]["port"] for name, s in named(resources, "Service").items()}
    aenv = [(w, c) for w, c in containers(resources) if c["image"].startswith("localhost/aenv")]
    assert {c["args"][0] for _, c in aenv} == {"scheduler", "gateway", "server"}
    for workload, container in aenv:
        settings = service_settings(environment(resources, container))
        scheduler = urlsplit(settings.scheduler_url)
        assert services[scheduler.hostname] == scheduler.port
        assert urlsplit(settings.redis_url).hostname in services
        assert settings.cluster_secret and settings.api_key
        own = {p["containerPort"] for p in container["ports"]}
        address = {"scheduler": settings.scheduler_addr, "gateway": settings.gateway_addr}
        assert int(address.get(container["args"][0], settings.api_addr).rsplit(":", 1)[1]) in own
        if container["args"][0] == "server":
            assert settings.node_addr == f"http://{POD_IP}:{settings.port}"
            assert container["securityContext"]["privileged"]
            assert not workload["spec"]["template"]["spec"]["hostNetwork"]
