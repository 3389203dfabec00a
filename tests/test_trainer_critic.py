"""The DeepSpeed trainer's value head (rl.value_function) against float64 transformers + plain PyTorch.

One run is a real process group (ZeRO-0 on 1 rank, ZeRO-3 on 2 ranks over gloo) in which every rank builds
a trainer without a head and one with it, and records: their forward passes and exported weights; a first
step on the value loss alone (the zero head gives the trunk no gradient, so only the head moves, to
non-zero weights); a step of policy-gradient + value loss with its gradients; the DeepSpeed state saved,
one more step, and the state loaded back. The tests check the records.
"""

import functools
import os
import random

import pytest
import torch
import torch.multiprocessing as mp
from helpers import deepspeed_shm_removed, worker_port

from pipelinerl.config import TrainerConfig
from pipelinerl.launch.procs import free_port
from pipelinerl.trainer.packing import Sample, pack

pytestmark = pytest.mark.slow  # real DeepSpeed processes: about 40 s

SAMPLES, MICRO_BATCH_TOKENS, VALUE_COEF = 8, 20, 0.5
LR = 0.02  # Adam's first step moves each head weight by ~LR: values of order 0.1-1 afterwards
TRUNK = "model.layers.0.mlp.up_proj.weight"  # a parameter the value loss reaches only through the hidden state


def make_samples(vocab: int) -> list[Sample]:
    rng = random.Random(7)
    out = []
    for i in range(SAMPLES):
        p = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 6))]
        c = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 10))]
        fields = {"advantage": [rng.gauss(0, 1)] * len(c), "return": [rng.gauss(0, 1) for _ in c]}
        out.append(Sample(p, c, index=i, token_fields=fields))
    return out


def rank_samples(samples: list[Sample], rank: int, world: int) -> list[Sample]:
    """Uneven shares (rank 0 takes three quarters), so the ranks pad to equal micro-batch counts."""
    cut = len(samples) * 3 // 4 if world == 2 else len(samples)
    return samples[:cut] if rank == 0 else samples[cut:]


def sample_loss(new_N, values_N, advantage_N, return_N, num_sequences, policy_coef=1.0, value_coef=VALUE_COEF):
    """REINFORCE plus the critic's squared error: the tokens' share of the step's loss."""
    policy = -(new_N * advantage_N.to(new_N)).sum()
    value = ((values_N - return_N.to(values_N)) ** 2).sum()
    return (policy_coef * policy + value_coef * value) / num_sequences


def micro_batch_loss(mb, new_N, values_N, num_sequences, policy_coef=1.0):
    f = mb.fields_N
    return sample_loss(new_N, values_N, f["advantage"], f["return"], num_sequences, policy_coef), {}


def head_state(trainer) -> dict[str, torch.Tensor]:
    """Collective: full copies of the value head's weight [1, H] and bias [1]."""
    import deepspeed

    head = trainer.engine.module.value_head
    with deepspeed.zero.GatheredParameters(list(head.parameters())):
        return {n: p.detach().clone() for n, p in head.named_parameters()}


def train_step(trainer, mbs, num_sequences, policy_coef=1.0) -> dict[str, torch.Tensor]:
    """One optimizer step; returns every parameter's full gradient (trainer names: lm.*, value_head.*)."""
    from deepspeed.utils import safe_get_full_grad

    trainer.accumulate(mbs, functools.partial(micro_batch_loss, num_sequences=num_sequences, policy_coef=policy_coef))
    grads = {n: safe_get_full_grad(p).clone() for n, p in trainer.engine.module.named_parameters()}
    trainer.optimizer_step()
    return grads


