"""What every process of the service sets for itself, light enough for any of them to import:
the heap frozen once it is set up, and the margin uvicorn's drain gets past the service's own.

Its own module so that processes.py (which starts the front ends' HTTP server) and http_server.py
(which runs it) both import it, and neither imports the other back."""

from __future__ import annotations

import gc

# uvicorn cancels open requests this long after the service's own drain deadline, which answers what
# is left 503: long enough for those answers to be written.
ANSWER_MARGIN_S = 5.0


def freeze_heap() -> None:
    """Take what is alive once the process is set up (modules, the app, the models' sessions) out of
    the cyclic collector's reach: each full collection walked all of it on the event loop, and those
    pauses were the slowest requests (p99 at c=64: 70-88 ms frozen, 115-153 ms not; BENCHMARKS.md)."""
    gc.collect()
    gc.freeze()
