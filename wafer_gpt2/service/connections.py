"""Connection limits uvicorn lacks, as its own HTTP protocol (httptools) with a few timers more.

uvicorn's `timeout_keep_alive` closes a connection idle *between* requests; nothing bounds one that never
sends a request, trickles its headers, stops halfway through its body, or the number of connections
(`limit_concurrency` answers 503 only once a request has arrived, so idle sockets pile up until the
process runs out of file descriptors). `GuardedHttpToolsProtocol` adds:

- a header deadline: from the connection (or the first byte of the next request on a kept-alive one)
  to the end of the request's headers, `header_timeout_s`. An idle connection is closed; one that was
  sending headers gets 408. Headers larger than `max_header_bytes` get 431.
- a body deadline: from the end of the headers to the end of the body, `body_timeout_s`; past it 408
  (if no response has started) and the connection is closed, which the app sees as a disconnect.
- body-pending connections (headers complete, body still to come: the request cannot have started
  any work) are bounded per client address, `max_body_pending_per_client`: beyond it that address's
  oldest is cut with 408 once it has waited `body_pending_grace_s` for its body (a client that writes
  headers and body separately is body-pending for a moment between them), so one address cannot hold
  many of them for the body deadline.
- a connection cap, `max_connections`: at the cap a new connection evicts the oldest one that has no
  request under way (connected and silent, sending headers, or idle between requests), else the oldest
  body-pending one that has waited `body_pending_grace_s` (408), so neither silent sockets nor
  body-less requests can lock clients out for long; otherwise the new one gets 503 with `Retry-After`.
  Connections closing after a refusal hold no place under the cap, and each new one over it closes
  one of them, so file descriptors stay bounded too.
- a client that half-closes after sending its request (shutdown(SHUT_WR)) still gets its response;
  the connection closes once it is sent.
- at shutdown, once the server has closed its port (`begin_closing`, wafer_gpt2/service/server.py), every
  connection closes after its current response, or its next one if it has none under way.

`fit_to_fd_limit` raises the process's file-descriptor limit and keeps the cap below it.

It also tells a request's handler of its client's disconnect by a callback (`WATCH_DISCONNECT` in the
request's scope), so a handler waiting for the engine needs no task of its own reading ASGI `receive`
for the disconnect (which cost two tasks and an `asyncio.wait` per request).
"""

from __future__ import annotations

import asyncio
import logging
import resource
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import cast

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from wafer_gpt2.settings import FD_RESERVE, ServerSettings

log = logging.getLogger(__name__)

REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large", 503: b"Service Unavailable"}

# The scope key of a request served by this protocol: `scope[WATCH_DISCONNECT](callback)` has `callback`
# called once when the client disconnects from the request (soon, when it already has); `(None)` stops.
WATCH_DISCONNECT = "wafer.watch_disconnect"
DisconnectWatch = Callable[[Callable[[], None] | None], None]


def _watch_disconnect(
    ref: weakref.ReferenceType[RequestResponseCycle], callback: Callable[[], None] | None
) -> None:
    cycle = ref()  # weak: the scope holds this, and the cycle holds the scope
    if cycle is None:
        return
    cycle.wafer_on_disconnect = callback  # type: ignore[attr-defined]
    if callback is None:
        return
    if cycle.disconnected:
        asyncio.get_running_loop().call_soon(_tell_disconnect, cycle)
    elif not cycle.response_complete:
        # What ASGI `receive` does before it waits: uvicorn stops reading a connection whose unread body
        # passed its buffer limit, and only a read notices the client leaving.
        cycle.flow.resume_reading()


def _tell_disconnect(cycle: RequestResponseCycle) -> None:
    """The client left `cycle`'s request: call its watcher, once."""
    callback = cycle.__dict__.pop("wafer_on_disconnect", None)
    if callback is not None:
        callback()


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout_s: float = ServerSettings.header_timeout_s
    body_timeout_s: float = ServerSettings.body_timeout_s
    keep_alive_timeout_s: float = ServerSettings.keep_alive_timeout_s
    max_connections: int = ServerSettings.max_connections
    max_body_pending_per_client: int = ServerSettings.max_body_pending_per_client
    body_pending_grace_s: float = ServerSettings.body_pending_grace_s
    max_header_bytes: int = 65536


