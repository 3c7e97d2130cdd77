"""Service settings, grouped by the component that reads them; every knob is an environment variable
``VITSERVE_<NAME>`` and a flag ``--<name>`` (service/launcher/cli.py).

``Settings`` holds one group per owner: ``repository`` (the model manager), ``batching`` (the
batcher), ``runtime`` (onnxruntime's sessions), ``limits`` (what a request may carry), ``server``
(HTTP, gRPC, access, logs, health, shutdown) and ``link`` (the front-end processes and their shared
memory). A component is given its group; the names of the variables and flags are the fields' own,
without the group's, so moving a setting between groups changes neither.

``Settings(max_batch_size=4, port=9000)`` takes the settings by their flat names (as the command line
gives them) and puts each in its group; the rest come from the environment.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator
from pydantic.fields import FieldInfo

from service.settings.batching import BatchingSettings
from service.settings.group import ENV_PREFIX, SettingsGroup
from service.settings.limits import LimitSettings
from service.settings.link import LinkSettings
from service.settings.repository import RepositorySettings
from service.settings.runtime import RuntimeSettings
from service.settings.server import ServerSettings

# Each group's attribute on Settings, and its class, in the order --help lists them.
GROUPS: dict[str, type[SettingsGroup]] = {
    "repository": RepositorySettings,
    "batching": BatchingSettings,
    "runtime": RuntimeSettings,
    "limits": LimitSettings,
    "server": ServerSettings,
    "link": LinkSettings,
}


def setting_fields() -> dict[str, FieldInfo]:
    """Every setting by its flat name (``max_batch_size``), over all groups, in --help's order."""
    return {name: field for group in GROUPS.values() for name, field in group.model_fields.items()}


def group_of(name: str) -> str:
    """The group a setting belongs to: ``group_of("max_batch_size") == "batching"``."""
    for group, cls in GROUPS.items():
        if name in cls.model_fields:
            return group
    raise KeyError(f"no setting is named {name!r}")


def _by_group(values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Flat settings (and whole groups, by the group's name) sorted into their groups."""
    grouped: dict[str, dict[str, Any]] = {group: {} for group in GROUPS}
    unknown = []
    for name, value in values.items():
        if name in GROUPS:
            grouped[name] = value
            continue
        try:
            grouped[group_of(name)][name] = value
        except KeyError:
            unknown.append(name)
    if unknown:
        raise TypeError(f"unknown settings: {', '.join(sorted(unknown))}")
    return grouped


class Settings(BaseModel):
    """The configuration of the vitserve inference service: one group of settings per component."""

    model_config = ConfigDict(protected_namespaces=())

    repository: RepositorySettings
    batching: BatchingSettings
    runtime: RuntimeSettings
    limits: LimitSettings
    server: ServerSettings
    link: LinkSettings

    def __init__(self, **values: Any) -> None:
        groups: dict[str, SettingsGroup] = {}
        problems: list[Any] = []
        for group, given in _by_group(values).items():
            if isinstance(given, SettingsGroup):
                groups[group] = given
                continue
            try:  # each group reads the environment for what is not given
                groups[group] = GROUPS[group](**given)
            except ValidationError as error:
                problems.extend(error.errors())
        if problems:  # every invalid setting at once, as one flat class would report them
            raise ValidationError.from_exception_data(type(self).__name__, problems)
        super().__init__(**groups)

    @model_validator(mode="after")
    def _queue_holds_a_request(self) -> Settings:
        queue, request = self.batching.max_queue_size, self.limits.max_images_per_request
        if queue is not None and queue < request:
            raise ValueError(
                f"max_queue_size ({queue}) must be at least max_images_per_request "
                f"({request}), or a full-sized request could never be queued"
            )
        return self

    def model_copy(self, *, update: dict[str, Any] | None = None, deep: bool = False) -> Settings:
        """A copy with ``update``'s settings (flat names, or whole groups) changed, unvalidated as
        pydantic's own; every group is copied, so changing the copy never changes this one."""
        grouped = _by_group(update or {})
        copies: dict[str, Any] = {}
        for group, changes in grouped.items():
            if isinstance(changes, SettingsGroup):
                copies[group] = changes
            else:
                copies[group] = getattr(self, group).model_copy(update=changes or None, deep=deep)
        return super().model_copy(update=copies, deep=deep)


__all__ = [
    "ENV_PREFIX",
    "GROUPS",
    "BatchingSettings",
    "LimitSettings",
    "LinkSettings",
    "RepositorySettings",
    "RuntimeSettings",
    "ServerSettings",
    "Settings",
    "group_of",
    "setting_fields",
]
