"""Bad requests to the control plane: always a 4xx with a JSON `{code, message}`, never a 500 or a crash."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from urllib.parse import quote

import httpx
import pytest

from .conftest import NodeServer, Sandboxes

pytestmark = pytest.mark.vm

UNKNOWN = "inotasandbox0000000000"
# Values past what the node takes: beyond the 24 h cap, past 64 bits, and too long to convert.
HUGE_TIMEOUTS = [b"86401", b"2147483648", b"1" + b"0" * 30, b"9" * 5000]
DEEP = b"[" * 100_000


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
        *(b'{"templateID": "base", "timeout": ' + t + b"}" for t in HUGE_TIMEOUTS),
        DEEP,
        b'{"templateID": "base", "metadata": ' + DEEP,
        b'{"templateID": "base", "mcp": ' + b'{"a": ' * 50_000,
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
        ("POST", "connect", DEEP),
        *(("POST", "connect", b'{"timeout": ' + t + b"}") for t in HUGE_TIMEOUTS),
        *(("POST", "fork", b'{"timeout": ' + t + b"}") for t in HUGE_TIMEOUTS),
        *(("POST", "timeout", b'{"timeout": ' + t + b"}") for t in HUGE_TIMEOUTS),
        ("POST", "snapshots", b'{"name": "bad name with spaces"}'),
        ("POST", "snapshots", b'{"name": 7}'),
        ("POST", "snapshots", b'{"name": "Upper/Case:1.0"}'),
        ("POST", "fork", b'{"count": 0}'),
        ("POST", "fork", b'{"count": 17}'),
        ("POST", "fork", b'{"count": 1000}'),
        ("POST", "fork", b'{"count": "2"}'),
        ("PUT", "network", b'{"allowOut": "nope"}'),
        ("PUT", "network", b'{"denyOut": ["not-a-cidr"]}'),
        ("PUT", "network", b"{"),
    ]
    for method, action, body in calls:
        json_type = {"Content-Type": "application/json"}
        response = api.request(method, f"/sandboxes/{sandbox_id}/{action}", content=body, headers=json_type)
        assert_client_error(response, 400)
    sandbox = api.get(f"/sandboxes/{sandbox_id}").json()
    assert sandbox["state"] == "running"
    assert sandbox["endAt"] < "2030", sandbox["endAt"]  # no refused timeout was applied


def test_snapshot_names(api: httpx.Client, sandboxes: Sandboxes, node: NodeServer) -> None:
    """E2B's `namespace/name:tag` spelling is taken (the node keeps the name); other names are refused,
    not rewritten; deleting a snapshot is logged."""
    sandbox_id = sandboxes.create().sandbox_id
    for name in ("Upper/Case:1.0", "UPPER", "a/b/c"):
        response = api.post(f"/sandboxes/{sandbox_id}/snapshots", json={"name": name})
        assert "invalid snapshot name" in assert_client_error(response, 400)["message"]
    response = api.post(f"/sandboxes/{sandbox_id}/snapshots", json={"name": "team/e2e-names:v1"}, timeout=300)
    assert response.status_code == 201, response.text
    snapshot = response.json()
    assert snapshot["names"] == ["e2e-names"]
    assert api.delete("/templates/e2e-names").status_code == 204
    assert f"deleted snapshot {snapshot['snapshotID']}" in node.log_tail(200)


def test_built_in_template_cannot_be_deleted(api: httpx.Client) -> None:
    for reference in ("base", "team/base:default", api.get("/templates/base").json()["templateID"]):
        body = assert_client_error(api.delete(f"/templates/{quote(reference, safe='')}"), 409)  # as the SDK
        assert "built into this node" in body["message"]
    assert api.get("/templates/base").status_code == 200
    created = api.post("/v2/sandboxes", json={"templateID": "base"}, timeout=300)
    assert created.status_code == 201, created.text
    assert api.delete(f"/sandboxes/{created.json()['sandboxID']}").status_code == 204


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
    for method, path in (("PATCH", "/v2/sandboxes"), ("DELETE", "/v2/sandboxes"), ("PUT", "/sandboxes")):
        response = api.request(method, path)
        assert_client_error(response, 405)
        assert set(response.headers["Allow"].split(",")) == {"GET", "POST"}, response.headers


def raw_request(node: NodeServer, request: bytes) -> tuple[int, str, bytes]:
    """Send bytes that httpx would refuse to; the status, content type and body of the answer."""
    with socket.create_connection(("127.0.0.1", node.port), timeout=30) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):  # the node closes the connection after such an error
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers.get("content-type", ""), body


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GET /v2/sandboxes/" + b"a" * 20_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET /v2/sandboxes HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"p" * 20_000 + b"\r\n\r\n",
        b"GET /\x00 HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET / HTTP/7.0\r\n\r\n",
        b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03\r\n\r\n",
    ],
)
def test_unparseable_requests(node: NodeServer, request_bytes: bytes) -> None:
    status, content_type, body = raw_request(node, request_bytes)
    assert status == 400 and content_type.startswith("application/json"), (status, content_type, body[:200])
    error = json.loads(body)
    assert error["code"] == 400 and error["message"]


def test_openapi_declares_constraints(api: httpx.Client) -> None:
    document = api.get("/openapi.json").json()
    ids = [op["operationId"] for ops in document["paths"].values() for op in ops.values()]
    assert len(ids) == len(set(ids))
    connect = document["components"]["schemas"]["ConnectSandbox"]["properties"]
    timeout = next(b for b in connect["timeout"]["anyOf"] if b.get("type") == "integer")
    assert timeout["maximum"] == 24 * 3600
    snapshot = document["components"]["schemas"]["SnapshotRequest"]["properties"]
    assert next(b for b in snapshot["memory"]["anyOf"] if b.get("type") != "null")["type"] == "boolean"


def test_node_still_healthy(node: NodeServer, api: httpx.Client) -> None:
    """Runs last in this module: after all of the above the node is up and serving."""
    assert node.healthy() and node.alive()
    assert api.get("/v2/sandboxes").status_code == 200
    log = node.log_tail(400)
    assert "Traceback" not in log and " ERROR " not in log