def fit_to_fd_limit(max_connections: int, reserve: int = FD_RESERVE) -> int:
    """Raise this process's file-descriptor limit to its hard limit and return the connection cap that
    fits under it with `reserve` to spare (`max_connections` or less), logging both. Past the limit
    accept() fails (EMFILE) and new clients wait unanswered, while at the cap they get in by eviction;
    containers often start with a limit of 1024, the default cap."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = max(soft, max_connections + reserve) if hard == resource.RLIM_INFINITY else hard
    limit = soft
    if wanted > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            limit = wanted
        except (ValueError, OSError) as exc:
            log.warning("the file-descriptor limit %d could not be raised to %d: %s", soft, wanted, exc)
    raised = f" (raised from {soft})" if limit > soft else ""
    cap = min(max_connections, max(1, limit - reserve))
    if cap < max_connections:
        log.warning(
            "file-descriptor limit %d%s: --max-connections %d lowered to %d, keeping %d for the server's own "
            "files (raise the hard limit, e.g. `ulimit -Hn`, docker --ulimit nofile=N:N)",
            limit,
            raised,
            max_connections,
            cap,
            limit - cap,
        )
    else:
        log.info("file-descriptor limit %d%s; at most %d connections", limit, raised, cap)
    return cap


def protocol_class(limits: ConnectionLimits) -> type[GuardedHttpToolsProtocol]:
    """uvicorn's `http=` argument: the guarded protocol bound to `limits`, with this server's own
    eviction queues (see `GuardedHttpToolsProtocol`)."""
    queues: dict[str, object] = {
        "waiting": {},
        "refused": {},
        "body_pending": {},
        "body_pending_by_client": {},
    }
    return type("BoundGuardedHttpToolsProtocol", (GuardedHttpToolsProtocol,), {"limits": limits, **queues})


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    limits = ConnectionLimits()
    # Set when the server stops accepting (`begin_closing`): every response from then on closes its
    # connection.
    closing = False
    # This server's connections with no request under way, oldest first (the first to be evicted).
    waiting: dict[GuardedHttpToolsProtocol, None] = {}
    # Its connections answered with a refusal and closing gently (`_refuse`), oldest first: open, so
    # they hold descriptors, but no place under the cap; each new connection over the cap closes one.
    refused: dict[GuardedHttpToolsProtocol, None] = {}
    # Its connections whose request's headers have arrived and its body has not, oldest first (the next
    # to be evicted), and the same by client address. A connection joins only when a read ends with the
    # body still to come: a request that arrives whole never does.
    body_pending: dict[GuardedHttpToolsProtocol, None] = {}
    body_pending_by_client: dict[str, dict[GuardedHttpToolsProtocol, None]] = {}

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._timer: asyncio.TimerHandle | None = None  # set for `_due` or sooner (see `_arm`)
        self._due: float | None = None  # the deadline (loop time), None when none
        self._on_due: Callable[[], None] = _nothing
        self._header_bytes = 0
        self._in_headers = False  # between a request's first byte and the end of its headers
        self._in_body = False
        self._body_pending = False  # in `body_pending` (see there)
        self._pending_since = 0.0  # when the headers of the request whose body is pending ended
        self._eof = False
        self._refused = False  # answered and half-closed: what the client still sends is discarded
        if len(self.connections) - len(self.refused) > self.limits.max_connections:
            if self.refused:
                next(iter(self.refused)).evict()  # one descriptor fewer; its answer has been written
            if self.waiting:
                log.warning(
                    "%d connections open: the oldest without a request is closed", len(self.connections)
                )
                next(iter(self.waiting)).evict()
            elif self.body_pending and self._waited_long(next(iter(self.body_pending))):
                log.warning(
                    "%d connections open: the oldest still waiting for its request's body is closed",
                    len(self.connections),
                )
                next(iter(self.body_pending)).cut_body(
                    "request body not received: the server needed the connection for another", linger=False
                )
            else:
                log.warning(
                    "connection refused: all %d connections carry requests or have just sent headers",
                    len(self.connections) - 1,
                )
                self._refuse(503, "too many connections; retry shortly", b"retry-after: 1\r\n")
                return
        self._set_waiting(True)
        self._arm(self.limits.header_timeout_s, self._header_timed_out)

    def _set_waiting(self, waiting: bool) -> None:
        self.waiting.pop(self, None)
        if waiting:
            self.waiting[self] = None  # to the end: the newest

    def evict(self) -> None:
        self._set_waiting(False)
        self.refused.pop(self, None)
        self._drop_timer()
        self.transport.close()

    @classmethod
    def begin_closing(cls, connections: Iterable[object]) -> None:
        """The server has stopped accepting: each of `connections` (uvicorn's, this server's) closes
        after the response to its current request, or to its next one if it has none under way."""
        cls.closing = True
        for protocol in connections:
            cycle = getattr(protocol, "cycle", None)
            if cycle is not None and not cycle.response_complete:
                cycle.keep_alive = False

    @classmethod
    def awaiting_first_request(cls) -> int:
        """Connections that have not yet sent a request (nor been refused)."""
        return sum(1 for protocol in cls.waiting if protocol.cycle is None)

    def _waited_long(self, protocol: GuardedHttpToolsProtocol) -> bool:
        """`protocol`'s body has been pending for the grace (evicting it then costs nothing a client
        sending normally would lose)."""
        return self.loop.time() >= protocol._pending_since + self.limits.body_pending_grace_s

    def _set_body_pending(self, pending: bool) -> None:
        if pending == self._body_pending:
            return
        self._body_pending = pending
        client = self.client[0] if self.client else ""
        same_client = self.body_pending_by_client.get(client)
        if not pending:
            self.body_pending.pop(self, None)
            if same_client is not None:
                same_client.pop(self, None)
                if not same_client:
                    del self.body_pending_by_client[client]
            return
        # The body deadline was set when the headers ended: no clock read here.
        self._pending_since = (self._due or 0.0) - self.limits.body_timeout_s
        self.body_pending[self] = None
        if same_client is None:
            same_client = self.body_pending_by_client[client] = {}
        same_client[self] = None
        if len(same_client) > self.limits.max_body_pending_per_client:
            self._bound_client(same_client)

    def _bound_client(self, same_client: dict[GuardedHttpToolsProtocol, None]) -> None:
        """One address has more body-pending connections than its bound: cut its oldest that have
        waited the grace, and have the next oldest's deadline come when it will have."""
        limit = self.limits.max_body_pending_per_client
        while len(same_client) > limit:
            oldest = next(iter(same_client))
            if not self._waited_long(oldest):
                oldest._arm_at(
                    oldest._pending_since + self.limits.body_pending_grace_s, oldest._client_bound_due
                )
                return
            log.warning(
                "%s: more than %d connections waiting for their bodies: the oldest is closed",
                oldest.client[0] if oldest.client else "",
                limit,
            )
            oldest.cut_body(
                f"request body not received: more than {limit} connections from this address "
                "were waiting for their request bodies"
            )

    def _client_bound_due(self) -> None:
        """The grace of the oldest of an address over its bound has passed."""
        if self.transport.is_closing() or not self._body_pending:
            return
        same_client = self.body_pending_by_client.get(self.client[0] if self.client else "", {})
        if len(same_client) > self.limits.max_body_pending_per_client:
            self._bound_client(same_client)
        else:  # back within the bound meanwhile: the body deadline holds again
            self._arm_at(self._pending_since + self.limits.body_timeout_s, self._body_timed_out)

    def cut_body(self, message: str, linger: bool = True) -> None:
        """End the request whose body is still to come: 408 if no response has started, and the
        connection closes (`linger`: gently, see `_refuse`; else at once, to make room now); the app
        sees a disconnect."""
        self._set_body_pending(False)
        self._in_body = False
        self._disarm()
        cycle = self.cycle
        if cycle is not None and not cycle.response_started:
            self._refuse(408, message, linger=linger)
        else:
            self.transport.close()
        if cycle is not None:
            cycle.disconnected = True  # the app reads a disconnect now; what it sends goes nowhere
            cycle.message_event.set()
            _tell_disconnect(cycle)

    def connection_lost(self, exc: Exception | None) -> None:
        self._set_waiting(False)
        self.refused.pop(self, None)
        self._set_body_pending(False)
        self._drop_timer()
        super().connection_lost(exc)
        if self.cycle is not None and self.cycle.disconnected:
            _tell_disconnect(self.cycle)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        super().data_received(data)
        if self._in_headers and not self.transport.is_closing():  # the headers go on past this chunk
            self._header_bytes += len(data)
            if self._header_bytes > self.limits.max_header_bytes:
                self._refuse(431, f"request headers larger than {self.limits.max_header_bytes} bytes")
        elif self._in_body and not self._body_pending and not self.transport.is_closing():
            self._set_body_pending(True)  # the body goes on past this chunk

    # asyncio.Protocol's eof_received returns bool | None (True keeps the half-closed transport open);
    # uvicorn annotates its override `-> None`.
    def eof_received(self) -> bool | None:  # type: ignore[override]
        if self._refused:
            return None
        if self.cycle is not None and not self.cycle.response_complete and not self._in_body:
            self._eof = True  # half-closed after the request: keep writing its response
            return True
        return None  # nothing to answer: let the transport close

    # httptools callbacks

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_headers = True
        if self._due is None:  # a kept-alive connection's next request: its headers get a deadline
            self._arm(self.limits.header_timeout_s, self._header_timed_out)

    def on_headers_complete(self) -> None:
        self._set_waiting(False)  # a request is under way: never evicted
        self._in_headers, self._in_body = False, True
        self._header_bytes = 0
        self._arm(self.limits.body_timeout_s, self._body_timed_out)
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle.transport is self.transport:  # a new request's cycle
            if self.closing:
                cycle.keep_alive = False
            # Duck-typed: the cycle only writes, closes and asks is_closing.
            cycle.transport = cast(asyncio.Transport, HeadHeldTransport(self.transport, self.loop))
            cycle.scope[WATCH_DISCONNECT] = partial(_watch_disconnect, weakref.ref(cycle))  # type: ignore[literal-required]

    def on_message_complete(self) -> None:
        self._in_body = False
        if self._body_pending:
            self._set_body_pending(False)
        self._disarm()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._eof:
            self.transport.close()
        elif not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            self._set_waiting(True)  # idle between requests (not a pipelined one under way)

    # timers: one deadline at a time, set and cleared at every request (a loop timer armed
    # and cancelled twice per request costs a noticeable share of the HTTP process). Setting a deadline stores it; the
    # loop's timer is replaced only when the new deadline comes sooner than the one it was set for (a
    # request's header and body deadlines come later each time), and a timer that fires before the
    # deadline sets itself again for the rest. Clearing it leaves the timer to lapse.

    def _arm(self, seconds: float, callback: Callable[[], None]) -> None:
        self._arm_at(self.loop.time() + seconds, callback)

    def _arm_at(self, due: float, callback: Callable[[], None]) -> None:
        self._due, self._on_due = due, callback
        timer = self._timer
        if timer is None or timer.when() > due:
            if timer is not None:
                timer.cancel()
            self._timer = self.loop.call_at(due, self._deadline_reached)

    def _disarm(self) -> None:
        self._due = None

    def _drop_timer(self) -> None:
        """The connection is gone: its timer goes too (it would keep the protocol alive until it fired)."""
        self._due = None
        timer: asyncio.TimerHandle | None = getattr(self, "_timer", None)  # unset before __init__ ends
        if timer is not None:
            timer.cancel()
            self._timer = None

    def _deadline_reached(self) -> None:
        self._timer = None
        due = self._due
        if due is None:
            return
        if self.loop.time() < due:  # a later deadline replaced the one this timer was set for
            self._timer = self.loop.call_at(due, self._deadline_reached)
            return
        self._due = None
        self._on_due()

    def _header_timed_out(self) -> None:
        if self.transport.is_closing():
            return
        if self._in_headers:
            self._refuse(408, f"request headers not received within {self.limits.header_timeout_s:g} s")
        else:
            self.transport.close()  # connected and silent

    def _body_timed_out(self) -> None:
        if self.transport.is_closing() or not self._in_body:
            return
        self.cut_body(f"request body not received within {self.limits.body_timeout_s:g} s")

    def _refuse(self, status: int, message: str, extra_headers: bytes = b"", linger: bool = True) -> None:
        """Answer `status` and close gently: half-close, discard what still arrives for a second, then
        close (closing with unread data would reset the connection and lose the answer). Meanwhile it
        is in `refused`. Without `linger` it closes at once (the answer goes out before the close,
        unless the client had sent more)."""
        body = message.encode()
        self.transport.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: %d\r\n"
            b"connection: close\r\n%s\r\n%s" % (status, REASONS[status], len(body), extra_headers, body)
        )
        self._refused = True
        self._set_waiting(False)
        if linger and self.transport.can_write_eof():
            self.transport.write_eof()
            self._arm(1.0, self.transport.close)
            self.refused[self] = None
        else:
            self.transport.close()


def _nothing() -> None:
    pass


class HeadHeldTransport:
    """A response's view of its connection: its first write (the status line and headers) is held until
    its next write or the end of the event loop's turn, whichever comes first, so a small response goes
    out in one write (one system call and one wake-up of the client instead of two). A stream's
    head still goes out at once: at the end of the turn that started it. The bytes and their order are
    the same."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop):
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None
        self._first = True

    def write(self, data: bytes) -> None:
        if self._held is not None:
            data, self._held = self._held + data, None
        elif self._first:
            self._first = False
            self._held = data
            self._loop.call_soon(self.flush)
            return
        self._transport.write(data)

    def flush(self) -> None:
        held, self._held = self._held, None
        if held is not None and not self._transport.is_closing():
            self._transport.write(held)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def __getattr__(self, name: str):
        return getattr(self._transport, name)  # anything else, as the transport has it
