"""Fit-and-pad against pixel arrays worked out here by hand, and served predictions against
onnxruntime run on the model file.

The model card's preprocessing: fit the image inside the model's 28 x 28 keeping its aspect ratio
(bilinear), pad it centred (an odd margin puts the extra pixel after the image: offset = margin // 2),
then ``(x / 255 - mean) / std``. The expected arrays below come from numpy alone (``np.interp`` for
bilinear interpolation between pixel centres, the edges held; a triangle kernel written out for a
2x reduction), never from ``Preprocessor``, so a change to the interpolation or the offset rounding
fails here even when training and serving would still agree with each other.
"""

from __future__ import annotations

import numpy as np
import pytest

from service.contract.model_repository import ModelMetadata
from service.contract.preprocessing import Preprocessor
from tests.support import SPEC, Reference, assert_matches

SIZE = 28
MEAN, STD = SPEC.mean[0], SPEC.std[0]


@pytest.fixture(scope="module")
def preprocessor(reference: Reference) -> Preprocessor:
    """The tiny model's own metadata (pad value 0, light-on-dark, the Fashion-MNIST mean and std)."""
    document = reference.classifier.get_modelmeta().custom_metadata_map["vitserve"]
    return Preprocessor(ModelMetadata.model_validate_json(document), max_pixels=1 << 20)


def bilinear(image: np.ndarray, height: int, width: int) -> np.ndarray:
    """Bilinear interpolation between pixel centres (output pixel i samples the input at
    (i + 0.5) * in / out - 0.5; beyond the first and last centre the edge pixel is held), enlarging
    only: the textbook definition, in numpy."""
    in_h, in_w = image.shape
    ys = (np.arange(height) + 0.5) * in_h / height - 0.5
    xs = (np.arange(width) + 0.5) * in_w / width - 0.5
    rows = np.stack([np.interp(xs, np.arange(in_w), row) for row in image])  # [in_h, width]
    return np.stack([np.interp(ys, np.arange(in_h), col) for col in rows.T], axis=1)


