"""How a config field is declared (`doc`, `section`) and how a bad value is reported (`check*`).

A field carries its meaning, unit and the meaning of `null` in its dataclass metadata, so the
documentation lives where the field is declared and `pipelinerl show-config --doc` can print it:

    lr: float = doc(1e-6, "peak learning rate after warm-up")
    max_lag: int | None = doc(None, "bound on ...", unit="versions", null="no bound")
"""

from __future__ import annotations

import copy
import dataclasses
import re
from typing import Any


class ConfigError(ValueError):
    """A bad config file, key, value or override: the message names the key and how to fix it."""


@dataclasses.dataclass(frozen=True)
class FieldDoc:
    """What a field means (`meaning`), in which unit, and what `null` means (for optional fields)."""

    meaning: str
    unit: str | None = None
    null: str | None = None

    def comment(self) -> str:
        """One line: `[unit] meaning; null = ...`."""
        text = f"[{self.unit}] {self.meaning}" if self.unit else self.meaning
        return f"{text}; null = {self.null}" if self.null else text


DOC_KEY = "pipelinerl_doc"  # the dataclasses field metadata key holding a FieldDoc


def doc(default: Any, meaning: str, *, unit: str | None = None, null: str | None = None) -> Any:
    """A documented field. A list or dict default is copied for each instance (dataclasses refuse
    mutable defaults)."""
    metadata = {DOC_KEY: FieldDoc(meaning, unit, null)}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def section(schema: type, meaning: str | None = None) -> Any:
    """A nested section; documented by `meaning`, else by the first sentence of the class's docstring."""
    paragraph = " ".join((schema.__doc__ or "").strip().split("\n\n")[0].split())
    meaning = meaning or re.split(r"(?<!\be\.g)(?<!\bi\.e)\.(\s|$)", paragraph, maxsplit=1)[0]  # not at e.g. or i.e.
    return dataclasses.field(default_factory=schema, metadata={DOC_KEY: FieldDoc(meaning)})


def field_doc(f: dataclasses.Field) -> FieldDoc | None:
    return f.metadata.get(DOC_KEY)


def section_schema(f: dataclasses.Field) -> type | None:
    """The section class of a `section(...)` field; None for a plain field."""
    return f.default_factory if dataclasses.is_dataclass(f.default_factory) else None


def check(ok: bool, key: str, message: str) -> None:
    """Raise the user-facing error for a bad field: names the key and says how to fix it."""
    if not ok:
        raise ConfigError(f"config `{key}`: {message}")


def check_choice(value: Any, choices: tuple, key: str) -> None:
    check(value in choices, key, f"got {value!r}; choose one of {', '.join(map(repr, choices))}")


def check_positive(value: float | None, key: str, allow_null: bool = False) -> None:
    if value is None:
        check(allow_null, key, "must be set (null is not allowed here)")
        return
    check(value > 0, key, f"got {value!r}; must be > 0")
