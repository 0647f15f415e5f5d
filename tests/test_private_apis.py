"""The service leans on a few names of uvicorn and FastAPI that are not their public API (the
connection limits extend uvicorn's httptools protocol, the shutdown closes uvicorn's listening
sockets itself, the lean path wraps FastAPI's route handler). pyproject pins the versions they were
written against; this test fails, naming the name, when an upgrade removes or renames one, before a
behaviour test fails for a reason that is harder to read. docs/architecture.md lists them."""

from __future__ import annotations

import inspect

import pytest
import uvicorn
from fastapi.routing import APIRoute, APIRouter
from pydantic import BaseModel
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle
from uvicorn.server import ServerState

from wafer_gpt2.service import connections, hot_routes, server

# What wafer_gpt2/service/connections.py overrides on uvicorn's protocol (each calls the original).
PROTOCOL_HOOKS = (
    "connection_made",
    "connection_lost",
    "data_received",
    "eof_received",
    "on_message_begin",
    "on_headers_complete",
    "on_message_complete",
    "on_response_complete",
)
# Attributes it reads, where uvicorn sets them.
PROTOCOL_ATTRIBUTES = ("transport", "cycle", "loop")
CYCLE_ATTRIBUTES = ("disconnected", "response_complete", "keep_alive", "flow")
# What wafer_gpt2/service/server.py reads of uvicorn.Server while it closes the port.
SERVER_ATTRIBUTES = ("servers", "server_state", "config", "lifespan", "should_exit", "force_exit")


def assigned_in(cls: type, attribute: str) -> bool:
    """`cls`'s own source (or a base's within the same library) assigns `self.<attribute>`."""
    return any(
        f"self.{attribute} =" in inspect.getsource(klass) or f"self.{attribute}: " in inspect.getsource(klass)
        for klass in cls.__mro__
        if klass.__module__.split(".")[0] == cls.__module__.split(".")[0]
    )


@pytest.mark.parametrize("name", PROTOCOL_HOOKS)
def test_uvicorn_protocol_still_has_the_overridden_hooks(name: str) -> None:
    assert callable(getattr(HttpToolsProtocol, name, None)), f"uvicorn's HttpToolsProtocol.{name} is gone"
    assert name in vars(connections.GuardedHttpToolsProtocol), (
        f"connections.GuardedHttpToolsProtocol no longer overrides {name}"
    )


@pytest.mark.parametrize("attribute", PROTOCOL_ATTRIBUTES)
def test_uvicorn_protocol_still_sets_what_the_limits_read(attribute: str) -> None:
    assert assigned_in(HttpToolsProtocol, attribute), (
        f"uvicorn's HttpToolsProtocol no longer sets .{attribute}"
    )


@pytest.mark.parametrize("attribute", CYCLE_ATTRIBUTES)
def test_uvicorn_cycle_still_sets_what_the_disconnect_watch_reads(attribute: str) -> None:
    assert assigned_in(RequestResponseCycle, attribute), f"RequestResponseCycle no longer sets .{attribute}"


def test_uvicorn_protocol_takes_the_arguments_the_shutdown_passes() -> None:
    parameters = inspect.signature(HttpToolsProtocol.__init__).parameters
    assert {"config", "server_state", "app_state"} <= parameters.keys()
    assert "connections" in inspect.signature(ServerState.__init__).parameters or assigned_in(
        ServerState, "connections"
    )


@pytest.mark.parametrize("attribute", SERVER_ATTRIBUTES)
def test_uvicorn_server_still_has_what_the_shutdown_reads(attribute: str) -> None:
    assert assigned_in(uvicorn.Server, attribute), f"uvicorn.Server no longer sets .{attribute}"
    assert issubclass(server.ServiceServer, uvicorn.Server)


class Body(BaseModel):
    text: str


async def echo(body: Body) -> str:
    return body.text


def test_fastapi_route_still_exposes_what_the_lean_path_wraps() -> None:
    assert callable(getattr(APIRoute, "get_route_handler", None))
    route = APIRoute("/echo", endpoint=echo, methods=["POST"])
    assert hasattr(route, "body_field"), "FastAPI's APIRoute no longer has .body_field"
    assert route.body_field is not None, "FastAPI's APIRoute.body_field no longer names the body's model"
    assert "route_class" in inspect.signature(APIRouter.__init__).parameters
    assert issubclass(hot_routes.ServiceRoute, APIRoute)
