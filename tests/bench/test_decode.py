"""bench/decode.py: its phone photo is what it says, its ``full`` path is the source's processor
(Hugging Face's DeiT at shortest edge 256, an outside reference), and a run reports every photo."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image
from skimage import data
from transformers import DeiTImageProcessorPil

from bench import decode


def test_a_phone_photo_is_a_4032_x_3024_jpeg_of_the_photos_centre():
    jpeg = decode.phone_jpeg(data.chelsea())  # 451 x 300: its centre 400 x 300 is 4:3
    image = Image.open(io.BytesIO(jpeg))
    assert (image.format, image.size, image.mode) == ("JPEG", decode.PHOTO_SIZE, "RGB")
    small = np.asarray(image.resize((400, 300), Image.Resampling.BOX), dtype=np.float64)
    centre = data.chelsea()[:, 25:425].astype(np.float64)
    assert np.abs(small - centre).mean() < 4


def test_the_full_path_is_hugging_faces_processor_on_the_decoded_photo():
    jpeg = decode.phone_jpeg(data.coffee())
    processor = DeiTImageProcessorPil(
        size={"shortest_edge": 256}, image_mean=decode.IMAGENET_MEAN, image_std=decode.IMAGENET_STD
    )
    expected = processor(Image.open(io.BytesIO(jpeg)), return_tensors="np")["pixel_values"][0]
    preprocessor = decode.Preprocessor(decode.metadata(), max_pixels=10**8)
    full = decode.full_decode_and_resize(jpeg, preprocessor)
    np.testing.assert_allclose(full, expected, rtol=0, atol=2e-6)


def test_a_run_times_every_path_and_compares_every_photo():
    result = decode.run(rounds=1, with_model=False, photos={"chelsea": data.chelsea()})
    assert set(result.ms_per_photo) == set(decode.PATHS)
    assert all(spread is not None and spread.n == 1 for spread in result.ms_per_photo.values())
    (photo,) = result.photos
    assert photo.name == "chelsea" and photo.top1 is None
    assert 0 < photo.mean_difference < photo.max_difference < 1
    text = result.markdown()
    assert text.startswith("## A phone photo to the model's input\n")
    assert "| chelsea |" in text and "| service |" in text and "top-1" not in text
    share = result.ms_per_photo["service"].median / result.ms_per_photo["full"].median
    assert result.share == share and f"**{'PASS' if share <= 0.25 else 'FAIL'}**" in text
