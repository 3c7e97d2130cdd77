"""Starts and supervises the service's processes."""
