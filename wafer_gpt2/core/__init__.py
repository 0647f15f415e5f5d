"""The wafer side's shared vocabulary: architectures, tilings, the cost model and its calibration, the
memory layout, the wire format, the program's interface with its host (`abi`), the runtime Protocol
(`runtime`) and the engine's `Backend` contract (`steps`)."""
