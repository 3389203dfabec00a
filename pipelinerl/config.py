"""The run configuration: omegaconf structured dataclasses, one section per role.

Every field is documented where it is declared (units; what ``null`` means). Validation lives in each
section's ``__post_init__`` and runs when ``load_config`` turns the merged omegaconf tree into these
dataclasses, so a bad value fails before any process starts. This module must not import torch: the
CLI loads configs instantly.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import MISSING, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from pipelinerl.atomic import write_file
from pipelinerl.dtypes import MODEL_DTYPES


class ConfigError(ValueError):
    """A bad config file, key, value or override: the message names the key and how to fix it."""


def _check(ok: bool, key: str, message: str) -> None:
    """Raise the user-facing error for a bad field: names the key and says how to fix it."""
    if not ok:
        raise ConfigError(f"config `{key}`: {message}")


def _check_choice(value: Any, choices: tuple, key: str) -> None:
    _check(value in choices, key, f"got {value!r}; choose one of {', '.join(map(repr, choices))}")


def _check_positive(value: float | None, key: str, allow_null: bool = False) -> None:
    if value is None:
        _check(allow_null, key, "must be set (null is not allowed here)")
        return
    _check(value > 0, key, f"got {value!r}; must be > 0")


@dataclass
class TinyModelConfig:
    """Shape of the offline tiny Qwen2 model that `pipelinerl make-tiny-model` builds.

    vLLM-CPU needs head_dim (hidden_size / num_attention_heads) in {32, 64, 80, ...}; 16 crashes it.
    Embeddings are always untied: vLLM-CPU's weight reload is silently wrong on tied ones (FACTS.md).
    """

    hidden_size: int = 128  # model width
    num_layers: int = 2  # decoder layers
    num_attention_heads: int = 4  # query heads; head_dim = hidden_size / this
    num_key_value_heads: int = 2  # grouped-query KV heads; must divide num_attention_heads
    intermediate_size: int = 512  # FFN width
    max_position_embeddings: int = 256  # longest prompt + completion, in tokens
    seed: int = 0  # weights are a pure function of this seed and the shape
    warm_start_steps: int = 400  # supervised steps on the task before RL; 0 = raw random init
    warm_start_target: float = 0.30  # stop warm start once held-out greedy success reaches this
    warm_start_lr: float = 1e-3  # AdamW learning rate of the warm start

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_attention_heads", "num_key_value_heads",
                     "intermediate_size", "max_position_embeddings"):
            _check_positive(getattr(self, name), f"model.tiny.{name}")
        _check(self.hidden_size % self.num_attention_heads == 0, "model.tiny.hidden_size",
               "must be a multiple of num_attention_heads")
        head_dim = self.hidden_size // self.num_attention_heads
        _check(head_dim >= 32 and head_dim % 16 == 0, "model.tiny.num_attention_heads",
               f"head_dim = {head_dim}; vLLM-CPU supports 32, 64, 80, ... (use fewer heads)")
        _check(self.num_attention_heads % self.num_key_value_heads == 0, "model.tiny.num_key_value_heads",
               "must divide num_attention_heads")
        _check(self.warm_start_steps >= 0, "model.tiny.warm_start_steps", "must be >= 0")
        _check(0.0 <= self.warm_start_target <= 1.0, "model.tiny.warm_start_target", "must be in [0, 1]")
        _check_positive(self.warm_start_lr, "model.tiny.warm_start_lr")


@dataclass
class ModelConfig:
    """The policy model: an HF-format folder on a filesystem every node sees (no hub access)."""

    path: str = MISSING  # folder with config.json, weights and tokenizer; relative paths are from the CWD
    build_tiny_if_missing: bool = False  # `run` builds (and warm-starts) the tiny model at `path` if absent
    dtype: str = "float32"  # training and serving dtype: float32 | bfloat16 | float16
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)  # used only when building the tiny model

    def __post_init__(self) -> None:
        _check(bool(self.path), "model.path", "set it to an HF-format model folder")
        _check_choice(self.dtype, MODEL_DTYPES, "model.dtype")


@dataclass
class InferenceConfig:
    """vLLM inference servers (`pipelinerl serve`): `vllm` on GPUs, `vllm-cpu` here; same flags."""

    num_servers: int = 1  # vLLM servers per inference node (locally: on this machine), each on
    #                        tensor_parallel_size GPUs
    host: str = "127.0.0.1"  # address servers bind to; `0.0.0.0` on clusters
    base_port: int = 8080  # server i listens on base_port + i (per node)
    tensor_parallel_size: int = 1  # GPUs per server (vLLM tensor parallelism); 1 on CPU
    max_model_len: int | None = None  # prompt + completion limit in tokens; null = the model's own
    max_num_seqs: int = 256  # sequences one server runs concurrently (its full batch)
    gpu_memory_utilization: float = 0.9  # vLLM's fraction of GPU memory; on CPU the default 0.92 fails, use 0.3
    cpu_kv_cache_gb: float | None = 1.0  # VLLM_CPU_KVCACHE_SPACE in GiB on CPU; null = vLLM's default
    enable_prefix_caching: bool = False  # vLLM prefix cache; only with kv_on_update=recompute (see below)
    kv_on_update: str = "keep"  # running sequences after an update: keep (stale KV) | recompute (re-prefill)
    weight_update_backend: str | None = None  # nccl | gloo; null = nccl when CUDA is present, else gloo
    weight_update_timeout_s: float = 600.0  # seconds any weight-update wait may take (group join, each
    #                                          bucket, each reply); the trainer sends it to the servers
    auth_token: str | None = None  # bearer token of the control routes; null = RUN_DIR/auth_token
    #                                   (created with mode 0600 by the first server that needs it)
    startup_timeout_s: float = 600.0  # launcher waits this long for a server's /health
    reference_servers: int = 1  # servers of the frozen reference model (`serve --reference`), started only
    #                             when rl.kl_coef > 0 or rl.algorithm=dpo (with dpo_reference=reference,
    #                             the default); locally on base_port + num_servers + i, on Slurm in the
    #                             first server slots of the first inference node. They run with
    #                             max_model_len + 1 (so it must be set): scoring a sequence that fills
    #                             max_model_len takes one more token of room
    engine_args: dict = field(default_factory=dict)  # extra vLLM engine arguments, passed through as-is

    def __post_init__(self) -> None:
        for name in ("num_servers", "tensor_parallel_size", "max_num_seqs", "weight_update_timeout_s",
                     "startup_timeout_s", "reference_servers"):
            _check_positive(getattr(self, name), f"inference.{name}")
        _check(1 <= self.base_port <= 65535 - self.num_servers - self.reference_servers, "inference.base_port",
               "must be a free TCP port")
        _check_positive(self.max_model_len, "inference.max_model_len", allow_null=True)
        _check(0.0 < self.gpu_memory_utilization <= 1.0, "inference.gpu_memory_utilization", "must be in (0, 1]")
        _check_positive(self.cpu_kv_cache_gb, "inference.cpu_kv_cache_gb", allow_null=True)
        _check(self.cpu_kv_cache_gb is None or float(self.cpu_kv_cache_gb).is_integer(),
               "inference.cpu_kv_cache_gb", "vLLM takes whole GiB here (e.g. 1 or 4)")
        _check_choice(self.kv_on_update, ("keep", "recompute"), "inference.kv_on_update")
        _check(not (self.kv_on_update == "keep" and self.enable_prefix_caching), "inference.enable_prefix_caching",
               "kv_on_update=keep continues on stale KV, and vLLM cannot reset the prefix cache while those "
               "requests hold blocks: set enable_prefix_caching=false, or kv_on_update=recompute")
        _check(self.auth_token is None or len(self.auth_token) >= 16, "inference.auth_token",
               "use at least 16 characters, or null to use RUN_DIR/auth_token")
        if self.weight_update_backend is not None:
            _check_choice(self.weight_update_backend, ("nccl", "gloo"), "inference.weight_update_backend")


@dataclass
class SamplingConfig:
    """Sampling parameters of the actor's rollouts (and of evaluation when actor.eval_greedy is false).

    The servers report the log-probs of the distribution actually sampled (vLLM's processed log-probs:
    logits / temperature), and the trainer scores with the same temperature, so importance ratios, ESS and
    KL compare like with like. Truncations the trainer cannot reproduce (top_p < 1) are refused.
    """

    temperature: float = 1.0  # softmax temperature of rollouts; the trainer scores with it too. 1.0
    #                           samples the policy itself
    top_p: float = 1.0  # nucleus mass: only 1.0 (no truncation) is accepted; kept so that a config
    #                     asking for nucleus sampling gets a clear refusal rather than an unknown key
    max_new_tokens: int = 8192  # completion length limit in tokens; longer ones are marked truncated
    min_new_tokens: int = 0  # every sampled completion has at least this many tokens (vLLM's `min_tokens`:
    #                          EOS and stop tokens are masked until then); greedy evaluation ignores it.
    #                          0 = no minimum; must be <= max_new_tokens. The behaviour log-probs are then
    #                          those of the masked distribution, which the trainer does not reproduce
    #                          (ratios low by the EOS mass): for tests and benchmarks, not for training

    def __post_init__(self) -> None:
        _check(0 < self.temperature <= 2, "actor.sampling.temperature", "must be in (0, 2]: vLLM refuses more, and greedy is not RL sampling")
        _check(self.top_p == 1.0, "actor.sampling.top_p",
               f"got {self.top_p!r}; only 1.0 is supported: the trainer cannot reproduce nucleus truncation of "
               "the behaviour distribution, so importance ratios, ESS and KL would be wrong. Use temperature "
               "to sharpen sampling instead")
        _check_positive(self.max_new_tokens, "actor.sampling.max_new_tokens")
        _check(0 <= self.min_new_tokens <= self.max_new_tokens, "actor.sampling.min_new_tokens",
               f"got {self.min_new_tokens!r}; must be in [0, max_new_tokens={self.max_new_tokens}]")


@dataclass
class ActorConfig:
    """The actor: prompts in, G attempts each, rewards, the lag throttle (`pipelinerl actor`)."""

    attempts: int = 8  # G: completions sampled per prompt; advantages are computed within each group
    max_lag: int | None = None  # bound on (trainer version - oldest version in flight); 0 = on-policy;
    #                                 null = no bound
    max_groups_in_flight: int = 32  # prompt groups awaiting completion at once (keeps servers at full batch)
    request_timeout_s: float = 600.0  # one completion request; on timeout it is retried on another server
    max_retries: int = 3  # retries of one request before the actor fails with the server's error
    eval_every_steps: int = 20  # held-out evaluation every N trainer versions; 0 = never
    eval_samples: int = 200  # held-out prompts per evaluation (one completion each: pass@1)
    eval_greedy: bool = True  # greedy (temperature 0) evaluation; false = sampled like training
    sampling: SamplingConfig = field(default_factory=SamplingConfig)

    def __post_init__(self) -> None:
        _check(self.attempts >= 2, "actor.attempts", "group advantages need at least 2 attempts per prompt")
        _check(self.max_lag is None or self.max_lag >= 0, "actor.max_lag", "must be >= 0, or null for no bound")
        _check_positive(self.max_groups_in_flight, "actor.max_groups_in_flight")
        _check_positive(self.request_timeout_s, "actor.request_timeout_s")
        _check(self.max_retries >= 0, "actor.max_retries", "must be >= 0")
        _check(self.eval_every_steps >= 0, "actor.eval_every_steps", "must be >= 0 (0 disables evaluation)")
        _check(self.eval_samples >= 0, "actor.eval_samples", "must be >= 0")


@dataclass
class TaskConfig:
    """The data set and its reward."""

    name: str = "addition"  # addition (2-digit sums, answer written units-first; CPU) | math (math-verify)
    dataset_path: str | None = None  # math training rows: .jsonl/.json/.parquet of {question, answer}
    #                                     (or problem/answer, or Open-Reasoner-Zero pairs); null for addition
    eval_dataset_path: str | None = None  # math test rows (e.g. MATH-500, AIME 2024), same formats;
    #                                          null = hold out eval_fraction of dataset_path instead
    eval_fraction: float = 0.06  # share of the data held out for evaluation (never trained on)
    seed: int = 0  # data order and the held-out split
    reward_timeout_s: int = 5  # math-verify limit per parse and per comparison, whole seconds (signal.alarm);
    #                            a pathological answer then scores 0 instead of stalling the actor

    def __post_init__(self) -> None:
        _check_choice(self.name, ("addition", "math"), "task.name")
        _check(self.name != "math" or bool(self.dataset_path), "task.dataset_path",
               "the math task needs a file of {question, answer} rows (.jsonl, .json or .parquet)")
        _check(0.0 < self.eval_fraction < 1.0, "task.eval_fraction", "must be in (0, 1)")
        _check(isinstance(self.reward_timeout_s, int) and self.reward_timeout_s >= 1, "task.reward_timeout_s",
               "must be a whole number of seconds >= 1")


@dataclass
class TrainerConfig:
    """The DeepSpeed trainer (`pipelinerl train`)."""

    backend: str = "deepspeed"  # which trainer backend builds the model and optimizer: deepspeed
    zero_stage: int = 3  # DeepSpeed ZeRO stage: 0 (plain DDP), 1, 2 or 3 (sharded params, for 7B/32B)
    num_gpus: int | None = None  # trainer ranks (one per GPU; gloo processes on CPU); null = every GPU of
    #                               the training nodes / of launch.training_gpus (1 process on CPU)
    micro_batch_tokens: int = 8192  # token budget of one packed micro-batch (prompt + completion tokens)
    samples_per_step: int = 64  # samples (completions) per optimizer step, summed over all ranks
    max_steps: int | None = None  # stop after this many optimizer steps; null = until stopped
    lr: float = 1e-6  # peak learning rate
    lr_schedule: str = "constant"  # constant | linear (decay to 0 at max_steps) | cosine (to 0 at max_steps)
    warmup_steps: int = 0  # linear warm-up from 0 to lr over this many optimizer steps
    weight_decay: float = 0.0  # AdamW decoupled weight decay
    betas: list = field(default_factory=lambda: [0.9, 0.999])  # AdamW (beta1, beta2)
    adam_eps: float = 1e-8  # AdamW epsilon
    grad_clip: float | None = 1.0  # max global gradient L2 norm; null = no clipping
    gradient_checkpointing: bool = False  # recompute activations in backward (long sequences on GPU)
    attn_implementation: str = "sdpa"  # sdpa (any device; packed sequences get a block-diagonal mask) |
    #                                    flash_attention_2 (GPU with flash-attn installed; varlen kernels)
    deepspeed_config: dict = field(default_factory=dict)  # merged over the generated DeepSpeed config,
    #                                    e.g. {zero_optimization: {reduce_bucket_size: 5e8}}; {} = none
    dist_timeout_s: float = 1800.0  # a trainer collective (all-reduce, gather) waiting longer fails
    broadcast_host: str | None = None  # address the servers reach trainer rank 0 at for weight updates;
    #                                       null = this host's address on the route to the first server
    broadcast_port: int = 29511  # TCP port of the weight-update group's store on trainer rank 0
    broadcast_bucket_mb: float = 256.0  # weights are broadcast in buckets of at most this many MiB
    broadcast_checksums: bool = False  # debug: servers check a per-tensor checksum after each update
    data_timeout_s: float = 1500.0  # fail, naming the stream and cursor, if a step's data does not arrive
    #                                  within this long; must be < dist_timeout_s (the other ranks wait
    #                                  in a collective meanwhile)

    def __post_init__(self) -> None:
        _check_choice(self.backend, ("deepspeed",), "trainer.backend")
        _check_choice(self.zero_stage, (0, 1, 2, 3), "trainer.zero_stage")
        _check_positive(self.num_gpus, "trainer.num_gpus", allow_null=True)
        _check_positive(self.micro_batch_tokens, "trainer.micro_batch_tokens")
        _check_positive(self.samples_per_step, "trainer.samples_per_step")
        _check_positive(self.max_steps, "trainer.max_steps", allow_null=True)
        _check_positive(self.lr, "trainer.lr")
        _check_choice(self.lr_schedule, ("constant", "linear", "cosine"), "trainer.lr_schedule")
        _check(self.lr_schedule == "constant" or self.max_steps is not None, "trainer.lr_schedule",
               f"{self.lr_schedule!r} decays to 0 at trainer.max_steps, so set max_steps")
        _check(self.warmup_steps >= 0, "trainer.warmup_steps", "must be >= 0")
        _check(self.weight_decay >= 0, "trainer.weight_decay", "must be >= 0")
        _check(len(self.betas) == 2 and all(0.0 <= b < 1.0 for b in self.betas), "trainer.betas",
               "must be two numbers in [0, 1), e.g. [0.9, 0.999]")
        _check_positive(self.adam_eps, "trainer.adam_eps")
        _check_positive(self.grad_clip, "trainer.grad_clip", allow_null=True)
        _check_positive(self.broadcast_bucket_mb, "trainer.broadcast_bucket_mb")
        _check_positive(self.data_timeout_s, "trainer.data_timeout_s")
        _check_choice(self.attn_implementation, ("sdpa", "flash_attention_2"), "trainer.attn_implementation")
        _check_positive(self.dist_timeout_s, "trainer.dist_timeout_s")
        _check(self.data_timeout_s < self.dist_timeout_s, "trainer.data_timeout_s",
               f"got {self.data_timeout_s}; must be < trainer.dist_timeout_s ({self.dist_timeout_s}), or a starved "
               "trainer dies of a collective timeout instead of saying what it waited for")
        _check(1 <= self.broadcast_port <= 65535, "trainer.broadcast_port", "must be a free TCP port")
        _check("train_batch_size" not in self.deepspeed_config
               and "gradient_accumulation_steps" not in self.deepspeed_config, "trainer.deepspeed_config",
               "batch sizes come from trainer.samples_per_step and micro_batch_tokens; remove them here")


@dataclass
class RLConfig:
    """The RL objective. Defaults are seed 000's simplified GRPO: importance-weighted policy gradient,
    no clipping, no KL, no entropy, no value function, loss normalised by the number of sequences.
    algorithm=dpo defaults to seed 004's online DPO: anchored at the initial model, mean loss per pair."""

    algorithm: str = "grpo"  # grpo (policy gradient with group baselines) | dpo (online DPO on group pairs)
    baseline: str = "mean"  # group baseline: mean | leave_one_out (mean of the other G-1 rewards)
    divide_by_std: bool = False  # divide advantages by the group's reward std (+ 1e-6)
    ppo_clip: float | None = None  # PPO ratio clip epsilon, e.g. 0.2; null = no clipping (seed 000)
    tis_cap: float | None = None  # truncated importance sampling: cap ratios at this; null = no cap
    max_token_lag: int | None = None  # drop tokens whose lag exceeds this (seed 001); null = keep all
    kl_coef: float = 0.0  # weight of the k3 KL to the reference model (per-token log-ratio clamped to
    #                       +-10, rl/losses.py); 0 = no KL term
    value_function: bool = False  # train a critic head and use GAE advantages (seed 001's baseline)
    gamma: float = 1.0  # GAE discount (value_function only)
    gae_lambda: float = 1.0  # GAE lambda (value_function only)
    value_coef: float = 0.5  # weight of the critic's squared error (value_function only)
    dpo_beta: float = 0.1  # online DPO temperature (algorithm=dpo only); the DPO loss is the mean over
    #                        the step's pairs of -log sigmoid(beta * margin) (seed 004)
    dpo_reference: str = "reference"  # DPO's reference log-probs (algorithm=dpo only): reference (the
    #                                    frozen initial model's, from reference servers: seed 004's online
    #                                    DPO anchored at the start) | behaviour (the sampling policy's, no
    #                                    reference server; a moving trust region)

    def __post_init__(self) -> None:
        _check_choice(self.algorithm, ("grpo", "dpo"), "rl.algorithm")
        _check_choice(self.baseline, ("mean", "leave_one_out"), "rl.baseline")
        _check_positive(self.ppo_clip, "rl.ppo_clip", allow_null=True)
        _check(self.tis_cap is None or self.tis_cap >= 1.0, "rl.tis_cap", "must be >= 1, or null for no cap")
        _check(self.ppo_clip is None or self.tis_cap is None, "rl.tis_cap",
               "ppo_clip and tis_cap both reshape the importance ratio; set at most one of them")
        _check(self.algorithm == "grpo" or not self.value_function, "rl.value_function",
               "the critic's GAE advantages apply to algorithm=grpo only; DPO uses no advantages")
        _check(self.max_token_lag is None or self.max_token_lag >= 0, "rl.max_token_lag",
               "must be >= 0, or null to keep every token")
        _check(self.kl_coef >= 0, "rl.kl_coef", "must be >= 0")
        _check(0.0 <= self.gamma <= 1.0, "rl.gamma", "must be in [0, 1]")
        _check(0.0 <= self.gae_lambda <= 1.0, "rl.gae_lambda", "must be in [0, 1]")
        _check(self.value_coef >= 0, "rl.value_coef", "must be >= 0")
        _check_positive(self.dpo_beta, "rl.dpo_beta")
        _check_choice(self.dpo_reference, ("behaviour", "reference"), "rl.dpo_reference")

    @property
    def needs_reference_logprobs(self) -> bool:
        """Whether the trainer must fetch reference-model log-probs for each sample."""
        return self.kl_coef > 0 or (self.algorithm == "dpo" and self.dpo_reference == "reference")


