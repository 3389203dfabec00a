"""reward.kind=model on the actor's side (pipelinerl/actor/rewards.py, CompletionsClient.score_rewards): what a
reward server is sent, how its answer becomes a reward, and the refusals. The served model itself is checked
against transformers in tests/test_reward_model.py."""

import asyncio
import json
import math
from pathlib import Path

import httpx
import pytest

from pipelinerl.actor import CompletionsClient
from pipelinerl.actor.rewards import RewardModelInputs
from pipelinerl.config import ConfigError, RewardConfig, load_config
from pipelinerl.rundir import REWARD_SERVERS_DIR
from pipelinerl.tiny.model import build_tokenizer

REPO = Path(__file__).resolve().parent.parent


def _reward_cfg(model_dir: Path, **kw) -> RewardConfig:
    return RewardConfig(kind="model", model_path=str(model_dir), **kw)


def test_inputs_are_the_policys_token_ids_or_their_text_and_scores_map_to_rewards(tmp_path):
    tokenizer = build_tokenizer()
    tokenizer.save_pretrained(tmp_path / "rm")
    prompt = tokenizer("37+48=").input_ids  # with its BOS, as the actor sends prompts
    completions = [tokenizer("58", add_special_tokens=False).input_ids + [tokenizer.eos_token_id],
                   tokenizer("5", add_special_tokens=False).input_ids]  # finished, and cut at the length limit
    tokens = RewardModelInputs(_reward_cfg(tmp_path / "rm"), tokenizer)
    assert tokens.inputs(prompt, completions) == [prompt + completions[0], prompt + completions[1]]
    text = RewardModelInputs(_reward_cfg(tmp_path / "rm", input="text"), tokenizer)
    assert text.inputs(prompt, completions) == ["37+48=58" + tokenizer.eos_token, "37+48=5"]
    # the server's tokenizer adds the BOS again: the same ids as the token inputs
    assert [tokenizer(t).input_ids for t in text.inputs(prompt, completions)] == tokens.inputs(prompt, completions)

    assert tokens.reward(0.25) == 0.25 and tokens.is_success(0.51) and not tokens.is_success(0.5)
    logit = RewardModelInputs(_reward_cfg(tmp_path / "rm", score="logit", success_threshold=0.8), tokenizer)
    for p in (0.25, 0.5, 0.9, 1e-3):
        assert logit.reward(p) == pytest.approx(math.log(p / (1 - p)), rel=1e-12)
    assert logit.reward(1.0) == pytest.approx(math.log((1 - 1e-7) / 1e-7))  # clamped, not infinite
    assert logit.is_success(logit.reward(0.81)) and not logit.is_success(logit.reward(0.79))


def test_token_inputs_refuse_a_reward_model_with_another_tokenizer(tmp_path):
    tokenizer = build_tokenizer()
    other = build_tokenizer()
    other.add_tokens(["<unk_word>"])
    other.save_pretrained(tmp_path / "rm")
    with pytest.raises(ConfigError, match="reward.input.*another tokenizer.*set reward.input=text"):
        RewardModelInputs(_reward_cfg(tmp_path / "rm"), tokenizer)
    RewardModelInputs(_reward_cfg(tmp_path / "rm", input="text"), tokenizer)  # text: any tokenizer


def _client(run_dir: Path, *urls: str) -> CompletionsClient:
    cfg = load_config(REPO / "configs" / "tiny_cpu.yaml", [f"run_dir={run_dir}", "actor.max_retries=2"])
    (run_dir / REWARD_SERVERS_DIR).mkdir(parents=True)
    for url in urls:
        (run_dir / REWARD_SERVERS_DIR / url.split("//")[1].replace(":", "_")).write_text(url + "\n")
    return CompletionsClient(cfg.actor, str(run_dir), reference=False, reward=True)


def _classification(probs: list[list[float]], order: list[int]) -> dict:
    return {"data": [{"index": i, "probs": probs[i], "num_classes": len(probs[i]), "label": "LABEL_0"} for i in order]}


def test_score_rewards_retries_a_failed_server_and_reads_scores_in_input_order(tmp_path):
    client = _client(tmp_path / "run", "http://h:1", "http://h:2")
    client.reward_pool.load["http://h:2"] = 3  # h:1, the less loaded, takes the first attempt
    asked = []

    def server(request: httpx.Request) -> httpx.Response:
        host = request.url.netloc.decode()
        asked.append((host, request.url.path))
        if host == "h:1":
            return httpx.Response(503, text="the engine died")
        return httpx.Response(200, json=_classification([[0.9], [0.1], [0.5]], order=[2, 0, 1]))

    async def score() -> list[float]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(server)) as http:
            return await client.score_rewards(http, [[1, 2], [1, 3], "text"])

    assert asyncio.run(score()) == [0.9, 0.1, 0.5]
    assert asked == [("h:1", "/classify"), ("h:2", "/classify")]
    assert "http://h:1" in client.reward_pool.aside


