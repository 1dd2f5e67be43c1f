"""The node service protocols (`aenv.orchestrator.interface`) and who implements which.

A gateway forwards each call by its keyword arguments (`aenv.cluster.wire`, from the protocols'
type hints), so every implementation must take the protocol's parameters under their names.
"""

from __future__ import annotations

import inspect

import pytest

from aenv.cluster import wire
from aenv.cluster.builds import ClusterBuilds
from aenv.cluster.catalog import ClusterCatalog
from aenv.cluster.clusternode import ClusterNode
from aenv.cluster.remote import RemoteNode
from aenv.orchestrator.interface import (
    BuildService,
    CatalogService,
    CheckpointService,
    HandoverService,
    NodeService,
    ObservationService,
    RouteService,
    SandboxService,
    StatusService,
)
from aenv.orchestrator.local import LocalNode

PARTS = (
    SandboxService, HandoverService, CheckpointService, ObservationService, CatalogService, BuildService,
    StatusService,
)  # fmt: skip


def calls(protocol: type) -> set[str]:
    return {name for name in dir(protocol) if not name.startswith("_")}


def test_the_parts_divide_the_node_service_and_it_travels_whole_but_the_upload() -> None:
    names = [name for part in PARTS for name in calls(part)]
    assert len(names) == len(set(names)) and set(names) == calls(NodeService)
    assert calls(NodeService) - {"receive_template_file"} == wire.CALLS
    assert not calls(RouteService) & calls(NodeService)


@pytest.mark.parametrize(
    ("implementation", "protocols"),
    [
        (LocalNode, (NodeService, RouteService)),
        (RemoteNode, (NodeService,)),
        (ClusterNode, (NodeService,)),
        (ClusterCatalog, (CatalogService, StatusService)),
        (ClusterBuilds, (BuildService,)),
    ],
)
def test_each_implementation_serves_its_protocols_by_their_parameters(
    implementation: type, protocols: tuple[type, ...]
) -> None:
    for protocol in protocols:
        for name in calls(protocol):
            expected = inspect.signature(getattr(protocol, name)).parameters
            assert inspect.signature(getattr(implementation, name)).parameters.keys() == expected.keys(), name


def test_only_a_node_routes_data_plane_traffic() -> None:
    assert hasattr(LocalNode, "route")
    assert not hasattr(ClusterNode, "route") and not hasattr(RemoteNode, "route")
