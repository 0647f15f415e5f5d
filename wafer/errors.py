"""The project's one root exception: every error it raises on purpose derives from `WaferGPT2Error`.

A caller (the CLI, a user's script) tells "the input or the environment is wrong, here is why" from a
bug by catching this one type. It imports nothing, so any module of the project can use it.
"""

from __future__ import annotations


class WaferGPT2Error(Exception):
    """An error the project raises on purpose, with a message that says what is wrong."""


class InvalidInput(WaferGPT2Error, ValueError):
    """A value given to the project (a flag, a shape, a file's content) that it cannot work with."""


class MissingExtra(WaferGPT2Error, ImportError):
    """A tool that needs an optional dependency the install left out (e.g. plotting: `[report]`)."""
