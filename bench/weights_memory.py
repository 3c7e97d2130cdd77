"""What one model version costs the engine in memory with both of its graphs loaded.

``python -m bench.weights_memory --repo /tmp/heavy --model vit-base`` loads the version as the engine
does (``Runtime.load``: the classifier's instances, the attention graph, the warm-up), each time in a
fresh process, and prints the process's resident memory after loading (VmRSS), after one largest batch
of each graph, and at its peak (VmHWM),
against the bytes of the classifier's weights (its initializers) and the target for imported models: RSS at most
1.3 x the weights' bytes + 250 MB. ``python -m bench.heavy_models base --repo /tmp/heavy`` writes a
ViT-B/16 to measure.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
from pathlib import Path

import numpy as np
import onnx

MB = 1024 * 1024


def weight_bytes(path: Path) -> int:
    """The bytes of a graph's initializers (its weights), as they would be held in memory."""
    model = onnx.load(str(path), load_external_data=False)
    total = 0
    for tensor in model.graph.initializer:
        count = 1
        for dim in tensor.dims:
            count *= dim
        total += count * onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
    return total


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _load_and_report(repo: str, name: str, instances: int, queue: multiprocessing.Queue) -> None:
    from service.contract.model_config import serving_config
    from service.contract.model_repository import version_files
    from service.engine.model_versions import model_config
    from service.engine.runtime import Runtime
    from service.settings import Settings

    settings = Settings(provider="cpu")
    before = _status_kb("VmRSS")
    serving = serving_config(model_config(Path(repo), name), {"instance_count": instances})
    files = version_files(Path(repo), name, 1)
    runtime = Runtime.load(files, settings.runtime, serving, settings.batching)
    loaded = _status_kb("VmRSS")
    images = np.zeros((serving.max_batch_size, *runtime.input_shape), np.float32)
    runtime.classify(images)
    runtime.attend(images[: settings.batching.attention_max_batch_size])
    queue.put(
        {
            "rss_before_mb": before / 1024,
            "rss_mb": loaded / 1024,
            "rss_after_batches_mb": _status_kb("VmRSS") / 1024,
            "peak_mb": _status_kb("VmHWM") / 1024,
            "shared_mb": runtime.shared.bytes / MB if runtime.shared else 0,
            "attention_shared": runtime.attention_shared,
        }
    )


def measure(repo: Path, name: str, instances: int) -> dict:
    """One load in a fresh (spawned) process: its memory figures."""
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=_load_and_report, args=(str(repo), name, instances, queue))
    process.start()
    result = queue.get(timeout=600)
    process.join()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.weights_memory", description=__doc__)
    parser.add_argument("--repo", type=Path, required=True)
    parser.add_argument("--model", default="vit-base")
    parser.add_argument("--instances", type=int, default=2, help="classifier instances")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    weights = weight_bytes(args.repo / args.model / "1" / "model.onnx")
    target = 1.3 * weights / MB + 250
    print(f"weights {weights / MB:.1f} MB; target RSS <= {target:.0f} MB")
    for _ in range(args.repeats):
        result = measure(args.repo, args.model, args.instances)
        result["ratio_to_weights"] = result["rss_mb"] * MB / weights
        result["meets_target"] = result["rss_mb"] <= target
        print(
            json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in result.items()})
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
