"""DeiT's distillation token: one more token and a head of its own, the logits the mean of both heads',
attention maps over the tokens the service knows, checkpoints, the ONNX export, and the loss."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from export import onnx as onnx_export
from export.checkpoint import load_checkpoint, read_metadata, save_checkpoint
from export.config import ViTConfig
from export.data import FASHION_MNIST_LABELS, get_dataset_spec, load_test_split, normalize
from export.finetune import adapt
from export.model import VisionTransformer, without_tokens
from export.summary import trace_shapes
from export.teacher import distillation_loss
from service.contract.attention_maps import attention_map
from service.contract.model_repository import ModelMetadata
from tests.export.conftest import FASHION_DIR, small


def config(pooling: str, **changes) -> ViTConfig:
    return small(**{"pooling": pooling, "distillation_token": True, **changes})


def randomised(model: VisionTransformer) -> VisionTransformer:
    """The tokens and heads start at zero (all logits 0): give every parameter values."""
    torch.manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(std=0.3)
    return model.eval()


# -- the model ----------------------------------------------------------------------------------
@pytest.mark.parametrize(("pooling", "tokens"), [("token", 18), ("mean", 17)])
def test_one_more_token_one_more_head_and_maps_without_it(pooling, tokens):
    c = config(pooling)
    assert (c.num_patches, c.num_tokens, c.map_tokens) == (16, tokens, tokens - 1)
    model = randomised(VisionTransformer(c))
    assert model.distillation_token.shape == (1, 1, 32)
    assert model.distillation_head.weight.shape == (10, 32)
    images = torch.randn(3, 1, 16, 16)
    assert model.embed(images).shape == (3, tokens, 32)
    logits, distilled = model.forward_heads(images)
    assert logits.shape == distilled.shape == (3, 10)
    shapes = dict(trace_shapes(model, images))
    assert shapes["+ distillation token"] == (3, tokens, 32)
    assert shapes["block 1 attention probabilities"] == (3, 4, tokens, tokens)
    assert shapes["distillation head logits"] == (3, 10)
    assert shapes["attention maps (batch, layers, heads, tokens, tokens)"] == (
        *(3, 2, 4),
        *(tokens - 1, tokens - 1),
    )
    _, maps = model.forward_with_attention(images)
    assert maps.shape == (3, 2, 4, tokens - 1, tokens - 1)
    # Without the flag, nothing of it: the models trained before it load as they were.
    plain = VisionTransformer(config(pooling, distillation_token=False))
    assert plain.distillation_token is None and plain.distillation_head is None
    assert not any(key.startswith("distillation") for key in plain.state_dict())
    assert plain.config.num_tokens == tokens - 1


@pytest.mark.parametrize("pooling", ["token", "mean"])
def test_the_logits_are_the_mean_of_two_heads_that_each_read_their_own_tokens(pooling):
    model = randomised(VisionTransformer(config(pooling)))
    images = torch.randn(4, 1, 16, 16)
    logits, distilled = model.forward_heads(images)
    assert not torch.allclose(logits, distilled, atol=1e-3)
    torch.testing.assert_close(model(images), (logits + distilled) / 2)
    features, _ = model.forward_features(images)
    index = 1 if pooling == "token" else 0  # [class token] [distillation token] patches
    token_changed, patch_changed = features.clone(), features.clone()
    token_changed[:, index] += 1.0
    patch_changed[:, -1] += 1.0
    # The class head never reads the distillation token (nor, with mean pooling, averages it in).
    torch.testing.assert_close(model.forward_head(token_changed), model.forward_head(features))
    assert not torch.allclose(
        model.forward_distillation_head(token_changed), model.forward_distillation_head(features)
    )
    # The distillation head reads its token alone.
    torch.testing.assert_close(
        model.forward_distillation_head(patch_changed), model.forward_distillation_head(features)
    )


@pytest.mark.parametrize("pooling", ["token", "mean"])
def test_the_maps_leave_the_distillation_token_out_and_stay_probabilities(pooling):
    model = randomised(VisionTransformer(config(pooling)))
    images = torch.randn(2, 1, 16, 16)
    _, raw = model.forward_features(images, return_attention=True)
    raw = torch.stack(raw, dim=1)
    index = 1 if pooling == "token" else 0
    kept = [i for i in range(raw.shape[-1]) if i != index]
    expected = raw[..., kept, :][..., kept]
    expected = expected / expected.sum(-1, keepdim=True)
    _, maps = model.forward_with_attention(images)
    torch.testing.assert_close(maps, expected)
    torch.testing.assert_close(maps.sum(-1), torch.ones(maps.shape[:-1]))
    # What the service draws: one value a patch, over the 4 x 4 grid.
    drawn = attention_map(
        maps[0].detach().numpy(), method="rollout", layer=1, head=None, pooling=pooling, grid=(4, 4)
    )
    assert drawn.shape == (4, 4)
    torch.testing.assert_close(without_tokens(raw, [index]), expected)


def test_a_checkpoint_keeps_the_token_and_its_head(tmp_path):
    model = randomised(VisionTransformer(config("mean", image_height=28, image_width=28)))
    path = tmp_path / "run" / "model.safetensors"
    save_checkpoint(model, path, "fashion-mnist", FASHION_MNIST_LABELS)
    loaded, metadata = load_checkpoint(path)
    assert loaded.config.distillation_token and json.loads(metadata["config"])["distillation_token"]
    state = loaded.state_dict()
    for key in ("distillation_token", "distillation_head.weight", "distillation_head.bias"):
        assert torch.equal(state[key], model.state_dict()[key]), key
    images = torch.randn(2, 1, 28, 28)
    torch.testing.assert_close(loaded(images), model(images), atol=0, rtol=0)
    # A checkpoint written before the field existed (no "distillation_token" in its config) has
    # no token.
    plain = VisionTransformer(
        config("mean", image_height=28, image_width=28, distillation_token=False)
    )
    older = tmp_path / "older.safetensors"
    save_checkpoint(plain, older, "fashion-mnist", FASHION_MNIST_LABELS)
    recorded = json.loads(read_metadata(older)["config"])
    recorded.pop("distillation_token")
    from safetensors.torch import load_file, save_file

    save_file(
        load_file(str(older)), str(older), {**read_metadata(older), "config": json.dumps(recorded)}
    )
    assert not load_checkpoint(older)[0].config.distillation_token


def test_fine_tuning_keeps_both_tokens_positions_and_renews_both_heads():
    torch.manual_seed(0)
    parent = randomised(VisionTransformer(config("token")))
    child = VisionTransformer(parent.config.replace(image_height=24, image_width=24, num_classes=3))
    adapt(parent, child, same_classes=False)
    table = child.position_embedding
    assert table.shape == (1, 2 + 36, 32)
    torch.testing.assert_close(table[:, :2], parent.position_embedding[:, :2])
    assert torch.equal(child.distillation_token, parent.distillation_token)
    for head in (child.head, child.distillation_head):
        assert not head.weight.any() and head.weight.shape == (3, 32)


# -- the loss -----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["hard", "soft"])
def test_with_a_token_the_teacher_is_learnt_by_the_distillation_head_alone(kind):
    generator = torch.Generator().manual_seed(0)
    logits, distilled, teacher = (torch.randn(8, 5, generator=generator) for _ in range(3))
    labels = torch.randint(0, 5, (8,), generator=generator)
    logits.requires_grad_(True)
    distilled.requires_grad_(True)
    loss = distillation_loss(logits, teacher, labels, kind, 0.1, distilled)
    loss.backward()
    # The class head's gradient is that of half its cross-entropy with the labels, nothing more.
    expected = torch.autograd.grad(
        0.5 * F.cross_entropy(logits, labels, label_smoothing=0.1), logits
    )[0]
    torch.testing.assert_close(logits.grad, expected)
    if kind == "hard":
        target = 0.5 * F.cross_entropy(distilled, teacher.argmax(1))
    else:
        target = (
            0.5
            * 9.0
            * F.kl_div(
                F.log_softmax(distilled / 3, 1),
                F.log_softmax(teacher / 3, 1),
                reduction="batchmean",
                log_target=True,
            )
        )
    torch.testing.assert_close(
        distilled.grad, torch.autograd.grad(target, distilled)[0], atol=1e-6, rtol=1e-5
    )


# -- the export, and the service --------------------------------------------------------------
needs_fashion = pytest.mark.skipif(not FASHION_DIR.is_dir(), reason="needs dataset-fashion-mnist")


@pytest.fixture(scope="module", params=["token", "mean"])
def distilled(request, tmp_path_factory):
    """(model, export result, repository): a model with a distillation token exported as
    ``distilled`` version 1, its heads apart enough that their mean is not either's."""
    c = config(request.param, image_height=28, image_width=28, patch_size=7)
    model = randomised(VisionTransformer(c))
    work = tmp_path_factory.mktemp("distilled")
    save_checkpoint(
        model, work / "run" / "model.safetensors", "fashion-mnist", FASHION_MNIST_LABELS
    )
    result = onnx_export.export_model(work / "run", "distilled", 1, work / "repo", measure=False)
    return model, result, work / "repo"


