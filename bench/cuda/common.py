"""What the three parts of ``python -m bench.cuda`` share: the device they check, the models, the
bounds of agreement with the CPU, and the report they write into."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from bench.server_process import REPO

CPU, CUDA = "CPUExecutionProvider", "CUDAExecutionProvider"
# what parts 1 and 2 check against the CPU: the provider, and the VITSERVE_PROVIDER that picks it
# (tests/bench/test_cuda.py runs the checks with the CPU standing in for the GPU)
DEVICE, DEVICE_SETTING = CUDA, "cuda"
MODELS = REPO / "models"
DEFAULT = MODELS / "fashion-mnist-vit" / "1"
PORTS = range(18100, 18110)  # the benches' range, no other bench's part
TEST_LABELS = "t10k-labels-idx1-ubyte.gz"
# float32 on two providers: cuDNN and MLAS sum in other orders (and CUDA may use TF32 matmuls)
MAX_RELATIVE_ERROR = {"fp32": 1e-2, "int8": 5e-2}
MIN_AGREEMENT = 0.995
MAX_SCORE_DIFFERENCE = 1e-2  # softmax probability, service on CUDA against the CPU provider
BATCHES = (1, 8, 64, 512)
LEVELS = (1, 64, 256)


def relative_error(got: np.ndarray, reference: np.ndarray) -> float:
    reference = reference.astype(np.float64)
    return float(np.linalg.norm(got - reference) / np.linalg.norm(reference))


@dataclass
class Report:
    lines: list[str]
    failures: list[str]

    def check(self, ok: bool, what: str) -> str:
        if not ok:
            self.failures.append(what)
        return "pass" if ok else "**FAIL**"
