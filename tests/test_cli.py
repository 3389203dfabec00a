"""The `pipelinerl` command line: entry points, argument conventions, error reporting, log lines."""

import argparse
import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipelinerl.cli import build_parser, parse_args

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "configs" / "tiny_cpu.yaml"
ROLE_COMMANDS = ("show-config", "serve", "openenv-serve", "train", "actor", "run")  # each takes CONFIG [key=value ...]


def _run(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, check=False, **kwargs)


def _subparsers(parser: argparse.ArgumentParser, prefix: str = ""):
    """(command path, parser) of every (nested) subcommand."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield f"{prefix}{name}", sub
                yield from _subparsers(sub, f"{prefix}{name} ")


def test_python_dash_m_pipelinerl_and_version():
    out = _run("-m", "pipelinerl", "--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"pipelinerl {importlib.metadata.version('pipelinerl')}"
    help_out = _run("-m", "pipelinerl", "--help")
    assert help_out.returncode == 0 and "show-config" in help_out.stdout and "--version" in help_out.stdout


def test_every_positional_has_help_and_role_commands_take_config_alike():
    parser = build_parser()
    commands = dict(_subparsers(parser))
    assert set(ROLE_COMMANDS) <= set(commands)
    for path, sub in [("", parser), *commands.items()]:
        for action in sub._actions:
            if not action.option_strings:
                assert action.help, f"`pipelinerl {path}`: positional {action.dest!r} has no help"
    for name in ROLE_COMMANDS:
        positionals = [a for a in commands[name]._actions if not a.option_strings]
        assert [(a.dest, a.metavar) for a in positionals] == [("config", "CONFIG"), ("overrides", "key=value")], name


def test_overrides_before_and_after_options():
    args = parse_args(["serve", str(TINY), "run_dir=a", "--port", "9000", "--version", "3", "model.dtype=float32"])
    assert (args.config, args.port, args.version) == (str(TINY), 9000, 3)  # `serve --version` is the policy's
    assert args.overrides == ["run_dir=a", "model.dtype=float32"]
    args = parse_args(["show-config", "--doc", str(TINY), "trainer.lr=1"])
    assert args.doc and args.overrides == ["trainer.lr=1"]
    args = parse_args(["train", str(TINY), "--nproc", "2", "a=1", "b=2"])
    assert args.nproc == 2 and args.overrides == ["a=1", "b=2"]


def test_serve_kinds_are_exclusive_and_only_policy_kinds_take_a_version(monkeypatch, capsys):
    """`serve --eval` is a policy server that only evaluates: it takes --version like `serve`; a frozen kind
    (--reference, --reward) refuses it, and two kinds at once are refused by the parser."""
    import pipelinerl.inference.server
    from pipelinerl.config import ConfigError

    served = []
    monkeypatch.setattr(pipelinerl.inference.server, "serve",
                        lambda cfg, port, version, kind: served.append((cfg.run_dir, port, version, kind)))
    for flags, kind in (([], "policy"), (["--eval"], "eval")):
        args = parse_args(["serve", str(TINY), *flags, "--model", "m", "--version", "3", "--port", "9001", "run_dir=r"])
        args.func(args)
        assert served.pop() == ("r", 9001, 3, kind)
    args = parse_args(["serve", str(TINY), "--reward", "--version", "3"])
    with pytest.raises(ConfigError, match="a reward server serves a frozen model: drop --version"):
        args.func(args)
    with pytest.raises(SystemExit) as err:
        parse_args(["serve", str(TINY), "--eval", "--reference"])
    assert err.value.code == 2 and "not allowed with argument --eval" in capsys.readouterr().err


def test_slurm_takes_its_own_command_line_options_first_too():
    assert parse_args(["slurm", "--help"]).slurm_args == ["--help"]
    args = parse_args(["slurm", "script", "--job-name", "x", str(TINY), "a=1"])
    assert args.slurm_args == ["script", "--job-name", "x", str(TINY), "a=1"]
    out = _run("-m", "pipelinerl", "slurm", "--help")
    assert out.returncode == 0 and "script" in out.stdout


@pytest.mark.parametrize("argv", [
    ["train", str(TINY), "--nproc", "2", "--bogus"],  # an unknown option
    ["train", str(TINY), "--nproc", "2", "stray"],  # not key=value
    ["make-tiny-model", "out", "--seed", "1", "a=1"],  # a command without overrides
])
def test_unrecognized_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as err:
        parse_args(argv)
    assert err.value.code == 2
    assert "unrecognized arguments" in capsys.readouterr().err


def test_show_config_and_its_errors():
    out = _run("-m", "pipelinerl", "show-config", str(TINY), "trainer.lr=0.5")
    assert out.returncode == 0, out.stderr
    assert "lr: 0.5" in out.stdout and "run_dir: runs/tiny_cpu" in out.stdout
    doc = _run("-m", "pipelinerl", "show-config", "--doc", str(TINY), "trainer.lr=0.5")
    assert doc.returncode == 0, doc.stderr
    assert "  lr: 0.5  # peak learning rate (after warm-up)" in doc.stdout.splitlines()
    assert yaml.safe_load(doc.stdout) == yaml.safe_load(out.stdout)
    bad = _run("-m", "pipelinerl.cli", "show-config", str(TINY), "trainer.lr=-2")  # the module works too
    assert bad.returncode == 2
    assert "config `trainer.lr`: got -2.0; must be > 0" in bad.stderr
    assert "Traceback" not in bad.stderr


LINE = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} "


def test_every_log_line_names_level_role_and_rank():
    code = ("import logging; from pipelinerl.logs import setup_logging; setup_logging('train', 1); "
            "logging.getLogger('pipelinerl.x').info('step 3'); logging.getLogger('pipelinerl.x').debug('hidden'); "
            "setup_logging('actor'); logging.getLogger('pipelinerl.y').warning('slow')")
    out = _run("-c", code)
    assert out.returncode == 0, out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 2, lines  # DEBUG is below the default level
    assert re.fullmatch(LINE + r"INFO train\[rank 1\] pipelinerl\.x: step 3", lines[0]), lines[0]
    assert re.fullmatch(LINE + r"WARNING actor pipelinerl\.y: slow", lines[1]), lines[1]


def test_log_level_from_the_environment():
    env = {**os.environ, "PIPELINERL_LOG_LEVEL": "debug"}
    code = "import logging; from pipelinerl.logs import setup_logging; setup_logging('run'); logging.debug('d')"
    assert re.fullmatch(LINE + r"DEBUG run root: d", _run("-c", code, env=env).stderr.strip())
    bad = _run("-c", code, env={**env, "PIPELINERL_LOG_LEVEL": "LOUD"})
    assert bad.returncode != 0 and "is not a logging level" in bad.stderr
