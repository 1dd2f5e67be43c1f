"""Bad requests to the control plane: always a 4xx with a JSON `{code, message}`, never a 500 or a crash."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from .conftest import NodeServer, Sandboxes

pytestmark = pytest.mark.vm

UNKNOWN = "inotasandbox0000000000"


@pytest.fixture
def api(node: NodeServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=node.url, headers={"X-API-Key": node.key}, timeout=30) as client:
        yield client


def assert_client_error(response: httpx.Response, *statuses: int) -> dict:
    request = f"{response.request.method} {response.request.url.raw_path.decode()[:80]}"
    assert 400 <= response.status_code < 500, f"{request}: {response.status_code} {response.text[:300]}"
    if statuses:
        assert response.status_code in statuses, f"{request}: {response.status_code} {response.text[:300]}"
    assert response.headers["content-type"].startswith("application/json"), request
    body = response.json()
    assert body["code"] == response.status_code, (request, body)
    assert isinstance(body["message"], str) and body["message"], (request, body)
    return body


def post_raw(api: httpx.Client, path: str, content: bytes | str) -> httpx.Response:
    return api.post(path, content=content, headers={"Content-Type": "application/json"})


@pytest.mark.parametrize(
    "body",
    [
        b"{",
        b"not json",
        b"\xff\xfe\x00garbage",
        b'{"templateID": "base",}',
        b"[]",
        b'"base"',
        b"null",
        b"42",
        b'{"templateID": "base", "bogus": 1}',
        b'{"templateID": 5}',
        b'{"templateID": ""}',
        b'{"templateID": null}',
        b'{"templateID": "base", "timeout": "10"}',
        b'{"templateID": "base", "timeout": -1}',
        b'{"templateID": "base", "timeout": 1.5}',
        b'{"templateID": "base", "timeout": 99999999999}',
        b'{"templateID": "base", "metadata": {"k": 1}}',
        b'{"templateID": "base", "metadata": ["k"]}',
        b'{"templateID": "base", "envVars": "FOO=bar"}',
        b'{"templateID": "base", "autoPause": "yes"}',
        b'{"templateID": "base", "autoResume": {"enabled": true, "extra": 1}}',
        b'{"templateID": "base", "network": {"allowOut": ["example.com"]}}',
        b'{"templateID": "base", "network": {"denyOut": "0.0.0.0/0"}}',
        b'{"templateID": "base", "secure": "false"}',
        b'{"templateID": "' + b"x" * 300 + b'"}',
        b"",
    ],
)
def test_create_rejects_bad_bodies(api: httpx.Client, body: bytes) -> None:
    for path in ("/v2/sandboxes", "/sandboxes"):
        assert_client_error(post_raw(api, path, body))


def test_unknown_template(api: httpx.Client) -> None:
    for name in ("no-such-template", "../../etc/passwd", "team/none:tag", "%00", "ÜNICODE"):
        assert_client_error(api.post("/v2/sandboxes", json={"templateID": name}), 400, 404)
    for name in ("no-such-template", "a..b", "x" * 500):
        assert_client_error(api.get(f"/templates/{name}"), 400, 404)
        assert_client_error(api.delete(f"/templates/{name}"), 400, 404)
        assert_client_error(api.get(f"/templates/aliases/{name}"), 400, 404)
        assert_client_error(api.get(f"/snapshots/{name}"), 400, 404)


@pytest.mark.parametrize("sandbox_id", [UNKNOWN, "x" * 300, "-", "a.b", "%2e%2e", "i" + "é" * 10])
def test_unknown_sandbox(api: httpx.Client, sandbox_id: str) -> None:
    calls = [
        ("GET", f"/sandboxes/{sandbox_id}", None),
        ("DELETE", f"/sandboxes/{sandbox_id}", None),
        ("POST", f"/sandboxes/{sandbox_id}/timeout", {"timeout": 30}),
        ("POST", f"/sandboxes/{sandbox_id}/refreshes", {}),
        ("POST", f"/sandboxes/{sandbox_id}/pause", {}),
        ("POST", f"/sandboxes/{sandbox_id}/resume", {}),
        ("POST", f"/sandboxes/{sandbox_id}/connect", {"timeout": 30}),
        ("POST", f"/v2/sandboxes/{sandbox_id}/connect", {"timeout": 30}),
        ("GET", f"/sandboxes/{sandbox_id}/metrics", None),
        ("POST", f"/sandboxes/{sandbox_id}/snapshots", {}),
        ("POST", f"/sandboxes/{sandbox_id}/fork", {"count": 1}),
        ("PUT", f"/sandboxes/{sandbox_id}/network", {"allowOut": []}),
    ]
    for method, path, body in calls:
        response = api.request(method, path, json=body)
        assert_client_error(response, 400, 404)


def test_bad_bodies_for_a_running_sandbox(api: httpx.Client, sandboxes: Sandboxes) -> None:
    sandbox_id = sandboxes.create().sandbox_id
    calls = [
        ("POST", "timeout", b"{"),
        ("POST", "timeout", b"{}"),
        ("POST", "timeout", b'{"timeout": "5"}'),
        ("POST", "timeout", b'{"timeout": -5}'),
        ("POST", "timeout", b'{"timeout": 5, "extra": true}'),
        ("POST", "timeout", b'{"timeout": 99999999999}'),
        ("POST", "refreshes", b'{"duration": "x"}'),
        ("POST", "pause", b'{"memory": "no"}'),
        ("POST", "pause", b"[1]"),
        ("POST", "connect", b'{"timeout": "x"}'),
        ("POST", "snapshots", b'{"name": "bad name with spaces"}'),
        ("POST", "snapshots", b'{"name": 7}'),
        ("POST", "fork", b'{"count": 0}'),
        ("POST", "fork", b'{"count": 1000}'),
        ("POST", "fork", b'{"count": "2"}'),
        ("PUT", "network", b'{"allowOut": "nope"}'),
        ("PUT", "network", b'{"denyOut": ["not-a-cidr"]}'),
        ("PUT", "network", b"{"),
    ]
    for method, action, body in calls:
        json_type = {"Content-Type": "application/json"}
        response = api.request(method, f"/sandboxes/{sandbox_id}/{action}", content=body, headers=json_type)
        assert_client_error(response)
    assert api.get(f"/sandboxes/{sandbox_id}").json()["state"] == "running"


@pytest.mark.parametrize(
    "query",
    [
        "limit=abc",
        "limit=0",
        "limit=-1",
        "limit=100000",
        "state=bogus",
        "state=running,exploded",
        "nextToken=%%%",
        "nextToken=bm90LWEtdG9rZW4",
    ],
)
def test_bad_list_queries(api: httpx.Client, query: str) -> None:
    assert_client_error(api.get(f"/v2/sandboxes?{query}"), 400)


def test_oversize_body(api: httpx.Client) -> None:
    padding = "x" * (1 << 20)
    body = json.dumps({"templateID": "base", "metadata": {"pad": padding}})
    assert_client_error(post_raw(api, "/v2/sandboxes", body), 413)
    assert_client_error(post_raw(api, f"/sandboxes/{UNKNOWN}/timeout", body), 404, 413)


def test_authentication(node: NodeServer) -> None:
    with httpx.Client(base_url=node.url, timeout=30) as client:
        calls = [("GET", "/v2/sandboxes"), ("POST", "/v2/sandboxes"), ("GET", f"/sandboxes/{UNKNOWN}")]
        for method, path in calls:
            body = {"templateID": "base"} if method == "POST" else None
            for headers in (
                {},
                {"X-API-Key": "e2b_wrong"},
                {"X-API-Key": ""},
                {"X-API-Key": node.key + "x"},
                {"Authorization": f"Bearer {node.key}"},
            ):
                assert_client_error(client.request(method, path, json=body, headers=headers), 401)
            two_keys = [("X-API-Key", node.key), ("X-API-Key", "e2b_other")]
            response = client.request(method, path, json=body, headers=httpx.Headers(two_keys))
            assert_client_error(response, 401)
            same_twice = [("X-API-Key", node.key), ("X-API-Key", node.key)]
            response = client.request(method, path, json=body, headers=httpx.Headers(same_twice))
            assert_client_error(response, 401)
        assert client.get("/health").status_code == 204


def test_unknown_routes_and_methods(api: httpx.Client) -> None:
    assert_client_error(api.get("/no/such/route"), 404)
    assert_client_error(api.request("PATCH", "/v2/sandboxes"), 404, 405)
    assert_client_error(api.delete("/v2/sandboxes"), 404, 405)
    assert_client_error(api.put("/sandboxes"), 404, 405)


def test_node_still_healthy(node: NodeServer, api: httpx.Client) -> None:
    """Runs last in this module: after all of the above the node is up and serving."""
    assert node.healthy() and node.alive()
    assert api.get("/v2/sandboxes").status_code == 200
    assert "Traceback" not in node.log_tail(400)
