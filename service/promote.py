"""``python -m service.promote``: promote a model's candidate version, or roll it back, by the evidence.

Reads ``GET /models/{name}/shadow`` (the candidate against the live version on the same live requests)
and decides: fewer than ``--min-requests`` compared is not evidence yet (wait; with ``--wait-s`` it
asks again until then); enough, with top-1 agreement at least ``--min-agreement``, the probability
difference's p99 at most ``--max-p99-difference`` (when given) and the candidate's model time at most
``--max-latency-ratio`` times the live version's, promotes it (``POST .../shadow/promote``); enough that
misses a threshold rolls it back (``POST .../shadow/rollback``), unless ``--keep``. Every decision is
logged with its numbers. ``--dry-run`` decides and logs, and changes nothing. The API key comes from
``--api-key`` or, kept out of the process list, from ``VITSERVE_API_KEY`` (the service's own variable).

Exit codes: 0 promoted (or would be), 3 not enough evidence yet, 4 rolled back (or would be, or kept
with ``--keep``), 1 the service refused or could not be reached, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any

from service.contract.candidates import Thresholds, judge
from service.settings.group import ENV_PREFIX

logger = logging.getLogger("vitserve.promote")

EXIT_PROMOTED, EXIT_FAILED, EXIT_WAIT, EXIT_ROLLED_BACK = 0, 1, 3, 4
# the API key, when --api-key does not give it: the service's own setting (api_key)
API_KEY_VARIABLE = f"{ENV_PREFIX}API_KEY"


# (method, path) -> the JSON answer; raises RuntimeError with the service's message on a refusal
Request = Callable[[str, str], dict[str, Any]]


def http_requester(url: str, api_key: str | None, timeout_s: float = 630.0) -> Request:
    """Requests to the service at ``url`` (a promotion reloads the model: allow it time)."""

    def request(method: str, path: str) -> dict[str, Any]:
        headers = {"Accept": "application/json"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        call = urllib.request.Request(url.rstrip("/") + path, method=method, headers=headers)
        try:
            with urllib.request.urlopen(call, timeout=timeout_s) as answer:
                return json.load(answer)
        except urllib.error.HTTPError as error:
            raise RuntimeError(f"{method} {path}: {error.code} {error.read().decode()}") from None
        except (urllib.error.URLError, OSError) as error:
            raise RuntimeError(f"{method} {path}: cannot reach {url}: {error}") from None

    return request


def decide(
    request: Request,
    model: str,
    thresholds: Thresholds,
    *,
    dry_run: bool = False,
    keep: bool = False,
    wait_s: float = 0.0,
    poll_s: float = 5.0,
) -> int:
    """Read the comparison, decide, act, log; the exit code."""
    path = f"/models/{urllib.parse.quote(model, safe='')}/shadow"
    deadline = time.monotonic() + wait_s
    while True:
        report = request("GET", path)
        verdict = judge(report, thresholds)
        if verdict.action != "wait" or time.monotonic() + poll_s > deadline:
            break
        logger.info("%s: waiting (%s)", verdict.summary, "; ".join(verdict.reasons))
        time.sleep(poll_s)
    reasons = "; ".join(verdict.reasons)
    if verdict.action == "wait":
        logger.warning(
            "%s: not enough evidence yet (%s); nothing changed", verdict.summary, reasons
        )
        return EXIT_WAIT
    if verdict.action == "rollback" and keep:
        logger.warning("%s: thresholds missed (%s); kept (--keep)", verdict.summary, reasons)
        return EXIT_ROLLED_BACK
    if dry_run:
        logger.warning("%s: would %s%s (--dry-run)", verdict.summary, verdict.action, _why(reasons))
    else:
        version = report["candidate_version"]
        query = f"?version={version}" if verdict.action == "promote" else ""
        done = request("POST", f"{path}/{verdict.action}{query}")
        logger.warning(
            "%s: %s%s; live version %s -> %s",
            verdict.summary,
            "promoted" if verdict.action == "promote" else "rolled back",
            _why(reasons),
            done["live_version_before"],
            done["live_version"],
        )
    return EXIT_PROMOTED if verdict.action == "promote" else EXIT_ROLLED_BACK


def _why(reasons: str) -> str:
    return f" ({reasons})" if reasons else ""


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m service.promote",
        description="Promote a model's candidate version, or roll it back, by its shadow comparison.",
    )
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the service's HTTP address")
    parser.add_argument("--model", required=True, help="the model whose candidate is decided on")
    parser.add_argument("--min-agreement", type=float, required=True, help="top-1, 0..1")
    parser.add_argument("--min-requests", type=int, required=True, help="requests compared")
    parser.add_argument(
        "--max-latency-ratio", type=float, required=True, help="candidate / live model time (p50)"
    )
    parser.add_argument("--max-p99-difference", type=float, help="max |p_live - p_candidate|, p99")
    parser.add_argument(
        "--api-key",
        help=f"the service's API key, when it has one; default: the environment's {API_KEY_VARIABLE}, "
        "the variable the service reads (prefer it: a command line is visible to every user in ps)",
    )
    parser.add_argument("--dry-run", action="store_true", help="decide and log; change nothing")
    parser.add_argument("--keep", action="store_true", help="never roll back; only promote")
    parser.add_argument("--wait-s", type=float, default=0.0, help="ask again until enough evidence")
    arguments = parser.parse_args(argv)
    if arguments.api_key is None:
        arguments.api_key = os.environ.get(API_KEY_VARIABLE) or None
    if not 0 <= arguments.min_agreement <= 1:
        parser.error("--min-agreement must lie in 0..1")
    if arguments.min_requests < 1 or arguments.max_latency_ratio <= 0:
        parser.error("--min-requests must be 1 or more and --max-latency-ratio above 0")
    return arguments


def main(argv: list[str] | None = None) -> int:
    arguments = parse(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    thresholds = Thresholds(
        arguments.min_agreement,
        arguments.min_requests,
        arguments.max_latency_ratio,
        arguments.max_p99_difference,
    )
    try:
        return decide(
            http_requester(arguments.url, arguments.api_key),
            arguments.model,
            thresholds,
            dry_run=arguments.dry_run,
            keep=arguments.keep,
            wait_s=arguments.wait_s,
        )
    except (RuntimeError, ValueError) as error:
        logger.error("%s", error)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
