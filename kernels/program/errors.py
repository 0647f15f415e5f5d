"""The one error the program generator raises."""


class ProgramError(ValueError):
    """A plan the CSL program cannot be laid out for; the message names the region and the rule."""
