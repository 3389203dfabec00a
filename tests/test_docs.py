"""The documentation site (docs/, mkdocs.yml) and the README: the site builds with `mkdocs build --strict` (a
broken link, a missing page or a page left out of the navigation fails), the README fits on a screen with its two
commands first, and every command the pages show still matches the program it names.

What "still matches" checks, per kind of command (each found in a ```bash block or an inline code span):
- `make TARGET ...`: the Makefile has the target; `ARGS="key=value ..."` of `make run` loads with the config.
- `pipelinerl COMMAND ...`: the command exists, and every `--option` shown is one of its parser's options. A
  concrete line with its config (no placeholder such as CONFIG, no [optional] part) is parsed whole by the CLI's
  own parser, and its config with its key=value overrides is loaded (a renamed key fails here).
- `tools/NAME.py ...` / `python tools/...`: the tool exists and every `--option` shown is in its `--help`.
- `sbatch slurm/...` and `bash slurm/...`: cluster-only; the script exists (tests/test_slurm.py runs them).
Nothing here starts a run: the tests that do are the ones named in each page.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = sorted((REPO / "docs").rglob("*.md"))
PLACEHOLDER = re.compile(r"\b[A-Z][A-Z_]{1,}\b|\[|\.\.\.")  # CONFIG, RUN_DIR, [--opt], key=value ...
PREFIXES = ("make ", "pipelinerl ", "tools/", "python tools/", ".venv/bin/python tools/", "sbatch ", "bash slurm/")


def commands() -> list[tuple[str, str]]:
    """(page, command) for every command line in a shell block or an inline code span of the docs and README."""
    found = []
    for path in [REPO / "README.md", *PAGES]:
        text, page = path.read_text(), str(path.relative_to(REPO))
        for block in re.finditer(r"```(?:bash|sh|shell)\n(.*?)```", text, re.S):
            found += [(page, line.split("  #")[0].strip()) for line in block.group(1).splitlines()
                      if line.strip() and not line.lstrip().startswith("#")]
        text = re.sub(r"```.*?```", "", text, flags=re.S)
        found += [(page, " ".join(span.split())) for span in re.findall(r"`([^`]+)`", text)]
    return [(page, cmd) for page, cmd in found if cmd.startswith(PREFIXES)]


def options(cmd: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])(--[a-z][\w-]*)", cmd))


@cache
def make_targets() -> set[str]:
    return set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.M))


@cache
def tool_help(script: str) -> str:
    out = subprocess.run([sys.executable, script, "--help"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"{script} --help failed: {out.stderr[-500:]}"
    return out.stdout


def cli_options(words: list[str]) -> tuple[set[str], str]:
    """The options of `pipelinerl WORDS...` (the deepest subcommand WORDS name) and that subcommand's path."""
    import argparse

    from pipelinerl.cli import build_parser
    from pipelinerl.launch.slurm_cli import _parser as slurm_parser

    parser, path = build_parser(), []
    if words[:1] == ["slurm"]:
        parser, path, words = slurm_parser(), ["slurm"], words[1:]
    for word in words:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or word not in subs[0].choices:
            break
        parser, path = subs[0].choices[word], [*path, word]
    return {o for a in parser._actions for o in a.option_strings}, " ".join(path)


def check_config(config: str, overrides: list[str]) -> None:
    from pipelinerl.config import load_config

    load_config(REPO / config, overrides)


def check(cmd: str) -> None:
    words = shlex.split(cmd.replace("\\|", "|"))
    if words[0] == "make":
        assert words[1] in make_targets(), f"no make target {words[1]!r}"
        args = next((w.split("=", 1)[1] for w in words[2:] if w.startswith("ARGS=")), "")
        if words[1] == "run" and "=" in args and not args.startswith("-"):
            check_config("configs/tiny_cpu.yaml", args.split())
    elif words[0] in ("sbatch", "bash"):
        script = next(w for w in words[1:] if w.startswith("slurm/"))
        assert (REPO / script).is_file(), f"no {script}"
    elif words[0] == "pipelinerl":
        known, path = cli_options(words[1:])
        assert path or words[1].startswith("--"), f"no command `pipelinerl {words[1]}`"
        unknown = options(cmd) - known - {"--help", "--version"}
        assert not unknown, f"`pipelinerl {path}` has no option {sorted(unknown)}"
        if not PLACEHOLDER.search(cmd) and path in ("run", "show-config", "plan") and len(words) > 2:
            from pipelinerl.cli import parse_args

            args = parse_args(words[1:])
            check_config(args.config, args.overrides)
    else:
        script = next(w for w in words if w.startswith("tools/"))
        assert (REPO / script).is_file(), f"no {script}"
        if script.endswith(".py"):
            unknown = {o for o in options(cmd) if not re.search(rf"(?<![\w-]){re.escape(o)}\b", tool_help(script))}
            assert not unknown, f"{script} has no option {sorted(unknown)}"


def test_the_site_builds_strictly(tmp_path):
    """mkdocs build --strict: every page in the navigation exists, every link and anchor resolves, and no page
    under docs/ is left out of the navigation."""
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "not included in the \"nav\"" not in out.stderr, out.stderr[-2000:]
    assert (tmp_path / "site" / "reference" / "config" / "index.html").is_file()


def test_the_readme_fits_on_a_screen_with_its_two_commands_first():
    text = (REPO / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    first_block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    assert [line.split()[:2] for line in first_block.splitlines()] == [["make", "run"], ["make", "test"]]
    for link in re.findall(r"\]\((docs/[^)#]+)", text):
        assert (REPO / link).is_file(), f"README links to a missing page {link}"


@pytest.mark.parametrize("page,cmd", commands(), ids=[f"{page}: {cmd[:60]}" for page, cmd in commands()])
def test_a_command_in_the_docs_matches_its_program(page, cmd):
    check(cmd)


def test_the_command_check_fails_on_a_stale_command():
    """The checks above can fail: a make target, a pipelinerl option, a config key and a tool option that do not
    exist are each refused."""
    from pipelinerl.config import ConfigError

    for stale in ("make deploy", "pipelinerl serve CONFIG --gpus 2", "tools/sweep.py CONFIG --no-such-option",
                  "pipelinerl nosuch CONFIG"):
        with pytest.raises(AssertionError):
            check(stale)
    with pytest.raises(ConfigError):
        check("pipelinerl run configs/tiny_cpu.yaml trainer.no_such_key=1")
    assert len(commands()) > 50  # the extraction finds the pages' commands
