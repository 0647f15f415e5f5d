"""Host-side helpers shared by the kernel examples' run.py scripts (SDK 1.4 host API only).

Every stream between regions carries, per item, a 5-word header then f32 payload words (see
wafer_gpt2/kernels/comm/README.md); these helpers build such items and read them back.
"""

from __future__ import annotations

import numpy as np

HDR = 5


def header(item: int, slot: int = 0, position: int = 0, flags: int = 0, target: int = 0) -> np.ndarray:
    return np.array([item, slot, position, flags, target], dtype=np.uint32)


def item_words(head: np.ndarray, payload: np.ndarray) -> np.ndarray:
    """One item on a stream: header words, then the f32 payload as its bits."""
    return np.concatenate([head.astype(np.uint32), np.asarray(payload, dtype=np.float32).view(np.uint32)])


def split_items(words: np.ndarray, payload: int) -> tuple[np.ndarray, np.ndarray]:
    """A stream of items of `payload` f32 words each -> (headers [n, HDR] u32, payloads [n, payload] f32)."""
    rows = np.asarray(words, dtype=np.uint32).reshape(-1, HDR + payload)
    return rows[:, :HDR], rows[:, HDR:].copy().view(np.float32)


def to_wire16(values: np.ndarray) -> np.ndarray:
    """fp16 values -> uint32 words with the value in the low half (memcpy's 16-bit transfers)."""
    return np.asarray(values, dtype=np.float16).view(np.uint16).astype(np.uint32)


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GPT-2's GELU as wafer_gpt2/kernels/lib/gelu.csl writes it (tanh through exp), in float32."""
    f = np.float32
    inner = f(np.sqrt(2.0 / np.pi)) * (x + f(0.044715) * (x * x * x))
    with np.errstate(over="ignore"):
        tanh = f(1) - f(2) / (np.exp(f(2) * inner) + f(1))
    return f(0.5) * x * (f(1) + tanh)
