"""How an error answer is logged: expected refusals as warnings, at most one line a code per window.

A 503 (queue full, not ready, shutting down, decode slots taken, timeouts) is the service working as
documented under load, not a fault, and a line per request would bury the log under a flood
(docs/decisions.md#refusals-are-warnings). Each such code logs one WARNING per ``WINDOW_S`` seconds,
saying how many were refused since its previous line; every other 5xx is an ERROR, every time.
"""

from __future__ import annotations

import logging
import time

logger = logging.getLogger("vitserve")

WINDOW_S = 10.0
_last: dict[str, tuple[float, int]] = {}  # code -> (when its last line was written, refused since)


def log_error_answer(status: int, code: str, request_id: str | None, message: str) -> None:
    """Log a 5xx answer: rate-limited WARNING for a 503, ERROR for the rest; nothing below 500."""
    if status < 500:
        return
    if status != 503:
        logger.error("%s [request %s]: %s", code, request_id, message)
        return
    now = time.monotonic()
    since, count = _last.get(code, (-WINDOW_S, 0))
    if now - since < WINDOW_S:
        _last[code] = (since, count + 1)
        return
    _last[code] = (now, 0)
    more = f" ({count} more refused with {code} in the last {now - since:.0f} s)" if count else ""
    logger.warning("%s [request %s]: %s%s", code, request_id, message, more)
