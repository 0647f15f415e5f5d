"""The product's one root exception: every error it raises on purpose derives from `WaferGPT2Error`.

A caller (the CLI, a user's script) tells "the input or the environment is wrong, here is why" from a
bug by catching this one type. It imports nothing, so any module of the product can use it. The errors
that belong to no one layer live here too: the CLI's `UserError` and the program generator's
`ProgramError`. (The CSL executor, `csl_executor`, is a package of its own with its own root, `CslError`.)
"""

from __future__ import annotations


class WaferGPT2Error(Exception):
    """An error the project raises on purpose, with a message that says what is wrong."""


class InvalidInput(WaferGPT2Error, ValueError):
    """A value given to the project (a flag, a shape, a file's content) that it cannot work with."""


class MissingExtra(WaferGPT2Error, ImportError):
    """A tool that needs an optional dependency the install left out (e.g. plotting: `[plot]`)."""


class UserError(WaferGPT2Error, ValueError):
    """A problem the user can fix: printed as one line, exit status 2."""


class ProgramError(WaferGPT2Error, ValueError):
    """A plan the CSL program cannot be laid out for; the message names the region and the rule."""
