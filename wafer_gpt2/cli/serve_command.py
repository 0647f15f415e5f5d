"""`wafer-gpt2 serve`: the HTTP service (TGI and OpenAI APIs) over a long-lived wafer worker.

The checkpoint is loaded and checked before the server starts, so a bad one ends here with one error
line and a non-zero exit, never a server answering with garbage. The port then opens at once; the
worker uploads the model to the backend (/health answers 503 until it is done). If that upload fails,
the server stops with exit status 1.
"""

from __future__ import annotations

import argparse
import functools
import ipaddress
import os
import sys
from dataclasses import replace
from pathlib import Path

from wafer_gpt2.backends.registry import (
    BACKENDS,
    DEFAULT_BACKEND,
    BackendOptions,
    build_backend,
    build_sim_backend,
)
from wafer_gpt2.core.steps import Backend
from wafer_gpt2.errors import UserError
from wafer_gpt2.logs import LOG_FORMATS
from wafer_gpt2.logs import configure as configure_logging
from wafer_gpt2.model.checkpoint import load_checkpoint, resolve_weights
from wafer_gpt2.model.params import GPT2Params
from wafer_gpt2.service.chat_template import ChatTemplateError, load_chat_template
from wafer_gpt2.settings import SERVE_ENGINE_PROCESS, ServerSettings

API_KEY_ENV = "WAFER_GPT2_API_KEY"
ALLOW_NO_API_KEY_ENV = "WAFER_GPT2_ALLOW_NO_API_KEY"


