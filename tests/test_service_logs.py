"""Log lines carry the HTTP request's id (text and JSON), and the id comes back in `X-Request-Id`."""

from __future__ import annotations

import json
import logging
import sys

from fastapi import FastAPI
from fastapi.testclient import TestClient

from wafer_gpt2.engine.request import GenerationRequest, RequestState
from wafer_gpt2.logs import JsonFormatter, RequestIdFilter, RequestIdMiddleware, configure

log = logging.getLogger("test.service_logs")


def app_with_ids(records: list[logging.LogRecord]) -> FastAPI:
    app = FastAPI()
    app.add_middleware(RequestIdMiddleware)

    @app.get("/hello")
    async def hello() -> dict:
        record = log.makeRecord(log.name, logging.INFO, __file__, 0, "hello", (), None)
        RequestIdFilter().filter(record)
        records.append(record)
        state = RequestState(GenerationRequest((1,), 1), detokenizer=None, sampler=None)
        return {"state_id": state.id}

    return app


def test_request_id_is_echoed_logged_and_names_the_engine_state():
    records: list[logging.LogRecord] = []
    client = TestClient(app_with_ids(records))
    response = client.get("/hello", headers={"X-Request-Id": "abc-123"})
    assert response.headers["x-request-id"] == "abc-123"
    assert records[-1].request_id == "abc-123"
    assert response.json()["state_id"].startswith("abc-123.")

    fresh = client.get("/hello")
    assert fresh.headers["x-request-id"] not in ("", "abc-123")
    assert records[-1].request_id == fresh.headers["x-request-id"]

    unusable = client.get("/hello", headers={"X-Request-Id": "a b\tc" * 30})
    assert unusable.headers["x-request-id"] != "a b\tc" * 30  # never copied into log lines as is


def test_json_lines_carry_the_request_id_and_the_traceback():
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        record = log.makeRecord(log.name, logging.ERROR, __file__, 0, "step %s", ("failed",), sys.exc_info())
    record.request_id = "r-1"
    entry = json.loads(JsonFormatter().format(record))
    assert entry["request_id"] == "r-1" and entry["message"] == "step failed" and entry["level"] == "ERROR"
    assert "RuntimeError: boom" in entry["exception"]


def test_configure_installs_one_root_handler_with_the_filter():
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        configure("warning", "json")
        (handler,) = root.handlers
        assert isinstance(handler.formatter, JsonFormatter)
        assert any(isinstance(f, RequestIdFilter) for f in handler.filters)
        assert root.level == logging.WARNING
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
