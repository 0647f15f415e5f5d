"""Rate-limited logging: a flood of identical lines (the same logger, level, message and exception type
- a traceback per refused connection, say) must not fill the disk or hide everything else.

`RepeatFilter` lets the first `burst` records of a kind through in each `window_s`, drops the rest, and
tells on the next record of that kind it lets through how many it dropped.
"""

from __future__ import annotations

import logging
import threading
import time

Kind = tuple[str, int, str, str]


class RepeatFilter(logging.Filter):
    def __init__(self, burst: int = 5, window_s: float = 60.0, clock=time.monotonic):
        super().__init__()
        self.burst = burst
        self.window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._seen: dict[Kind, list] = {}  # kind -> [window start, passed, dropped]

    def filter(self, record: logging.LogRecord) -> bool:
        exc_type = record.exc_info[0].__name__ if record.exc_info and record.exc_info[0] else ""
        kind = (record.name, record.levelno, str(record.msg), exc_type)
        now = self._clock()
        with self._lock:
            state = self._seen.get(kind)
            if state is None or now - state[0] >= self.window_s:
                dropped = state[2] if state is not None else 0
                if len(self._seen) > 10_000:  # kinds are bounded by the code's log calls; be safe
                    self._seen.clear()
                self._seen[kind] = [now, 1, 0]
                if dropped:
                    record.msg = (
                        f"{record.msg} [{dropped} more like this suppressed in the last {self.window_s:g} s]"
                    )
                return True
            if state[1] < self.burst:
                state[1] += 1
                return True
            state[2] += 1
            return False


def limit_repeats(loggers: tuple[str, ...] = ("", "uvicorn", "uvicorn.error", "uvicorn.access")) -> None:
    """Put one RepeatFilter on every handler of these loggers (a handler filter sees propagated records)."""
    repeat = RepeatFilter()
    for name in loggers:
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, RepeatFilter) for f in handler.filters):
                handler.addFilter(repeat)
