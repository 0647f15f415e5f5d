"""The engine: continuous batching over one backend (`core.py`), its worker thread (`worker.py`) and
the engine in a process of its own (`process.py`, `messages.py`), with what they share: requests and
their events, scheduling, KV slots, sampling, detokenizing, metrics and the request failures with
their HTTP status (`failures.py`)."""
