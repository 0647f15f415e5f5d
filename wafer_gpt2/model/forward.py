"""The reference GPT-2 forward pass: plain fp32 NumPy with a KV cache.

This is the oracle the simulator, the CSL kernels and the service are checked against, so it is
written for clarity first. It matches Hugging Face's `GPT2LMHeadModel` (eager attention, fp32):

    x = wte[tokens] + wpe[positions]
    for each block:  x = x + attn(ln_1(x));  x = x + mlp(ln_2(x))
    logits = ln_f(x) @ wte.T            (the LM head is tied to the token embedding)

Several independent sequences can run in one call (`forward_batch`): the row-wise work (LayerNorm,
the four GEMMs, GELU, the LM head) is done on all rows at once and only attention is per sequence.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from wafer_gpt2.model.config import GPT2Config
from wafer_gpt2.model.params import GPT2Params, LayerParams


class KVCache:
    """One sequence's keys and values: per layer a [capacity, C] array for K and one for V.

    `length` is how many leading positions hold valid entries. The arrays come from `np.zeros`, so
    memory is only committed for positions actually written.
    """

    def __init__(self, config: GPT2Config, capacity: int | None = None) -> None:
        self.capacity = capacity or config.n_positions
        if not 0 < self.capacity <= config.n_positions:
            raise ValueError(
                f"KV cache capacity {self.capacity} outside 1..{config.n_positions} (n_positions)"
            )
        shape = (self.capacity, config.n_embd)
        self.k = [np.zeros(shape, dtype=np.float32) for _ in range(config.n_layer)]
        self.v = [np.zeros(shape, dtype=np.float32) for _ in range(config.n_layer)]
        self.length = 0

    def reset(self) -> None:
        self.length = 0


@dataclass(frozen=True)
class Segment:
    """`count` consecutive rows of a batch that continue one sequence from position `start`."""

    cache: KVCache
    start: int
    count: int


def layer_norm(x: np.ndarray, gain: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)  # biased variance, as torch's LayerNorm
    return (x - mean) / np.sqrt(var + eps) * gain + bias


def gelu(x: np.ndarray) -> np.ndarray:
    """GPT-2's tanh approximation of GELU (HF's `gelu_new`)."""
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def causal_attention(
    q: np.ndarray, keys: np.ndarray, values: np.ndarray, start: int, n_head: int
) -> np.ndarray:
    """q [n, C] for positions start..start+n-1; keys/values [start+n, C] (the cache so far).

    Query i sees keys 0..start+i. Returns [n, C] (heads concatenated).
    """
    n, c = q.shape
    t = keys.shape[0]
    d = c // n_head
    qh = q.reshape(n, n_head, d).transpose(1, 0, 2)  # [H, n, D]
    kh = keys.reshape(t, n_head, d).transpose(1, 2, 0)  # [H, D, T]
    vh = values.reshape(t, n_head, d).transpose(1, 0, 2)  # [H, T, D]
    scores = (qh @ kh) * np.float32(1.0 / math.sqrt(d))  # [H, n, T]
    query_pos = start + np.arange(n)[:, None]
    key_pos = np.arange(t)[None, :]
    scores = np.where(key_pos <= query_pos, scores, -np.inf)
    out = softmax(scores) @ vh  # [H, n, D]
    return out.transpose(1, 0, 2).reshape(n, c)


def attention_block(
    x: np.ndarray, layer: LayerParams, layer_index: int, segments: Sequence[Segment], n_head: int
) -> np.ndarray:
    """Self-attention for all rows: QKV and the output projection batched, attention per sequence."""
    c = x.shape[1]
    qkv = x @ layer.attn_w + layer.attn_b  # [N, 3C]
    q, k, v = qkv[:, :c], qkv[:, c : 2 * c], qkv[:, 2 * c :]
    y = np.empty_like(q)
    row = 0
    for seg in segments:
        rows = slice(row, row + seg.count)
        end = seg.start + seg.count
        cache_k, cache_v = seg.cache.k[layer_index], seg.cache.v[layer_index]
        cache_k[seg.start : end] = k[rows]
        cache_v[seg.start : end] = v[rows]
        y[rows] = causal_attention(q[rows], cache_k[:end], cache_v[:end], seg.start, n_head)
        row += seg.count
    return y @ layer.attn_proj_w + layer.attn_proj_b


def mlp(x: np.ndarray, layer: LayerParams) -> np.ndarray:
    return gelu(x @ layer.fc_w + layer.fc_b) @ layer.proj_w + layer.proj_b


def forward_hidden(params: GPT2Params, tokens: np.ndarray, segments: Sequence[Segment]) -> np.ndarray:
    """Final hidden states (after ln_f), [N, C], for a batch of rows laid out as `segments`.

    Writes each row's K/V into its sequence's cache and advances the caches' `length`.
    """
    cfg = params.config
    tokens = np.asarray(tokens, dtype=np.int64)
    if tokens.ndim != 1 or tokens.shape[0] != sum(seg.count for seg in segments):
        raise ValueError(f"tokens must be 1-D with one entry per segment row, got shape {tokens.shape}")
    for seg in segments:
        if seg.start < 0 or seg.count < 1 or seg.start + seg.count > seg.cache.capacity:
            raise ValueError(
                f"positions {seg.start}..{seg.start + seg.count - 1} do not fit a cache of {seg.cache.capacity}"
            )
        if seg.start > seg.cache.length:
            raise ValueError(
                f"position {seg.start} leaves a gap: the cache holds only {seg.cache.length} positions"
            )
    if tokens.size and not (0 <= tokens.min() and tokens.max() < cfg.vocab_size):
        raise ValueError(f"token ids must lie in 0..{cfg.vocab_size - 1}")

    if not segments:
        return np.zeros((0, cfg.n_embd), dtype=np.float32)

    eps, n_head = cfg.layer_norm_epsilon, cfg.n_head
    positions = np.concatenate([np.arange(seg.start, seg.start + seg.count) for seg in segments])
    x = params.wte[tokens] + params.wpe[positions]
    for i, layer in enumerate(params.layers):
        x = x + attention_block(layer_norm(x, layer.ln_1_g, layer.ln_1_b, eps), layer, i, segments, n_head)
        x = x + mlp(layer_norm(x, layer.ln_2_g, layer.ln_2_b, eps), layer)
    for seg in segments:
        seg.cache.length = seg.start + seg.count
    return layer_norm(x, params.ln_f_g, params.ln_f_b, eps)


def lm_head(params: GPT2Params, hidden: np.ndarray) -> np.ndarray:
    """Logits over the vocabulary, [N, V]: the tied head multiplies by wte^T."""
    return hidden @ params.wte.T


def forward(params: GPT2Params, tokens: Sequence[int] | np.ndarray, cache: KVCache, start: int) -> np.ndarray:
    """Logits [len(tokens), V] for `tokens` at positions start.. of one sequence.

    Prefill with `start=0` and the prompt, then decode one token at a time with `start=cache.length`.
    """
    tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
    hidden = forward_hidden(params, tokens, [Segment(cache, start, tokens.shape[0])])
    return lm_head(params, hidden)


def logsumexp(logits: np.ndarray) -> np.ndarray:
    """log(sum(exp(logits))) over the last axis, in float64."""
    x = np.asarray(logits, dtype=np.float64)
    peak = x.max(axis=-1, keepdims=True)
    return (peak + np.log(np.exp(x - peak).sum(axis=-1, keepdims=True)))[..., 0]