def worker(rank, world, port, model_dir, stage, out_dir):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from pipelinerl.trainer.deepspeed_backend import DeepSpeedTrainer
    from pipelinerl.trainer.dist import close_process_group, init_process_group, read_dist_env

    dist = read_dist_env()
    cfg = TrainerConfig(zero_stage=stage, micro_batch_tokens=MICRO_BATCH_TOKENS, lr=LR, lr_schedule="constant",
                        warmup_steps=0, weight_decay=0.0, grad_clip=None, dist_timeout_s=120, data_timeout_s=60,
                        deepspeed_config={"zero_optimization": {"stage3_param_persistence_threshold": 0}})
    init_process_group(dist, cfg.dist_timeout_s, cfg.jit_lock_stale_s)
    out = {}
    plain = DeepSpeedTrainer(cfg, dist)
    plain.init(model_dir)
    samples = make_samples(plain.lm.config.vocab_size)
    mbs = pack(rank_samples(samples, rank, world), MICRO_BATCH_TOKENS)
    out["micro_batch"] = mbs[0]
    with torch.no_grad():
        out["plain_logprobs"], out["plain_values"] = plain.forward(mbs[0])
    out["plain_shapes"] = plain.named_shapes()
    plain.save_hf(out_dir / "plain_hf")

    critic = DeepSpeedTrainer(cfg, dist, value_head=True)
    critic.init(model_dir)
    weight = critic.engine.module.value_head.weight
    out["head_shard_numel"] = weight.ds_tensor.numel() if stage == 3 else weight.numel()  # this rank's part
    out["shapes"], out["gathered_names"] = critic.named_shapes(), [n for n, _ in critic.gathered_parameters()]
    critic.save_hf(out_dir / "critic_hf")
    with torch.no_grad():
        out["initial_values"] = critic.forward(mbs[0])[1]
    out["initial"] = critic.full_state_dict()
    train_step(critic, mbs, len(samples), policy_coef=0.0)
    out["head"], out["warmed"] = head_state(critic), critic.full_state_dict()
    with torch.no_grad():
        out["logprobs"], out["values"] = critic.forward(mbs[0])
    out["grads"] = train_step(critic, mbs, len(samples))
    out["trained"], out["trained_head"] = critic.full_state_dict(), head_state(critic)
    critic.save_state(out_dir / "state")
    train_step(critic, mbs, len(samples))
    out["moved_head"] = head_state(critic)
    critic.load_state(out_dir / "state")
    out["loaded"], out["loaded_head"] = critic.full_state_dict(), head_state(critic)
    torch.save(out, out_dir / f"rank{rank}.pt")
    close_process_group()


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    """Memoised runs keyed by (world, stage): each rank's records and the run's folder."""

    @functools.cache
    def get(world, stage):
        out_dir = tmp_path_factory.mktemp(f"critic_w{world}_z{stage}")
        port = free_port(worker_port(18700 + os.getpid() % 50))
        with deepspeed_shm_removed(port):
            mp.spawn(worker, args=(world, port, str(tiny_model_dir), stage, out_dir), nprocs=world, join=True)
        return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(world)], out_dir

    return get


RUNS = [pytest.param(1, 0, id="zero0_1rank"), pytest.param(2, 3, id="zero3_2ranks")]


def float64_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64, attn_implementation="sdpa")


