"""What every ``python -m export.<tool>`` command (and ``python -m bench``) shares: a parser that
shows the module's docstring as written, and a mistake the user can fix printed as one line with exit
status 2 instead of a traceback."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The description as written, and each option's default after its help (argparse's
    ArgumentDefaultsHelpFormatter), unless the help already says it or there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (
            "default" in text
            or action.default in (None, argparse.SUPPRESS)
            or not action.option_strings
        ):
            return text
        return text + " (default: %(default)s)"


def command_parser(prog: str, doc: str | None) -> argparse.ArgumentParser:
    """The parser of ``python -m <prog>``; ``doc`` (the module docstring) is its help text."""
    return argparse.ArgumentParser(
        prog=f"python -m {prog}", description=doc, formatter_class=HelpFormatter
    )


def version_number(text: str) -> int:
    """``--version``'s type: a model version, an integer from 1 to the contract's ``MAX_VERSION``
    (a signed 64-bit integer, as the service's link and Triton's protocol carry it)."""
    from service.contract.model_repository import MAX_VERSION

    try:
        value = int(text)
    except ValueError:  # not a number, or more digits than int() reads
        value = None
    if value is None or not 1 <= value <= MAX_VERSION:
        raise argparse.ArgumentTypeError(
            f"must be an integer from 1 to {MAX_VERSION}, got {text[:40]!r}"
        )
    return value


def exit_status(action: Callable[[], object], *also: type[Exception]) -> int:
    """0 after ``action()``; 2 with ``error: ...`` on stderr when it raises a checkpoint, dataset or
    value error (or one of ``also``)."""
    # Imported here: the torch-free commands (export.pipeline, bench) use the parser alone.
    from export.checkpoint import CheckpointError
    from export.data import DatasetError

    try:
        action()
    except (CheckpointError, DatasetError, ValueError, *also) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0
