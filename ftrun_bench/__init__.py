"""Benchmarks and their worker processes, and synthetic inputs for tests and benchmarks: code that measures
or feeds the runtime but is not part of it. `ftrun bench NAME` (ftrun/bench.py) loads these modules by name,
so the runtime never imports this package; it imports only ftrun/ (tests/unit/test_layering.py)."""
