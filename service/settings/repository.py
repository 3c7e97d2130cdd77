"""The model repository, and which of its models and versions are served: the model manager's settings."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator

from service.settings.group import SettingsGroup


class RepositorySettings(SettingsGroup):
    """Where the models are, which are loaded, which one is the default, and how the repository is followed."""

    model_repository: Path = Field(
        default=Path("models"),
        description="Directory of the model repository (layout of docs/model-repository.md).",
    )
    models: str | None = Field(
        default=None,
        description=(
            "Comma-separated names of the models to load at start-up, '*' for every model in the "
            "repository; unset: every model, except in 'explicit' model control, where none is "
            "loaded until asked (as Triton's --load-model). Outside 'explicit' mode the models "
            "not named are not served."
        ),
    )
    model_name: str | None = Field(
        default=None,
        min_length=1,
        description=(
            "The default model, served by /predict and /attention; unset: the only model, or the "
            "first by name."
        ),
    )
    model_version: int | None = Field(
        default=None,
        ge=1,
        description=(
            "Pin the default model to this version (overrides its version_policy); unset follows "
            "the policy (by default the highest version)."
        ),
    )
    model_control: Literal["none", "poll", "explicit"] = Field(
        default="none",
        description=(
            "Model control mode, as Triton's: 'none' loads at start-up only; 'poll' also follows the "
            "repository (new, changed and removed versions) every repository_poll_s; 'explicit' loads "
            "and unloads on POST /v2/repository/models/{name}/load|unload."
        ),
    )
    repository_poll_s: float = Field(
        default=5.0,
        gt=0.0,
        le=3600.0,
        description="Seconds between two scans of the repository in 'poll' mode.",
    )

    @field_validator("models")
    @classmethod
    def _every_model_is_alone(cls, value: str | None) -> str | None:
        names = [name.strip() for name in (value or "").split(",") if name.strip()]
        if "*" in names and len(names) > 1:
            raise ValueError(
                "'*' (every model) cannot be combined with model names, as in Triton's --load-model"
            )
        return value

    @property
    def model_list(self) -> list[str]:
        """The names in ``models`` (none for '*')."""
        names = [name.strip() for name in (self.models or "").split(",") if name.strip()]
        return [] if names == ["*"] else names

    @property
    def loads_every_model(self) -> bool:
        """Whether start-up loads every model of the repository: ``models`` is '*', or unset
        outside 'explicit' model control (where, as in Triton's, an unset list loads none)."""
        if self.models is None or not self.models.strip():
            return self.model_control != "explicit"
        return not self.model_list