def exposure_problem(host: str, api_key: str | None, allow_no_api_key: bool) -> str | None:
    """Why serving on `host` as configured is refused: an address beyond loopback needs an API key or
    the explicit opt-out. None when it may go ahead."""
    if api_key or allow_no_api_key:
        return None
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if loopback:
        return None
    return (
        f"--host {host} serves beyond loopback and no API key is set: set ${API_KEY_ENV} (or --api-key), "
        f"or pass --allow-no-api-key (${ALLOW_NO_API_KEY_ENV}=1) to serve without authentication"
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    defaults = ServerSettings()
    parser = subparsers.add_parser(
        "serve",
        help="serve the model over HTTP (TGI- and OpenAI-compatible)",
        description="Serve GPT-2 over HTTP: POST /generate, /generate_stream, /, /v1/completions, "
        "/v1/chat/completions; "
        "GET /health, /info, /metrics, /v1/models.",
    )
    parser.add_argument("--host", default=defaults.host, help=f"address to bind ({defaults.host})")
    parser.add_argument("--port", type=int, default=defaults.port, help=f"port ({defaults.port})")
    parser.add_argument("--backend", choices=BACKENDS, default=DEFAULT_BACKEND, help="what runs the model")
    parser.add_argument(
        "--weights", help="an HF GPT-2 directory or an llm.c .bin (default: the embedded demo model)"
    )
    parser.add_argument(
        "--model",
        "--served-model-name",
        dest="model",
        help="the name clients use for the model (/info, /v1/models, OpenAI `model`); default: the checkpoint's",
    )
    parser.add_argument("--dtype", choices=("fp16", "fp32"), default=defaults.dtype, help="wafer precision")
    parser.add_argument(
        "--max-concurrent",
        type=int,
        default=defaults.max_concurrent_requests,
        metavar="N",
        help=f"KV slots on the wafer = requests in the running batch ({defaults.max_concurrent_requests})",
    )
    parser.add_argument(
        "--max-queue",
        type=int,
        default=defaults.max_queue,
        metavar="N",
        help=f"requests that may wait for a slot; beyond that the answer is 429 ({defaults.max_queue})",
    )
    parser.add_argument(
        "--context", type=int, metavar="T", help="KV positions per slot (default: the model's n_positions)"
    )
    parser.add_argument(
        "--top-k",
        type=int,
        default=defaults.top_k,
        metavar="K",
        help=f"candidates the wafer returns per token ({defaults.top_k})",
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=1,
        metavar="R",
        help="pipeline replicas on the wafer; --max-concurrent slots are shared among them (1)",
    )
    parser.add_argument(
        "--steps-in-flight",
        type=int,
        default=1,
        metavar="N",
        help="steps the host program keeps on a wafer backend (sim, csl, sdk-*, modeled) at a time: the "
        "running requests are stepped in N groups, the next group's step sent while one computes (1)",
    )
    parser.add_argument(
        "--step-token-budget",
        type=int,
        default=defaults.step_token_budget,
        metavar="N",
        help=f"token items per engine step; prompts are chunked to fit ({defaults.step_token_budget})",
    )
    parser.add_argument(
        "--max-input-tokens", type=int, metavar="N", help="longest prompt (default: context - 1)"
    )
    parser.add_argument(
        "--max-input-chars",
        type=int,
        metavar="N",
        help="longest prompt text, checked before tokenizing (default: max input tokens x 66, the most "
        "characters one GPT-2 token stands for)",
    )
    parser.add_argument(
        "--max-new-tokens", type=int, metavar="N", help="largest max_new_tokens (default: context - 1)"
    )
    parser.add_argument(
        "--max-logprobs",
        type=int,
        default=defaults.max_logprobs,
        metavar="N",
        help="most alternatives per token the OpenAI routes' logprobs, top_logprobs and prompt_logprobs "
        f"may ask for, at most --top-k ({defaults.max_logprobs}, as vLLM)",
    )
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=defaults.request_timeout_s,
        metavar="S",
        help="seconds a request may take, queue included",
    )
    parser.add_argument(
        "--step-timeout",
        type=float,
        default=defaults.step_timeout_s,
        metavar="S",
        help="the step watchdog: seconds a wafer step may take, plus --step-timeout-per-item per item; "
        f"past that its requests fail (504) and the backend restarts ({defaults.step_timeout_s:g})",
    )
    parser.add_argument(
        "--step-timeout-per-item",
        type=float,
        default=defaults.step_timeout_per_item_s,
        metavar="S",
        help=f"seconds added to a step's deadline per item it carries ({defaults.step_timeout_per_item_s:g})",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=defaults.shutdown_timeout_s,
        metavar="S",
        help="seconds running requests may take to finish at shutdown",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=defaults.max_body_bytes,
        metavar="B",
        help="largest request body",
    )
    for flag, dest, what in (
        ("--header-timeout", "header_timeout_s", "seconds a client may take to send a request's headers"),
        ("--body-timeout", "body_timeout_s", "seconds a client may take to send a request's body"),
        ("--keep-alive-timeout", "keep_alive_timeout_s", "seconds an idle connection stays open"),
    ):
        default = getattr(defaults, dest)
        parser.add_argument(
            flag, type=float, dest=dest, default=default, metavar="S", help=f"{what} ({default:g})"
        )
    parser.add_argument(
        "--max-connections",
        type=int,
        default=defaults.max_connections,
        metavar="N",
        help="open connections; at the cap a new one evicts the oldest idle one, else the oldest waiting for "
        "its body; when all carry requests it gets 503 (lowered below the file-descriptor limit; "
        f"{defaults.max_connections})",
    )
    parser.add_argument(
        "--max-body-pending-per-client",
        type=int,
        default=defaults.max_body_pending_per_client,
        metavar="N",
        help="connections from one client address whose request body is still to come; beyond it the "
        f"oldest is cut with 408 once late by --body-pending-grace ({defaults.max_body_pending_per_client})",
    )
    parser.add_argument(
        "--body-pending-grace",
        type=float,
        dest="body_pending_grace_s",
        default=defaults.body_pending_grace_s,
        metavar="S",
        help="seconds a request's body may lag its headers before the connection may be cut to make room "
        f"(the per-address bound, the connection cap) ({defaults.body_pending_grace_s:g})",
    )
    parser.add_argument(
        "--event-loop",
        choices=("asyncio", "uvloop"),
        default=defaults.event_loop,
        help=f"uvicorn's event loop ({defaults.event_loop}: its socket writes let the engine's thread run)",
    )
    parser.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=SERVE_ENGINE_PROCESS,
        help="run the engine (and the model's backend) in a process of its own: HTTP and the engine each "
        "get a core and a GIL (wafer_gpt2/engine/process.py; on by default, --no-engine-process: one process)",
    )
    parser.add_argument(
        "--engine-heartbeat-timeout",
        type=float,
        default=defaults.engine_heartbeat_timeout_s,
        metavar="S",
        help="an engine process that has not reported for S seconds is taken for stopped or hung: /health "
        "503 `unresponsive`, new requests 503, and its requests end at their --request-timeout "
        f"(504) until it reports again ({defaults.engine_heartbeat_timeout_s:g})",
    )
    parser.add_argument(
        "--engine-outbox-limit",
        type=int,
        default=defaults.engine_outbox_limit,
        metavar="N",
        help="messages that may wait for an engine process that does not read them; beyond that new "
        f"requests get 503 ({defaults.engine_outbox_limit})",
    )
    parser.add_argument(
        "--engine-answer-timeout",
        type=float,
        default=defaults.engine_answer_timeout_s,
        metavar="S",
        help="how long /metrics and /info wait for the engine process's figures; /metrics then leaves the "
        f"engine's series out ({defaults.engine_answer_timeout_s:g})",
    )
    parser.add_argument(
        "--engine-restart-limit",
        type=int,
        default=defaults.engine_restart_limit,
        metavar="N",
        help="an engine process that dies is started again in place (/health 503 `reloading` meanwhile); "
        "after N restarts within --engine-restart-window the next death stops the server, exit status 1 "
        f"(0: never restart) ({defaults.engine_restart_limit})",
    )
    parser.add_argument(
        "--engine-restart-window",
        type=float,
        default=defaults.engine_restart_window_s,
        metavar="S",
        help=f"the window of --engine-restart-limit, seconds ({defaults.engine_restart_window_s:g})",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"require `Authorization: Bearer KEY` (default: ${API_KEY_ENV}; unset: no authentication)",
    )
    parser.add_argument(
        "--allow-no-api-key",
        action="store_true",
        default=os.environ.get(ALLOW_NO_API_KEY_ENV, "") not in ("", "0"),
        help=f"serve beyond loopback without an API key (default: ${ALLOW_NO_API_KEY_ENV}=1); without it a "
        "--host other than loopback needs a key",
    )
    parser.add_argument(
        "--chat-template",
        metavar="FILE",
        help="Jinja chat template for /v1/chat/completions (a file, or the template itself); "
        "default: a plain 'User: ... / Assistant:' transcript a base model can continue",
    )
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    parser.add_argument(
        "--log-format",
        default="text",
        choices=LOG_FORMATS,
        help="text lines, or one JSON object per line (uvicorn's lines too); both carry the request id",
    )
    parser.set_defaults(func=run)


