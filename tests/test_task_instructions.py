"""The instructions task (prompts without answers, scored only by a reward model) and the 8B RLHF config that uses
it: seed 004's chatbot run in shape."""

import json
from pathlib import Path

import pytest

from pipelinerl import cli
from pipelinerl.config import ConfigError, TaskConfig, load_config
from pipelinerl.launch.slurm import check_config, dry_run_allocation, plan_roles
from pipelinerl.launch.slurm_node import node_server_roles
from pipelinerl.plan.memory import plan_for
from pipelinerl.tasks import get_task

REPO = Path(__file__).resolve().parent.parent
RLHF_8B = REPO / "configs" / "llama8b_rlhf_dpo.yaml"


def test_prompts_are_read_from_any_prompt_field_and_held_out_apart(tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in
                            [{"prompt": f"Write a haiku about {i}."} for i in range(40)] + [{"Instruction": "Hi."}]))
    task = get_task(TaskConfig(name="instructions", dataset_path=str(data), eval_fraction=0.1))
    assert not task.has_check and len(task.train_items) + len(task.eval_items) == 41
    assert {i.id for i in task.train_items}.isdisjoint(i.id for i in task.eval_items)
    assert "Hi." in [i.prompt for i in task.train_items + task.eval_items]
    with pytest.raises(RuntimeError, match="no check.*reward.kind=model"):
        task.reward(task.train_items[0], "text", True)

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps({"text": "no prompt field"}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl row 1: no prompt text in a field prompt/instruction/question"):
        get_task(TaskConfig(name="instructions", dataset_path=str(bad)))
    texts = tmp_path / "texts.jsonl"
    texts.write_text(json.dumps({"text": "Say hi."}) + "\n" + json.dumps({"text": "Say bye."}) + "\n")
    named = get_task(TaskConfig(name="instructions", dataset_path=str(texts), question_field="text", eval_fraction=0.5))
    assert sorted(i.prompt for i in named.train_items + named.eval_items) == ["Say bye.", "Say hi."]


def test_the_instructions_task_needs_a_reward_model_and_no_evaluation(tmp_path):
    base = [f"run_dir={tmp_path}", "task.name=instructions", "task.dataset_path=p.jsonl"]
    with pytest.raises(ConfigError, match="reward.kind.*set reward.kind=model"):
        load_config(REPO / "configs" / "tiny_cpu.yaml", base)
    with pytest.raises(ConfigError, match="actor.eval_every_steps"):
        load_config(REPO / "configs" / "tiny_cpu.yaml", [*base, "reward.kind=model", "reward.model_path=rm"])
    load_config(REPO / "configs" / "tiny_cpu.yaml", [*base, "reward.kind=model", "reward.model_path=rm",
                                                     "actor.eval_every_steps=0"])


def test_the_8b_rlhf_config_places_its_reference_and_reward_servers_and_fits_80gb_gpus(monkeypatch):
    """Online DPO anchored at the reference server, rewards from the reward server: both in the first inference
    node's first slots (GPUs 0 and 1), 6 policy servers; every role fits 80 GB GPUs by `pipelinerl plan` with the
    built-in LLaMA 3.1 8B shapes (the model folders are the user's)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    cfg = load_config(RLHF_8B)
    assert (cfg.task.name, cfg.reward.kind, cfg.rl.algorithm, cfg.rl.dpo_reference) == (
        "instructions", "model", "dpo", "reference")
    check_config(cfg)
    roles = node_server_roles(cfg, "c.yaml", cfg.model.path, 0, "inference0", side=True)
    assert [(r.name, r.env["CUDA_VISIBLE_DEVICES"]) for r in roles[:3]] == [
        ("reference0", "0"), ("reward0", "1"), ("server2", "2")]
    assert plan_roles(cfg, dry_run_allocation(cfg), Path("c.yaml"))["servers@inference0"].argv[-2:] == [
        "--side-node", "inference0"]
    plan = plan_for(cfg, cli.trainer_ranks(cfg))
    assert plan.fits, plan.problems
    assert set(plan.roles) == {"trainer", "server", "reference", "reward"}
