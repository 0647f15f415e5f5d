"""Benchmarks shipped with the product, run by `wafer-gpt2 bench ...` (`wafer_gpt2/cli/bench_command.py`):
`host.py` measures the host stack's tokens/s over the stand-in backends, with the real server
(`bench_server.py`) and a raw-socket load generator in a process of its own (`load_client.py`)."""
