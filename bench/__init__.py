"""Benchmarks of vitserve: ``python -m bench`` (bench/run.py) measures it against the servers a user
would write instead, finds where its time goes, and swaps a model under load; it writes BENCHMARKS.md.
"""
