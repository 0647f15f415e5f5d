"""Prometheus metrics under the names dashboards already scrape: TGI's `tgi_*` and vLLM's `vllm:*`.

The text exposition format is small enough to write here (no extra dependency): counters, gauges and
histograms with labels, thread-safe because the engine's worker thread records while the event loop
renders.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence

from service.kv_slots import KVUsage

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
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

LabelValues = tuple[str, ...]


def _format_value(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if float(value).is_integer():
        return str(int(value))
    return repr(float(value))


def _format_labels(names: Sequence[str], values: Sequence[str]) -> str:
    if not names:
        return ""
    escaped = (str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") for v in values)
    return "{" + ",".join(f'{name}="{value}"' for name, value in zip(names, escaped, strict=True)) + "}"


class _Metric:
    kind = ""

    def __init__(self, name: str, help_text: str, label_names: Sequence[str] = ()):
        self.name = name
        self.help_text = help_text
        self.label_names = tuple(label_names)
        self._lock = threading.Lock()

    def _key(self, labels: dict[str, str]) -> LabelValues:
        if set(labels) != set(self.label_names):
            raise ValueError(f"{self.name}: labels {sorted(labels)} differ from {list(self.label_names)}")
        return tuple(str(labels[name]) for name in self.label_names)

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help_text}", f"# TYPE {self.name} {self.kind}"]


class Counter(_Metric):
    kind = "counter"

    def __init__(self, name: str, help_text: str, label_names: Sequence[str] = ()):
        super().__init__(name, help_text, label_names)
        self._values: dict[LabelValues, float] = {} if label_names else {(): 0.0}

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = self._key(labels)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def value(self, **labels: str) -> float:
        with self._lock:
            return self._values.get(self._key(labels), 0.0)

    def render(self) -> list[str]:
        with self._lock:
            items = sorted(self._values.items())
        return [f"{self.name}{_format_labels(self.label_names, key)} {_format_value(v)}" for key, v in items]


class Gauge(Counter):
    kind = "gauge"

    def set(self, value: float, **labels: str) -> None:
        key = self._key(labels)
        with self._lock:
            self._values[key] = float(value)


class Histogram(_Metric):
    kind = "histogram"

    def __init__(self, name: str, help_text: str, buckets: Sequence[float], label_names: Sequence[str] = ()):
        super().__init__(name, help_text, label_names)
        self.buckets = tuple(sorted(buckets)) + (math.inf,)
        self._series: dict[LabelValues, tuple[list[int], list[float]]] = {}  # counts per bucket, [sum]

    def observe(self, value: float, **labels: str) -> None:
        key = self._key(labels)
        with self._lock:
            counts, total = self._series.setdefault(key, ([0] * len(self.buckets), [0.0]))
            for index, bound in enumerate(self.buckets):
                if value <= bound:
                    counts[index] += 1
                    break
            total[0] += value

    def count(self, **labels: str) -> int:
        with self._lock:
            series = self._series.get(self._key(labels))
            return sum(series[0]) if series else 0

    def render(self) -> list[str]:
        lines = []
        with self._lock:
            series = sorted((key, list(counts), total[0]) for key, (counts, total) in self._series.items())
        for key, counts, total in series:
            cumulative = 0
            for bound, count in zip(self.buckets, counts, strict=True):
                cumulative += count
                labels = _format_labels((*self.label_names, "le"), (*key, _format_value(bound)))
                lines.append(f"{self.name}_bucket{labels} {cumulative}")
            plain = _format_labels(self.label_names, key)
            lines.append(f"{self.name}_sum{plain} {_format_value(total)}")
            lines.append(f"{self.name}_count{plain} {cumulative}")
        return lines


class ServiceMetrics:
    """Every metric the service exports; the engine records, `/metrics` renders."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self._metrics: list[_Metric] = []
        m = {"model_name": model_name}
        self._model_labels = m

        # TGI's names.
        self.tgi_request_count = self._add(Counter("tgi_request_count", "Requests received"))
        self.tgi_request_success = self._add(Counter("tgi_request_success", "Requests that finished"))
        self.tgi_request_failure = self._add(
            Counter("tgi_request_failure", "Requests that failed, by reason", ("err",))
        )
        self.tgi_queue_size = self._add(Gauge("tgi_queue_size", "Requests waiting for a KV slot"))
        self.tgi_batch_current_size = self._add(
            Gauge("tgi_batch_current_size", "Requests in the running batch")
        )
        self.tgi_request_duration = self._add(
            Histogram(
                "tgi_request_duration", "Request duration in seconds (queue + inference)", DURATION_BUCKETS
            )
        )
        self.tgi_request_queue_duration = self._add(
            Histogram("tgi_request_queue_duration", "Seconds spent waiting for a KV slot", DURATION_BUCKETS)
        )
        self.tgi_request_inference_duration = self._add(
            Histogram("tgi_request_inference_duration", "Seconds from admission to the end", DURATION_BUCKETS)
        )
        self.tgi_request_mean_time_per_token_duration = self._add(
            Histogram(
                "tgi_request_mean_time_per_token_duration",
                "Mean seconds per generated token of a request",
                DURATION_BUCKETS,
            )
        )
        self.tgi_request_generated_tokens = self._add(
            Histogram("tgi_request_generated_tokens", "Tokens generated per request", TOKEN_BUCKETS)
        )
        self.tgi_request_input_length = self._add(
            Histogram("tgi_request_input_length", "Prompt tokens per request", TOKEN_BUCKETS)
        )
        self.tgi_batch_forward_duration = self._add(
            Histogram(
                "tgi_batch_forward_duration",
                "Seconds per engine step (one trip through the wafer)",
                DURATION_BUCKETS,
            )
        )
        self.tgi_batch_next_size = self._add(
            Histogram("tgi_batch_next_size", "Token items per engine step", BATCH_BUCKETS)
        )

        # vLLM's names (labelled with the model, as vLLM does).
        self.vllm_num_requests_running = self._add(
            Gauge("vllm:num_requests_running", "Requests in the running batch", ("model_name",))
        )
        self.vllm_num_requests_waiting = self._add(
            Gauge("vllm:num_requests_waiting", "Requests waiting for a KV slot", ("model_name",))
        )
        self.vllm_kv_cache_usage_perc = self._add(
            Gauge("vllm:kv_cache_usage_perc", "Fraction of the wafer's KV slots held (0..1)", ("model_name",))
        )
        self.vllm_time_to_first_token_seconds = self._add(
            Histogram(
                "vllm:time_to_first_token_seconds",
                "Seconds to the first token",
                DURATION_BUCKETS,
                ("model_name",),
            )
        )
        self.vllm_inter_token_latency_seconds = self._add(
            Histogram(
                "vllm:inter_token_latency_seconds",
                "Seconds between tokens",
                DURATION_BUCKETS,
                ("model_name",),
            )
        )
        self.vllm_e2e_request_latency_seconds = self._add(
            Histogram(
                "vllm:e2e_request_latency_seconds",
                "Request duration in seconds",
                DURATION_BUCKETS,
                ("model_name",),
            )
        )
        self.vllm_request_success_total = self._add(
            Counter(
                "vllm:request_success_total", "Finished requests by reason", ("model_name", "finished_reason")
            )
        )
        self.vllm_prompt_tokens_total = self._add(
            Counter("vllm:prompt_tokens_total", "Prompt tokens processed", ("model_name",))
        )
        self.vllm_generation_tokens_total = self._add(
            Counter("vllm:generation_tokens_total", "Tokens generated", ("model_name",))
        )

        # The wafer's own.
        self.wafer_kv_slots_used = self._add(Gauge("wafer_kv_slots_used", "KV slots held by requests"))
        self.wafer_kv_slots_total = self._add(Gauge("wafer_kv_slots_total", "KV slots the plan provides"))
        self.wafer_kv_tokens_reserved = self._add(
            Gauge("wafer_kv_tokens_reserved", "KV positions reserved by running requests")
        )
        self.wafer_engine_ready = self._add(Gauge("wafer_engine_ready", "1 when the engine serves, else 0"))
        self.wafer_cancel_latency_steps = self._add(
            Histogram(
                "wafer_cancel_latency_steps",
                "Engine steps between a cancellation (client gone) and its KV slot being freed",
                (0, 1, 2, 4, 8, 16),
            )
        )
        self.wafer_engine_restarts_total = self._add(
            Counter("wafer_engine_restarts_total", "Times the worker reloaded the model after a failure")
        )
        self.wafer_engine_step_timeouts_total = self._add(
            Counter("wafer_engine_step_timeouts_total", "Steps failed by the step watchdog (hung backend)")
        )

    def _add(self, metric):
        self._metrics.append(metric)
        return metric

    def record_scheduler_state(self, waiting: int, running: int, kv: KVUsage) -> None:
        m = self._model_labels
        self.tgi_queue_size.set(waiting)
        self.tgi_batch_current_size.set(running)
        self.vllm_num_requests_waiting.set(waiting, **m)
        self.vllm_num_requests_running.set(running, **m)
        self.vllm_kv_cache_usage_perc.set(kv.fraction, **m)
        self.wafer_kv_slots_used.set(kv.slots_used)
        self.wafer_kv_slots_total.set(kv.slots_total)
        self.wafer_kv_tokens_reserved.set(kv.tokens_reserved)

    def record_step(self, seconds: float, items: int) -> None:
        self.tgi_batch_forward_duration.observe(seconds)
        self.tgi_batch_next_size.observe(items)

    def record_token(self, since_previous: float, first: bool) -> None:
        m = self._model_labels
        if first:
            self.vllm_time_to_first_token_seconds.observe(since_previous, **m)
        else:
            self.vllm_inter_token_latency_seconds.observe(since_previous, **m)
        self.vllm_generation_tokens_total.inc(**m)

    def record_arrival(self, input_length: int) -> None:
        self.tgi_request_count.inc()
        self.tgi_request_input_length.observe(input_length)
        self.vllm_prompt_tokens_total.inc(input_length, **self._model_labels)

    def record_success(
        self, finish_reason: str, queue_s: float, inference_s: float, generated_tokens: int
    ) -> None:
        m = self._model_labels
        total = queue_s + inference_s
        self.tgi_request_success.inc()
        self.tgi_request_duration.observe(total)
        self.tgi_request_queue_duration.observe(queue_s)
        self.tgi_request_inference_duration.observe(inference_s)
        self.tgi_request_generated_tokens.observe(generated_tokens)
        if generated_tokens:
            self.tgi_request_mean_time_per_token_duration.observe(inference_s / generated_tokens)
        self.vllm_e2e_request_latency_seconds.observe(total, **m)
        self.vllm_request_success_total.inc(finished_reason=finish_reason, **m)

    def record_failure(self, reason: str) -> None:
        self.tgi_request_failure.inc(err=reason)

    def render(self) -> str:
        lines: list[str] = []
        for metric in self._metrics:
            lines.extend(metric.header())
            lines.extend(metric.render())
        return "\n".join(lines) + "\n"
