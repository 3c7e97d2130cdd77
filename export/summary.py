"""Model summary and the tensor shape after every stage, for any preset or trained checkpoint.

    python -m export.summary --preset mnist-tiny [--batch 2] [--depth 4]
    python -m export.summary runs/fashion-small [IMAGE]

With an image file, the image is prepared as the service prepares an upload and the shape after every
module of that real forward pass is printed (forward hooks), then the prediction.

The shapes come from running a random batch through the model's own modules, stage by stage, and
the walk checks itself against the model: its embedding must equal ``VisionTransformer.embed`` and
its logits the model's fused forward pass.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from export.checkpoint import load_checkpoint, resolve_checkpoint
from export.cli import command_parser, exit_status
from export.config import PRESETS, ViTConfig, get_preset
from export.data import spec_from_metadata
from export.model import VisionTransformer, patchify, without_tokens


@dataclass(frozen=True)
class ModuleRow:
    name: str  # qualified name, "" for the model itself
    kind: str
    parameters: int  # recursive
    depth: int


def module_rows(model: VisionTransformer, max_depth: int = 4) -> list[ModuleRow]:
    """Every module down to ``max_depth`` and the model's own parameters, in definition order."""
    rows = [ModuleRow("", type(model).__name__, model.num_parameters(), 0)]
    own = dict(model.named_parameters(recurse=False))
    for name, child in model.named_children():
        for sub_name, module in child.named_modules():
            qualified = f"{name}.{sub_name}" if sub_name else name
            depth = qualified.count(".") + 1
            if depth <= max_depth:
                parameters = sum(p.numel() for p in module.parameters())
                rows.append(ModuleRow(qualified, type(module).__name__, parameters, depth))
        if name == "patch_embedding":  # then the class token and the position table join in
            for param_name, param in own.items():
                rows.append(ModuleRow(param_name, "Parameter", param.numel(), 1))
            if "position_embedding" not in own:
                rows.append(ModuleRow("position_embedding", "buffer (fixed, not saved)", 0, 1))
    return rows


@torch.inference_mode()
def trace_shapes(
    model: VisionTransformer, images: torch.Tensor
) -> list[tuple[str, tuple[int, ...]]]:
    """(stage, shape) after every stage of a forward pass, in eval mode."""
    was_training = model.training
    model.eval()
    try:
        return _trace(model, images)
    finally:
        model.train(was_training)


