"""``python -m service.promote``'s decision on a comparison, threshold by threshold."""

from __future__ import annotations

import pytest

from service.promote import Thresholds, judge, parse


def report(compared: int, agreement: float, p99: float, ratio: float, candidate=2) -> dict:
    return {
        "model": "m",
        "live_version": 1,
        "candidate_version": candidate,
        "pairs": [
            {  # an older pair's numbers are never the evidence
                "live_version": 1,
                "candidate_version": 3,
                "requests_compared": 10_000,
                "top1_agreement": 1.0,
                "probability_difference": {"p99": 0.0},
                "model_ms": {"ratio_p50": 1.0},
            },
            {
                "live_version": 1,
                "candidate_version": 2,
                "requests_compared": compared,
                "top1_agreement": agreement,
                "probability_difference": {"p99": p99},
                "model_ms": {"ratio_p50": ratio},
            },
        ],
    }


THRESHOLDS = Thresholds(
    min_agreement=0.99, min_requests=500, max_latency_ratio=1.5, max_p99_difference=0.1
)


@pytest.mark.parametrize(
    ("numbers", "action", "reasons"),
    [
        ((499, 1.0, 0.0, 1.0), "wait", ["only 499 of 500 requests"]),
        ((500, 0.99, 0.1, 1.5), "promote", []),
        ((500, 0.989, 0.1, 1.5), "rollback", ["top-1 agreement 0.9890 < 0.99"]),
        ((500, 1.0, 0.11, 1.5), "rollback", ["p99 difference 0.1100 > 0.1"]),
        ((500, 1.0, 0.0, 1.51), "rollback", ["model time ratio 1.5100 > 1.5"]),
    ],
)
def test_each_threshold_decides(numbers, action, reasons):
    verdict = judge(report(*numbers), THRESHOLDS)
    assert (verdict.action, verdict.reasons) == (action, reasons)
    assert f"{numbers[0]} requests compared (min 500)" in verdict.summary


def test_no_candidate_and_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="no candidate version"):
        judge(report(500, 1.0, 0.0, 1.0, candidate=None), THRESHOLDS)
    with pytest.raises(SystemExit):
        parse(["--model", "m", "--min-agreement", "99", "--min-requests", "5"])


REQUIRED = ["--model", "m", "--min-agreement", "0.9", "--min-requests", "1"]
REQUIRED += ["--max-latency-ratio", "2"]


def test_the_api_key_comes_from_the_service_s_own_variable_and_never_needs_the_command_line(
    monkeypatch, capsys
):
    """On the command line the key is visible to every user in ``ps``: the command also takes it
    from VITSERVE_API_KEY, the variable the service reads, and says so in --help; a request it
    sends carries it (seen by a server here)."""
    import http.server
    import threading

    from service.promote import main
    from service.settings.server import ServerSettings

    monkeypatch.setenv("VITSERVE_API_KEY", "from-the-environment")
    assert ServerSettings().api_key.get_secret_value() == "from-the-environment"  # the service's
    assert parse(REQUIRED).api_key == "from-the-environment"
    assert parse([*REQUIRED, "--api-key", "given"]).api_key == "given"
    with pytest.raises(SystemExit):
        parse(["--help"])
    assert "VITSERVE_API_KEY" in " ".join(capsys.readouterr().out.split())

    seen: list[str | None] = []

    class Service(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(self.headers.get("Authorization"))
            self.send_response(401)
            self.end_headers()

        def log_message(self, *_: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Service)
    threading.Thread(target=server.handle_request, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}"
    assert main([*REQUIRED, "--url", url]) == 1  # refused (401): it is the header that counts
    server.server_close()
    assert seen == ["Bearer from-the-environment"]
