"""Prometheus metrics under the names dashboards already scrape: TGI's `tgi_*` and vLLM's `vllm:*`.

prometheus-client holds them (thread-safe: the engine's worker thread records while the event loop
renders). `render` writes the text format itself, from the registry's samples, for two reasons that
keep the names dashboards know: TGI's counters have no `_total` suffix, which prometheus-client's own
writer always adds to a counter, and labels keep their declared order (vLLM's) instead of being sorted.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from wafer_gpt2.engine.kv_slots import usage_fraction

DURATION_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)
# A metric family as `ServiceMetrics.samples` gives it: (name, help, type, [(sample name, labels, value)]).
Family = tuple[str, str, str, list[tuple[str, tuple[tuple[str, str], ...], float]]]
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


# Requests' and steps' figures wait in plain queues and reach prometheus-client together (`fold`): at
# every `samples()` (a scrape, the engine process's report), when the engine goes idle, and once this
# many wait. Each figure was a locked update of its own (twelve per request, two per step); folded, a
# batch costs one per counter and per histogram bucket that received any.
FOLD_EVERY = 256


def _format_value(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if float(value).is_integer():
        return str(int(value))
    return repr(float(value))


def _escape(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _format_labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    # Bucket bounds as before (le="1", not prometheus-client's le="1.0"): series keep their labels.
    shown = {name: _format_value(float(v)) if name == "le" else v for name, v in labels.items()}
    return "{" + ",".join(f'{name}="{_escape(value)}"' for name, value in shown.items()) + "}"


class ServiceMetrics:
    """Every metric the service exports; the engine records, `/metrics` renders."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry()  # one per app (tests build many apps in one process)
        self._bare_counters: set[str] = set()  # counters named without `_total` (TGI's)
        self._labels = {"model_name": model_name}
        self._child_cache: dict[tuple, Any] = {}  # `_child`'s
        # Not yet folded (`fold`): appended by the recording thread, drained by whoever folds.
        self._arrivals: deque[int] = deque()  # input lengths
        self._successes: deque[tuple[str, float, float, int]] = (
            deque()
        )  # reason, queue_s, inference_s, tokens
        self._steps: deque[tuple[float, int]] = deque()  # seconds, items
        # Per step: its generated tokens, and their latencies (first tokens, later ones, later ones repeated).
        self._step_tokens: deque[
            tuple[int, Sequence[float], Sequence[float], Sequence[tuple[float, int]]]
        ] = deque()
        # The latest recorded (`record_scheduler_state`'s arguments), and the one the gauges show.
        self._scheduler_state: tuple[int, int, int, int, int] | None = None
        self._gauged_state: tuple[int, int, int, int, int] | None = None
        self._own_families: set[str] = set()  # what this process alone records (`track_engine_process`)
        model = ("model_name",)
        counter, gauge, histogram = self._counter, self._gauge, self._histogram

        # TGI's names.
        self.tgi_request_count = counter("tgi_request_count", "Requests received")
        self.tgi_request_success = counter("tgi_request_success", "Requests that finished")
        self.tgi_request_failure = counter("tgi_request_failure", "Requests that failed, by reason", ("err",))
        self.tgi_queue_size = gauge("tgi_queue_size", "Requests waiting for a KV slot")
        self.tgi_batch_current_size = gauge("tgi_batch_current_size", "Requests in the running batch")
        self.tgi_request_duration = histogram(
            "tgi_request_duration", "Request duration in seconds (queue + inference)", DURATION_BUCKETS
        )
        self.tgi_request_queue_duration = histogram(
            "tgi_request_queue_duration", "Seconds spent waiting for a KV slot", DURATION_BUCKETS
        )
        self.tgi_request_inference_duration = histogram(
            "tgi_request_inference_duration", "Seconds from admission to the end", DURATION_BUCKETS
        )
        self.tgi_request_mean_time_per_token_duration = histogram(
            "tgi_request_mean_time_per_token_duration",
            "Mean seconds per generated token of a request",
            DURATION_BUCKETS,
        )
        self.tgi_request_generated_tokens = histogram(
            "tgi_request_generated_tokens", "Tokens generated per request", TOKEN_BUCKETS
        )
        self.tgi_request_input_length = histogram(
            "tgi_request_input_length", "Prompt tokens per request", TOKEN_BUCKETS
        )
        self.tgi_batch_forward_duration = histogram(
            "tgi_batch_forward_duration",
            "Seconds per engine step (one trip through the wafer)",
            DURATION_BUCKETS,
        )
        self.tgi_batch_next_size = histogram(
            "tgi_batch_next_size", "Token items per engine step", BATCH_BUCKETS
        )

        # vLLM's names (labelled with the model, as vLLM does).
        self.vllm_num_requests_running = gauge(
            "vllm:num_requests_running", "Requests in the running batch", model
        )
        self.vllm_num_requests_waiting = gauge(
            "vllm:num_requests_waiting", "Requests waiting for a KV slot", model
        )
        self.vllm_kv_cache_usage_perc = gauge(
            "vllm:kv_cache_usage_perc", "Fraction of the wafer's KV slots held (0..1)", model
        )
        self.vllm_time_to_first_token_seconds = histogram(
            "vllm:time_to_first_token_seconds", "Seconds to the first token", DURATION_BUCKETS, model
        )
        self.vllm_inter_token_latency_seconds = histogram(
            "vllm:inter_token_latency_seconds", "Seconds between tokens", DURATION_BUCKETS, model
        )
        self.vllm_e2e_request_latency_seconds = histogram(
            "vllm:e2e_request_latency_seconds", "Request duration in seconds", DURATION_BUCKETS, model
        )
        self.vllm_request_success_total = counter(
            "vllm:request_success_total", "Finished requests by reason", ("model_name", "finished_reason")
        )
        self.vllm_prompt_tokens_total = counter("vllm:prompt_tokens_total", "Prompt tokens processed", model)
        self.vllm_generation_tokens_total = counter("vllm:generation_tokens_total", "Tokens generated", model)

        # The wafer's own.
        self.wafer_kv_slots_used = gauge("wafer_kv_slots_used", "KV slots held by requests")
        self.wafer_kv_slots_total = gauge("wafer_kv_slots_total", "KV slots the plan provides")
        self.wafer_kv_tokens_reserved = gauge(
            "wafer_kv_tokens_reserved", "KV positions reserved by running requests"
        )
        self.wafer_engine_ready = gauge("wafer_engine_ready", "1 when the engine serves, else 0")
        self.wafer_cancel_latency_steps = histogram(
            "wafer_cancel_latency_steps",
            "Engine steps between a cancellation (client gone) and its KV slot being freed",
            (0, 1, 2, 4, 8, 16),
        )
        self.wafer_engine_restarts_total = counter(
            "wafer_engine_restarts_total", "Times the worker reloaded the model after a failure"
        )
        self.wafer_engine_step_timeouts_total = counter(
            "wafer_engine_step_timeouts_total", "Steps failed by the step watchdog (hung backend)"
        )

    def track_engine_process(self, up: Callable[[], float], outbox: Callable[[], float]) -> Counter:
        """The HTTP process's own series of an engine that runs in a process of its own
        (`wafer_gpt2/engine/process.py`): `up` and `outbox` are read at each scrape; the counter returned
        counts the engine process's restarts. These are what /metrics shows when the engine process
        does not answer for its own series."""
        answering = self._gauge(
            "wafer_engine_process_up",
            "1 while the engine process runs and reports within its heartbeat deadline, else 0",
        )
        answering.set_function(up)
        waiting = self._gauge(
            "wafer_engine_outbox_messages", "Messages waiting for the engine process to read its pipe"
        )
        waiting.set_function(outbox)
        restarts = self._counter(
            "wafer_engine_process_restarts_total", "Times the engine process died and was started again"
        )
        self._own_families |= {
            "wafer_engine_process_up",
            "wafer_engine_outbox_messages",
            "wafer_engine_process_restarts_total",
        }
        return restarts

    def _counter(self, name: str, help_text: str, labels: tuple[str, ...] = ()) -> Counter:
        if not name.endswith("_total"):
            self._bare_counters.add(name)
        return Counter(name, help_text, labels, registry=self.registry)

    def _gauge(self, name: str, help_text: str, labels: tuple[str, ...] = ()) -> Gauge:
        return Gauge(name, help_text, labels, registry=self.registry)

    def _histogram(self, name: str, help_text: str, buckets, labels: tuple[str, ...] = ()) -> Histogram:
        return Histogram(name, help_text, labels, buckets=buckets, registry=self.registry)

    # ----- what the engine records -----------------------------------------------------------------

    def _labelled(self) -> tuple:
        """The per-model children the engine updates at every step and token, looked up once (a
        `labels()` call costs more than the update itself)."""
        children = self.__dict__.get("_children")
        if children is None:
            m = self._labels
            children = self._children = (
                self.vllm_num_requests_waiting.labels(**m),
                self.vllm_num_requests_running.labels(**m),
                self.vllm_kv_cache_usage_perc.labels(**m),
                self.vllm_time_to_first_token_seconds.labels(**m),
                self.vllm_inter_token_latency_seconds.labels(**m),
                self.vllm_generation_tokens_total.labels(**m),
            )
        return children

    def record_scheduler_state(
        self, waiting: int, running: int, slots_used: int, slots_total: int, tokens_reserved: int
    ) -> None:
        """The queue and KV figures of now, `KVUsage`'s as plain numbers (they are recorded whenever
        they change, up to once per request queued, and a `KVUsage`, built under the slots' lock, costs
        more than the rest of queueing one): the gauges take the latest at the next fold (eight locked
        sets each time they changed, several times a step, cost more than the step's bookkeeping)."""
        self._scheduler_state = (waiting, running, slots_used, slots_total, tokens_reserved)

    def _set_scheduler_gauges(
        self, waiting: int, running: int, slots_used: int, slots_total: int, tokens_reserved: int
    ) -> None:
        waiting_gauge, running_gauge, kv_gauge = self._labelled()[:3]
        self.tgi_queue_size.set(waiting)
        self.tgi_batch_current_size.set(running)
        waiting_gauge.set(waiting)
        running_gauge.set(running)
        kv_gauge.set(usage_fraction(slots_used, slots_total))
        self.wafer_kv_slots_used.set(slots_used)
        self.wafer_kv_slots_total.set(slots_total)
        self.wafer_kv_tokens_reserved.set(tokens_reserved)

    def record_step(self, seconds: float, items: int) -> None:
        self._steps.append((seconds, items))
        if len(self._steps) >= FOLD_EVERY:
            self.fold()

    def record_step_tokens(
        self,
        count: int,
        first: Sequence[float],
        later: Sequence[float],
        later_repeated: Sequence[tuple[float, int]] = (),
    ) -> None:
        """A step's generated tokens and their latencies (first tokens, later ones; `later_repeated`:
        later ones as (latency, how many tokens had it), as a decode run's step gives its rows one),
        queued for `fold`: there, one locked update per bucket that received any over many steps,
        instead of two per token or a few per step."""
        self._step_tokens.append((count, first, later, later_repeated))
        if len(self._step_tokens) >= FOLD_EVERY:
            self.fold()

    def _child(self, metric, *values: str):
        """`metric.labels(model_name, *values)`, looked up once per label values: a `labels()` call
        costs more than the update, and every request makes several."""
        key = (metric, values)
        child = self._child_cache.get(key)
        if child is None:
            child = self._child_cache[key] = metric.labels(self.model_name, *values)
        return child

    def record_arrival(self, input_length: int) -> None:
        self._arrivals.append(input_length)
        if len(self._arrivals) >= FOLD_EVERY:
            self.fold()

    def record_success(
        self, finish_reason: str, queue_s: float, inference_s: float, generated_tokens: int
    ) -> None:
        self._successes.append((finish_reason, queue_s, inference_s, generated_tokens))
        if len(self._successes) >= FOLD_EVERY:
            self.fold()

    def fold(self) -> None:
        """Everything `record_arrival`, `record_success`, `record_step` and `record_step_tokens`
        queued, and the latest `record_scheduler_state`, into the metrics."""
        state = self._scheduler_state  # not cleared: a state recorded meanwhile is applied next time
        if state is not None and state is not self._gauged_state:
            self._set_scheduler_gauges(*state)
            self._gauged_state = state
        arrivals, successes, steps = _drain(self._arrivals), _drain(self._successes), _drain(self._steps)
        step_tokens = _drain(self._step_tokens)
        if step_tokens:
            children = self._labelled()
            counts, firsts, laters, repeats = zip(*step_tokens, strict=True)
            first = [latency for latencies in firsts for latency in latencies]
            later = [latency for latencies in laters for latency in latencies]
            repeated = [pair for pairs in repeats for pair in pairs]
            if first:
                observe_all(children[3], first)
            if later or repeated:
                observe_all(children[4], later, repeated)
            children[5].inc(sum(counts))
        if arrivals:
            self.tgi_request_count.inc(len(arrivals))
            observe_all(self.tgi_request_input_length, arrivals)
            self._child(self.vllm_prompt_tokens_total).inc(sum(arrivals))
        if successes:
            self.tgi_request_success.inc(len(successes))
            totals = [queue_s + inference_s for _, queue_s, inference_s, _ in successes]
            observe_all(self.tgi_request_duration, totals)
            observe_all(self.tgi_request_queue_duration, [s[1] for s in successes])
            observe_all(self.tgi_request_inference_duration, [s[2] for s in successes])
            observe_all(self.tgi_request_generated_tokens, [s[3] for s in successes])
            per_token = [inference_s / tokens for _, _, inference_s, tokens in successes if tokens]
            if per_token:
                observe_all(self.tgi_request_mean_time_per_token_duration, per_token)
            observe_all(self._child(self.vllm_e2e_request_latency_seconds), totals)
            reasons: dict[str, int] = {}
            for reason, *_ in successes:
                reasons[reason] = reasons.get(reason, 0) + 1
            for reason, count in reasons.items():
                self._child(self.vllm_request_success_total, reason).inc(count)
        if steps:
            observe_all(self.tgi_batch_forward_duration, [seconds for seconds, _ in steps])
            observe_all(self.tgi_batch_next_size, [items for _, items in steps])

    def record_failure(self, reason: str) -> None:
        self.tgi_request_failure.labels(err=reason).inc()

    # ----- /metrics --------------------------------------------------------------------------------

    def samples(self) -> list[Family]:
        """Every metric's samples under the names /metrics shows (picklable: the engine process sends
        its own to the HTTP process, `wafer_gpt2/engine/process.py`)."""
        self.fold()
        families: list[Family] = []
        for family in self.registry.collect():
            name = family.name
            if family.type == "counter" and name not in self._bare_counters:
                name += "_total"
            rows = [
                (
                    name if family.type == "counter" else sample.name,
                    tuple(sample.labels.items()),
                    sample.value,
                )
                for sample in family.samples
                if not sample.name.endswith(
                    "_created"
                )  # prometheus-client's creation timestamps: never exported
            ]
            families.append((name, family.documentation, family.type, rows))
        return families

    def render(self, merged: Sequence[list[Family]] = (), own_only: bool = False) -> str:
        """The Prometheus text format (0.0.4) of every metric's samples, each summed with the same sample
        of `merged` (another process's `samples()` of the same metrics: there only the engine records
        the engine's, here only the HTTP process the rest, so the sums are each side's own values).
        `own_only`: the engine process's samples are missing, so only the series this process alone
        records (`track_engine_process`); a family both record would read as a counter reset."""
        others: dict[str, dict[tuple[str, tuple], float]] = {}
        for families in merged:
            for name, _, _, rows in families:
                values = others.setdefault(name, {})
                for sample_name, labels, value in rows:
                    values[sample_name, labels] = values.get((sample_name, labels), 0.0) + value
        lines: list[str] = []
        for name, documentation, kind, rows in self.samples():
            if own_only and name not in self._own_families:
                continue
            lines += [f"# HELP {name} {documentation}", f"# TYPE {name} {kind}"]
            values = {(sample_name, labels): value for sample_name, labels, value in rows}
            for key, value in others.get(name, {}).items():  # a label set only the other side has goes last
                values[key] = values.get(key, 0.0) + value
            for (sample_name, labels), value in values.items():
                lines.append(f"{sample_name}{_format_labels(dict(labels))} {_format_value(value)}")
        return "\n".join(lines) + "\n"