def settings_from_args(args: argparse.Namespace, model_id: str) -> ServerSettings:
    chat_template = None
    if args.chat_template is not None:
        try:
            chat_template = load_chat_template(args.chat_template).source
        except ChatTemplateError as exc:
            raise UserError(str(exc)) from None
    optional = (args.context, args.max_input_tokens, args.max_new_tokens)
    for flag, value, minimum in (
        ("--port", args.port, 0),
        ("--max-concurrent", args.max_concurrent, 1),
        ("--replicas", args.replicas, 1),
        ("--steps-in-flight", args.steps_in_flight, 1),
        ("--max-queue", args.max_queue, 0),
        ("--top-k", args.top_k, 1),
        ("--step-token-budget", args.step_token_budget, 1),
        ("--max-body-bytes", args.max_body_bytes, 1),
        ("--max-connections", args.max_connections, 1),
        ("--engine-outbox-limit", args.engine_outbox_limit, 1),
        ("--engine-restart-limit", args.engine_restart_limit, 0),
        ("--max-body-pending-per-client", args.max_body_pending_per_client, 1),
        ("--context", optional[0], 2),  # one prompt token and one new token
        ("--max-input-tokens", optional[1], 1),
        ("--max-input-chars", args.max_input_chars, 1),
        ("--max-new-tokens", optional[2], 1),
        ("--max-logprobs", args.max_logprobs, 0),
    ):
        if value is not None and value < minimum:
            raise UserError(f"{flag} must be at least {minimum}, got {value}")
    for flag, value in (
        ("--request-timeout", args.request_timeout),
        ("--shutdown-timeout", args.shutdown_timeout),
        ("--step-timeout", args.step_timeout),
        ("--header-timeout", args.header_timeout_s),
        ("--body-timeout", args.body_timeout_s),
        ("--keep-alive-timeout", args.keep_alive_timeout_s),
        ("--engine-heartbeat-timeout", args.engine_heartbeat_timeout),
        ("--engine-answer-timeout", args.engine_answer_timeout),
        ("--engine-restart-window", args.engine_restart_window),
        ("--body-pending-grace", args.body_pending_grace_s),
    ):
        if not value > 0:
            raise UserError(f"{flag} must be positive, got {value}")
    if not args.step_timeout_per_item >= 0:
        raise UserError(f"--step-timeout-per-item must be 0 or more, got {args.step_timeout_per_item}")
    return ServerSettings(
        host=args.host,
        port=args.port,
        backend=args.backend,
        model_id=model_id,
        dtype=args.dtype,
        max_concurrent_requests=args.max_concurrent,
        event_loop=args.event_loop,
        engine_process=args.engine_process,
        engine_heartbeat_timeout_s=args.engine_heartbeat_timeout,
        engine_outbox_limit=args.engine_outbox_limit,
        engine_answer_timeout_s=args.engine_answer_timeout,
        engine_restart_limit=args.engine_restart_limit,
        engine_restart_window_s=args.engine_restart_window,
        freeze_heap=True,
        max_queue=args.max_queue,
        context_length=args.context,
        top_k=args.top_k,
        step_token_budget=args.step_token_budget,
        max_input_tokens=args.max_input_tokens,
        max_input_chars=args.max_input_chars,
        max_new_tokens_limit=args.max_new_tokens,
        max_logprobs=args.max_logprobs,
        request_timeout_s=args.request_timeout,
        shutdown_timeout_s=args.shutdown_timeout,
        step_timeout_s=args.step_timeout,
        step_timeout_per_item_s=args.step_timeout_per_item,
        header_timeout_s=args.header_timeout_s,
        body_timeout_s=args.body_timeout_s,
        keep_alive_timeout_s=args.keep_alive_timeout_s,
        max_connections=args.max_connections,
        max_body_pending_per_client=args.max_body_pending_per_client,
        body_pending_grace_s=args.body_pending_grace_s,
        max_body_bytes=args.max_body_bytes,
        api_key=args.api_key or None,
        chat_template=chat_template,
    )


