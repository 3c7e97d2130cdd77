"""Reliability benches too slow for CI: overload (``python -m bench.reliability.overload``) and a soak
(``python -m bench.reliability.soak``). Results and commands are in RELIABILITY.md."""
