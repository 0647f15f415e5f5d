"""The simulator's threads: independent pieces of a step (the slots of a large step, the column blocks
of a large GEMV, halves of the items in attention and the head) run side by side on a small pool.
NumPy releases the GIL inside its loops and BLAS calls, so threads suffice.

`WAFER_SIM_THREADS` sets the pool size; the default is the cores, at most 2 (what the benchmark's
peer, torch, takes on the project's machines). Once the simulator runs, NumPy's BLAS runs one thread
per call, process-wide: the pool is the parallelism, and a multi-threaded BLAS inside each of its
workers oversubscribes the cores and makes a large prefill slower, not faster.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

SIM_THREADS = int(os.environ.get("WAFER_SIM_THREADS", min(2, os.cpu_count() or 1)))

_worker = threading.local()  # `inside` is set on the pool's threads: work they split runs in place


def threads() -> int:
    return max(1, SIM_THREADS)


@functools.cache
def _one_blas_thread() -> None:
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=1, user_api="blas")  # stays for as long as the process lives


@functools.cache
def _pool(size: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(size, thread_name_prefix="sim", initializer=_mark_worker)


def _mark_worker() -> None:
    _worker.inside = True


def map_all(work: Callable[[T], None], pieces: Iterable[T], in_place: bool = False) -> None:
    """Run `work` on every piece: on the pool when there is more than one piece, in this thread when
    `in_place`, when the pool has one thread, or when called from one of the pool's own threads (a
    worker never waits on the pool). Re-raises the first failure."""
    _one_blas_thread()
    pieces = list(pieces)
    if len(pieces) < 2 or in_place or threads() < 2 or getattr(_worker, "inside", False):
        for piece in pieces:
            work(piece)
    else:
        list(_pool(threads()).map(work, pieces))