def test_score_rewards_refuses_a_reply_that_is_not_one_probability_per_input(tmp_path):
    client = _client(tmp_path / "run", "http://h:1")
    replies = iter([_classification([[0.2, 0.8], [0.3, 0.7]], order=[0, 1]), _classification([[0.5]], order=[0])])

    async def score() -> list[float]:
        server = httpx.MockTransport(lambda request: httpx.Response(200, json=next(replies)))
        async with httpx.AsyncClient(transport=server) as http:
            return await client.score_rewards(http, [[1], [2]])

    with pytest.raises(ValueError, match="one probability each"):  # two labels: not a one-logit classifier
        asyncio.run(score())
    with pytest.raises(ValueError, match="one probability each"):  # one answer for two inputs
        asyncio.run(score())


def test_every_attempt_failing_names_the_reward_servers(tmp_path):
    client = _client(tmp_path / "run", "http://h:1")

    async def score() -> list[float]:
        server = httpx.MockTransport(lambda request: httpx.Response(400, json={"error": {"message": "too long"}}))
        async with httpx.AsyncClient(transport=server) as http:
            return await client.score_rewards(http, [[1]])

    with pytest.raises(RuntimeError, match=r"POST /classify failed on the reward servers \['http://h:1'\] after 3"):
        asyncio.run(score())


def test_reward_config_is_checked_where_it_is_written(tmp_path):
    with pytest.raises(ConfigError, match="reward.model_path"):
        load_config(REPO / "configs" / "tiny_cpu.yaml", [f"run_dir={tmp_path}", "reward.kind=model"])
    with pytest.raises(ConfigError, match="reward.kind.*tool_sums"):
        load_config(REPO / "configs" / "tiny_tools.yaml", [f"run_dir={tmp_path}", "reward.kind=model",
                                                          "reward.model_path=rm"])
    with pytest.raises(ConfigError, match="inference.base_port.*policy, reference, reward, eval and OpenEnv"):
        load_config(REPO / "configs" / "tiny_cpu.yaml", [f"run_dir={tmp_path}", "reward.kind=model",
                                                         "reward.model_path=rm", "reward.servers=3",
                                                         "inference.base_port=65531"])
    with pytest.raises(ConfigError, match="reward.rubric.*put {prompt} and {completion} in it"):
        load_config(REPO / "configs" / "tiny_cpu.yaml", [f"run_dir={tmp_path}", "reward.kind=judge",
                                                         "reward.model_path=j", "reward.rubric='Grade {prompt}.'"])
    judge = load_config(REPO / "configs" / "tiny_cpu.yaml", [f"run_dir={tmp_path}", "reward.kind=judge",
                                                             "reward.model_path=j"])
    assert judge.reward.servers_started == 1 and "{completion}" in judge.reward.judge_rubric  # the default rubric
    verify = load_config(REPO / "configs" / "tiny_cpu.yaml", [f"run_dir={tmp_path}", "reward.servers=4"])
    assert verify.reward.servers_started == 0  # kind=verify starts none, whatever `servers` says


@pytest.mark.parametrize("text, score", [
    ("The sum is right.\nSCORE: 7", 0.7),
    ("SCORE: 10\n\n", 1.0),
    ("  SCORE:0  ", 0.0),
    ("Reasoning...\nSCORE: 7.5", 0.75),
    ("SCORE: 11", None),  # above judge_max_score
    ("SCORE: -1", None),
    ("SCORE: 7\nBut maybe 3.", None),  # not the last line
    ("score: 7", None),
    ("SCORE: 7/10", None),
    ("SCORE: seven", None),
    ("", None),
    ("I give it a 9.", None),
])
def test_a_verdict_is_read_strictly_from_the_last_line(text, score):
    from pipelinerl.actor.judge import parse_verdict

    assert parse_verdict(text, 10.0) == (None if score is None else pytest.approx(score))


