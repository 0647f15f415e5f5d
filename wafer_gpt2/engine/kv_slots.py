"""The KV slot manager: who owns which of the wafer's KV cache slots.

The plan gives the wafer a fixed number of slots, each holding `context_length` positions of K/V in
every layer's attention region. A request holds one slot from admission until it ends, however it ends;
the engine frees the slot and tells the backend to forget it. Allocation is all-or-nothing: a request
whose prompt plus `max_new_tokens` cannot fit in one slot is refused before it is queued, so a running
request never runs out of KV room halfway.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from wafer_gpt2.errors import InvalidInput, WaferGPT2Error


class SlotError(WaferGPT2Error, RuntimeError):
    """Misuse of the slot manager (freeing a slot nobody holds): a bug in the engine, never user input."""


@dataclass(frozen=True)
class KVUsage:
    slots_used: int
    slots_total: int
    tokens_reserved: int  # positions the holders may write (prompt + max_new_tokens each)
    tokens_capacity: int  # slots_total * context_length

    @property
    def fraction(self) -> float:
        """Share of the KV capacity that is held (vLLM's `kv_cache_usage_perc`, 0..1)."""
        return usage_fraction(self.slots_used, self.slots_total)


def usage_fraction(slots_used: int, slots_total: int) -> float:
    """`KVUsage.fraction` of those figures."""
    return slots_used / slots_total if slots_total else 0.0


class KVSlotManager:
    def __init__(self, num_slots: int, context_length: int):
        if num_slots <= 0 or context_length <= 0:
            raise InvalidInput(
                f"need at least one slot and one position (got {num_slots} x {context_length})"
            )
        self.num_slots = num_slots
        self.context_length = context_length
        self._lock = threading.Lock()
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._holders: dict[int, tuple[str, int]] = {}  # slot -> (request id, tokens reserved)
        self._reserved = 0  # the sum of the holders' reservations, kept as they change

    def fits(self, tokens_needed: int) -> bool:
        return 0 < tokens_needed <= self.context_length

    def allocate(self, request_id: str, tokens_needed: int) -> int | None:
        """A free slot for `request_id`, or None when every slot is held."""
        if not self.fits(tokens_needed):
            raise SlotError(
                f"request {request_id} needs {tokens_needed} positions; a slot holds {self.context_length}"
            )
        with self._lock:
            if not self._free:
                return None
            slot = self._free.pop()
            self._holders[slot] = (request_id, tokens_needed)
            self._reserved += tokens_needed
            return slot

    def free(self, slot: int) -> None:
        with self._lock:
            if slot not in self._holders:
                raise SlotError(f"slot {slot} is not held")
            self._reserved -= self._holders.pop(slot)[1]
            self._free.append(slot)

    def free_all(self) -> list[int]:
        """Release every slot (after a worker failure or at shutdown); returns the slots that were held."""
        with self._lock:
            held = sorted(self._holders)
            self._holders.clear()
            self._reserved = 0
            self._free = list(range(self.num_slots - 1, -1, -1))
            return held

    def holder(self, slot: int) -> str | None:
        with self._lock:
            entry = self._holders.get(slot)
            return entry[0] if entry else None

    def counts(self) -> tuple[int, int]:
        """(slots held, tokens reserved): what `usage` reports that changes, cheaply (the engine compares
        it at every step to skip unchanged gauges)."""
        return len(self._holders), self._reserved

    def usage(self) -> KVUsage:
        with self._lock:
            return KVUsage(
                slots_used=len(self._holders),
                slots_total=self.num_slots,
                tokens_reserved=self._reserved,
                tokens_capacity=self.num_slots * self.context_length,
            )