def _trace(model: VisionTransformer, images: torch.Tensor) -> list[tuple[str, tuple[int, ...]]]:
    config = model.config
    stages: list[tuple[str, tuple[int, ...]]] = []

    def record(name: str, tensor: torch.Tensor) -> None:
        stages.append((name, tuple(tensor.shape)))

    record("input", images)
    if config.patch_embedding == "linear":
        patches = patchify(images, config.patch_size)
        record("patches (reshape)", patches)
        record("patch projection (linear)", model.patch_embedding.projection(patches))
    else:
        record("patch projection (conv)", model.patch_embedding.projection(images))
    x = model.patch_embedding(images)
    record("patch embedding", x)
    if model.class_token is not None:
        x = torch.cat([model.class_token.expand(x.shape[0], -1, -1), x], dim=1)
        record("+ class token", x)
    if model.distillation_token is not None:
        before = 1 if model.class_token is not None else 0
        token = model.distillation_token.expand(x.shape[0], -1, -1)
        x = torch.cat([x[:, :before], token, x[:, before:]], dim=1)
        record("+ distillation token", x)
    x = model.embedding_dropout(x + model.position_embedding)
    record(f"+ position embedding ({config.position_embedding})", x)
    if not torch.equal(x, model.embed(images)):
        raise RuntimeError("the summary's walk diverged from VisionTransformer.embed")

    captured: dict[str, torch.Tensor] = {}
    maps = []
    for index, block in enumerate(model.blocks):
        attention = block.attention
        hooks = [
            attention.qkv.register_forward_hook(lambda m, i, o: captured.__setitem__("qkv", o)),
            attention.projection.register_forward_hook(
                lambda m, i, o: captured.__setitem__("concatenated", i[0])
            ),
            attention.register_forward_hook(lambda m, i, o: captured.__setitem__("attended", o[0])),
            block.mlp.fc1.register_forward_hook(lambda m, i, o: captured.__setitem__("hidden", o)),
        ]
        try:
            x, probabilities = block(x, return_attention=True)
        finally:
            for hook in hooks:
                hook.remove()
        batch, tokens, _ = x.shape
        q, _, v = (
            captured["qkv"]
            .reshape(batch, tokens, 3, config.heads, config.head_dim)
            .permute(2, 0, 3, 1, 4)
        )
        per_head = probabilities @ v
        concatenated = per_head.transpose(1, 2).reshape(batch, tokens, config.dim)
        if not torch.allclose(concatenated, captured["concatenated"], atol=1e-5, rtol=1e-4):
            raise RuntimeError(
                f"block {index}: heads concatenated differ from the projection input"
            )
        prefix = f"block {index}"
        record(f"{prefix} qkv", captured["qkv"])
        record(f"{prefix} q / k / v per head", q)
        record(f"{prefix} attention probabilities", probabilities)
        record(f"{prefix} per-head output", per_head)
        record(f"{prefix} heads concatenated", concatenated)
        record(f"{prefix} multi-head attention (projected)", captured["attended"])
        record(f"{prefix} mlp hidden", captured["hidden"])
        record(f"{prefix} output", x)
        maps.append(probabilities)

    features = x if config.pooled_norm else model.norm(x)
    if not config.pooled_norm:
        record("final norm", features)
    patches = features[:, config.num_prefix_tokens :]
    pooled = features[:, 0] if config.pooling == "token" else patches.mean(dim=1)
    record(f"pooled ({config.pooling})", pooled)
    if config.pooled_norm:
        record("final norm (of the pooled features)", model.norm(pooled))
    representation = model.read(pooled)
    if config.representation_size is not None:
        record("pre-logits (Linear + Tanh)", representation)
    logits = model.head(representation)
    attention = torch.stack(maps, dim=1)
    if model.distillation_head is not None:
        record("class head logits", logits)
        token = features[:, config.num_prefix_tokens - 1]
        record("distillation token", token)
        distilled = model.distillation_head(model.read(token))
        record("distillation head logits", distilled)
        logits = (logits + distilled) / 2
    if config.unmapped_tokens:
        attention = without_tokens(attention, config.unmapped_tokens)
    record("logits", logits)
    record("attention maps (batch, layers, heads, tokens, tokens)", attention)
    if not torch.allclose(logits, model(images), atol=1e-4, rtol=1e-4):
        raise RuntimeError("the summary's walk gives other logits than VisionTransformer.forward")
    return stages


def _shapes(output: object) -> str:
    if isinstance(output, torch.Tensor):
        return str(tuple(output.shape))
    if isinstance(output, tuple | list):
        return ", ".join(_shapes(item) for item in output)
    return repr(output)


@torch.inference_mode()
def module_shapes(model: VisionTransformer, images: torch.Tensor) -> list[tuple[str, str, str]]:
    """(module, type, output shape) after every module of a forward pass, in the order each module
    finished (forward hooks; seed 000's print_shapes). Attention runs unfused, so every block also
    shows its attention probabilities, (batch, heads, tokens, tokens)."""
    rows: list[tuple[str, str, str]] = []

    def hook(name: str):
        def record(module: torch.nn.Module, inputs: object, output: object) -> None:
            rows.append((name or "(model)", type(module).__name__, _shapes(output)))

        return record

    handles = [module.register_forward_hook(hook(name)) for name, module in model.named_modules()]
    was_training = model.training
    model.eval().set_fused_attention(False)
    try:
        model(images)
    finally:
        model.set_fused_attention(True)
        model.train(was_training)
        for handle in handles:
            handle.remove()
    return rows


