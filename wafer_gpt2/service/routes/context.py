"""What the route families share (`ServiceContext`): the settings, the engine, the metrics, the
tokenizer's hooks, the chat template, the request pool, and the helpers every route uses (the
request limits, the model check, building a request off the event loop, naming ignored fields)."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import quote

from fastapi import Request
from pydantic import BaseModel

from wafer_gpt2.engine.core import TokenizerHooks
from wafer_gpt2.engine.failures import NotFound
from wafer_gpt2.engine.metrics import ServiceMetrics
from wafer_gpt2.engine.serving import ServingEngine
from wafer_gpt2.service.chat_template import ChatTemplate
from wafer_gpt2.service.schemas import ignored_fields
from wafer_gpt2.service.validation import Limits
from wafer_gpt2.settings import ServerSettings

log = logging.getLogger(__name__)
VERSION = "0.1.0"
PLACEHOLDER_MODELS = ("dummy", "tgi")  # what TGI clients send as `model` when they do not know it
# Threads that build requests (tokenizing is the slow part) off the event loop; started with the app.
REQUEST_THREADS = 2
# Bodies up to this size are tokenized on the event loop: well under a tenth of a millisecond of work,
# less than the hop to a pool thread and back costs; longer ones go to the pool.
INLINE_BODY_BYTES = 1024
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

T = TypeVar("T")


def request_pool(threads: int = REQUEST_THREADS) -> ThreadPoolExecutor:
    """A pool whose threads all exist from the start (a lazily grown pool would look like a leak)."""
    pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="wafer-request")
    barrier = threading.Barrier(threads)
    for started in [pool.submit(barrier.wait) for _ in range(threads)]:
        started.result()
    return pool


class IgnoredFields:
    """Unknown fields are accepted and ignored (as vLLM and TGI do) but said so: in the response header
    `X-Ignored-Fields`, and in a warning logged once per route and set of names (not once per request)."""

    HEADER = "X-Ignored-Fields"
    MAX_NAMES = 20  # the header names at most these (a body may hold thousands of unknown fields)

    def __init__(self) -> None:
        self._logged: set[tuple[str, str]] = set()

    def headers(self, body: BaseModel, path: str) -> dict[str, str]:
        # Percent-encoded: a field name may hold anything, a header value only visible ASCII.
        names = [quote(name, safe="!#$&'()*+,/:;=?@[]^_`{|}~") for name in ignored_fields(body)]
        if not names:
            return {}
        shown = ", ".join(names[: self.MAX_NAMES])
        if len(names) > self.MAX_NAMES:
            shown += f" (and {len(names) - self.MAX_NAMES} more)"
        key = (path, shown)
        if key not in self._logged and len(self._logged) < 1000:
            self._logged.add(key)
            log.warning("%s: ignored unknown fields: %s", path, shown)
        return {self.HEADER: shown}


@dataclass
class ServiceContext:
    """What every route family registers its routes from (built once per app by `create_app`)."""

    settings: ServerSettings
    engine: ServingEngine
    metrics: ServiceMetrics
    hooks: TokenizerHooks
    chat_template: ChatTemplate
    pool: ThreadPoolExecutor
    model_summary: dict
    ignored: IgnoredFields = field(default_factory=IgnoredFields)
    # The limits change only with the backend (a reload brings a new one): built once per backend, not
    # per request. (backend, its limits), or empty before the first request.
    _limits_of: list[tuple[object, Limits]] = field(default_factory=list)

    def limits(self) -> Limits:
        """The request limits of the engine's current backend (Unavailable before it is loaded)."""
        backend = self.engine.backend
        limits_of = self._limits_of
        if not limits_of or limits_of[0][0] is not backend:
            limits_of[:] = [(backend, Limits.of(self.settings, backend))]
        return limits_of[0][1]

    async def off_loop(self, build: Callable[..., T], *args: Any, request: Request | None = None) -> T:
        """Tokenize and validate in the request pool: a long prompt must not stall the event loop. A
        small `request` body is built right here (the pool's round trip costs more than the work)."""
        if request is not None:
            length = request.headers.get("content-length")
            if length is not None and length.isdigit() and int(length) <= INLINE_BODY_BYTES:
                return build(*args)
        return await asyncio.get_running_loop().run_in_executor(self.pool, build, *args)

    def check_model(self, model: str | None) -> None:
        """NotFound for a `model` other than the served one. huggingface_hub names the model "dummy"
        when it talks to a URL (TGI ignores the name): accepted, as TGI's placeholders are."""
        if model is not None and model not in (self.settings.model_id, *PLACEHOLDER_MODELS):
            raise NotFound(
                f"the model `{model}` does not exist; this server serves `{self.settings.model_id}`",
                param="model",
            )