def _drain(waiting: deque) -> list:
    """What `waiting` holds, taken out: popped one by one, so a figure appended meanwhile by the
    recording thread is either taken or left for the next fold, never lost."""
    out = []
    while True:
        try:
            out.append(waiting.popleft())
        except IndexError:
            return out


def observe_all(
    histogram: Histogram, values: Sequence[float], repeated: Sequence[tuple[float, int]] = ()
) -> None:
    """`histogram.observe(v)` for every v, and `times` times for every (v, times) of `repeated`, as one
    update per bucket that receives any: prometheus-client has no bulk observe, so this counts into its
    bucket values itself (`_upper_bounds`, `_buckets`, `_sum`: a child's, as `observe` updates them). A
    value repeated is looked up once, not once per time. A histogram without them, or a NaN, goes one
    by one."""
    bounds = getattr(histogram, "_upper_bounds", None)
    buckets = getattr(histogram, "_buckets", None)
    total = getattr(histogram, "_sum", None)
    # NaN when a value is NaN (or infinities of both signs: one by one too)
    added = sum(values) + sum(value * times for value, times in repeated)
    if bounds is None or buckets is None or total is None or added != added:
        for value in values:
            histogram.observe(value)
        for value, times in repeated:
            for _ in range(times):
                histogram.observe(value)
        return
    counts: dict[int, int] = {}
    for value in values:
        index = bisect_left(bounds, value)  # the first bound >= value: `observe`'s bucket
        counts[index] = counts.get(index, 0) + 1
    for value, times in repeated:
        index = bisect_left(bounds, value)
        counts[index] = counts.get(index, 0) + times
    total.inc(added)
    for index, count in counts.items():
        buckets[index].inc(count)
