"""Metrics, tracing and logs, shared by the engine and the front ends."""
