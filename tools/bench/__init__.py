"""The benchmarks run from a checkout: `python -m tools.bench sim|service ...` (bench_sim.py,
bench_service.py), and scripts for single measurements (core_instructions.py, csl_cycles.py,
fp16_error.py, http_loop_profile.py). The host stack's benchmark ships with the product:
`wafer-gpt2 bench host` (wafer_gpt2/benchmarks/)."""
