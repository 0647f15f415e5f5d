"""Server settings: every limit the service enforces, in one place (filled by `wafer-gpt2 serve`)."""

from __future__ import annotations

from dataclasses import dataclass

# File descriptors `serve` keeps for the server's own beyond its connections (the listener, the event
# loop, the engine process's pipes, logs: about 15 when idle), so that connections, capped below the
# limit less this, never make accept() fail (wafer_gpt2.service.connections.fit_to_fd_limit).
FD_RESERVE = 64

# `serve` runs the engine in a process of its own (HTTP and the engine each get a core and a GIL: more
# tokens/s where the host, not the backend, is the limit, and no loss on the simulator), and so does
# `bench host` by default, to measure what `serve` runs; an app built in-process (`ServerSettings`, the
# tests) keeps it on a thread unless asked.
SERVE_ENGINE_PROCESS = True


@dataclass(frozen=True)
class ServerSettings:
    # Where and what to serve.
    host: str = "127.0.0.1"
    port: int = 8000
    backend: str = "sim"
    model_id: str = "gpt2"  # the name /info and /v1/models report
    dtype: str = "fp16"

    # Capacity. `max_concurrent_requests` is the number of KV slots the wafer is asked for: the running
    # batch. `max_queue` more requests may wait; beyond that the answer is 429 at once.
    max_concurrent_requests: int = 16
    max_queue: int = 64
    context_length: int | None = None  # None: the model's n_positions
    top_k: int = 64  # candidates the wafer returns per token (the sampler's top_k may not exceed it)
    step_token_budget: int = 256  # items per step: decodes first, prefill chunks fill the rest

    # Request limits.
    max_input_tokens: int | None = None  # None: context_length - 1
    # Longest prompt text, checked before tokenizing. None: max_input_tokens x the most characters one
    # token stands for, so no prompt that could fit is refused.
    max_input_chars: int | None = None
    max_new_tokens_default: int = 100  # TGI route when the request does not say
    max_new_tokens_limit: int | None = None  # None: context_length - 1
    max_stop_sequences: int = 4
    max_stop_length: int = 200  # characters per stop sequence
    # OpenAI routes take any number of stop sequences (as vLLM); their total length is bounded because
    # the engine's worker checks each one at every token of the request.
    max_stop_chars_total: int = 4000
    max_top_n_tokens: int = 5  # TGI's top_n_tokens (TGI's own default limit)
    # The OpenAI routes' logprobs, top_logprobs and prompt_logprobs (vLLM's --max-logprobs and its
    # default); never more than the `top_k` candidates the wafer returns per token.
    max_logprobs: int = 20
    max_n: int = 8  # OpenAI `n` x number of prompts per request
    max_body_bytes: int = 1_000_000
    request_timeout_s: float = 600.0  # queue + generation; the request fails with 504 beyond it
    # The step watchdog: a step may take step_timeout_s + step_timeout_per_item_s x its items; beyond
    # that its requests fail (504) and the backend is restarted.
    step_timeout_s: float = 60.0
    step_timeout_per_item_s: float = 0.25

    # Connections (wafer_gpt2/service/connections.py): what a client may hold open and for how long.
    header_timeout_s: float = 10.0  # from connecting (or the next request's first byte) to its headers' end
    # From the headers' end to the body's end. A body is at most max_body_bytes (1 MB: 100 KB/s for 10 s)
    # and a prompt's is a few KB, which a client that is sending at all delivers in well under a second;
    # the same 10 s as the header deadline and as HAProxy's `timeout http-request` (deploy/haproxy).
    body_timeout_s: float = 10.0
    keep_alive_timeout_s: float = 5.0  # idle between two requests on one connection
    # Open connections. At the cap a new one evicts the oldest without a request under way, else the
    # oldest still waiting for its body; when every one carries a request it gets 503. `serve` raises
    # the file-descriptor limit to its hard limit and lowers this below it (FD_RESERVE).
    max_connections: int = 1024
    # Connections from one client address whose request body has not yet arrived (such a request has
    # started nothing); one more cuts that address's oldest with 408. Behind a balancer every client
    # shares its address, but the balancer sends bodies of up to 16 KB whole (deploy/haproxy:
    # http-buffer-request).
    max_body_pending_per_client: int = 32
    # A body-pending connection is cut to make room (the per-address bound above, the connection cap)
    # only once its body has been this late: many clients write headers and body separately, so a
    # request is body-pending for a moment between the two.
    body_pending_grace_s: float = 1.0
    # uvicorn's event loop: "asyncio" or "uvloop". asyncio's socket writes let go of the GIL, which the
    # engine's worker then gets; uvloop's hold it through the system call, a large share of the server's
    # GIL time on the streamed routes, so streams run faster on asyncio and nothing runs slower.
    event_loop: str = "asyncio"
    # The engine in a process of its own (`wafer_gpt2/engine/process.py`): HTTP and the engine each get a
    # GIL. The backend factory must then be picklable (it crosses a spawn). `serve` turns it on
    # (`SERVE_ENGINE_PROCESS` above).
    engine_process: bool = False
    # An engine process that has not reported for this long is taken for stopped or hung: /health answers
    # 503 `unresponsive`, new requests 503, and the requests it holds end at their own deadline
    # (`request_timeout_s`, 504) on the HTTP side. It reports at least every quarter of this.
    engine_heartbeat_timeout_s: float = 5.0
    # Messages to the engine process (requests, questions) that may wait while it does not read its pipe;
    # beyond that new requests get 503. Cancellations always wait their turn (each frees a KV slot).
    engine_outbox_limit: int = 256
    # How long /metrics and /info wait for the engine process's figures. Without them /metrics shows the
    # HTTP process's own series only (never the engine's counters as 0).
    engine_answer_timeout_s: float = 1.0
    # An engine process that dies is started again in place (/health 503 `reloading` meanwhile); more
    # than `engine_restart_limit` deaths within `engine_restart_window_s` stop the server (exit 1).
    engine_restart_limit: int = 3
    engine_restart_window_s: float = 600.0
    # After startup (and in an engine process after each load) the long-lived heap is frozen out of
    # the garbage collector (`wafer_gpt2/engine/heap.py`). `serve` sets it; tests that build many apps in one
    # process do not (each freeze is a full collection of the test process).
    freeze_heap: bool = False

    # Chat: the Jinja source of `--chat-template` (None: the plain transcript of wafer_gpt2.service.chat_template).
    chat_template: str | None = None

    # Lifecycle.
    shutdown_timeout_s: float = 30.0  # how long in-flight requests may finish after a shutdown signal
    api_key: str | None = None  # when set, generation routes need `Authorization: Bearer <key>`