@dataclass
class ConventionalConfig:
    """Conventional RL, the seeds' baseline (used only with `mode: conventional`): the servers generate a
    batch of B samples with frozen weights, the trainer then takes G optimizer steps on it (S =
    trainer.samples_per_step samples each), and only then are the weights synced, once per batch."""

    steps_per_batch: int = 4  # G: optimizer steps per generated batch; 1 = synchronous on-policy RL
    batch_size: int | None = None  # B: samples generated per batch; null = G x trainer.samples_per_step
    #                                    (the only valid value: every batch must fill exactly G steps)

    def __post_init__(self) -> None:
        _check_positive(self.steps_per_batch, "conventional.steps_per_batch")
        _check_positive(self.batch_size, "conventional.batch_size", allow_null=True)


@dataclass
class StreamsConfig:
    """Arrow rollout streams under RUN_DIR/streams: whole segments published by rename, readers poll
    (pipelinerl/streams/__init__.py describes the protocol)."""

    segment_max_rows: int = 256  # a writer publishes its segment at this many samples (whole groups)...
    segment_max_bytes: int = 64 * 2**20  # ...or at this many bytes of Arrow data...
    segment_max_seconds: float = 5.0  # ...or when its oldest buffered group is this many seconds old
    poll_interval_s: float = 0.2  # seconds between a waiting reader's directory listings
    fsync: bool = True  # fsync each segment before its rename and its folder after; false = faster,
    #                      but a machine crash may lose (and a restarted writer renumber) recent segments
    dedup_window: int | None = 100_000  # sample ids a reader remembers to drop duplicates (~120 bytes
    #                                         each); null = all of them (memory grows with the run)
    retention: str = "keep"  # consumed segments: keep | delete (by `release`, once a checkpoint covers them)

    def __post_init__(self) -> None:
        _check_positive(self.segment_max_rows, "streams.segment_max_rows")
        _check_positive(self.segment_max_bytes, "streams.segment_max_bytes")
        _check_positive(self.segment_max_seconds, "streams.segment_max_seconds")
        _check_positive(self.poll_interval_s, "streams.poll_interval_s")
        _check_positive(self.dedup_window, "streams.dedup_window", allow_null=True)
        _check_choice(self.retention, ("keep", "delete"), "streams.retention")