def header_lines(model: VisionTransformer, max_depth: int = 4) -> list[str]:
    """What the model is, and its modules down to ``max_depth`` with their parameter counts."""
    config = model.config
    rows_grid, cols_grid = config.grid
    lines = [
        f"{type(model).__name__}: {config.image_height}x{config.image_width}x{config.in_channels} "
        f"images, patch {config.patch_size} -> {rows_grid}x{cols_grid} = {config.num_patches} "
        f"patches ({config.patch_embedding} embedding)"
        + (" + class token" if config.pooling == "token" else "")
        + (" + distillation token" if config.distillation_token else "")
        + f", {config.num_tokens} tokens; dim {config.dim}, depth {config.depth}, heads "
        f"{config.heads} (head dim {config.head_dim}), mlp {config.mlp_dim}, pooling {config.pooling}",
        "",
        f"{'module':<40} {'type':<28} {'parameters':>12}",
    ]
    for row in module_rows(model, max_depth)[1:]:
        name = "  " * (row.depth - 1) + row.name.rsplit(".", 1)[-1]
        lines.append(f"{name:<40} {row.kind:<28} {row.parameters:>12,}")
    total = model.num_parameters()
    trainable = model.num_parameters(trainable_only=True)
    lines += [
        "",
        f"total parameters: {total:,} ({trainable:,} trainable), "
        f"{4 * total / 2**20:.2f} MiB as float32",
    ]
    return lines


def format_summary(model: VisionTransformer, batch: int = 1, max_depth: int = 4) -> str:
    """The model, its modules, and the shape after every stage of a random batch."""
    config = model.config
    lines = [*header_lines(model, max_depth), "", f"{'stage':<56} shape"]
    images = torch.randn(batch, config.in_channels, config.image_height, config.image_width)
    for name, shape in trace_shapes(model, images):
        lines.append(f"{name:<56} {tuple(shape)}")
    return "\n".join(lines)


def format_image_summary(
    model: VisionTransformer, metadata: dict[str, str], image: Path, max_depth: int = 4
) -> str:
    """The model, and the shape after every module on a real forward pass of one image file,
    prepared as the service would prepare an upload of it; then the prediction."""
    from export.pixels import UnreadableImage, preprocessor_for, read_image

    spec = spec_from_metadata(metadata)
    try:
        prepared = read_image(image, preprocessor_for(spec))
    except UnreadableImage as error:
        raise ValueError(f"{image}: {error}") from error
    images = torch.from_numpy(prepared.tensor).unsqueeze(0)
    lines = [*header_lines(model, max_depth), ""]
    lines.append(
        f"{image}: prepared as the service does ({spec.polarity} images, "
        f"{'inverted' if prepared.inverted else 'not inverted'}) -> {tuple(images.shape)}"
    )
    lines += ["", f"{'module (forward hooks, in the order each finished)':<52} {'type':<20} output"]
    for name, kind, shape in module_shapes(model, images):
        lines.append(f"{name:<52} {kind:<20} {shape}")
    with torch.inference_mode():
        probabilities = model.eval()(images).softmax(dim=1)[0]
    labels = json.loads(metadata["labels"])
    top = probabilities.topk(min(3, len(labels)))
    lines += ["", "prediction: " + ", ".join(
        f"{labels[int(i)]} {100 * float(p):.1f}%" for p, i in zip(top.values, top.indices, strict=True)
    )]  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = command_parser("export.summary", __doc__)
    parser.add_argument("source", nargs="?", help="a checkpoint (.safetensors) or run directory")
    parser.add_argument("image", nargs="?", type=Path, help="an image file to run through it")
    parser.add_argument(
        "--preset", choices=sorted(PRESETS), help="a preset's model, random weights"
    )
    parser.add_argument("--batch", type=int, default=1, help="batch size of the random input")
    parser.add_argument("--depth", type=int, default=4, help="deepest module level listed")
    args = parser.parse_args(argv)
    if args.batch < 1:
        parser.error(f"--batch must be at least 1, got {args.batch}")
    if (args.preset is None) == (args.source is None):
        parser.error("give either --preset NAME or a checkpoint / run directory")
    if args.preset is not None:
        if args.image is not None:
            parser.error("an image runs through a trained checkpoint; give a run directory")
        config: ViTConfig = get_preset(args.preset)
        torch.manual_seed(0)
        model = VisionTransformer(config)
        print(f"preset {args.preset}")
        print(format_summary(model, args.batch, args.depth))
        return 0

    def summarise_checkpoint() -> None:
        model, metadata = load_checkpoint(args.source)
        print(f"checkpoint {resolve_checkpoint(args.source)} ({metadata['dataset']})")
        if args.image is None:
            print(format_summary(model, args.batch, args.depth))
        else:
            print(format_image_summary(model, metadata, args.image, args.depth))

    return exit_status(summarise_checkpoint)


if __name__ == "__main__":
    raise SystemExit(main())
