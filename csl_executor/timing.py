"""The executor's cycle model: every cycle count it reports is built from these constants.

They are the same public figures the planner's cost model (`wafer_gpt2.core.cost`) starts from
(the Cerebras SDK documentation and Cerebras' published hardware figures), so that executor cycles and modeled cycles can be compared
region by region; where no public figure exists the value is an assumption, said so.
Queue depths are the SDK's (`csl_executor.arch`). The executor models the timing of a program's
structure (hops, queues, back-pressure, task order), not the micro-architecture: see
csl_executor/README.md, "What it does not model".
"""

from __future__ import annotations

from typing import Literal

# Calibrated on Cerebras hardware: the published CS-3 runs of WaferLLM's MeshGEMV (docs/calibration.md,
# "The data"; the executor's own table is in csl_executor/README.md, "Timed like hardware"). The cost
# model (wafer_gpt2.core.cost) fits three constants on them; the executor uses the same three, each where the
# mechanism it prices happens.
HOP = 2  # router to router, per wavelet: the fit gives 2.03 cycles (the SDK's "one cycle" between
# neighbours is the link's rate, one wavelet per cycle); topic-13's simulator log shows a broadcast
# reaching x = 1, 2, 3 at cycles 1156, 1158, 1160
ROUTER_TO_CE = 7  # a wavelet stopping at a PE (csl-notes: "router to processor about 7 cycles")
# How a stream into a PE's input queue is paced (docs/kernels.md; csl_executor/README.md, "Timed like
# hardware", has the hardware evidence). "queue-depth": a wavelet holds its place in the input queue from
# the cycle the router sends it down the ramp until the CE takes it (ROUTER_TO_CE cycles later at the
# earliest), so a long stream into one queue runs at depth / ROUTER_TO_CE wavelets a cycle (4/7 into a
# four-deep queue; about depth / 8 for a SIMD-64 read, which takes wavelets in pairs). "link-rate": the
# ramp holds the wavelets on their way down besides the queue (ROUTER_TO_CE of them), so a stream runs at
# the link's rate, a wavelet a cycle, and a queue nobody reads backs up depth + ROUTER_TO_CE wavelets.
STREAM_PACING: Literal["queue-depth", "link-rate"] = "queue-depth"
CE_TO_ROUTER = 1  # output queue to router (assumption: one cycle, a link's rate)
TASK_START = 20  # picking a task and entering it (assumption, as wafer_gpt2.core.cost.TASK_ACTIVATION_CYCLES)
STATEMENT = 1  # one scalar operation of a task (assumption: the CE issues about one per cycle)
# Starting a DSD operation: the fit gives 15.4 cycles per operation started, with the scalar
# control between operations; the executor charges the statement that issues it (STATEMENT) apart.
DSD_SETUP = 14
# One step of a @map beyond its function's work: the fit gives 2.0 cycles per step beyond the FMACs;
# the executor charges the step's statement (STATEMENT) apart.
MAP_STEP = 1
ELEMENTS_PER_CYCLE = {  # steps of a DSD operation per cycle, memory operands only (csl-semantics §3)
    ("wse2", 32): 1,
    ("wse2", 16): 4,
    ("wse3", 32): 1,
    ("wse3", 16): 8,
}
FABRIC_ELEMENTS_PER_CYCLE = 1  # an operation with a fabric operand moves one wavelet per cycle
ROUTER_DEPTH = 2  # wavelets a router buffers per color (assumption: router buffering is undocumented)
MEMCPY_PATH_DEPTH = 2  # wavelets buffered between memcpy and a PE, each way (assumption, see the doc:
# pipeline-01 notes that a pass-through stalls past 14 wavelets; 2 + 4 + 6 + 2 = 14 on WSE-2)
DEFAULT_CE_INPUT_DEPTH = 4  # a color reaching a CE with no queue named for it (assumption)
# A memcpy command reaching the PEs (assumption: the SDK hides memcpy's timing). It must exceed what a
# program does between a streaming H2D taking its last wavelet and a copy-mode D2H that reads the
# result: topic-14 streams 5 wavelets through 4 PEs and then copies their sums out.
COMMAND_LATENCY = 1000
COPY_WORDS_PER_CYCLE = 1  # copy-mode memcpy, per PE (assumption)
