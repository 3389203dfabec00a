"""tools/gen_reference.py: the committed reference pages (docs/reference/) are what the code generates, they name
every config field and command, a field added without regenerating fails the check, and table cells are escaped.
No server starts: the routes are read from the source."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from pipelinerl.cli import build_parser
from pipelinerl.config import Config, TrainerConfig
from pipelinerl.config.fields import doc, section
from pipelinerl.launch import slurm_cli

REPO = Path(__file__).resolve().parent.parent
PAGES = REPO / "docs" / "reference"

spec = importlib.util.spec_from_file_location("gen_reference", REPO / "tools" / "gen_reference.py")
gen = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # its dataclasses look the module up
spec.loader.exec_module(gen)


def leaf_keys(schema: type, prefix: str = "") -> list[str]:
    """Dotted keys of every plain field, by the fields' resolved types (not by the generator's section test)."""
    hints = typing.get_type_hints(schema)
    keys = []
    for f in dataclasses.fields(schema):
        if dataclasses.is_dataclass(hints[f.name]):
            keys += leaf_keys(hints[f.name], f"{prefix}{f.name}.")
        else:
            keys.append(prefix + f.name)
    return keys


def command_paths(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    paths = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                paths += [(*prefix, name), *command_paths(sub, (*prefix, name))]
    return paths


def columns(row: str) -> list[str]:
    """A table row's cells, split at the pipes that are not escaped."""
    return [c.strip() for c in re.split(r"(?<!\\)\|", row.strip())[1:-1]]


def test_the_committed_pages_are_what_the_code_generates():
    """The CLI itself, in a process of its own (the check CI runs)."""
    out = subprocess.run([sys.executable, "tools/gen_reference.py", "--check"], cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, f"run python tools/gen_reference.py: {out.stderr}"


def test_the_config_page_names_every_leaf_field():
    text = (PAGES / "config.md").read_text()
    keys = leaf_keys(Config)
    assert len(keys) > 100 and "actor.sampling.temperature" in keys and "run_dir" in keys
    assert [k for k in keys if f"| `{k}` |" not in text] == []


def test_the_cli_page_has_a_section_per_command_and_subcommand():
    headings = set(re.findall(r"^#{2,3} (.+)$", (PAGES / "cli.md").read_text(), re.M))
    paths = command_paths(build_parser()) + [("slurm", *p) for p in command_paths(slurm_cli._parser())]
    assert ("streams", "inspect") in paths and ("slurm", "launch") in paths
    assert [p for p in paths if f"pipelinerl {' '.join(p)}" not in headings] == []


def test_the_http_page_lists_the_servers_routes_each_described():
    text = (PAGES / "http.md").read_text()
    rows = [columns(line) for line in text.splitlines() if line.startswith("| POST") or line.startswith("| GET")]
    found = {(method, path.strip("`")) for method, path, _ in rows}
    assert {("POST", "/init_process_group"), ("POST", "/request_weight_update"), ("POST", "/hold"),
            ("POST", "/release"), ("GET", "/status"), ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
            ("POST", "/rl/reward")} <= found
    assert [row for row in rows if not row[2]] == []  # every handler has a docstring


@dataclasses.dataclass
class TrainerPlus(TrainerConfig):
    warmup_shape: str = doc("cosine", "a field added without regenerating the page", unit="steps")


@dataclasses.dataclass
class ConfigPlus(Config):
    trainer: TrainerPlus = section(TrainerPlus, "the trainer, one field more")


def test_a_field_added_without_regenerating_fails_the_check(monkeypatch, capsys):
    committed = (PAGES / "config.md").read_text()
    page = gen.config_page(ConfigPlus)
    assert "| `trainer.warmup_shape` | `cosine` | steps | a field added without regenerating the page |" in page
    assert page != committed
    monkeypatch.setattr(gen, "pages", lambda: {PAGES / "config.md": page})
    assert gen.main(["--check"]) == 1
    assert "docs/reference/config.md is out of date" in capsys.readouterr().err
    assert (PAGES / "config.md").read_text() == committed  # --check writes nothing


def test_a_field_without_documentation_is_refused():
    bare = dataclasses.make_dataclass("Bare", [("knob", int, dataclasses.field(default=1))])
    with pytest.raises(ValueError, match="`knob` has no documentation"):
        gen.config_page(bare)


def test_a_pipe_in_a_cell_is_escaped_and_keeps_the_row_s_columns():
    row = gen.table(("key", "meaning"), [("`a|b`", "keep | recompute, *not* <name>")])[2]
    assert columns(row) == ["<code>a&#124;b</code>", r"keep \| recompute, \*not\* &lt;name&gt;"]
    mode = next(line for line in (PAGES / "config.md").read_text().splitlines() if line.startswith("| `mode` |"))
    assert len(columns(mode)) == 4 and r"\| conventional" in mode


def test_routes_are_read_from_literal_loops_decorators_and_annotated_operations(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "app.py").write_text('''"""A test server."""


class Ops:
    def alpha(self):
        """Alpha does it.

        Not this paragraph."""

    def beta(self):
        """Beta does it."""


def build(ops: Ops, router):
    """The routes."""
    for path, op in (("/a", ops.alpha), ("/b", ops.beta)):
        router.add_api_route(path, wrap(op), methods=["POST", "PUT"])

    @router.get("/c")
    async def see():
        """C is seen."""
''')
    page = gen.http_page(tmp_path / "pkg")
    assert "## pkg/app.py\n\nA test server.\n\n### build\n\nThe routes." in page
    rows = [columns(line) for line in page.splitlines() if re.match(r"\| [A-Z]+ \|", line)]
    assert rows == [["POST", "`/a`", "Alpha does it."], ["PUT", "`/a`", "Alpha does it."],
                    ["POST", "`/b`", "Beta does it."], ["PUT", "`/b`", "Beta does it."], ["GET", "`/c`", "C is seen."]]