def halve(image: np.ndarray) -> np.ndarray:
    """A 2x reduction with the triangle (bilinear) filter stretched to the output's pixel size:
    each output pixel weighs the 4 input pixels around its centre 1/8, 3/8, 3/8, 1/8 (at an edge the
    weights that fall outside are dropped and the rest rescaled to sum to 1)."""

    def one_axis(values: np.ndarray) -> np.ndarray:
        n = len(values)
        out = []
        for i in range(n // 2):
            taps = [(2 * i - 1, 1), (2 * i, 3), (2 * i + 1, 3), (2 * i + 2, 1)]
            inside = [(j, w) for j, w in taps if 0 <= j < n]
            total = sum(w for _, w in inside)
            out.append(sum(values[j] * w for j, w in inside) / total)
        return np.array(out)

    rows = np.stack([one_axis(row) for row in image])
    return np.stack([one_axis(col) for col in rows.T], axis=1)


def framed(content: np.ndarray, top: int, left: int) -> np.ndarray:
    """``content`` on a 28 x 28 canvas of the pad value (0), then normalised: the model's input."""
    canvas = np.zeros((SIZE, SIZE))
    canvas[top : top + content.shape[0], left : left + content.shape[1]] = content
    return ((canvas / 255.0 - MEAN) / STD).astype(np.float32)[None]


def served(preprocessor: Preprocessor, image: np.ndarray) -> np.ndarray:
    return preprocessor.from_pixels(image.tolist(), "pixels", invert="never").tensor


def ramp(height: int, width: int) -> np.ndarray:
    """Distinct values in every row and column, so that any change of sampling shows."""
    y, x = np.mgrid[0:height, 0:width]
    return (y * 37 + x * 11) % 256


@pytest.mark.parametrize(
    ("shape", "offset"),
    [((5, 28), (11, 0)), ((28, 3), (0, 12)), ((1, 28), (13, 0)), ((28, 28), (0, 0))],
    ids=["strip-odd-margin-rows", "column-odd-margin-cols", "one-row", "full-frame"],
)
def test_a_fitting_image_is_padded_centred_with_the_odd_pixel_after(preprocessor, shape, offset):
    image = ramp(*shape)
    expected = framed(image, *offset)
    np.testing.assert_allclose(served(preprocessor, image), expected, atol=1e-5)


def test_a_small_image_is_enlarged_bilinearly_then_padded(preprocessor):
    """3 x 9 fits as 9 x 28 (scale 28/9; 3 * 28/9 = 9.33, rounded to 9 rows); 19 rows of margin:
    9 above, 10 below."""
    image = ramp(3, 9)
    expected = framed(bilinear(image, 9, 28), 9, 0)
    np.testing.assert_allclose(served(preprocessor, image), expected, atol=1e-4)


def test_a_square_image_is_enlarged_bilinearly_to_the_whole_frame(preprocessor):
    image = ramp(14, 14)
    np.testing.assert_allclose(
        served(preprocessor, image), framed(bilinear(image, 28, 28), 0, 0), atol=1e-4
    )


def test_a_large_image_is_reduced_with_the_bilinear_filter(preprocessor):
    """56 x 56 -> 28 x 28: a filter over 4 input pixels per output pixel, not one sampled pixel."""
    image = ramp(56, 56)
    np.testing.assert_allclose(served(preprocessor, image), framed(halve(image), 0, 0), atol=1e-3)


def test_predict_on_a_fitted_image_matches_onnxruntime_on_the_hand_made_tensor(
    client, reference: Reference
):
    """/predict on a 3 x 9 and a 14 x 14 image against the model file run here on the tensors built
    above: preprocessing, batching and the answer's scores, all against an outside reference."""
    images = [ramp(3, 9), ramp(14, 14)]
    tensors = np.stack(
        [framed(bilinear(images[0], 9, 28), 9, 0), framed(bilinear(images[1], 28, 28), 0, 0)]
    )
    (logits,) = reference.classifier.run(["logits"], {"images": tensors})
    probabilities = np.exp(logits - logits.max(axis=1, keepdims=True))
    probabilities /= probabilities.sum(axis=1, keepdims=True)
    body = {"images": [{"pixels": image.tolist()} for image in images], "invert": "never"}
    body["top_k"] = 10
    answer = client.post("/predict", json=body)
    assert answer.status_code == 200, answer.text
    for prediction, expected in zip(answer.json()["predictions"], probabilities, strict=True):
        assert_matches(prediction, expected, atol=1e-3)


def test_attention_answers_the_prediction_onnxruntime_gives(client, fashion_images, reference):
    """/attention's prediction against the model file run here, not against /predict (which shares
    the service's preprocessing and runtime)."""
    for image in fashion_images[:3]:
        expected = reference.probabilities(image[None])[0]
        body = {"image": {"pixels": image.tolist()}, "invert": "never", "top_k": 10}
        answer = client.post("/attention", json=body)
        assert answer.status_code == 200, answer.text
        prediction = answer.json()["prediction"]
        assert_matches(prediction, expected)
        assert prediction["score"] == pytest.approx(float(expected.max()), abs=1e-4)


@pytest.mark.parametrize(
    ("shape", "fitted"),
    [
        ((10, 29), (10, 28)),  # 10 * 28 / 29 = 9.66: rounds to 10 rows, truncates to 9
        ((29, 10), (28, 10)),
        ((20, 57), (10, 28)),  # 9.82
        ((7, 40), (5, 28)),  # 4.9
        ((10, 31), (9, 28)),  # 9.03: rounds down, as truncation does (a ceiling would give 10)
    ],
    ids=["10x29", "29x10", "20x57", "7x40", "10x31"],
)
def test_the_fitted_size_is_rounded_to_the_nearest_pixel(preprocessor, shape, fitted):
    """The rounding edge of fit-and-pad: a flat image fills exactly the fitted rows and columns,
    rounded (not truncated), placed at margin // 2; the rest is the pad value."""
    rows, cols = fitted
    top, left = (SIZE - rows) // 2, (SIZE - cols) // 2
    expected = framed(np.full(fitted, 200.0), top, left)
    np.testing.assert_allclose(served(preprocessor, np.full(shape, 200)), expected, atol=1e-4)
