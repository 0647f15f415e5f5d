"""matplotlib for the figures (plan maps, the report), loaded only by what draws.

Plotting is a tool, not part of serving: matplotlib is the `report` extra (`pip install
'wafer-gpt2[report]'`; `make test` installs it), and a server never imports it.
"""

from __future__ import annotations

from types import ModuleType

from wafer.errors import MissingExtra


def pyplot() -> ModuleType:
    """matplotlib.pyplot on the Agg backend (files only: no display on servers and CI)."""
    try:
        import matplotlib
    except ImportError as exc:
        raise MissingExtra(
            "drawing figures needs matplotlib, which serving does not: pip install 'wafer-gpt2[report]'"
        ) from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
