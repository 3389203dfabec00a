"""Loading: a YAML file merged with `key=value` overrides into a validated `Config`."""

from __future__ import annotations

import dataclasses
import difflib
from pathlib import Path

from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from pipelinerl.config.fields import ConfigError, section_schema
from pipelinerl.config.root import Config


def _all_keys(schema: type, prefix: str = "") -> list[str]:
    """Every dotted key of a structured config section (for 'did you mean' hints)."""
    keys = []
    for f in dataclasses.fields(schema):
        keys.append(prefix + f.name)
        if section_schema(f) is not None:
            keys.extend(_all_keys(section_schema(f), f"{prefix}{f.name}."))
    return keys


def _unknown_key_error(key: str) -> ConfigError:
    close = difflib.get_close_matches(key, _all_keys(Config), n=1)
    hint = f"; did you mean `{close[0]}`?" if close else "; `pipelinerl show-config` lists the valid keys"
    return ConfigError(f"config: unknown key `{key}`{hint}")


def _omegaconf_error(err: OmegaConfBaseException) -> ConfigError:
    key = getattr(err, "full_key", None) or "?"
    if isinstance(err, ConfigKeyError):
        return _unknown_key_error(key)
    if isinstance(err, ValidationError):
        return ConfigError(f"config `{key}`: {err.msg.splitlines()[0]}")
    return ConfigError(f"config `{key}`: {err}")


def load_config(path: str | Path | None = None, overrides: tuple[str, ...] | list[str] = ()) -> Config:
    """YAML file (optional) + `key=value` overrides -> validated Config. Errors are ConfigError."""
    schema = OmegaConf.structured(Config)
    layers = []
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        layers.append(OmegaConf.load(path))
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override {item!r} is not of the form key=value (e.g. trainer.lr=1e-5)")
    if overrides:
        layers.append(OmegaConf.from_dotlist(list(overrides)))
    try:
        merged = OmegaConf.merge(schema, *layers)
        missing = sorted(OmegaConf.missing_keys(merged))
        if missing:
            raise ConfigError(f"config: required key(s) {', '.join(f'`{k}`' for k in missing)} not set; "
                              "set them in the YAML file or as key=value overrides")
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise _omegaconf_error(err) from None
