"""Which legal schedule a run follows: the order in which a PE's picker takes runnable tasks, and
small latency variations the hardware does not pin down.

What the SDK documents about the order (its "A Conceptual View", "Task IDs" and "Libraries" pages):
a task runs when it is activated and unblocked, tasks run to completion, and `<tile_config>`'s
`task_priority` makes a task HIGH or LOW. Nothing orders tasks of one priority. The executor picks
among the runnable tasks of the highest priority present, by one of these policies:

- `local-first` (the default): tasks activated by the program (local tasks) before tasks activated
  by wavelets (data and control tasks), the lowest ID first within each. A fitted choice, not a
  documented one: it is the one simple order found under which every public program that depends on
  the order runs right (csl-examples' game-of-life needs its local tasks before its data tasks;
  25-pt-stencil, stencil-v2 and fft-1d-2d need the lower of two local tasks first). See
  csl_executor/README.md, "Schedules".
- `highest`: the highest task ID first (the executor's earlier default).
- `lowest`: the lowest task ID first.
- `fifo`: what became runnable first, ties to the lowest ID.
- `seed:N`: a pseudo-random choice drawn from a generator seeded with N, plus up to
  `JITTER_CYCLES` extra cycles, drawn from the same generator, on each task start, DSD operation
  start and wavelet delivery to a CE. Wavelets on one color still arrive in order (every buffer is
  FIFO), so each seed is a schedule the hardware could follow; a program that is right under the
  default and wrong under some seed depends on an order the SDK does not promise.

Chosen by `Machine(schedule=...)` / `SdkRuntime(..., schedule=...)`, or else by the environment:
`WAFER_CSL_SCHEDULE` (any of the above), then `WAFER_CSL_PICKER` (a policy name), then `local-first`.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field

from csl_executor.errors import CslRuntimeError

POLICIES = ("local-first", "highest", "lowest", "fifo")
JITTER_CYCLES = 3  # at most this many extra cycles per randomized latency (assumption: a few cycles)


@dataclass
class Schedule:
    policy: str = "local-first"  # one of POLICIES, or "random"
    seed: int | None = None
    jitter: int = 0
    rng: random.Random = field(default_factory=random.Random)

    def __str__(self) -> str:
        return f"seed:{self.seed}" if self.policy == "random" else self.policy

    def choose(self, candidates: list[tuple[int, int, str, int | None]]) -> tuple[int, int, str, int | None]:
        """One of (stamp, task ID, kind, color) candidates, all of one priority."""
        if self.policy == "local-first":
            return min(candidates, key=lambda c: (c[2] != "local", c[1]))
        if self.policy == "highest":
            return max(candidates, key=lambda c: c[1])
        if self.policy == "lowest":
            return min(candidates, key=lambda c: c[1])
        if self.policy == "fifo":
            return min(candidates, key=lambda c: (c[0], c[1]))
        ordered = sorted(candidates, key=lambda c: (c[1], c[0]))  # the draw depends on the set only
        return ordered[self.rng.randrange(len(ordered))]

    def delay(self) -> int:
        """Extra cycles for one randomized latency (0 unless the schedule is seeded)."""
        return self.rng.randint(0, self.jitter) if self.jitter else 0


def parse_schedule(spec: str | Schedule | None) -> Schedule:
    """A policy name or `seed:N` (None: from the environment, see the module doc)."""
    if isinstance(spec, Schedule):
        return spec
    if spec is None:
        spec = os.environ.get("WAFER_CSL_SCHEDULE") or os.environ.get("WAFER_CSL_PICKER") or "local-first"
    spec = spec.strip()
    if spec in POLICIES:
        return Schedule(spec)
    if spec.startswith("seed:"):
        try:
            seed = int(spec[5:])
        except ValueError:
            seed = None
        if seed is not None:
            return Schedule("random", seed, JITTER_CYCLES, random.Random(seed))
    raise CslRuntimeError(f"schedule {spec!r}: expected {', '.join(POLICIES)} or seed:N")
