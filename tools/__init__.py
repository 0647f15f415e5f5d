"""Tools run from a checkout (`python -m tools.bench ...`, `python -m tools.report ...`): benchmarks,
the load test, the performance report, the loopback appliance and the demo model's trainer. Not
shipped in the wheel; they import the product, the product never imports them."""
