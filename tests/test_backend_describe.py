"""Every backend describes itself, so /info and the engine never check backend names or plans."""

from __future__ import annotations

import pytest

from wafer_gpt2.backends.registry import BackendOptions, build_backend

KEYS = {"backend", "device_type", "dtype", "num_slots", "context_length", "vocab_size", "top_k", "plan"}


@pytest.mark.parametrize(("name", "dtype"), [("reference", "fp32"), ("sim", "fp16")])
def test_describe(small_params, name, dtype):
    backend = build_backend(name, small_params, BackendOptions(slots=2, context=16, top_k=8, dtype=dtype))
    try:
        described = backend.describe()
    finally:
        backend.close()
    assert set(described) == KEYS
    assert described["backend"] == described["device_type"] == name
    assert described["dtype"] == dtype
    assert (described["num_slots"], described["context_length"], described["top_k"]) == (2, 16, 8)
    assert described["vocab_size"] == small_params.config.vocab_size
    if name == "reference":
        assert described["plan"] == {}
    else:  # the plan in brief: no regions or routes
        assert described["plan"]["dtype"] == "fp16" and described["plan"]["slots"] == 2
        assert "regions" not in described["plan"]
