"""Reduction roles (reduce.csl): on each index of a line, which colors it receives on, which it sends on.

A chain ends at the last index, a tree (the rounds of `wafer.tiling.tree_rounds`) at index 0. One role
word per index packs the receive-slot mask, the send slot and the stream flag; layout.csl decodes it.
"""

from __future__ import annotations

import math

from kernels.program.codes import MAX_RX, ROLE_HAS_TX, ROLE_STREAM, ROLE_TX_SHIFT


def tree_receives(i: int, n: int) -> list[int]:
    """Rounds j in which index i is a destination of tree_rounds(n) (it then adds i + 2^j)."""
    out, s, j = [], 1, 0
    while s < n:
        if i % (2 * s) == 0 and i + s < n:
            out.append(j)
        s, j = 2 * s, j + 1
    return out


def tree_send_round(i: int, n: int) -> int | None:
    s, j = 1, 0
    while s < n:
        if i % (2 * s) == s:
            return j
        s, j = 2 * s, j + 1
    return None


def rounds(n: int) -> int:
    return math.ceil(math.log2(n)) if n > 1 else 0


def reduction_roles(kind: str, n: int) -> list[int]:
    """One role word per index: receive-slot mask, send slot, flags (layout.csl decodes them)."""
    words = []
    for i in range(n):
        if kind == "chain":
            mask = 1 << ((i - 1) % 2) if i > 0 else 0
            word = mask
            if i < n - 1:
                word |= ((i % 2) << ROLE_TX_SHIFT) | ROLE_HAS_TX
            if 0 < i < n - 1:
                word |= ROLE_STREAM
        else:
            mask = sum(1 << j for j in tree_receives(i, n))
            word = mask
            send = tree_send_round(i, n)
            if send is not None:
                word |= (send << ROLE_TX_SHIFT) | ROLE_HAS_TX
        words.append(word)
    return words


def decode_role(word: int) -> tuple[list[int], int | None, bool]:
    """(receive slots in order, send slot or None, stream) of a role word."""
    rx = [j for j in range(MAX_RX) if word >> j & 1]
    tx = (word >> ROLE_TX_SHIFT) & 0xF if word & ROLE_HAS_TX else None
    return rx, tx, bool(word & ROLE_STREAM)


def reduction_root(kind: str, n: int) -> int:
    return n - 1 if kind == "chain" else 0
