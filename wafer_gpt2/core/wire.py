"""The words that cross the memcpy streams each step: one format for host, simulator and CSL.

Every memcpy transfer moves 32-bit words, so both directions are arrays of uint32 (floats travel as
their IEEE-754 bits). One pipeline replica has one input port and one output port
(`plan.io_ports(replica)`): the host streams onto color H2D_COLOR at the input port's PE and reads
color D2H_COLOR at the output port's PE.

Input stream, host -> the replica's input port, one message per step:

    word 0              n_items
    then per item       slot, position, token, flags, target        (ITEM_WORDS = 5)

  `slot` is the replica's own slot index (0 .. slots per replica - 1). `flags` bit 0 (WANT_SCORES):
  the head reports this item; bit 1 (HAS_TARGET): also report the logit of token id `target`
  (otherwise `target` is 0 and ignored). Items of one slot are consecutive positions, in order.

Output stream, the replica's output port -> host: one record per item whose WANT_SCORES flag is set,
in item order, each `record_words(k)` = 2k + 3 words:

    item index (u32: the item's index in the step's message)
    top-k ids (k x u32, best first; ties go to the lower id)
    top-k logits (k x f32)
    log-sum-exp over the whole vocabulary (f32)
    target logit (f32; NaN when the item did not ask for one)
"""

from __future__ import annotations

import functools

import numpy as np

from wafer_gpt2.core.steps import FIELDS, SLOT, StepInputs, StepScores
from wafer_gpt2.errors import WaferGPT2Error

# The memcpy streaming colors (kernels/layout.csl: MEMCPYH2D_DATA_1_ID and MEMCPYD2H_DATA_1_ID).
H2D_COLOR = 14
D2H_COLOR = 15

ITEM_WORDS = FIELDS  # an item's words are the rows of `StepInputs.columns`, in order
HEADER_WORDS = 1


class WireError(WaferGPT2Error, RuntimeError):
    """A stream message that does not follow this format."""


def record_words(top_k: int) -> int:
    return 2 * top_k + 3


@functools.lru_cache(maxsize=8)
def _record_dtype(top_k: int) -> np.dtype:
    """An output record as one structured value (`record_words(top_k)` words): its fields are the
    format's, the floats' bits read as float32."""
    return np.dtype(
        [
            ("item", np.uint32),
            ("ids", np.int32, (top_k,)),
            ("logits", np.float32, (top_k,)),
            ("tail", np.float32, (2,)),
        ]
    )


def step_message(inputs: StepInputs, slots_per_replica: int) -> np.ndarray:
    """The input-stream message of one replica's items (header + ITEM_WORDS per item, uint32), their
    slots counted within the replica: the step's columns, transposed, behind the header."""
    n = len(inputs)
    words = np.empty(HEADER_WORDS + ITEM_WORDS * n, dtype=np.uint32)
    words[0] = n
    body = words[HEADER_WORDS:].reshape(n, ITEM_WORDS)
    body[:] = inputs.columns.T
    body[:, SLOT] %= slots_per_replica
    return words


def message_words(header: int) -> int:
    """Total words of an input message whose first word is `header`."""
    return HEADER_WORDS + ITEM_WORDS * int(header)


def decode_items(words: np.ndarray) -> StepInputs:
    """Parse one complete input message (header included)."""
    words = np.asarray(words, dtype=np.uint32)
    if words.size < HEADER_WORDS or words.size != message_words(words[0]):
        raise WireError(
            f"input message of {words.size} words does not match its header "
            f"({int(words[0]) if words.size else '?'} items need "
            f"{message_words(words[0]) if words.size else '?'} words)"
        )
    return StepInputs(words[HEADER_WORDS:].reshape(-1, ITEM_WORDS).T.astype(np.int64))


def encode_scores(
    item_index: np.ndarray,
    topk_ids: np.ndarray,
    topk_logits: np.ndarray,
    logsumexp: np.ndarray,
    target_logit: np.ndarray,
) -> np.ndarray:
    """Output-stream words for n scored items: [n, record_words(k)] flattened, uint32."""
    n, k = topk_ids.shape
    records = np.empty((n, record_words(k)), dtype=np.uint32)
    records[:, 0] = item_index
    records[:, 1 : 1 + k] = topk_ids
    records[:, 1 + k : 1 + 2 * k] = np.ascontiguousarray(topk_logits, dtype=np.float32).view(np.uint32)
    records[:, 1 + 2 * k] = np.ascontiguousarray(logsumexp, dtype=np.float32).view(np.uint32)
    records[:, 2 + 2 * k] = np.ascontiguousarray(target_logit, dtype=np.float32).view(np.uint32)
    return records.reshape(-1)


def decode_scores(
    words: np.ndarray,
    top_k: int,
    expected_items: np.ndarray,
    asked_target: np.ndarray,
    count: int | None = None,
    index: np.ndarray | None = None,
) -> StepScores:
    """Parse the output stream of one step into its `StepScores`: `expected_items` (int64) are the
    indices (in the message) of the items that asked for scores, `asked_target` (bool) whether each of
    them asked for a target logit. The records are split into the step's columns at once, a few numpy
    calls a step (this runs between two steps, while the wafer waits). `count`: the message's items
    (default: the last scored one's index + 1); `index`: the rows' item indices in the step, where they
    differ from the message's (a replica's message is part of a step)."""
    size = record_words(top_k)
    words = np.asarray(words, dtype=np.uint32)
    n = expected_items.shape[0]
    if words.size != size * n:
        raise WireError(f"output stream of {words.size} words, expected {n} records of {size}")
    if words.ndim != 1:
        words = words.reshape(-1)
    # One copy of the records (the caller's buffer may be reused), read by field: the fields of a
    # structured dtype are views made at a fraction of a slice-and-view's cost (each numpy call costs
    # thousands of instructions at a few records).
    records = words.copy().view(_record_dtype(top_k))
    # Compared as lists: a numpy compare of a uint32 and an int64 column costs more at a few items.
    arrived, due = records["item"].tolist(), expected_items.tolist()
    if arrived != due:
        late = next(i for i, (got, want) in enumerate(zip(arrived, due, strict=True)) if got != want)
        raise WireError(f"output record for item {arrived[late]} arrived where item {due[late]} was due")
    if asked_target.shape != (n,):
        raise WireError(f"{asked_target.size} target flags for {n} records")
    floats = records["tail"].astype(np.float64)  # the log-sum-exp and target logit side by side
    targets = floats[:, 1]
    asked = np.count_nonzero(asked_target)  # a C call: any() and all() cost several times more
    if not asked:
        targets[:] = np.nan
    elif asked < n:
        targets[~asked_target] = np.nan
    return StepScores(
        count=(due[-1] + 1 if n else 0) if count is None else count,
        index=expected_items if index is None else index,
        topk_ids=records["ids"],
        topk_logits=records["logits"],
        logsumexp=floats[:, 0],
        target_logit=targets,
        has_target=asked_target,
    )
