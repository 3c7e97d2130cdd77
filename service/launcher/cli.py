"""The command line of ``python -m service`` and of the ``vitserve`` script: every setting a flag.

The flags are made from the fields of ``service/settings/`` (every group's), so a new setting is a new flag with no
edit here: ``max_batch_size`` is ``--max-batch-size``, and ``--help`` shows its description, default
and environment variable. Where Triton Inference Server (or uvicorn) has the concept, its flag is
accepted too (``ALIASES``): ``--model-repository``, ``--http-port``, ``--grpc-port``,
``--model-control-mode``, ``--load-model`` (repeatable, ``*`` for every model), ``--log-verbose``,
``--host`` and ``--port``.

Flags win over the environment, which still works: a flag is given to ``Settings`` as an argument,
which pydantic-settings ranks above the environment, and pydantic parses it as it parses the
variable. An invalid value exits 2 with one line per setting, naming the flag or the variable and
never the value. Only pydantic is imported here, so ``--help`` answers at once.
"""

from __future__ import annotations

import argparse
import sys
import typing
from collections.abc import Sequence

from pydantic import AliasChoices, SecretStr, ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import SettingsError

from service.settings import ENV_PREFIX, Settings, setting_fields

EXIT_BAD_SETTINGS = 2
EXIT_START_FAILED = 3  # a port in use, a model that does not load, httptools missing

# Triton's and uvicorn's names for the same settings, accepted beside each field's own flag.
ALIASES: dict[str, tuple[str, ...]] = {
    "port": ("--http-port",),
    "model_control": ("--model-control-mode",),
    "models": ("--load-model",),
    "repository_poll_s": ("--repository-poll-secs",),
    "graceful_shutdown_s": ("--exit-timeout-secs",),
    "max_connections": ("--limit-concurrency",),
}
# Flags that a model list is given with, once per name (as Triton's --load-model), or comma-separated.
REPEATABLE = ("models",)
LOG_VERBOSE = "--log-verbose"  # Triton's verbosity level: above 0 is log_level=debug

DESCRIPTION = """\
Serve the ONNX models of a model repository over HTTP (FastAPI) and gRPC (the Open Inference
Protocol), with dynamic batching on onnxruntime. Every setting is a flag and an environment
variable; a flag wins over the variable. Exit codes: 0 after a clean shutdown, 2 for invalid
settings, 3 when start-up failed."""


def flag(name: str) -> str:
    """The flag of a setting: ``max_batch_size`` is ``--max-batch-size``."""
    return "--" + name.replace("_", "-")


def variable(name: str) -> str:
    return f"{ENV_PREFIX}{name}".upper()


def _shown_default(field: FieldInfo) -> str:
    if field.default is None:
        return "unset"
    if isinstance(field.default, bool):
        return str(field.default).lower()
    return str(field.default) if str(field.default) != "" else "empty"


def _choices(field: FieldInfo) -> list[str] | None:
    """The values of a ``Literal`` setting, for --help and for argparse to check."""
    if typing.get_origin(field.annotation) is typing.Literal:
        return [str(choice) for choice in typing.get_args(field.annotation)]
    return None


def _variables(name: str, field: FieldInfo) -> str:
    """The environment variables a setting is read from (VITSERVE_PORT, or PORT)."""
    alias = field.validation_alias
    names = alias.choices if isinstance(alias, AliasChoices) else [variable(name)]
    return ", ".join(str(n) for n in names if str(n).isupper())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m service",
        usage="%(prog)s [--help] [--SETTING VALUE ...]",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        argument_default=argparse.SUPPRESS,  # only the flags given reach Settings
    )
    for name, field in setting_fields().items():
        flags = [flag(name), *ALIASES.get(name, ())]
        repeat = " Repeatable, or comma-separated." if name in REPEATABLE else ""
        if SecretStr in typing.get_args(field.annotation):
            repeat += " Prefer the variable: other users can read a flag in the process list."
        help_text = (
            f"{field.description}{repeat} [default: {_shown_default(field)}; "
            f"env: {_variables(name, field)}]"
        ).replace("%", "%%")
        options: dict[str, typing.Any] = {"dest": name, "help": help_text}
        if field.annotation is bool:
            options["action"] = argparse.BooleanOptionalAction
        else:
            options["choices"] = _choices(field)
            if name in REPEATABLE:
                options["action"] = "append"
        parser.add_argument(*flags, **options)
    parser.add_argument(
        LOG_VERBOSE,
        type=int,
        metavar="LEVEL",
        dest="log_verbose",
        help="Triton's verbose logging: a level above 0 is --log-level debug.",
    )
    return parser


def settings_problems(error: ValidationError, given: Sequence[str] = ()) -> list[str]:
    """One line per invalid setting, naming its flag when it was given as one, else its environment
    variable, and never its value (pydantic's own text quotes the input, which for a model-level
    check is every setting, the API key too)."""
    lines = []
    for problem in error.errors(include_url=False, include_input=False, include_context=False):
        location = problem.get("loc") or ()
        message = problem.get("msg", "invalid").removeprefix("Value error, ")
        if location:
            name = str(location[0])  # a field, or the alias it was read from (VITSERVE_PORT)
            where = name if name.isupper() else variable(name)
            if name in given:  # the flag, by each of its names: the user typed one of them
                where = " / ".join([flag(name), *ALIASES.get(name, ())])
            lines.append(f"setting {where}: {message}")
        else:
            lines.append(f"settings: {message}")
    return lines


def parse_settings(argv: list[str] | None = None) -> Settings:
    """The settings from the command line ``argv`` (``sys.argv[1:]`` when None) over the
    environment; ``--help`` prints them all and exits 0; a problem prints its lines on stderr and
    exits 2."""
    arguments = vars(build_parser().parse_args(argv))
    verbose = arguments.pop("log_verbose", None)
    if verbose is not None and verbose > 0 and "log_level" not in arguments:
        arguments["log_level"] = "debug"
    for name in REPEATABLE:
        if name in arguments:
            arguments[name] = ",".join(arguments[name])
    try:
        return Settings(**arguments)
    except ValidationError as error:
        problems = settings_problems(error, given=list(arguments))
    except SettingsError as error:  # a value pydantic-settings could not even read
        problems = [f"settings: {error}"]
    for problem in problems:
        print(f"cannot start: {problem}", file=sys.stderr)
    sys.exit(EXIT_BAD_SETTINGS)
