"""``dbfanout.toml``: the ``[app]`` section, the pollers, and one section type per source kind.

- :mod:`shared.config.app`: :class:`AppConfig`, :class:`Config` (pollers by queue and topic, the
  app's connections);
- :mod:`shared.config.poller`: :class:`PollerConfig` (every field's default is written there, once);
- :mod:`shared.config.sections`: the keys and checks of each kind (keyset, outbox, pg_logical,
  mysql_binlog);
- :mod:`shared.config.parse`: reading the file, the keys every poller has, cross-poller checks;
- :mod:`shared.config.fields`: typed readers, "did you mean" for unknown keys, ``${NAME}`` expansion.
"""

from shared.config.app import AppConfig, Config, ConnectionRole
from shared.config.fields import expand_refs, missing_setting_error
from shared.config.parse import CONFIG_SETTING, DEFAULT_CONFIG_NAME, config_path, load_config, parse_config
from shared.config.poller import (
    DEFAULT_LEASE_TTL_SECONDS,
    Cardinality,
    NullCursorPolicy,
    OnLostPosition,
    OversizePolicy,
    PollerConfig,
    Snapshot,
    SourceKind,
    SubscriptionConfig,
    Transport,
    Wake,
)
from shared.config.sections import LOG_POSITION_KINDS, SECTIONS, Section

__all__ = [
    "CONFIG_SETTING",
    "DEFAULT_CONFIG_NAME",
    "DEFAULT_LEASE_TTL_SECONDS",
    "LOG_POSITION_KINDS",
    "SECTIONS",
    "AppConfig",
    "Cardinality",
    "Config",
    "ConnectionRole",
    "NullCursorPolicy",
    "OnLostPosition",
    "OversizePolicy",
    "PollerConfig",
    "Section",
    "Snapshot",
    "SourceKind",
    "SubscriptionConfig",
    "Transport",
    "Wake",
    "config_path",
    "expand_refs",
    "load_config",
    "missing_setting_error",
    "parse_config",
]
