"""A phone photo to the model's input: the service's reduced decode against a full decode + resize.

``python -m bench.decode [--rounds 7] [--no-model]`` makes 4032 x 3024 JPEGs (quality 90, Pillow's
default 4:2:0) from the photos that scikit-learn and scikit-image ship, each centre-cropped to 4:3 and
upscaled (bicubic), and times, alternated over ``--rounds`` rounds, three ways from the file's bytes to
the float32 input of a 224 x 224 ``resize-crop`` model (shorter side 256, bicubic, ImageNet mean and
std: timm's and Hugging Face's DeiT at crop_pct 0.875):

- ``full``: decode every pixel, resize the whole image with the filter, crop, normalise: what the
  sources' own processors do with the image;
- ``full + reduce``: decode every pixel, then the service's preprocessing (whole-block averages
  down to a few times the resize first);
- ``service``: the service's path (``Preprocessor.from_bytes``): the JPEG decoded at the smallest
  DCT scale that keeps the shorter side at least 256, then the same.

It prints the median milliseconds per photo of each (with their range over rounds), the service's
share of ``full``, and how far the service's input is from ``full``'s (max and mean absolute
difference, normalised units). Unless ``--no-model``, a random-weight ViT-S/16 (``export.model``,
seed 0, 1000 classes; no weights are downloaded) is run on both inputs of each photo to say whether
its top-1 changed. BENCHMARKS.md ("A phone photo to the model's input") quotes it.
"""

from __future__ import annotations

import argparse
import io
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageOps

from bench.stats import Spread, alternated, fmt, median, ratio, spread_text, table
from service.contract.model_repository import ModelMetadata
from service.contract.preprocessing import RESAMPLE, Preprocessor, crop_box, normalise, resized_size

SIZE = 224
PHOTO_SIZE = (4032, 3024)
QUALITY = 90
PATHS = ("full", "full + reduce", "service")
TARGET_SHARE = 0.25  # the service's time at most a quarter of a full decode + resize
IMAGENET_MEAN = [0.485, 0.456, 0.406]
IMAGENET_STD = [0.229, 0.224, 0.225]


def metadata(classes: int = 1000) -> ModelMetadata:
    """A ViT-S/16 at 224: resize-crop to a shorter side of 256, bicubic, ImageNet mean and std."""
    grid = SIZE // 16
    return ModelMetadata.model_validate(
        {
            "format": 1,
            "graph": "classifier",
            "name": "vit-s16",
            "version": 1,
            "labels": [f"class {i}" for i in range(classes)],
            "input": {
                "name": "images",
                "layout": "NCHW",
                "dtype": "float32",
                "channels": 3,
                "height": SIZE,
                "width": SIZE,
            },
            "preprocessing": {
                "color": "rgb",
                "resize": "resize-crop",
                "shorter_side": 256,
                "resample": "bicubic",
                "polarity": "natural",
                "scale": 1 / 255,
                "mean": IMAGENET_MEAN,
                "std": IMAGENET_STD,
            },
            "patch": {"size": 16, "grid": [grid, grid]},
            "pooling": "token",
            "class_token": True,
            "tokens": grid * grid + 1,
            "depth": 12,
            "heads": 6,
        }
    )


def sample_photos() -> dict[str, np.ndarray]:
    """The colour photos scikit-learn and scikit-image ship (no download), as uint8 RGB arrays."""
    from skimage import data
    from sklearn.datasets import load_sample_images

    china, flower = load_sample_images().images
    return {
        "china": china,
        "flower": flower,
        "astronaut": data.astronaut(),
        "chelsea": data.chelsea(),
        "coffee": data.coffee(),
        "rocket": data.rocket(),
    }


