"""Writing a `Config` out: plain YAML (`show-config`, RUN_DIR/config.yaml) and YAML with each field's
documentation as comments (`show-config --doc`), which parses to the same data."""

from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf

from pipelinerl.atomic import write_file
from pipelinerl.config.fields import field_doc, section_schema
from pipelinerl.config.root import Config

DOC_WIDTH = 120  # a field's comment goes after its value if the line fits, else wrapped above it
DOC_HEADER = "# Resolved config. Each comment: [unit] meaning; null = what null means for that field.\n"


def to_yaml(cfg: Config) -> str:
    """The resolved config as YAML (what `show-config` prints and the launcher writes to RUN_DIR)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def save_config(cfg: Config, path: str | Path) -> None:
    """Write the resolved config atomically (temporary file + rename)."""
    write_file(path, to_yaml(cfg))


def to_doc_yaml(cfg: Config) -> str:
    """`to_yaml(cfg)` with every field's unit and meaning as a YAML comment (same data when parsed)."""
    data = OmegaConf.to_container(OmegaConf.structured(cfg))
    return DOC_HEADER + "".join(line + "\n" for line in _doc_lines(Config, data, indent=0))


def _doc_lines(schema: type, data: dict[str, Any], indent: int) -> list[str]:
    pad = " " * indent
    lines = []
    for f in dataclasses.fields(schema):
        comment = field_doc(f).comment()
        sub = section_schema(f)
        if sub is not None:
            head, body = f"{pad}{f.name}:", _doc_lines(sub, data[f.name], indent + 2)
        else:
            # No line folding: a scalar ends on its first line, so a trailing comment cannot cut it.
            text = yaml.safe_dump({f.name: data[f.name]}, default_flow_style=False, width=float("inf"),
                                  sort_keys=False)
            head, *rest = (pad + line for line in text.rstrip("\n").split("\n"))
            body = rest
        if len(head) + 4 + len(comment) <= DOC_WIDTH:
            lines.append(f"{head}  # {comment}")
        else:
            lines.extend(textwrap.wrap(comment, DOC_WIDTH, initial_indent=pad + "# ", subsequent_indent=pad + "# ",
                                       break_on_hyphens=False))
            lines.append(head)
        lines.extend(body)
    return lines
