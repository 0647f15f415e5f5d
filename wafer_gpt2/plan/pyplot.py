"""matplotlib for the figures (plan maps, the report), loaded only by what draws.

Plotting is a tool, not part of serving: matplotlib is the `plot` extra (`pip install
'wafer-gpt2[plot]'`; `make test` installs it), and a server never imports it.
"""

from __future__ import annotations

from types import ModuleType

from wafer_gpt2.errors import MissingExtra


def pyplot() -> ModuleType:
    """matplotlib.pyplot on the Agg backend (files only: no display on servers and CI)."""
    try:
        import matplotlib
    except ImportError as exc:
        raise MissingExtra(
            "drawing figures needs matplotlib, which serving does not: pip install 'wafer-gpt2[plot]'"
        ) from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
