"""The whole export stage in one command: train, report, export to ONNX, evaluate the ONNX file.

    python -m export.pipeline --preset fashion-small --dataset fashion-mnist --out runs/fashion-small \\
        --name fashion-mnist-vit --version 1 --repo models/ [--epochs 40] [--overwrite] [train args...]

Arguments this command does not know go to ``python -m export.train`` unchanged. A run directory that
already holds a resumable state (``RUN_DIR/last/state.json``) is resumed with its saved settings, so
restarting the command (a container restart) continues the run instead of starting it over; a
finished run goes straight to the export. The export writes nothing unless it passes verification,
and an existing version is kept unless ``--overwrite`` is given. The ONNX model's test accuracy is
then measured by ``export.evaluate`` and written to ``RUN_DIR/onnx_evaluation.json``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from export.cli import command_parser, version_number


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = command_parser("export.pipeline", __doc__)
    parser.add_argument("--out", required=True, type=Path, help="run directory (train output)")
    parser.add_argument("--name", required=True, help="model name in the repository")
    parser.add_argument(
        "--version", required=True, type=version_number, help="integer version, 1 or more"
    )
    parser.add_argument("--repo", default="models", type=Path, help="model repository directory")
    parser.add_argument("--data-dir", default=None, help="dataset directory (training and export)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing version")
    args, train_args = parser.parse_known_args(argv)
    if "--resume" in train_args:
        parser.error("--resume is implied: a run directory with last/state.json is resumed")
    return args, train_args


def train_argv(args: argparse.Namespace, train_args: list[str]) -> list[str]:
    argv = [*train_args, "--out", str(args.out)]
    if args.data_dir is not None:
        argv += ["--data-dir", args.data_dir]
    if (args.out / "last" / "state.json").is_file():
        argv += ["--resume", str(args.out)]
    return argv


def export_argv(args: argparse.Namespace) -> list[str]:
    argv = [
        str(args.out),
        "--name",
        args.name,
        "--version",
        str(args.version),
        "--repo",
        str(args.repo),
    ]
    if args.data_dir is not None:
        argv += ["--data-dir", args.data_dir]
    if args.overwrite:
        argv.append("--overwrite")
    return argv


def evaluate_argv(args: argparse.Namespace) -> list[str]:
    model = args.repo / args.name / str(args.version) / "model.onnx"
    argv = [str(model), "--json", str(args.out / "onnx_evaluation.json")]
    if args.data_dir is not None:
        argv += ["--data-dir", args.data_dir]
    return argv


def main(argv: list[str] | None = None) -> int:
    args, train_args = parse_args(argv)
    from export import evaluate, onnx, train
    from export.data import DatasetError

    command = train_argv(args, train_args)
    if "--resume" in command:
        print(f"resuming {args.out} with its saved settings (last/state.json)", flush=True)
    print("== train: python -m export.train " + " ".join(command), flush=True)
    try:
        code = train.main(command)
    except (DatasetError, ValueError, OSError) as error:
        print(f"error: training failed: {error}", file=sys.stderr)
        return 2
    if code:
        return code
    command = export_argv(args)
    print("== export: python -m export.onnx " + " ".join(command), flush=True)
    code = onnx.main(command)
    if code:
        return code
    command = evaluate_argv(args)
    print("== evaluate: python -m export.evaluate " + " ".join(command), flush=True)
    return evaluate.main(command)


if __name__ == "__main__":
    sys.exit(main())
