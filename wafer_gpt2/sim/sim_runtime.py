"""`SimRuntime`: the runtime contract (`wafer_gpt2.core.runtime.Runtime`) served by the embedded simulator.

Built from a plan: every region's PE memory is allocated (the plan is refused if a PE's symbols do
not fit), the host's copy-mode transfers read and write it, and the input-stream messages that
arrive at a replica's input port run the wafer program (`WaferProgram`), whose records wait at the
output port until the host reads them with a streaming memcpy_d2h.
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING

import numpy as np

from wafer_gpt2.core.abi import HOST_FUNCTIONS
from wafer_gpt2.core.runtime import CheckedRuntime, MemcpyDataType, WaferRuntimeError
from wafer_gpt2.core.wire import D2H_COLOR, H2D_COLOR, HEADER_WORDS, decode_items, message_words
from wafer_gpt2.sim.memory import WaferMemory
from wafer_gpt2.sim.wafer_program import WaferProgram

if TYPE_CHECKING:
    from wafer_gpt2.plan.structure import Plan


class SimRuntime(CheckedRuntime):
    backend = "sim"  # what `WaferGPT2.describe` reports

    def __init__(self, plan: Plan) -> None:
        super().__init__()
        self.plan = plan
        self.kernel_wh = (plan.arch.kernel_w, plan.arch.kernel_h)
        # The plan lists every array a PE keeps, its `cycles` counter included
        # (`wafer_gpt2.plan.symbols.with_cycles`).
        self.memory = WaferMemory(plan.regions, self.kernel_wh, plan.arch)
        self.program = WaferProgram(plan, self.memory)
        # Streams: words waiting at a PE, per (color, x, y).
        self._inbox: dict[tuple[int, int, int], list[np.ndarray]] = defaultdict(list)
        self._outbox: dict[tuple[int, int, int], list[np.ndarray]] = defaultdict(list)
        self._input_ports = {}
        self._output_ports = set()
        for replica in range(plan.replicas):
            port_in, port_out = plan.io_ports(replica)
            self._input_ports[(H2D_COLOR, port_in.x, port_in.y)] = replica
            self._output_ports.add((D2H_COLOR, port_out.x, port_out.y))

    # -- Runtime primitives ------------------------------------------------------------------------

    def get_id(self, symbol: str) -> int:
        return self.memory.symbol_id(symbol)

    def _load(self) -> None:
        pass  # the memory and program were built (and checked) with the runtime

    def _describe(self, symbol_id: int) -> str:
        return repr(self.memory.symbol_name(symbol_id))

    def _check_copy(self, what, symbol_id, rect, elems, data_type) -> None:
        self.memory.check_transfer(what, self.memory.symbol_name(symbol_id), rect, elems, data_type)

    def _check_stream(self, what, color, rect, elems, data_type) -> None:
        if data_type is not MemcpyDataType.MEMCPY_32BIT:
            raise WaferRuntimeError(f"{what}: the program's streams carry 32-bit words; use MEMCPY_32BIT")
        ports = self._input_ports if what == "memcpy_h2d" else self._output_ports
        px, py, w, h = rect
        for y in range(py, py + h):
            for x in range(px, px + w):
                if (color, x, y) not in ports:
                    direction = "receives" if what == "memcpy_h2d" else "sends"
                    listed = ", ".join(f"color {c} at ({px_}, {py_})" for c, px_, py_ in sorted(ports))
                    raise WaferRuntimeError(
                        f"{what}: streaming to color {color} at PE ({x}, {y}), but no PE program {direction} "
                        f"a memcpy stream there (ports: {listed})"
                    )

    def _check_launch(self, name: str, args: tuple) -> tuple:
        if name not in HOST_FUNCTIONS:
            raise WaferRuntimeError(
                f"launch: the program exports no function {name!r} (exported: {', '.join(HOST_FUNCTIONS)})"
            )
        expected = [arg for arg, _ in HOST_FUNCTIONS[name]]
        if len(args) != len(expected):
            raise WaferRuntimeError(
                f"launch({name!r}): takes {len(expected)} arguments ({', '.join(expected)}), got {len(args)}"
            )
        values = []
        for arg_name, arg in zip(expected, args, strict=True):
            if not isinstance(arg, int | np.integer) or isinstance(arg, bool):
                raise WaferRuntimeError(
                    f"launch({name!r}): argument {arg_name} must be an integer, got {arg!r}"
                )
            values.append(int(arg))
        if name == "clear_slot":
            replica, slot = values
            if not 0 <= replica < self.plan.replicas or not 0 <= slot < self.plan.slots:
                raise WaferRuntimeError(
                    f"launch('clear_slot'): replica {replica} / slot {slot} outside 0..{self.plan.replicas - 1} / "
                    f"0..{self.plan.slots - 1}"
                )
        return tuple(values)

    def _copy_in(self, symbol_id, rect, words_hwl, data_type) -> None:
        self.memory.write(self.memory.symbol_name(symbol_id), rect, words_hwl, data_type)

    def _copy_out(self, symbol_id, rect, elems, data_type) -> np.ndarray:
        return self.memory.read(self.memory.symbol_name(symbol_id), rect, elems, data_type)

    def _stream_in(self, color: int, rect, words_hwl: np.ndarray) -> None:
        px, py, w, h = rect
        for dy in range(h):
            for dx in range(w):
                key = (color, px + dx, py + dy)
                self._inbox[key].append(np.asarray(words_hwl[dy, dx], dtype=np.uint32))
                self._deliver(key)

    def _deliver(self, key: tuple[int, int, int]) -> None:
        """Run every complete message waiting at an input port (a partial one waits for more words)."""
        replica = self._input_ports[key]
        waiting = np.concatenate(self._inbox[key]) if self._inbox[key] else np.zeros(0, np.uint32)
        while waiting.size >= HEADER_WORDS and waiting.size >= message_words(waiting[0]):
            size = message_words(waiting[0])
            message, waiting = waiting[:size], waiting[size:]
            out = self.program.run_step(replica, decode_items(message))
            if out.size:
                port_out = self.plan.io_ports(replica)[1]
                self._outbox[(D2H_COLOR, port_out.x, port_out.y)].append(out)
        self._inbox[key] = [waiting] if waiting.size else []

    def _stream_out(self, color: int, rect, elems: int) -> np.ndarray:
        px, py, w, h = rect
        out = np.zeros((h, w, elems), dtype=np.uint32)
        for dy in range(h):
            for dx in range(w):
                key = (color, px + dx, py + dy)
                ready = np.concatenate(self._outbox[key]) if self._outbox[key] else np.zeros(0, np.uint32)
                if ready.size < elems:
                    raise WaferRuntimeError(
                        f"memcpy_d2h: streaming {elems} words from color {color} at PE ({px + dx}, {py + dy}), but "
                        f"the program has sent only {ready.size}; on the wafer this call would wait forever"
                    )
                out[dy, dx] = ready[:elems]
                self._outbox[key] = [ready[elems:]] if ready.size > elems else []
        return out

    def _launch(self, name: str, args: tuple) -> None:
        if name == "clear_slot":
            self.program.clear_slot(*args)
        elif name == "reset_cycles":
            self.program.reset_cycles()