def build_serving_backend(backend: str, params: GPT2Params, options: BackendOptions) -> Backend:
    if backend == "sim":  # the simulator's upload can show a progress bar
        return build_sim_backend(params, options, progress=True)
    return build_backend(backend, params, options)


def load_and_build_backend(backend: str, weights_path: Path, options: BackendOptions) -> Backend:
    """The backend factory of `--engine-process`: the engine process loads the checkpoint itself."""
    return build_serving_backend(backend, load_checkpoint(weights_path), options)


def run(args: argparse.Namespace) -> int:
    from wafer_gpt2.log_limits import limit_repeats
    from wafer_gpt2.service.api import create_app
    from wafer_gpt2.service.connections import fit_to_fd_limit
    from wafer_gpt2.service.server import ServiceServer

    problem = exposure_problem(args.host, args.api_key, args.allow_no_api_key)
    if problem is not None:
        raise UserError(problem)
    configure_logging(args.log_level, args.log_format)
    weights_path = resolve_weights(args.weights)
    params = load_checkpoint(weights_path, progress=True)
    config = params.config
    if args.context is not None and args.context > config.n_positions:
        raise UserError(f"--context {args.context} exceeds the model's n_positions ({config.n_positions})")
    if args.top_k > config.vocab_size:
        raise UserError(f"--top-k {args.top_k} exceeds the vocabulary size ({config.vocab_size})")
    settings = settings_from_args(args, model_id=args.model or config.name)
    # Before the engine process starts: it inherits the raised limit.
    settings = replace(settings, max_connections=fit_to_fd_limit(settings.max_connections))

    options = BackendOptions(
        slots=settings.max_concurrent_requests,
        context=settings.context_length,
        dtype=settings.dtype,
        top_k=settings.top_k,
        replicas=args.replicas,
        steps_in_flight=args.steps_in_flight,
    )

    # With --engine-process what crosses to the engine process is the checkpoint's path, not the weights
    # (the engine process loads them again; this one lets its copy go).
    build = (
        functools.partial(load_and_build_backend, settings.backend, weights_path, options)
        if settings.engine_process
        else functools.partial(build_serving_backend, settings.backend, params, options)
    )
    del params

    failure: list[str] = []
    server: ServiceServer | None = None

    def on_fatal(message: str) -> None:
        failure.append(message)
        if server is not None:
            server.should_exit = True

    # The checkpoint's name, not where it lies on the server's disk.
    summary = {**config.as_dict(), "n_params": config.n_params, "weights": weights_path.name}
    app = create_app(settings, build, model_summary=summary, on_fatal=on_fatal)
    server = ServiceServer(app, settings, log_level=args.log_level, own_log_format=args.log_format == "json")
    limit_repeats()  # on the handlers uvicorn has just set up, and the root's
    server.run()
    if failure:
        print(
            f"wafer-gpt2 serve: error: backend {settings.backend}: {failure[0]}",
            file=sys.stderr,
        )
        return 1
    return 0
