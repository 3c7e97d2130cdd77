"""The shadow comparison's Prometheus series: a candidate version against the live one, on the same rows.

Top-1 agreement is ``vitserve_shadow_top1_agreements_total / vitserve_shadow_images_total``; the
probability difference of an image is the largest ``|p_live - p_candidate|`` over its classes. The
engine process alone writes these; the request outcomes say what became of each shadow copy.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

_PAIR = ["model", "live", "candidate"]
_DIFFERENCE_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0)
_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


class ShadowSeries:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "vitserve_shadow_requests",
            "Shadow copies of live requests, by model, live and candidate version and outcome: "
            "compared, shed (the shadow queue was full or the candidate gone), failed, timeout, "
            "live_failed (the live answer was an error: nothing to compare), incompatible (the "
            "candidate cannot run this request: a tensor for another input, or other labels).",
            [*_PAIR, "outcome"],
            registry=registry,
        )
        self.images = Counter(
            "vitserve_shadow_images",
            "Images compared between the live and the candidate version.",
            _PAIR,
            registry=registry,
        )
        self.agreements = Counter(
            "vitserve_shadow_top1_agreements",
            "Images whose top-1 class the candidate and the live version agree on.",
            _PAIR,
            registry=registry,
        )
        self.difference = Histogram(
            "vitserve_shadow_probability_difference",
            "Per image, the largest absolute difference between the two versions' probabilities "
            "over the classes.",
            _PAIR,
            buckets=_DIFFERENCE_BUCKETS,
            registry=registry,
        )
        self.latency = Histogram(
            "vitserve_shadow_model_seconds",
            "Per shadow batch, each version's model time on the same images, run one right "
            "after the other on one thread, by role (live or candidate).",
            [*_PAIR, "role"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.confusion = Counter(
            "vitserve_shadow_confusion",
            "Compared images by the live version's top-1 class and the candidate's.",
            [*_PAIR, "live_class", "candidate_class"],
            registry=registry,
        )