def centre_jpeg(photo: np.ndarray, size: tuple[int, int], quality: int = QUALITY) -> bytes:
    """``photo``'s centre 4:3, resized to ``size`` (width, height; bicubic), as a JPEG."""
    h, w = photo.shape[:2]
    crop_w, crop_h = min(w, h * 4 // 3), min(h, w * 3 // 4)
    left, top = (w - crop_w) // 2, (h - crop_h) // 2
    image = Image.fromarray(photo[top : top + crop_h, left : left + crop_w])
    buffer = io.BytesIO()
    image.resize(size, Image.Resampling.BICUBIC).save(buffer, "JPEG", quality=quality)
    return buffer.getvalue()


def phone_jpeg(photo: np.ndarray) -> bytes:
    """``photo``'s centre 4:3, upscaled to 4032 x 3024, as a quality-90 JPEG."""
    return centre_jpeg(photo, PHOTO_SIZE)


def decoded_in_full(data: bytes) -> Image.Image:
    image = Image.open(io.BytesIO(data))
    image.load()
    return ImageOps.exif_transpose(image).convert("RGB")


def full_decode_and_resize(data: bytes, preprocessor: Preprocessor) -> np.ndarray:
    """Every pixel decoded, the whole image resized with the filter, cropped, normalised."""
    pre = preprocessor.metadata.preprocessing
    image = decoded_in_full(data)
    w, h = image.size
    resized = resized_size(pre, h, w, SIZE, SIZE)
    image = image.resize((resized[1], resized[0]), RESAMPLE[pre.resample])
    crop = np.asarray(image.crop(crop_box(pre, resized, SIZE, SIZE)), dtype=np.float32)
    return normalise(crop.transpose(2, 0, 1), pre)


def ways(preprocessor: Preprocessor) -> dict[str, Callable[[bytes], np.ndarray]]:
    return {
        "full": lambda data: full_decode_and_resize(data, preprocessor),
        "full + reduce": lambda data: preprocessor.from_image(decoded_in_full(data)).tensor,
        "service": lambda data: preprocessor.from_bytes(data, "image").tensor,
    }


@dataclass(frozen=True)
class PhotoResult:
    name: str
    max_difference: float
    mean_difference: float
    top1: tuple[int, int] | None  # the model's class on (the service's input, full's)


@dataclass(frozen=True)
class DecodeBench:
    rounds: int
    ms_per_photo: dict[str, Spread | None]
    photos: list[PhotoResult]
    model: str | None

    @property
    def top1_unchanged(self) -> bool | None:
        if any(p.top1 is None for p in self.photos):
            return None
        return all(p.top1[0] == p.top1[1] for p in self.photos)

    @property
    def share(self) -> float | None:
        return ratio(median(self.ms_per_photo["service"]), median(self.ms_per_photo["full"]))

    def markdown(self) -> str:
        full = self.ms_per_photo["full"]
        timing = table(
            ["path", "ms per photo, median (range over rounds)", "share of full"],
            [
                [path, spread_text(spread, 1), fmt(ratio(median(spread), median(full)), 3)]
                for path, spread in self.ms_per_photo.items()
            ],
        )
        top1 = self.model is not None
        differences = table(
            ["photo", "max abs difference", "mean abs difference"]
            + (["top-1: service, full"] if top1 else []),
            [
                [p.name, fmt(p.max_difference, 4), fmt(p.mean_difference, 5)]
                + ([f"{p.top1[0]}, {p.top1[1]}"] if p.top1 else [])
                for p in self.photos
            ],
        )
        share = self.share
        verdict = "-" if share is None else "PASS" if share <= TARGET_SHARE else "FAIL"
        model = (
            f" The top-1 class of {self.model} on both: unchanged on every photo: "
            f"**{'yes' if self.top1_unchanged else 'no'}**."
            if top1
            else ""
        )
        return "\n".join(
            [
                "## A phone photo to the model's input",
                "",
                f"{len(self.photos)} photos at {PHOTO_SIZE[0]} x {PHOTO_SIZE[1]} (JPEG quality "
                f"{QUALITY}, made from the photos scikit-learn and scikit-image ship) to a "
                f"{SIZE} x {SIZE} resize-crop input (shorter side 256, bicubic), {self.rounds} "
                f"rounds alternated. The service's share of a full decode + resize: "
                f"**{fmt(share, 3)}** (target <= {TARGET_SHARE}): **{verdict}**.",
                "",
                timing,
                "",
                "The service's input against full's, in normalised units (times the std, 0.22-0.23,"
                f" and 255 for levels of 0-255).{model}",
                "",
                differences,
                "",
                f"Command: `python -m bench.decode --rounds {self.rounds}`",
            ]
        )


def random_vit_s(classes: int = 1000) -> Callable[[np.ndarray], np.ndarray]:
    """A ViT-S/16 at 224 with random weights (seed 0; the head drawn from N(0, 1)), as the export
    writes its classifier graph, run by onnxruntime: [N, 3, 224, 224] -> top-1 indices."""
    import onnxruntime as ort
    import torch

    from export.config import ViTConfig
    from export.model import VisionTransformer
    from export.onnx_graphs import classifier_graph

    torch.manual_seed(0)
    config = ViTConfig(
        image_height=SIZE,
        image_width=SIZE,
        in_channels=3,
        patch_size=16,
        num_classes=classes,
        dim=384,
        depth=12,
        heads=6,
        mlp_dim=1536,
        pooling="token",
    )
    model = VisionTransformer(config).eval()
    with torch.no_grad():  # the head starts at zero: every image would be class 0
        torch.nn.init.normal_(model.head.weight, std=1.0)
    graph = classifier_graph(model)
    session = ort.InferenceSession(graph.SerializeToString(), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    return lambda batch: session.run(None, {name: batch.astype(np.float32)})[0].argmax(axis=1)


def run(rounds: int, with_model: bool, photos: dict[str, np.ndarray] | None = None) -> DecodeBench:
    """``photos`` (default :func:`sample_photos`) as phone JPEGs, timed and compared."""
    preprocessor = Preprocessor(metadata(), max_pixels=PHOTO_SIZE[0] * PHOTO_SIZE[1])
    chosen = sample_photos() if photos is None else photos
    files = {name: phone_jpeg(photo) for name, photo in chosen.items()}
    paths = ways(preprocessor)
    seconds: dict[str, list[float]] = {path: [] for path in PATHS}
    for round_ in range(rounds + 1):  # round 0 warms up, untimed
        for path in alternated(PATHS, round_):
            start = time.perf_counter()
            for data in files.values():
                paths[path](data)
            if round_:
                seconds[path].append((time.perf_counter() - start) / len(files))
    inputs = {name: (paths["service"](data), paths["full"](data)) for name, data in files.items()}
    top1 = random_vit_s() if with_model else None
    photos = []
    for name, (served, full) in inputs.items():
        difference = np.abs(served - full)
        chosen = None if top1 is None else tuple(int(c) for c in top1(np.stack([served, full])))
        photos.append(PhotoResult(name, float(difference.max()), float(difference.mean()), chosen))
    return DecodeBench(
        rounds=rounds,
        ms_per_photo={path: Spread.of(1000 * s for s in seconds[path]) for path in PATHS},
        photos=photos,
        model="a random-weight ViT-S/16 (seed 0)" if with_model else None,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.decode", description=__doc__)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--no-model", action="store_true", help="the input difference alone")
    args = parser.parse_args(argv)
    result = run(args.rounds, not args.no_model)
    print(result.markdown())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