def fashion(count: int) -> torch.Tensor:
    spec = get_dataset_spec("fashion-mnist")
    return normalize(load_test_split(spec, None).images[:count], spec)


@needs_fashion
def test_the_export_has_one_logits_output_the_mean_of_both_heads(distilled):
    model, result, repository = distilled
    c, version = model.config, repository / "distilled" / "1"
    images = fashion(9)
    with torch.inference_mode():
        logits, distilled_logits = model.forward_heads(images)
    classifier = ort.InferenceSession(str(version / "model.onnx"))
    assert [o.name for o in classifier.get_outputs()] == ["logits"]
    (exported,) = classifier.run(None, {"images": images.numpy()})
    np.testing.assert_allclose(exported, ((logits + distilled_logits) / 2).numpy(), atol=1e-4)
    assert np.abs(exported - logits.numpy()).max() > 0.1
    attention = ort.InferenceSession(str(version / "attention.onnx"))
    _, maps = attention.run(None, {"images": images.numpy()})
    assert maps.shape == (9, 2, 4, c.map_tokens, c.map_tokens)
    np.testing.assert_allclose(maps.sum(-1), 1.0, atol=1e-5)
    # The metadata the service reads describes those maps, and passes its checks.
    for name in ("model.onnx", "attention.onnx"):
        props = {p.key: p.value for p in onnx.load(str(version / name)).metadata_props}
        document = ModelMetadata.model_validate_json(props["vitserve"])
        assert document.tokens == c.map_tokens and document.pooling == c.pooling
    assert result["verification"]["batch_64"]["argmax_mismatches"] == 0