def reference_forward(model, weight, bias, s: Sample) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence on its own: completion log-probs, and the head on transformers' final hidden state at
    pos - 1 (the row that predicts the token at pos)."""
    ids = torch.tensor([s.prompt_ids + s.completion_ids])
    out = model(input_ids=ids, output_hidden_states=True)
    pos = torch.arange(len(s.prompt_ids), ids.shape[1])
    logprobs_N = out.logits[0].log_softmax(-1)[pos - 1, ids[0, pos]]
    values_N = out.hidden_states[-1][0, pos - 1] @ weight[0] + bias[0]
    return logprobs_N, values_N


def float64_head(rec) -> tuple[torch.Tensor, torch.Tensor]:
    return rec["head"]["weight"].double(), rec["head"]["bias"].double()


@pytest.mark.parametrize("world,stage", RUNS)
def test_values_start_at_zero_and_the_first_value_step_moves_only_the_head(runs, world, stage):
    records, _ = runs(world, stage)
    for rec in records:
        assert rec["head_shard_numel"] == rec["head"]["weight"].numel() // world  # ZeRO-3 partitions the head
        assert rec["plain_values"] is None
        assert torch.equal(rec["initial_values"], torch.zeros_like(rec["initial_values"]))
    rec = records[0]
    for name, tensor in rec["initial"].items():
        assert torch.equal(rec["warmed"][name], tensor), name
    assert rec["head"]["weight"].abs().min() > LR / 2 and rec["head"]["bias"].abs().min() > LR / 2


@pytest.mark.parametrize("world,stage", RUNS)
def test_one_forward_gives_the_no_head_logprobs_and_float64_values(runs, world, stage, tiny_model_dir):
    records, _ = runs(world, stage)
    model = float64_model(tiny_model_dir)
    samples = make_samples(model.config.vocab_size)
    for rec in records:
        assert torch.equal(rec["logprobs"], rec["plain_logprobs"])  # the same rows through the same LM head
        assert rec["values"].dtype == torch.float32 and rec["values"].shape == rec["logprobs"].shape
        seq_N = rec["micro_batch"].seq_index_N
        for i in seq_N.unique().tolist():
            with torch.no_grad():
                want_logprobs, want_values = reference_forward(model, *float64_head(records[0]), samples[i])
            torch.testing.assert_close(rec["logprobs"][seq_N == i].double(), want_logprobs, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(rec["values"][seq_N == i].double(), want_values, rtol=1e-5, atol=1e-5)
        assert rec["values"].abs().max() > 0.1  # the head is far from zero: the comparison is not vacuous


def reference_grads(model_dir, weight, bias, value_coef: float) -> dict[str, torch.Tensor]:
    """float64 gradients of the step's loss, one sequence at a time, under the trainer's parameter names."""
    model = float64_model(model_dir)
    weight, bias = torch.nn.Parameter(weight), torch.nn.Parameter(bias)
    samples = make_samples(model.config.vocab_size)
    for s in samples:
        new_N, values_N = reference_forward(model, weight, bias, s)
        f = {k: torch.tensor(v, dtype=torch.float64) for k, v in s.token_fields.items()}
        sample_loss(new_N, values_N, f["advantage"], f["return"], len(samples), value_coef=value_coef).backward()
    grads = {f"lm.{n}": p.grad for n, p in model.named_parameters()}
    return {**grads, "value_head.weight": weight.grad, "value_head.bias": bias.grad}


@pytest.mark.parametrize("world,stage", RUNS)
def test_a_value_loss_step_trains_head_and_trunk_with_float64_gradients(runs, world, stage, tiny_model_dir):
    (rec, *_), _ = runs(world, stage)
    want = reference_grads(tiny_model_dir, *float64_head(rec), VALUE_COEF)
    assert rec["grads"].keys() == want.keys()
    for name, truth in want.items():
        torch.testing.assert_close(rec["grads"][name].double(), truth, rtol=1e-4, atol=1e-6, msg=name)
    # the value loss reaches the trunk: without it the trunk's gradient is far off
    policy_only = reference_grads(tiny_model_dir, *float64_head(rec), 0.0)[f"lm.{TRUNK}"]
    error = (rec["grads"][f"lm.{TRUNK}"].double() - want[f"lm.{TRUNK}"]).abs().max()
    assert (policy_only - want[f"lm.{TRUNK}"]).abs().max() > 1000 * error
    # and the step moved both
    assert (rec["trained_head"]["weight"] - rec["head"]["weight"]).abs().max() > LR / 2
    assert (rec["trained"][TRUNK] - rec["warmed"][TRUNK]).abs().max() > LR / 2


@pytest.mark.parametrize("world,stage", RUNS)
def test_exported_weights_are_the_lm_alone_under_hf_names(runs, world, stage):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    records, out_dir = runs(world, stage)
    for rec in records:
        assert rec["shapes"] == rec["plain_shapes"]
        assert rec["gathered_names"] == [name for name, _, _ in rec["plain_shapes"]]
    plain, critic = out_dir / "plain_hf", out_dir / "critic_hf"
    assert sorted(p.name for p in critic.iterdir()) == sorted(p.name for p in plain.iterdir())
    want, got = load_file(plain / "model.safetensors"), load_file(critic / "model.safetensors")
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
    _, info = AutoModelForCausalLM.from_pretrained(critic, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


@pytest.mark.parametrize("world,stage", RUNS)
def test_save_and_load_state_restore_the_head(runs, world, stage):
    records, _ = runs(world, stage)
    for rec in records:
        saved, moved, loaded = rec["trained_head"], rec["moved_head"], rec["loaded_head"]
        assert not torch.equal(moved["weight"], saved["weight"])  # the step after the save changed the head
        for name in saved:
            assert torch.equal(loaded[name], saved[name]), name
    for name, tensor in records[0]["trained"].items():
        assert torch.equal(records[0]["loaded"][name], tensor), name
