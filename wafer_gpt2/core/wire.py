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

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from wafer_gpt2.core.steps import StepItem, TokenScores
from wafer_gpt2.errors import WaferGPT2Error

# The memcpy streaming colors (kernels/layout.csl: MEMCPYH2D_DATA_1_ID and MEMCPYD2H_DATA_1_ID).
H2D_COLOR = 14
D2H_COLOR = 15

# Scored items whose records the host may leave unread while it sends on: io.out
# (wafer_gpt2/kernels/pe/io_out.csl) holds one record and memcpy runs one command at a time, so a host driving the
# wafer program reads each record before it sends the next scored item (wafer_gpt2.host.program.WaferGPT2.step),
# or the H2D that carries it never ends and the D2H behind it never starts.
RECORDS_IN_FLIGHT = 1

ITEM_WORDS = 5
HEADER_WORDS = 1
WANT_SCORES = 1
HAS_TARGET = 2


class WireError(WaferGPT2Error, RuntimeError):
    """A stream message that does not follow this format."""


def record_words(top_k: int) -> int:
    return 2 * top_k + 3


@dataclass(frozen=True)
class WireItems:
    """One step's items as parallel arrays (what the embed region parses from the input stream)."""

    slot: np.ndarray  # int64 [n]
    position: np.ndarray  # int64 [n]
    token: np.ndarray  # int64 [n]
    want_scores: np.ndarray  # bool [n]
    target: np.ndarray  # int64 [n], -1 where no target was asked for

    def __len__(self) -> int:
        return int(self.slot.shape[0])


def encode_items(
    slots: Sequence[int],
    positions: Sequence[int],
    tokens: Sequence[int],
    want_scores: Sequence[bool],
    targets: Sequence[int | None],
) -> np.ndarray:
    """The input-stream message for one step: header + ITEM_WORDS per item, uint32."""
    return _message(list(zip(slots, positions, tokens, want_scores, targets, strict=True)))


def step_message(items: Sequence[StepItem], slots_per_replica: int) -> np.ndarray:
    """The input-stream message of one replica's items, their slots counted within the replica."""
    return _message(
        [
            (item.slot % slots_per_replica, item.position, item.token, item.want_scores, item.target)
            for item in items
        ]
    )


def _message(items: Sequence[tuple[int, int, int, bool, int | None]]) -> np.ndarray:
    """The message of (slot, position, token, want_scores, target) rows: built from one row per item, not
    a column at a time (this runs before every step)."""
    words = np.zeros(HEADER_WORDS + ITEM_WORDS * len(items), dtype=np.uint32)
    words[0] = len(items)
    if items:
        words[HEADER_WORDS:].reshape(len(items), ITEM_WORDS)[:] = [
            (
                slot,
                position,
                token,
                (WANT_SCORES if want else 0) | (0 if target is None else HAS_TARGET),
                0 if target is None else target,
            )
            for slot, position, token, want, target in items
        ]
    return words


def message_words(header: int) -> int:
    """Total words of an input message whose first word is `header`."""
    return HEADER_WORDS + ITEM_WORDS * int(header)


def decode_items(words: np.ndarray) -> WireItems:
    """Parse one complete input message (header included)."""
    words = np.asarray(words, dtype=np.uint32)
    if words.size < HEADER_WORDS or words.size != message_words(words[0]):
        raise WireError(
            f"input message of {words.size} words does not match its header "
            f"({int(words[0]) if words.size else '?'} items need "
            f"{message_words(words[0]) if words.size else '?'} words)"
        )
    body = words[HEADER_WORDS:].reshape(-1, ITEM_WORDS).astype(np.int64)
    flags = body[:, 3]
    return WireItems(
        slot=body[:, 0],
        position=body[:, 1],
        token=body[:, 2],
        want_scores=(flags & WANT_SCORES) != 0,
        target=np.where((flags & HAS_TARGET) != 0, body[:, 4], -1),
    )


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
    words: np.ndarray, top_k: int, expected_items: Sequence[int], asked_target: Sequence[bool]
) -> list[TokenScores]:
    """Parse the output stream of one step: `expected_items` are the indices of the items that asked
    for scores, `asked_target` whether each of them asked for a target logit. The step's records are
    split into columns at once and each item's `TokenScores` holds rows of them: a few numpy calls a step,
    not a few a record (this runs between two steps, while the wafer waits)."""
    size = record_words(top_k)
    words = np.asarray(words, dtype=np.uint32)
    if words.size != size * len(expected_items):
        raise WireError(
            f"output stream of {words.size} words, expected {len(expected_items)} records of {size}"
        )
    records = words.reshape(len(expected_items), size)
    arrived = records[:, 0].tolist()
    if arrived != list(expected_items):
        late = next(i for i, (got, due) in enumerate(zip(arrived, expected_items, strict=True)) if got != due)
        raise WireError(
            f"output record for item {arrived[late]} arrived where item {expected_items[late]} was due"
        )
    ids = records[:, 1 : 1 + top_k].astype(np.int32)
    logits = records[:, 1 + top_k : 1 + 2 * top_k].view(np.float32).copy()
    lse = records[:, 1 + 2 * top_k].view(np.float32).tolist()
    targets = records[:, 2 + 2 * top_k].view(np.float32).tolist()
    return [
        TokenScores(
            topk_ids=ids[i],
            topk_logits=logits[i],
            logsumexp=lse[i],
            target_logit=targets[i] if asked else None,
        )
        for i, asked in zip(range(len(lse)), asked_target, strict=True)
    ]
