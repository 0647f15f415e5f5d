"""Keeping the cyclic garbage collector off the long-lived heap of a server process.

A full collection walks every tracked object. After startup most of them live as long as the process
(modules, the FastAPI app and its schemas, the engine, the backend and its plan): a full collection
walks all of that heap, a stall of every request in flight each time one runs. `settle` collects once, then
freezes what is left (`gc.freeze`: moved to a generation the collector never walks), as vLLM's engine
core does after it has loaded the model. A later `settle` unfreezes first, so that what a reload
dropped (the old backend) can still be collected.
"""

from __future__ import annotations

import gc


def settle() -> None:
    gc.unfreeze()
    gc.collect()
    gc.freeze()
