"""What every group of settings shares: each field is read from its environment variable ``VITSERVE_<NAME>``."""

from __future__ import annotations

from pydantic_settings import BaseSettings, SettingsConfigDict

ENV_PREFIX = "VITSERVE_"


class SettingsGroup(BaseSettings):
    """A group of settings, read from the environment (``VITSERVE_<FIELD>``) unless given as arguments.

    The variables are those of the fields, without the group's name: a setting keeps its variable
    and its flag whichever group it belongs to.
    """

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        extra="ignore",
        protected_namespaces=(),
        validate_default=True,
    )
