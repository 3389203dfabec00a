"""`pipelinerl train`: read the rollout stream, advantages, pack, step, broadcast, log, checkpoint.

One process per rank (`pipelinerl run`, torchrun or srun set RANK etc.). Rank 0 reads the stream and
gives every rank exactly its share of whole groups each step (step_data.py), so group advantages are
local; the loss is normalised by the number of sequences in the step over all ranks. The policy version is the
number of optimizer steps taken: the weights of version k are published right after step k (conventional mode,
config `mode`: only after every G-th step, once per batch), and at start-up the current ones. Publishing is a
gather into rank 0's host memory; rank 0's delivery thread (weights/delivery.py) takes the newest version to
every announced server, so a server restarted on an old checkpoint catches up while the loop waits for data.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pipelinerl.config import Config, ConfigError
from pipelinerl.rundir import StatusFile
from pipelinerl.trainer.backends import build_trainer
from pipelinerl.trainer.checkpoints import (
    StopSignals,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from pipelinerl.trainer.contract import Trainer
from pipelinerl.trainer.dist import (
    DistInfo,
    all_reduce_sum,
    all_reduce_tensor,
    init_process_group,
    read_dist_env,
)
from pipelinerl.trainer.moe import load_stats, router_stats
from pipelinerl.trainer.packing import MicroBatch, Sample, pack, padding_micro_batch
from pipelinerl.trainer.step_data import StepData

log = logging.getLogger("pipelinerl.trainer")


@dataclass
class LoopState:
    step: int = 0  # optimizer steps taken = policy version of the current weights
    samples_seen: int = 0  # over all ranks
    cursor: dict | None = None  # the stream position after the last trained step (rank 0's reader)
    last_saved: int = -1  # step of the newest checkpoint (resumed from or written)
    resumed: int = 0  # the checkpoint's step this trainer resumed from: the last version of every lineage


def check_supported(cfg: Config, dist: DistInfo) -> None:
    """User errors the trainer can name before loading anything."""
    groups = cfg.trainer.samples_per_step // cfg.actor.attempts
    if groups % dist.world_size:
        raise ConfigError(f"trainer.samples_per_step / actor.attempts = {groups} groups per step do not split "
                         f"evenly over {dist.world_size} trainer ranks; make it a multiple of the rank count")


def token_lags(version: int, versions: list[int], resumed: int) -> list[int]:
    """Each token's lag: the optimizer steps between the policy that sampled it and the weights it trains.
    A token ahead of `version` was sampled by a discarded lineage (versions the trainer reached before it died
    and resumed from the checkpoint of step `resumed`): the lineages share the weights up to `resumed`, so its
    lag counts from there, never negative."""
    return [version - v if v <= version else version - resumed for v in versions]


def rows_to_samples(batches, version: int, first_index: int, cfg: Config, resumed: int = 0) -> list[Sample]:
    """One record batch per group -> Samples with per-token behaviour log-probs, lags (token_lags; `resumed`:
    the checkpoint's step the trainer resumed from) and loss mask (and reference log-probs when the objective
    needs them), and per-sequence advantage (or DPO role), group (and reward when the objective needs it). An
    episode's environment tokens (loss mask 0) stay in the sample's completion, as context for the model
    tokens after them; the loss and its statistics skip them. rl.overlong=filter masks every token of a
    truncated row (DAPO's overlong filtering) after the group's advantages are computed with it."""
    from pipelinerl.rl import dpo_roles, group_advantages

    samples = []
    for g, batch in enumerate(batches):
        rows = batch.to_pydict()
        rewards = torch.tensor(rows["reward"], dtype=torch.float64)
        group = torch.zeros(len(rewards), dtype=torch.long)
        if cfg.rl.algorithm == "dpo":
            adv = dpo_roles(rewards, group)
        else:
            adv = group_advantages(rewards, group, cfg.rl.baseline, cfg.rl.divide_by_std)
        baseline = _distill_baseline(rows) if cfg.rl.teacher is not None else 0.0
        for i, completion in enumerate(rows["completion_token_ids"]):
            n = len(completion)
            lags = token_lags(version, rows["versions"][i], resumed)
            mask = rows["loss_mask"][i]
            if cfg.rl.overlong == "filter" and rows["truncated"][i]:
                mask = [0] * len(mask)
            tokens = {"behaviour": rows["behaviour_logprobs"][i], "lag": lags, "loss_mask": mask}
            if cfg.rl.needs_reference_logprobs:
                tokens["reference"] = _reference_logprobs(rows, i, n)
            if cfg.rl.teacher_top_k:
                tokens.update(_teacher_top_k(rows, i, n, cfg.rl.teacher_top_k))
            if cfg.returns_routed_experts:
                tokens.update(_routed_experts(rows, i, n, cfg.rl.routing_replay == "r3"))
            seq = {"advantage": float(adv[i]), "group": float(g)}
            if cfg.rl.value_function:
                seq["reward"] = float(rewards[i])
            if cfg.rl.teacher is not None:
                seq["distill_baseline"] = baseline
            samples.append(Sample(rows["prompt_token_ids"][i], completion, first_index + len(samples), tokens, seq))
    return samples


def _field_names(cfg: Config) -> tuple[dict[str, tuple[int, ...]], list[str]]:
    """The per-token fields `rows_to_samples` gives every sample under this config, each with its shape per token
    (() one value, (k,) the teacher's top-k), and the per-sequence fields."""
    k = cfg.rl.teacher_top_k
    token = ["behaviour", "lag", "loss_mask"] + ["reference"] * cfg.rl.needs_reference_logprobs
    top = ["teacher_top_ids", "teacher_top_logprobs"] if k else []
    return ({**{n: () for n in token}, **{n: (k,) for n in top}},
            ["advantage", "group"] + ["reward"] * cfg.rl.value_function
            + ["distill_baseline"] * (cfg.rl.teacher is not None))


def _distill_baseline(rows: dict) -> float:
    """rl.teacher: the group's mean of teacher - behaviour log-prob over its model tokens (loss mask 1), each
    token's distillation baseline (rl/advantages.distill_advantages); computed before packing, so it does not
    depend on which micro-batch a sequence lands in."""
    gaps = [t - b for ref, beh, mask in zip(rows["reference_logprobs"], rows["behaviour_logprobs"], rows["loss_mask"])
            for t, b, m in zip(ref, beh, mask) if m]
    return sum(gaps) / len(gaps) if gaps else 0.0


def _reference_logprobs(rows: dict, i: int, n: int) -> list[float]:
    values = rows.get("reference_logprobs", [[]] * len(rows["reward"]))[i]
    if len(values) != n:
        raise ValueError(f"rollout {rows['sample_id'][i]} has {len(values)} reference log-probs for {n} completion "
                         "tokens: rl.kl_coef > 0 and rl.dpo_reference=reference need an actor that asks the "
                         "reference servers (RUN_DIR/reference_servers), which `pipelinerl run` starts for them")
    return values


def _teacher_top_k(rows: dict, i: int, n: int, k: int) -> dict[str, list[list[float]]]:
    """rl.teacher_top_k: row i's teacher top-k ids and log-probs, k per completion token."""
    ids, logprobs = rows["teacher_top_ids"][i], rows["teacher_top_logprobs"][i]
    if len(ids) != n * k:
        raise ValueError(f"rollout {rows['sample_id'][i]} has {len(ids)} teacher top-k entries for {n} completion "
                         f"tokens, expected rl.teacher_top_k={k} per token: the actor must run with the same "
                         "rl.teacher_top_k")
    return {"teacher_top_ids": [ids[t * k:(t + 1) * k] for t in range(n)],
            "teacher_top_logprobs": [logprobs[t * k:(t + 1) * k] for t in range(n)]}


def _routed_experts(rows: dict, i: int, n: int, required: bool) -> dict[str, list[list[int]]]:
    """Row i's routed experts, L x k ids per completion token (trainer/moe.py replays or compares them); none
    when the row has none (a multi-turn episode), which rl.routing_replay=r3 refuses."""
    ids = rows.get("routed_experts", [[]] * len(rows["reward"]))[i]
    if not ids and not required:
        return {}
    if not ids or len(ids) % n:
        raise ValueError(f"rollout {rows['sample_id'][i]} has {len(ids)} routed-expert ids for {n} completion "
                         "tokens: rl.routing_replay=r3 needs the policy servers' routing of every completion token")
    width = len(ids) // n
    return {"routed_experts": [ids[t * width:(t + 1) * width] for t in range(n)]}


def step_samples(batches, cfg: Config, dist: DistInfo, version: int,
                 resumed: int) -> tuple[list[Sample], list[float], int]:
    """This rank's share of a step as Samples, the rewards of those samples and how many were truncated."""
    first = dist.rank * (cfg.trainer.samples_per_step // dist.world_size)
    rewards = [r for batch in batches for r in batch.column("reward").to_pylist()]
    truncated = sum(sum(batch.column("truncated").to_pylist()) for batch in batches)
    return rows_to_samples(batches, version, first, cfg, resumed), rewards, truncated


def _loss_fn(cfg: Config, num_sequences: int, num_pairs: int, device: torch.device, token_log: list):
    """The loss of one micro-batch, normalised by the step's sequence (and DPO pair) counts over all ranks.
    Per-sequence fields are expanded to the tokens here (suffix _N: completion tokens, _S: the row's sequences).
    Only model tokens (loss mask 1) get loss, statistics and a token_log entry; GAE runs over them alone, so an
    episode's environment tokens are part of the transition from one model token to the next."""
    from pipelinerl.rl import LossInputs, compute_loss

    def loss_fn(mb: MicroBatch, new_N: torch.Tensor, values_N: torch.Tensor | None):
        student_top_NK = None
        if new_N.dim() == 2:  # rl.teacher_top_k: the completion token's log-prob, then the teacher's top-k's
            new_N, student_top_NK = new_N[:, 0], new_N[:, 1:]
        f = {k: v.to(device) for k, v in mb.fields_N.items()}
        per_seq = {k: v.to(device) for k, v in mb.seq_fields_S.items()}
        lag_N = f["lag"].long()
        mask_N = f["loss_mask"].bool() & (not mb.is_padding)  # padding: zero loss and stats
        seq_N = mb.row_seq_N.to(device)
        advantages_N, returns_N = per_seq["advantage"][seq_N], None
        if cfg.rl.value_function:
            advantages_N, returns_N = _model_token_gae(per_seq["reward"], values_N, seq_N, mask_N, cfg)
        inputs = LossInputs(new_N, f["behaviour"], advantages_N, mask_N, lag_N, seq_N, num_sequences,
                            ref_logprobs_T=f.get("reference"), values_T=values_N, returns_T=returns_N,
                            group_index_T=per_seq["group"][seq_N].long(), num_pairs=num_pairs,
                            distill_baseline_T=per_seq["distill_baseline"][seq_N] if cfg.rl.teacher else None,
                            teacher_top_logprobs_TK=f.get("teacher_top_logprobs"),
                            student_top_logprobs_TK=student_top_NK)
        loss, stats = compute_loss(inputs, cfg.rl)
        if not mb.is_padding:
            token_log.append((lag_N[mask_N].cpu(), f["behaviour"][mask_N].cpu(), new_N.detach()[mask_N].cpu()))
        return loss, {k: v.detach().cpu() for k, v in stats.items()}

    return loss_fn


def _model_token_gae(rewards_S: torch.Tensor, values_N: torch.Tensor, seq_N: torch.Tensor, mask_N: torch.Tensor,
                     cfg: Config) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE (advantages, returns) over the model tokens (mask_N) alone, each sequence's reward on its last one;
    zeros on the other tokens, which get no loss."""
    from pipelinerl.rl import gae_advantages, terminal_rewards

    rewards_M = terminal_rewards(rewards_S, seq_N, mask_N)[mask_N]
    advantages_M, returns_M = gae_advantages(rewards_M, values_N[mask_N], seq_N[mask_N], cfg.rl.gamma,
                                             cfg.rl.gae_lambda)
    advantages_N = torch.zeros_like(values_N).masked_scatter(mask_N, advantages_M)
    returns_N = torch.zeros_like(values_N).masked_scatter(mask_N, returns_M)
    return advantages_N, returns_N


def _reduce_stats(stats_list: list[dict]) -> dict[str, float]:
    """Merge micro-batch statistics, then over ranks (sum, or max for max_* keys) and summarise."""
    from pipelinerl.rl import merge_stats, summarize_stats

    merged = merge_stats(stats_list)
    out = {}
    for key in sorted(merged):
        out[key] = all_reduce_tensor(merged[key].double(), "max" if key.startswith("max_") else "sum")
    slots = out.pop("moe_slots", None)  # a mixture of experts: [layers, experts] routed slots (trainer/moe.py)
    compared = out.pop("moe_compared", None)  # (token-layer routings the servers gave, of them differing)
    summary = summarize_stats(out)
    if slots is not None:
        summary.update(load_stats(slots))
    if compared is not None and compared[0] > 0:
        summary["moe/routing_mismatch"] = float(compared[1] / compared[0])
    summary.update({k: float(v) for k, v in out.items() if k.endswith("_loss")})
    return summary


def _trained(samples: list[Sample], cfg: Config) -> tuple[list[Sample], list | None]:
    """The samples that get loss, and which must share a micro-batch. An empty completion has no token
    to weigh. Online DPO scores each group's (chosen, rejected) pair inside one micro-batch; without a
    KL term the group's other attempts add nothing to the loss and are not run at all."""
    trained = [s for s in samples if s.completion_ids]
    if cfg.rl.algorithm != "dpo":
        return trained, None
    role = {id(s): s.seq_fields["advantage"] for s in trained}
    if cfg.rl.kl_coef == 0:
        trained = [s for s in trained if role[id(s)] != 0]
    return trained, [s.seq_fields["group"] if role[id(s)] != 0 else None for s in trained]


def train_step(trainer: Trainer, samples: list[Sample], cfg: Config, dist: DistInfo,
               state: LoopState, token_log: list) -> dict[str, float]:
    """Forward/backward over this rank's packed samples, then one optimizer step."""
    trained, together = _trained(samples, cfg)
    # DPO pairs trained here: one per trained chosen sample, whose rejected partner shares its micro-batch
    # (`compute_loss` asserts it). The DPO loss is the mean over the step's pairs, all ranks.
    pairs = sum(s.seq_fields["advantage"] == 1 for s in trained) if cfg.rl.algorithm == "dpo" else 0
    num_sequences, tokens, num_pairs = all_reduce_sum(
        [len(samples), sum(len(s.completion_ids) for s in samples), pairs])
    micro_batches = pack(trained, cfg.trainer.micro_batch_tokens, together)
    loss_fn = _loss_fn(cfg, int(num_sequences), int(num_pairs), trainer.device, token_log)
    mb_stats = trainer.accumulate(micro_batches, loss_fn)
    if not mb_stats:  # nothing to train on this rank (e.g. only tied DPO groups): zero statistics, same keys
        pad = padding_micro_batch(*_field_names(cfg))
        no_values = torch.zeros(1, device=trainer.device) if cfg.rl.value_function else None
        no_logprobs = torch.zeros((1, 1 + cfg.rl.teacher_top_k) if cfg.rl.teacher_top_k else 1, device=trainer.device)
        mb_stats = [{**loss_fn(pad, no_logprobs, no_values)[1], **router_stats(trainer.router_tap)}]
    stats = _reduce_stats(mb_stats)
    stats.update(trainer.optimizer_step())
    stats.update(sequences=num_sequences, completion_tokens=tokens,
                 micro_batches=float(all_reduce_sum([len(micro_batches)])[0]))
    state.step += 1
    state.samples_seen += int(num_sequences)
    return stats


def resume(trainer: Trainer, root: Path, dist: DistInfo, backend: str) -> LoopState:
    """Restore the latest complete checkpoint, if any (every rank reads the same folder), written by the same
    trainer `backend` (checkpoints before the meta named it are DeepSpeed's)."""
    path = latest_checkpoint(root)
    if path is None:
        return LoopState()
    wrote = json.loads((path / "meta.json").read_text()).get("backend", "deepspeed")
    if wrote != backend:
        raise ValueError(f"{path} was written by trainer.backend={wrote}, this run has trainer.backend={backend}: "
                         "its trainer state does not load across backends; resume with trainer.backend="
                         f"{wrote}, or start a new run_dir from its hf/ folder (model.path)")
    meta = load_checkpoint(trainer, path)
    if "cursor" not in meta:
        raise ValueError(f"{path} holds per-rank stream cursors (written before the trainer read the stream on "
                         "rank 0 only); resume it with the pipelinerl version that wrote it, or start a new run_dir")
    log.info("resumed from %s (step %d, %d rank(s))", path, meta["step"], dist.world_size)
    return LoopState(step=meta["step"], samples_seen=meta["samples_seen"], cursor=meta["cursor"],
                     last_saved=meta["step"], resumed=meta["step"])


def checkpoint(trainer: Trainer, cfg: Config, dist: DistInfo, state: LoopState) -> None:
    """Collective. The cursor is the stream position after the last trained step, so a stop that came
    while a step's data was being read re-reads that data after the resume."""
    meta = {"version": state.step, "samples_seen": state.samples_seen, "cursor": state.cursor,
            "backend": cfg.trainer.backend}
    save_checkpoint(trainer, Path(cfg.run_dir) / "checkpoints", state.step, meta, cfg.checkpoints.keep_last, dist)
    state.last_saved = state.step
    if dist.is_main and state.cursor is not None:
        from pipelinerl.streams import ROLLOUT_TOPIC, release

        release(cfg.run_dir, ROLLOUT_TOPIC, state.cursor, cfg.streams)  # only segments this checkpoint has passed


class StepLogger:
    """TensorBoard scalars (rank 0), per-token zarr statistics (every rank, its own arrays), and rank 0's status
    file (RUN_DIR/status/trainer.json: the step, version, samples/s and lag, for `pipelinerl status`)."""

    def __init__(self, cfg: Config, dist: DistInfo, resumed_step: int, status: StatusFile | None = None):
        from pipelinerl.metrics import Scalars, TokenStats

        self.cfg, self.dist, self.status = cfg, dist, status
        self.scalars = Scalars(cfg.run_dir, "trainer") if cfg.logging.tensorboard and dist.is_main else None
        self.tokens = TokenStats(cfg.run_dir, f"rank{dist.rank}") if cfg.logging.zarr_stats else None
        if self.tokens is not None:
            self.tokens.truncate_to_step(resumed_step)  # versions >= the checkpoint's are trained again

    def log(self, step: int, stats: dict[str, float], token_log: list) -> None:
        """`step` counts optimizer steps taken, so this step's tokens were trained by version step - 1."""
        lag = None
        if token_log:
            lag, behaviour, current = (torch.cat(parts).numpy() for parts in zip(*token_log))
            if self.tokens is not None:
                self.tokens.append(step - 1, lag, behaviour, current)
        if self.status is not None:
            self.status.update(step=step, step_at=time.time(), max_steps=self.cfg.trainer.max_steps, **{
                k: stats[k] for k in ("samples_per_s", "samples_seen", "lag_mean", "lag_max", "reward_mean",
                                   "data_wait_fraction")
                if k in stats})
        if not self.dist.is_main or step % self.cfg.logging.every_steps:
            return
        if self.scalars is not None:
            self.scalars.log(step, stats)
            if lag is not None:
                self.scalars.histogram(step, "lag_hist", lag)
        log.info("step %d: %s", step, " ".join(f"{k}={v:.4g}" for k, v in sorted(stats.items())))

    def close(self) -> None:
        if self.scalars is not None:
            self.scalars.close()
        if self.status is not None:
            self.status.update(state="stopped", waiting=None)
            self.status.flush()
            self.status.close()


def _sync_due(cfg: Config, step: int) -> bool:
    """Pipeline mode syncs after every step; conventional mode after the last step of each batch."""
    return cfg.mode == "pipeline" or step % cfg.conventional.steps_per_batch == 0


def _checkpoint_due(cfg: Config, step: int) -> bool:
    every = cfg.checkpoints.every_steps
    return every is not None and step % every == 0


def train(cfg: Config) -> None:
    """The trainer role: runs until trainer.max_steps, or until SIGTERM/SIGUSR1 (then checkpoints)."""
    from pipelinerl.weights import Publication

    dist = read_dist_env()
    check_supported(cfg, dist)
    init_process_group(dist, cfg.trainer.dist_timeout_s, cfg.trainer.jit_lock_stale_s)
    torch.manual_seed(cfg.seed)
    evaluation = dist.is_main and cfg.inference.eval_servers > 0
    publication = Publication(readers=1 + evaluation) if dist.is_main else None
    trainer = build_trainer(cfg, dist, publication)
    trainer.init(cfg.model.path)
    state = resume(trainer, Path(cfg.run_dir) / "checkpoints", dist, cfg.trainer.backend)
    signals = StopSignals()
    if cfg.checkpoints.save_on_signal:
        signals.install()
    delivery = start_delivery(cfg, dist, publication) if dist.is_main else None
    eval_delivery = start_delivery(cfg, dist, publication, evaluation=True) if evaluation else None
    status = StatusFile(cfg.run_dir, "trainer") if dist.is_main else None
    data = StepData(cfg, dist, state.cursor, lambda: signals.received is not None, delivery, status)
    logger = StepLogger(cfg, dist, state.step, status)
    try:
        trainer.publish_weights(state.step)  # servers (re)started on older weights catch up before any step
        _run(trainer, data, cfg, dist, state, signals, logger, delivery)
    finally:
        logger.close()
        for d in (delivery, eval_delivery):
            if d is not None:
                d.close()


def start_delivery(cfg: Config, dist: DistInfo, publication, evaluation: bool = False):
    """Rank 0's delivery thread over the run's announced policy servers (RUN_DIR/servers), or with `evaluation`
    over its evaluation servers (RUN_DIR/eval_servers, inference.eval_servers): a group of their own on
    trainer.broadcast_port + 1, and a server held for an evaluation is left alone until released."""
    from pipelinerl.control import ControlClient
    from pipelinerl.rundir import EVAL_SERVERS_DIR, SERVERS_DIR, run_token, server_roster
    from pipelinerl.weights import Delivery, WeightBroadcaster
    from pipelinerl.weights.deadline import DeadlineRule
    from pipelinerl.weights.delivery import held_servers

    t, token = cfg.trainer, run_token(cfg.run_dir, cfg.inference.auth_token)
    control, folder = ControlClient(token), EVAL_SERVERS_DIR if evaluation else SERVERS_DIR
    sender = WeightBroadcaster([], cfg.inference.weight_update_backend or dist.backend, t.broadcast_host,
                               t.broadcast_port + evaluation, cfg.inference.weight_update_timeout_s,
                               int(t.broadcast_bucket_mb * 2**20), token, checksum_every=t.broadcast_checksum_every,
                               delta=t.broadcast_delta == "auto",
                               deadline=DeadlineRule(t.delivery_deadline_factor, t.delivery_deadline_margin_s,
                                                     t.delivery_deadline_floor_s, t.delivery_deadline_ceiling_s))
    return Delivery(publication, lambda: server_roster(cfg.run_dir, folder), sender, control,
                    t.delivery_fail_after_versions, t.delivery_fail_after_s, t.wait_log_s,
                    held=functools.partial(held_servers, control) if evaluation else None).start()


def delivery_stats(reports) -> dict[str, float]:
    """TensorBoard scalars of the delivery rounds since the last step (weights.DeliveryReport)."""
    done = [r for r in reports if r.ok]
    stats = {"broadcast_failed": float(len(reports) - len(done)), "broadcast_rounds": float(len(done))}
    if done:
        stats.update(broadcast_s=max(r.total_s for r in done), pause_s=max(r.paused_s for r in done),
                     broadcast_bytes=float(sum(r.bytes for r in done)),
                     broadcast_bytes_fraction=sum(r.bytes for r in done) / max(sum(r.dense_bytes for r in done), 1))
        changed = [r.changed_fraction for r in done if r.changed_fraction is not None]
        if changed:
            stats["broadcast_changed_fraction"] = changed[-1]
    return stats


def _run(trainer: Trainer, data: StepData, cfg: Config, dist: DistInfo, state: LoopState, signals: StopSignals,
         logger, delivery) -> None:
    max_steps = cfg.trainer.max_steps
    while max_steps is None or state.step < max_steps:
        started = time.monotonic()
        batches = data.next_step(state.step)
        if batches is None:  # a stop signal came while rank 0 waited for data
            if state.last_saved != state.step and state.step > 0:
                checkpoint(trainer, cfg, dist, state)
            # The same words as after a step: the signal's moment decides which path runs, not the caller.
            log.info("stop signal %s: checkpointed at step %d, exiting (it came while rank 0 waited for data)",
                     signals.requested(), state.step)
            return
        state.cursor = data.cursor()
        samples, rewards, truncated = step_samples(batches, cfg, dist, state.step, state.resumed)
        read_s = time.monotonic() - started
        token_log: list = []
        stats = train_step(trainer, samples, cfg, dist, state, token_log)
        train_s = time.monotonic() - started - read_s
        published = (trainer.publish_weights(state.step) if _sync_due(cfg, state.step)
                     else {"publish_s": 0.0, "bytes": 0.0})
        step_s = time.monotonic() - started
        reward_sum, reward_count, truncated = all_reduce_sum([sum(rewards), len(rewards), truncated])
        stats.update(read_s=read_s, train_s=train_s, publish_s=published["publish_s"],
                     publish_bytes=published["bytes"], samples_seen=state.samples_seen,
                     samples_per_s=cfg.trainer.samples_per_step / step_s, data_wait_fraction=read_s / step_s,
                     reward_mean=reward_sum / max(reward_count, 1),
                     truncated_fraction=truncated / max(reward_count, 1))
        if delivery is not None:
            stats.update(delivery_stats(delivery.reports()))
        logger.log(state.step, stats, token_log)
        stop = signals.requested()
        if stop or _checkpoint_due(cfg, state.step):
            checkpoint(trainer, cfg, dist, state)
        if stop:
            log.info("stop signal %s: checkpointed at step %d, exiting", stop, state.step)
            return
    if state.last_saved != state.step:
        checkpoint(trainer, cfg, dist, state)
    if delivery is not None:  # the servers outlive the trainer: they should serve (and evaluate) the final weights
        if logger.status is not None:
            logger.status.waiting(f"the servers to load the final version {delivery.publication.latest_version()}")
        delivery.wait_for(delivery.publication.latest_version(), cfg.inference.weight_update_timeout_s)