@dataclass
class CheckpointConfig:
    """Checkpoints under RUN_DIR/checkpoints: HF weights + DeepSpeed state + stream cursor + version."""

    every_steps: int | None = 100  # save every N optimizer steps; null = only on signals and at the end
    keep_last: int = 2  # complete checkpoints kept on disk (older ones are deleted)
    save_on_signal: bool = True  # save on SIGTERM / SIGUSR1 (Slurm's pre-time-limit signal), then exit

    def __post_init__(self) -> None:
        _check_positive(self.every_steps, "checkpoints.every_steps", allow_null=True)
        _check_positive(self.keep_last, "checkpoints.keep_last")


@dataclass
class LoggingConfig:
    """TensorBoard event files under RUN_DIR/tb and per-token zarr statistics under RUN_DIR/stats."""

    tensorboard: bool = True  # write TensorBoard scalars and histograms
    zarr_stats: bool = True  # append per-token lag and log-probs to zarr arrays
    every_steps: int = 1  # log trainer scalars every N optimizer steps
    progress_bar: bool = True  # console progress bar (the launcher's); off in batch jobs

    def __post_init__(self) -> None:
        _check_positive(self.every_steps, "logging.every_steps")


@dataclass
class SlurmConfig:
    """Slurm resources; each field names the #SBATCH flag it sets. null = the cluster's default."""

    account: str | None = None  # --account
    partition: str | None = None  # --partition
    qos: str | None = None  # --qos
    time: str = "3-00:00:00"  # --time, D-HH:MM:SS
    inference_nodes: int = 1  # --nodes of het component 0 (vLLM servers); 0 = colocated: every training
    #                            node also serves, on launch.inference_gpus (slurm/run_7b_one_node.sh)
    training_nodes: int = 1  # --nodes of het component 1 (DeepSpeed trainer + actor)
    gpus_per_node: int | None = 8  # --gpus-per-node; null on CPU-only clusters
    cpus_per_task: int | None = None  # --cpus-per-task
    mem: str | None = None  # --mem, e.g. "0" for the whole node
    signal_seconds: int = 300  # --signal=B:USR1@N: checkpoint and requeue N seconds before the time limit;
    #                            the trainer gets N - 30 s to checkpoint (submitit sets it; scripts: #SBATCH)
    master_port: int | None = None  # trainer's MASTER_PORT on the first training node; null = 20000 +
    #                                    job id % 10000 (jobs sharing a node then differ)

    def __post_init__(self) -> None:
        _check(self.inference_nodes >= 0, "launch.slurm.inference_nodes", "must be >= 0 (0 = colocated)")
        _check_positive(self.training_nodes, "launch.slurm.training_nodes")
        _check_positive(self.gpus_per_node, "launch.slurm.gpus_per_node", allow_null=True)
        _check_positive(self.cpus_per_task, "launch.slurm.cpus_per_task", allow_null=True)
        _check(self.signal_seconds >= 0, "launch.slurm.signal_seconds", "must be >= 0")
        _check(self.master_port is None or 1 <= self.master_port <= 65535, "launch.slurm.master_port",
               "must be a TCP port, or null to derive one from the job id")


