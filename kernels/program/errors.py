"""The one error the program generator raises."""

from wafer.errors import WaferGPT2Error


class ProgramError(WaferGPT2Error, ValueError):
    """A plan the CSL program cannot be laid out for; the message names the region and the rule."""