@needs_fashion
def test_the_service_predicts_and_draws_the_attention_of_a_distilled_model(distilled):
    from fastapi.testclient import TestClient

    from service.launcher.local_app import local_app
    from tests.support import b64, encode, make_settings

    model, _, repository = distilled
    images = load_test_split(get_dataset_spec("fashion-mnist"), None).images[:2, 0].numpy()
    with torch.inference_mode():
        expected = F.softmax(model(fashion(2)), dim=1).numpy()
    settings = make_settings(repository, model_name="distilled")
    with TestClient(local_app(settings)) as client:
        for image, probabilities in zip(images, expected, strict=True):
            body = {"images": [{"b64": b64(encode(image))}]}
            response = client.post("/predict", json=body)
            assert response.status_code == 200, response.text
            (prediction,) = response.json()["predictions"]
            assert prediction["index"] == int(probabilities.argmax())
            assert prediction["score"] == pytest.approx(float(probabilities.max()), abs=1e-4)
            drawn = client.post("/attention", json={"image": {"b64": b64(encode(image))}})
            assert drawn.status_code == 200, drawn.text
            assert drawn.json()["grid"] == [4, 4] and np.array(drawn.json()["map"]).shape == (4, 4)


def test_no_teacher_trains_both_heads_on_the_labels(tmp_path):
    """A distilled model fine-tuned without a teacher: its distillation head learns the labels."""
    from export.train_settings import TrainSettings
    from export.trainer import Trainer

    spec = get_dataset_spec("fashion-mnist")
    c = config("mean", image_height=28, image_width=28, patch_size=7)
    settings = TrainSettings(model_config=c.to_dict(), distillation="hard")
    trainer = Trainer(settings, tmp_path, spec)
    generator = torch.Generator().manual_seed(0)
    logits, distilled = (
        torch.randn(6, 10, generator=generator),
        torch.randn(6, 10, generator=generator),
    )
    labels = torch.randint(0, 10, (6,), generator=generator)
    images = torch.randn(6, 1, 28, 28)
    expected = (
        F.cross_entropy(logits, labels, label_smoothing=0.1)
        + F.cross_entropy(distilled, labels, label_smoothing=0.1)
    ) / 2
    torch.testing.assert_close(trainer.loss(images, logits, distilled, labels), expected)
    # With a teacher the distillation head learns the teacher's class instead.
    teacher = nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 10))
    trainer.use_teacher(teacher)
    with torch.no_grad():
        taught = teacher(images).argmax(1)
    expected = 0.5 * F.cross_entropy(logits, labels, label_smoothing=0.1) + 0.5 * F.cross_entropy(
        distilled, taught
    )
    torch.testing.assert_close(trainer.loss(images, logits, distilled, labels), expected)