@dataclass
class LaunchConfig:
    """Where the roles run."""

    backend: str = "local"  # local (child processes of `pipelinerl run`) | slurm
    torch_threads: int | None = None  # torch threads per CPU process; null = torch's default
    inference_gpus: str | None = None  # GPU ids of a node the servers use, e.g. "0-3" (tensor_parallel_size
    #                                     contiguous ids per server); null = the first half of the node's
    #                                     GPUs. Locally, and on Slurm only with slurm.inference_nodes=0 (ids
    #                                     are positions in the step's CUDA_VISIBLE_DEVICES); separate
    #                                     inference nodes use all their GPUs and setting this is an error
    training_gpus: str | None = None  # GPU ids of a node the trainer ranks use, one per rank, e.g. "4-7";
    #                                    null = the second half of the node's GPUs; same scope as
    #                                    inference_gpus, and disjoint from it
    slurm: SlurmConfig = field(default_factory=SlurmConfig)

    def __post_init__(self) -> None:
        from pipelinerl.launch.placement import parse_gpu_ids

        _check_choice(self.backend, ("local", "slurm"), "launch.backend")
        _check_positive(self.torch_threads, "launch.torch_threads", allow_null=True)
        for name in ("inference_gpus", "training_gpus"):
            try:
                if getattr(self, name) is not None:
                    parse_gpu_ids(getattr(self, name))
            except ValueError as err:
                _check(False, f"launch.{name}", str(err))


