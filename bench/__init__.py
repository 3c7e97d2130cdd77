"""Benchmarks of vitserve: engine (onnxruntime vs PyTorch), in-process micro-benchmarks, and the HTTP
service under load against a PyTorch-eager baseline. ``python -m bench`` runs them all and writes
BENCHMARKS.md; see bench/run_all.py.
"""