def test_the_actor_asks_the_judge_once_per_completion_and_counts_unparsed_verdicts(tmp_path, tiny_model_dir):
    """reward.kind=judge: one chat request per completion to the reward server, the rubric filled with the prompt
    and the completion (braces in them kept); SCORE / judge_max_score is the reward, an unparseable verdict 0 and
    counted (actor/judge_unparsed_frac); the task's check is kept as verified_reward."""
    from pipelinerl.actor import Completion
    from pipelinerl.actor.scheduler import Actor
    from pipelinerl.config import save_config

    cfg = load_config(REPO / "configs" / "tiny_cpu.yaml", [
        f"run_dir={tmp_path / 'run'}", f"model.path={tiny_model_dir}", "model.build_tiny_if_missing=false",
        "reward.kind=judge", f"reward.model_path={tiny_model_dir}", "reward.judge_max_score=4",
        "reward.rubric='Q: {prompt} A: {completion} Grade it.'", "reward.judge_max_tokens=32"])
    save_config(cfg, tmp_path / "c.yaml")
    run = tmp_path / "run"
    (run / REWARD_SERVERS_DIR).mkdir(parents=True)
    (run / REWARD_SERVERS_DIR / "j_1").write_text("http://j:1\n")
    actor = Actor(cfg, "judge_probe")
    item = actor.task.train_items[0]
    texts = [item.answer, "9{x}", "77"]
    verdicts = {item.answer: "fine\nSCORE: 4", "9{x}": "SCORE: 1", "77": "no idea"}
    asked = []

    def judge(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        asked.append((request.url.path, body))
        content = body["messages"][0]["content"]
        answer = content.split(" A: ")[1].removesuffix(" Grade it.")
        return httpx.Response(200, json={"choices": [{"index": 0, "message": {"role": "assistant",
                                                                               "content": verdicts[answer]}}]})

    async def score():
        completions = [Completion([1], [0.0], [0], text, True) for text in texts]
        async with httpx.AsyncClient(transport=httpx.MockTransport(judge)) as http:
            return await actor.score("judge_probe/0", item, actor.prompt_ids(item), completions, {}, http)

    try:
        rows = asyncio.run(score())
    finally:
        actor.close()
    assert sorted(b["messages"][0]["content"] for _, b in asked) == sorted(
        f"Q: {item.prompt} A: {text} Grade it." for text in texts)
    assert {path for path, _ in asked} == {"/v1/chat/completions"}
    assert all(b["temperature"] == 0.0 and b["max_tokens"] == 32 for _, b in asked)
    assert [r.reward for r in rows] == [1.0, 0.25, 0.0]
    assert [r.metadata["verified_reward"] for r in rows] == [1.0, 0.0, 0.0]
    assert (actor.window["judged"], actor.window["unparsed"]) == (3, 1)


def test_a_server_of_another_run_on_our_port_takes_no_request(tmp_path, caplog):
    """Two runs on one machine with one inference.base_port: the server answering at our discovery file's URL
    reports another run's id on /status; the actor sets it aside with an error naming both runs, and takes the
    version of its own run's server only."""
    import logging

    from pipelinerl.rundir import SERVERS_DIR, run_fingerprint, run_token

    run = tmp_path / "run"
    cfg = load_config(REPO / "configs" / "tiny_cpu.yaml", [f"run_dir={run}"])
    (run / SERVERS_DIR).mkdir(parents=True)
    for port in (1, 2):
        (run / SERVERS_DIR / f"h_{port}").write_text(f"http://h:{port}\n")
    ours = run_fingerprint(run_token(str(run)))
    client = CompletionsClient(cfg.actor, str(run), reference=False, run=ours)
    runs = {"h:1": run_fingerprint("another run's token"), "h:2": ours}

    def server(request: httpx.Request) -> httpx.Response:
        host = request.url.netloc.decode()
        return httpx.Response(200, json={"version": 3 if host == "h:2" else 9, "num_ranks": 1, "group_ready": True,
                                         "updating": False, "run": runs[host]})

    async def version() -> int:
        async with httpx.AsyncClient(transport=httpx.MockTransport(server)) as http:
            return await client.serving_version(http)

    with caplog.at_level(logging.ERROR, logger="pipelinerl.actor.client"):
        assert asyncio.run(version()) == 3
    assert "http://h:1" in client.pool.aside and "http://h:2" not in client.pool.aside
    assert f"serves another run (its /status says run {runs['h:1']}, ours is {ours})" in caplog.text
    assert client.pool.acquire(avoid=set()) == "http://h:2"
    assert len(ours) == 16 and ours == run_fingerprint(run_token(str(run)))  # stable, not the token itself
