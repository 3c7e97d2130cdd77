"""The settings' environment variables and flags are the ones users and deployments already use, and
each group of ``service/settings/`` reads its own.

The reference below is the data as it stood before the settings were grouped (commit bca3fe6, one flat
class): a setting that moves between groups keeps its names, and a name that changes fails here.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import SecretStr

from service.launcher.cli import build_parser, parse_settings
from service.settings import GROUPS, Settings

# setting: (its group, the environment variables it is read from, an example value as the variable
# gives it, the value it parses to).
REFERENCE: dict[str, tuple[str, tuple[str, ...], str, object]] = {
    "model_repository": (
        "repository",
        ("VITSERVE_MODEL_REPOSITORY",),
        "/srv/models",
        Path("/srv/models"),
    ),
    "models": ("repository", ("VITSERVE_MODELS",), "a,b", "a,b"),
    "model_name": ("repository", ("VITSERVE_MODEL_NAME",), "tiny", "tiny"),
    "model_version": ("repository", ("VITSERVE_MODEL_VERSION",), "3", 3),
    "model_control": ("repository", ("VITSERVE_MODEL_CONTROL",), "poll", "poll"),
    "repository_poll_s": ("repository", ("VITSERVE_REPOSITORY_POLL_S",), "2.5", 2.5),
    "max_batch_size": ("batching", ("VITSERVE_MAX_BATCH_SIZE",), "4", 4),
    "max_queue_delay_ms": ("batching", ("VITSERVE_MAX_QUEUE_DELAY_MS",), "7.5", 7.5),
    "max_queue_size": ("batching", ("VITSERVE_MAX_QUEUE_SIZE",), "128", 128),
    "request_timeout_s": ("batching", ("VITSERVE_REQUEST_TIMEOUT_S",), "9.0", 9.0),
    "instance_count": ("batching", ("VITSERVE_INSTANCE_COUNT",), "2", 2),
    "attention_max_batch_size": ("batching", ("VITSERVE_ATTENTION_MAX_BATCH_SIZE",), "3", 3),
    "idle_dispatch": ("batching", ("VITSERVE_IDLE_DISPATCH",), "false", False),
    "provider": ("runtime", ("VITSERVE_PROVIDER",), "cpu", "cpu"),
    "cuda_device_id": ("runtime", ("VITSERVE_CUDA_DEVICE_ID",), "1", 1),
    "cudnn_conv_algo_search": (
        "runtime",
        ("VITSERVE_CUDNN_CONV_ALGO_SEARCH",),
        "EXHAUSTIVE",
        "EXHAUSTIVE",
    ),
    "cuda_mem_limit_bytes": ("runtime", ("VITSERVE_CUDA_MEM_LIMIT_BYTES",), "1048576", 1048576),
    "intra_op_threads": ("runtime", ("VITSERVE_INTRA_OP_THREADS",), "3", 3),
    "inter_op_threads": ("runtime", ("VITSERVE_INTER_OP_THREADS",), "2", 2),
    "allow_spinning": ("runtime", ("VITSERVE_ALLOW_SPINNING",), "true", True),
    "max_body_bytes": ("limits", ("VITSERVE_MAX_BODY_BYTES",), "2048", 2048),
    "max_images_per_request": ("limits", ("VITSERVE_MAX_IMAGES_PER_REQUEST",), "5", 5),
    "max_pixels_per_image": ("limits", ("VITSERVE_MAX_PIXELS_PER_IMAGE",), "1000", 1000),
    "max_pixels_per_request": ("limits", ("VITSERVE_MAX_PIXELS_PER_REQUEST",), "4000", 4000),
    "max_json_values": ("limits", ("VITSERVE_MAX_JSON_VALUES",), "4096", 4096),
    "jpeg_draft": ("limits", ("VITSERVE_JPEG_DRAFT",), "false", False),
    "max_concurrent_decodes": ("limits", ("VITSERVE_MAX_CONCURRENT_DECODES",), "3", 3),
    "max_decode_waiters": ("limits", ("VITSERVE_MAX_DECODE_WAITERS",), "7", 7),
    "decode_wait_timeout_s": ("limits", ("VITSERVE_DECODE_WAIT_TIMEOUT_S",), "1.5", 1.5),
    "retry_after_s": ("limits", ("VITSERVE_RETRY_AFTER_S",), "4", 4),
    "host": ("server", ("VITSERVE_HOST",), "0.0.0.0", "0.0.0.0"),
    "port": ("server", ("VITSERVE_PORT", "PORT"), "9100", 9100),
    "grpc_port": ("server", ("VITSERVE_GRPC_PORT",), "9200", 9200),
    "health_port": ("server", ("VITSERVE_HEALTH_PORT",), "9300", 9300),
    "api_key": ("server", ("VITSERVE_API_KEY",), "a-key", "a-key"),
    "cors_origins": (
        "server",
        ("VITSERVE_CORS_ORIGINS",),
        "https://a.example",
        "https://a.example",
    ),
    "docs": ("server", ("VITSERVE_DOCS",), "false", False),
    "log_level": ("server", ("VITSERVE_LOG_LEVEL",), "debug", "debug"),
    "log_format": ("server", ("VITSERVE_LOG_FORMAT",), "json", "json"),
    "access_log": ("server", ("VITSERVE_ACCESS_LOG",), "true", True),
    "header_timeout_s": ("server", ("VITSERVE_HEADER_TIMEOUT_S",), "12.0", 12.0),
    "body_timeout_s": ("server", ("VITSERVE_BODY_TIMEOUT_S",), "13.0", 13.0),
    "body_min_bytes_per_s": ("server", ("VITSERVE_BODY_MIN_BYTES_PER_S",), "2000", 2000),
    "max_connections": ("server", ("VITSERVE_MAX_CONNECTIONS",), "40", 40),
    "max_header_bytes": ("server", ("VITSERVE_MAX_HEADER_BYTES",), "2048", 2048),
    "max_header_count": ("server", ("VITSERVE_MAX_HEADER_COUNT",), "20", 20),
    "graceful_shutdown_s": ("server", ("VITSERVE_GRACEFUL_SHUTDOWN_S",), "5.0", 5.0),
    "workers": ("link", ("VITSERVE_WORKERS",), "3", 3),
    "arena_mib": ("link", ("VITSERVE_ARENA_MIB",), "8", 8),
}

# Every option string of `python -m service` at bca3fe6: each setting's flag, Triton's and
# uvicorn's names for some, the --no- forms of the switches, --log-verbose and help.
FLAGS = {
    "-h", "--help", "--log-verbose",
    "--model-repository", "--models", "--load-model", "--model-name", "--model-version",
    "--model-control", "--model-control-mode", "--repository-poll-s", "--repository-poll-secs",
    "--max-batch-size", "--max-queue-delay-ms", "--max-queue-size", "--request-timeout-s",
    "--instance-count", "--retry-after-s", "--attention-max-batch-size",
    "--provider", "--cuda-device-id", "--cudnn-conv-algo-search", "--cuda-mem-limit-bytes",
    "--intra-op-threads", "--inter-op-threads", "--allow-spinning", "--no-allow-spinning",
    "--max-body-bytes", "--jpeg-draft", "--no-jpeg-draft", "--max-images-per-request", "--max-pixels-per-image", "--max-json-values",
    "--max-concurrent-decodes", "--max-decode-waiters", "--decode-wait-timeout-s",
    "--max-pixels-per-request",
    "--api-key", "--log-level", "--host", "--port", "--http-port", "--idle-dispatch",
    "--no-idle-dispatch", "--workers", "--arena-mib", "--header-timeout-s", "--body-timeout-s",
    "--body-min-bytes-per-s", "--max-connections", "--limit-concurrency", "--max-header-bytes",
    "--max-header-count", "--health-port", "--docs", "--no-docs", "--grpc-port", "--log-format",
    "--cors-origins", "--graceful-shutdown-s", "--exit-timeout-secs", "--access-log",
    "--no-access-log",
}  # fmt: skip


@pytest.fixture
def clean_environment(monkeypatch):
    """No setting from the caller's environment: only what each test sets."""
    for name in [*REFERENCE_VARIABLES, "PORT"]:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


