"""A series that no longer exists leaves the metrics without a warning, in either metrics mode."""

from __future__ import annotations

import warnings

from prometheus_client import CollectorRegistry, Gauge, generate_latest

from service.observability.metrics import forget_series


def gauge() -> tuple[CollectorRegistry, Gauge]:
    registry = CollectorRegistry()
    info = Gauge("m_info", "served", ["model", "version"], registry=registry)
    info.labels("m", "1").set(1)
    return registry, info


def test_a_retired_series_is_removed_in_one_process():
    registry, info = gauge()
    forget_series(info, "m", "1")
    assert b'm_info{model="m",version="1"}' not in generate_latest(registry)


def test_a_retired_series_is_zeroed_without_a_warning_in_multiprocess_mode(monkeypatch, tmp_path):
    """prometheus-client cannot remove a series there, and warned at every promotion: the zero in
    the process's file says the version is no longer served."""
    registry, info = gauge()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        forget_series(info, "m", "1")
    assert b'm_info{model="m",version="1"} 0.0' in generate_latest(registry)