@dataclass
class Config:
    """One run. `run_dir` is the bus every role shares (DESIGN.md)."""

    run_dir: str = MISSING  # the run directory on a filesystem all nodes see; re-using one resumes it
    seed: int = 0  # seeds sampling, data order and initialisation
    mode: str = "pipeline"  # pipeline (in-flight updates after every step, lag bounded by actor.max_lag) |
    #                         conventional (generate a batch, G steps, one sync: the `conventional` section)
    model: ModelConfig = field(default_factory=ModelConfig)
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    streams: StreamsConfig = field(default_factory=StreamsConfig)
    checkpoints: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    conventional: ConventionalConfig = field(default_factory=ConventionalConfig)

    def __post_init__(self) -> None:
        _check(bool(self.run_dir), "run_dir", "set it to a folder (it is created if missing)")
        _check(self.trainer.samples_per_step % self.actor.attempts == 0, "trainer.samples_per_step",
               f"must be a multiple of actor.attempts ({self.actor.attempts}) so whole groups fill a step")
        groups = self.trainer.samples_per_step // self.actor.attempts
        _check(self.trainer.num_gpus is None or groups % self.trainer.num_gpus == 0, "trainer.num_gpus",
               f"{groups} groups per step (trainer.samples_per_step / actor.attempts) do not split evenly over "
               f"{self.trainer.num_gpus} trainer ranks: make samples_per_step a multiple of attempts x ranks")
        _check(self.actor.sampling.temperature == 1.0 or not self.rl.needs_reference_logprobs,
               "actor.sampling.temperature", f"got {self.actor.sampling.temperature}; the reference servers' "
               "log-probs (rl.kl_coef > 0, DPO against the reference) are of the untempered model, while the "
               "trainer scores the tempered one: sample at 1.0, or drop the reference term")
        _check_choice(self.mode, ("pipeline", "conventional"), "mode")
        if self.mode == "conventional":
            self._check_conventional()

    def _check_conventional(self) -> None:
        G, S = self.conventional.steps_per_batch, self.trainer.samples_per_step
        if self.conventional.batch_size is None:
            self.conventional.batch_size = G * S  # derived here, the one place it is computed
        _check(self.conventional.batch_size == G * S, "conventional.batch_size",
               f"got {self.conventional.batch_size}; a batch must fill exactly G = {G} steps of "
               f"trainer.samples_per_step = {S} samples: set it to {G * S} or null")
        _check(self.trainer.max_steps is None or self.trainer.max_steps % G == 0, "trainer.max_steps",
               f"got {self.trainer.max_steps}; conventional mode trains whole batches: use a multiple of "
               f"conventional.steps_per_batch ({G})")
        _check(self.actor.max_lag is None, "actor.max_lag",
               f"conventional mode bounds the lag by construction (at most G - 1 = {G - 1}); set it to null")


