"""Request and operation metrics (`aenv.telemetry`) and JSON logs (`aenv.logs`) over a small
application of the API's shape, without a node: routes are counted by their template, the data
plane as one series, errors with their status, and log lines carry the sandbox they are about."""

from __future__ import annotations

import io
import json
import logging

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from aenv import logs
from aenv.telemetry import PROXIED, Telemetry

log = logging.getLogger("aenv.test.telemetry")


def samples(telemetry: Telemetry) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    from prometheus_client import generate_latest

    text = generate_latest(telemetry.registry).decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def app(telemetry: Telemetry) -> web.Application:
    async def create(request: web.Request) -> web.Response:
        return web.json_response({}, status=201)

    async def pause(request: web.Request) -> web.Response:
        log.info("pausing")
        raise web.HTTPConflict(text="not running")

    @web.middleware
    async def proxy(request: web.Request, handler):  # the data plane takes what carries the header
        if "E2b-Sandbox-Id" not in request.headers:
            return await handler(request)
        request[PROXIED] = True
        return web.Response(text="from the guest")

    application = web.Application(middlewares=[telemetry.middleware(), logs.request_context, proxy])
    application.router.add_post("/v2/sandboxes", create)
    application.router.add_post("/sandboxes/{sandboxID}/pause", pause)
    return application


async def test_requests_are_counted_by_route_template_and_operations_timed() -> None:
    telemetry = Telemetry(CollectorRegistry())
    async with TestClient(TestServer(app(telemetry))) as client:
        assert (await client.post("/v2/sandboxes")).status == 201
        for sandbox_id in ("sbx1", "sbx2"):
            assert (await client.post(f"/sandboxes/{sandbox_id}/pause")).status == 409
        assert (await client.get("/no/such/path")).status == 404
        relayed = await client.get("/files?path=/etc", headers={"E2b-Sandbox-Id": "sbx1"})
        assert await relayed.text() == "from the guest"
    seen = samples(telemetry)

    def value(name: str, **labels: str) -> float:
        return seen.get((name, frozenset(labels.items())), 0.0)

    requests = "aenv_http_requests_total"
    assert value(requests, route="/v2/sandboxes", method="POST", status="201") == 1
    assert value(requests, route="/sandboxes/{sandboxID}/pause", method="POST", status="409") == 2
    assert value(requests, route="unmatched", method="GET", status="404") == 1
    assert value(requests, route="proxy", method="GET", status="200") == 1
    operations = "aenv_operation_duration_seconds_count"
    assert value(operations, operation="create", stage="api", outcome="ok") == 1
    assert value(operations, operation="pause", stage="api", outcome="error") == 2
    assert value(operations, operation="proxy", stage="proxy", outcome="ok") == 1
    # no series names a sandbox: ids would make one per sandbox
    assert not any("sbx" in v for _, labels in seen for _, v in labels)


async def test_json_lines_carry_the_sandbox_a_request_names() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logs.JsonFormatter())
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        async with TestClient(TestServer(app(Telemetry(CollectorRegistry())))) as client:
            await client.post("/sandboxes/sbx7/pause")
        log.info("outside any request")
    finally:
        log.removeHandler(handler)
    inside, outside = (json.loads(line) for line in stream.getvalue().splitlines())
    assert inside["message"] == "pausing" and inside["sandbox_id"] == "sbx7"
    assert inside["level"] == "INFO" and inside["logger"] == "aenv.test.telemetry"
    assert "sandbox_id" not in outside


def test_exceptions_are_kept_in_json_lines() -> None:
    formatter = logs.JsonFormatter()
    try:
        raise ValueError("broken")
    except ValueError:
        record = logging.LogRecord("aenv", logging.ERROR, __file__, 1, "failed %s", ("here",), None)
        import sys

        record.exc_info = sys.exc_info()
    with logs.sandbox_context("sbx9"):
        line = json.loads(formatter.format(record))
    assert line["message"] == "failed here" and line["sandbox_id"] == "sbx9"
    assert "ValueError: broken" in line["exception"]
