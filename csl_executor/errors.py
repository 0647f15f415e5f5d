"""What the CSL executor reports: one exception type per stage, each message naming where and why."""

from __future__ import annotations


class CslError(Exception):
    """The root of everything the executor raises about a CSL program."""


class CslSyntaxError(CslError):
    """The source does not parse, or uses a construct the executor does not implement."""


class CslCompileError(CslError):
    """What `cslc` would refuse: a type error, a failed `@comptime_assert`, a resource rule broken.

    The message starts with `file:line:` and names the rule."""


class CslRuntimeError(CslError):
    """The program did something the hardware would not survive (an index out of bounds, a wavelet
    with nowhere to go, two operations on one queue), or the host misused the runtime."""


class CslDeadlock(CslRuntimeError):
    """No PE, router or host command can make progress while work is still pending.

    `report` lists which PEs, colors, queues and tasks are waiting on what."""

    def __init__(self, summary: str, report: str) -> None:
        super().__init__(f"{summary}\n{report}")
        self.summary = summary
        self.report = report


def at(file: str, line: int, message: str) -> str:
    return f"{file}:{line}: {message}"