REFERENCE_VARIABLES = sorted({name for _, names, _, _ in REFERENCE.values() for name in names})


def read(settings: Settings, name: str) -> object:
    value = getattr(getattr(settings, REFERENCE[name][0]), name)
    return value.get_secret_value() if isinstance(value, SecretStr) else value


def test_the_command_line_has_the_same_flags():
    options = {option for action in build_parser()._actions for option in action.option_strings}
    assert options == FLAGS


def test_help_names_each_settings_variables():
    """--help's "env:" for each setting lists the variables it is read from, as before."""
    helps = {action.dest: action.help for action in build_parser()._actions}
    assert set(REFERENCE) <= set(helps)
    for name, (_, variables, _, _) in REFERENCE.items():
        assert f"env: {', '.join(variables)}]" in helps[name], name
    assert set(helps) - set(REFERENCE) == {"help", "log_verbose"}  # no setting more, none less


@pytest.mark.parametrize("name", list(REFERENCE))
def test_each_group_reads_its_variables(clean_environment, name):
    group, variables, text, value = REFERENCE[name]
    for variable in variables:
        clean_environment.setenv(variable, text)
        assert read(Settings(), name) == value, variable
        alone = getattr(
            GROUPS[group](), name
        )  # the group alone reads it: a component given its group
        assert (alone.get_secret_value() if isinstance(alone, SecretStr) else alone) == value
        clean_environment.delenv(variable)
    assert read(Settings(), name) != value  # the example is not the default: the variable did it


@pytest.mark.parametrize("name", list(REFERENCE))
def test_each_flag_lands_in_its_group(clean_environment, name):
    _, _, text, value = REFERENCE[name]
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        argv = [flag if value else "--no-" + name.replace("_", "-")]
    else:
        argv = [flag, text]
    assert read(parse_settings(argv), name) == value
