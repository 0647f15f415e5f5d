"""The benchmarks: `python -m tools.bench sim|service|host ...` (bench_sim.py, bench_service.py,
bench_host.py), and scripts for single measurements (core_instructions.py, csl_cycles.py,
fp16_error.py, http_loop_profile.py)."""