def _all_keys(schema: type, prefix: str = "") -> list[str]:
    """Every dotted key of a structured config section (for 'did you mean' hints)."""
    keys = []
    for f in dataclasses.fields(schema):
        keys.append(prefix + f.name)
        if dataclasses.is_dataclass(f.default_factory):
            keys.extend(_all_keys(f.default_factory, f"{prefix}{f.name}."))
    return keys


def _unknown_key_error(key: str) -> ConfigError:
    close = difflib.get_close_matches(key, _all_keys(Config), n=1)
    hint = f"; did you mean `{close[0]}`?" if close else "; `pipelinerl show-config` lists the valid keys"
    return ConfigError(f"config: unknown key `{key}`{hint}")


def _omegaconf_error(err: OmegaConfBaseException) -> ConfigError:
    key = getattr(err, "full_key", None) or "?"
    if isinstance(err, ConfigKeyError):
        return _unknown_key_error(key)
    if isinstance(err, ValidationError):
        return ConfigError(f"config `{key}`: {err.msg.splitlines()[0]}")
    return ConfigError(f"config `{key}`: {err}")


def load_config(path: str | Path | None = None, overrides: tuple[str, ...] | list[str] = ()) -> Config:
    """YAML file (optional) + `key=value` overrides -> validated Config. Errors are ConfigError."""
    schema = OmegaConf.structured(Config)
    layers = []
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        layers.append(OmegaConf.load(path))
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override {item!r} is not of the form key=value (e.g. trainer.lr=1e-5)")
    if overrides:
        layers.append(OmegaConf.from_dotlist(list(overrides)))
    try:
        merged = OmegaConf.merge(schema, *layers)
        missing = sorted(OmegaConf.missing_keys(merged))
        if missing:
            raise ConfigError(f"config: required key(s) {', '.join(f'`{k}`' for k in missing)} not set; "
                             "set them in the YAML file or as key=value overrides")
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise _omegaconf_error(err) from None


def to_yaml(cfg: Config) -> str:
    """The resolved config as YAML (what `show-config` prints and the launcher writes to RUN_DIR)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def save_config(cfg: Config, path: str | Path) -> None:
    """Write the resolved config atomically (temporary file + rename)."""
    write_file(path, to_yaml(cfg))
