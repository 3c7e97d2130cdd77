"""Which version answers an unversioned request when a model tries a candidate version on live traffic.

Shared by the engine (the live version its shadow compares against) and the front ends (the canary's
choice), which import nothing heavy: no protobuf, no onnxruntime. The parameters that set it are read
in ``service/contract/model_config.py`` (:class:`~service.contract.model_config.CandidatePlan`).
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence

# The header a client names itself with, so that the canary answers it from one version every time.
CLIENT_KEY_HEADER = "x-client-key"


def live_version(ready: Sequence[int], pinned: int | None, candidate: int | None) -> int | None:
    """The version unversioned requests get: the pinned one when it is ready, else the newest ready
    version other than the candidate, else the candidate (it is all there is)."""
    if pinned in ready:
        return pinned
    others = [v for v in ready if v != candidate]
    if others:
        return max(others)
    return max(ready) if ready else None


def in_canary(percent: float, client_key: str | None) -> bool:
    """Whether an unversioned request goes to the candidate: for a client key, always the same answer
    (its SHA-256 read as a fraction in [0, 1)); without one, a random draw."""
    if percent <= 0:
        return False
    if percent >= 100:
        return True
    if client_key is None:
        draw = random.random()
    else:
        digest = hashlib.sha256(client_key.encode("utf-8", "surrogateescape")).digest()
        draw = int.from_bytes(digest[:8], "big") / 2**64
    return draw * 100 < percent
