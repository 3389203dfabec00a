"""The `trainer`, `rl` and `conventional` sections: the optimizer, the objective, the baseline schedule."""

from __future__ import annotations

from dataclasses import dataclass

from pipelinerl.config.fields import check, check_choice, check_positive, doc, section

TRAINER_BACKENDS = ("deepspeed", "fsdp2")  # trainer/backends.py maps each name to its class (and checks the two agree)


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class LoraConfig:
    """LoRA RL (peft): low-rank adapters beside the target linear layers are trained, the base stays frozen.
    Servers always get the merged weights (W + alpha / rank * B A), dense or as deltas, so they serve as
    for full fine-tuning; checkpoints hold the adapter (adapter/, peft's format), the trainer state and the
    merged HF folder."""

    rank: int = doc(0, "adapter rank r; 0 = off (every weight trained)")
    alpha: float = doc(16.0, "scaling numerator: the update is alpha / rank * B A")
    target_modules: list = doc(list(LORA_TARGETS), "names (last component) of the linear layers that get adapters")
    dropout: float = doc(0.0, "dropout on the adapter's input (training only)")
    seed: int = doc(0, "the adapters' initial values (A random, B zero) are a function of this seed, the same on "
                       "every rank")

    def __post_init__(self) -> None:
        check(self.rank >= 0, "trainer.lora.rank", "must be >= 0 (0 = off)")
        check_positive(self.alpha, "trainer.lora.alpha")
        check(bool(self.target_modules) and all(isinstance(t, str) and t for t in self.target_modules),
              "trainer.lora.target_modules", "must be a non-empty list of module names, e.g. [q_proj, v_proj]")
        check(0.0 <= self.dropout < 1.0, "trainer.lora.dropout", "must be in [0, 1)")


@dataclass
class TrainerConfig:
    """The trainer (`pipelinerl train`): its backend, batch shape, optimizer and timeouts."""

    backend: str = doc("deepspeed", f"which trainer backend builds the model and optimizer: "
                                    f"{' | '.join(TRAINER_BACKENDS)} (FSDP2: fully_shard per decoder layer, float32 "
                                    "master weights, model.dtype compute)")
    zero_stage: int = doc(3, "DeepSpeed ZeRO stage: 0 (plain DDP), 1, 2 or 3 (sharded params, for 7B/32B); "
                             "backend deepspeed only (FSDP2 always shards weights, gradients and optimizer state)")
    num_gpus: int | None = doc(None, "trainer ranks (one per GPU; gloo processes on CPU)",
                               null="every GPU of the training nodes / of launch.training_gpus (1 process on CPU)")
    micro_batch_tokens: int = doc(8192, "token budget of one packed micro-batch (prompt + completion tokens)",
                                  unit="tokens")
    samples_per_step: int = doc(64, "samples (completions) per optimizer step, summed over all ranks")
    max_steps: int | None = doc(None, "stop after this many optimizer steps", unit="steps", null="until stopped")
    lr: float = doc(1e-6, "peak learning rate (after warm-up)")
    lr_schedule: str = doc("constant", "constant | linear (decay to 0 at max_steps) | cosine (to 0 at max_steps)")
    warmup_steps: int = doc(0, "linear warm-up from 0 to lr over this many optimizer steps", unit="steps")
    weight_decay: float = doc(0.0, "AdamW decoupled weight decay")
    betas: list = doc([0.9, 0.999], "AdamW (beta1, beta2)")
    adam_eps: float = doc(1e-8, "AdamW epsilon")
    grad_clip: float | None = doc(1.0, "max global gradient L2 norm", null="no clipping")
    lora: LoraConfig = section(LoraConfig, "LoRA adapters instead of full fine-tuning (rank 0: off)")
    gradient_checkpointing: bool = doc(False, "recompute activations in backward (long sequences on GPU)")
    logprob_chunk_tokens: int | None = doc(
        1024, "the LM head and log-softmax run over this many completion tokens at a time, each chunk's logits "
              "recomputed in backward: the logits then need a few float32 [chunk, vocab] buffers (0.6 GB each at "
              "1024 x 152k) instead of the micro-batch's; equal to the unchunked result to float tolerance",
        unit="tokens",
        null="no chunking: the micro-batch's whole [tokens, vocab] logits at once (10 GB in float32 at 16k x 152k, "
             "plus its gradient)")
    attn_implementation: str = doc(
        "auto", "auto: flash_attention_2 on CUDA in bfloat16/float16 when flash-attn imports, else sdpa (the trainer "
                "logs which ran) | sdpa (any device; packed sequences get a T x T block-diagonal mask and attention "
                "over the whole micro-batch) | flash_attention_2 (GPU with flash-attn installed; varlen kernels over "
                "each packed sequence)")
    deepspeed_config: dict = doc({}, "merged over the generated DeepSpeed config, e.g. {zero_optimization: "
                                     "{reduce_bucket_size: 5e8}}; {} = none")
    dist_timeout_s: float = doc(1800.0, "a trainer collective (all-reduce, gather) waiting longer fails", unit="s")
    jit_lock_stale_s: float = doc(
        600.0, "at start-up each trainer rank removes a torch JIT-extension build lock "
               "(TORCH_EXTENSIONS_DIR/<op>/lock, e.g. DeepSpeed's deepspeed_shm_comm) that no process on its host "
               "holds open and that is older than this: one left by a killed process, on which every later JIT "
               "load would wait forever (logged as a warning); a younger one is kept, since a rank of another node "
               "sharing the folder may be building (a build takes 1-2 minutes)", unit="s")
    broadcast_host: str | None = doc(None, "address the servers reach trainer rank 0 at for weight updates",
                                     null="this host's address on the route to the first server")
    broadcast_port: int = doc(29511, "TCP port of the weight-update group's store on trainer rank 0")
    broadcast_bucket_mb: float = doc(256.0, "weights are broadcast in buckets of at most this size", unit="MiB")
    broadcast_checksum_every: int = doc(
        0, "every N-th version the servers check each updated tensor's CRC32 before loading it (a mismatch is "
           "logged, and in delta mode the update is resent dense at once); 0 = never, 1 = every update (a debug "
           "option: CRC32 runs on the CPU at about 1 GB/s)", unit="versions")
    broadcast_delta: str = doc(
        "off", "auto: after the first update, send each tensor as a delta (the positions and new values of its "
               "changed elements, compared bit by bit: lossless) when that is smaller than the tensor, to servers "
               "that hold the previous version; off: every tensor whole. At RL learning rates most bf16 weights do "
               "not change in a step, so auto sends a few percent of the bytes "
               "(tools/bench_weight_update.py). Costs one host-RAM copy of the model on trainer rank 0 and on "
               "every server worker, and the whole gather happens before the send (no overlap)")
    data_timeout_s: float = doc(1500.0, "fail, naming the stream and cursor, if a step's data does not arrive "
                                        "within this long; must be < dist_timeout_s (the other ranks wait in a "
                                        "collective meanwhile). `pipelinerl run` starts the trainer with the servers, "
                                        "so the first step's wait includes their start-up", unit="s")
    delivery_fail_after_versions: int = doc(
        5, "weight delivery (rank 0's own thread: every announced server is brought to the newest published "
           "version) stops the run when every server failed every attempt for this many consecutive published "
           "versions and for at least delivery_fail_after_s; the error names the servers and their last errors",
        unit="versions")
    delivery_fail_after_s: float = doc(120.0, "see delivery_fail_after_versions: how long the failures must "
                                              "last too (a server restart takes a while)", unit="s")
    delivery_deadline_factor: float = doc(
        3.0, "straggler isolation (weights/deadline.py): forming the weight-update group, and each delivery round, "
             "must end within factor x the median of the last 8 successful ones (a round's scaled up to its own "
             "bytes) + delivery_deadline_margin_s, clamped to [delivery_deadline_floor_s, "
             "delivery_deadline_ceiling_s]; at the deadline the round is abandoned, a member still silent "
             "3 s later, or else unfinished while another had finished, is set aside (backed off, re-joins once "
             "its /status answers) and the others go on at once")
    delivery_deadline_margin_s: float = doc(2.0, "see delivery_deadline_factor: added to the scaled median",
                                            unit="s")
    delivery_deadline_floor_s: float = doc(3.0, "see delivery_deadline_factor: the shortest deadline (load "
                                                "noise of a small model's sub-second rounds)", unit="s")
    delivery_deadline_ceiling_s: float = doc(
        120.0, "see delivery_deadline_factor: the longest deadline, and the deadline while nothing was measured "
               "yet (the first round) or after a deadline missed with every member answering; "
               "inference.weight_update_timeout_s still bounds it", unit="s")
    wait_log_s: float = doc(30.0, "a wait longer than this (for a step's data, for servers to reach a version) "
                                  "logs what it waits for and what the servers report, again every wait_log_s",
                            unit="s")

    def __post_init__(self) -> None:
        check_choice(self.backend, TRAINER_BACKENDS, "trainer.backend")
        check_choice(self.zero_stage, (0, 1, 2, 3), "trainer.zero_stage")
        check_positive(self.num_gpus, "trainer.num_gpus", allow_null=True)
        check_positive(self.micro_batch_tokens, "trainer.micro_batch_tokens")
        check_positive(self.logprob_chunk_tokens, "trainer.logprob_chunk_tokens", allow_null=True)
        check_positive(self.samples_per_step, "trainer.samples_per_step")
        check_positive(self.max_steps, "trainer.max_steps", allow_null=True)
        check_positive(self.lr, "trainer.lr")
        check_choice(self.lr_schedule, ("constant", "linear", "cosine"), "trainer.lr_schedule")
        check(self.lr_schedule == "constant" or self.max_steps is not None, "trainer.lr_schedule",
              f"{self.lr_schedule!r} decays to 0 at trainer.max_steps, so set max_steps")
        check(self.warmup_steps >= 0, "trainer.warmup_steps", "must be >= 0")
        check(self.weight_decay >= 0, "trainer.weight_decay", "must be >= 0")
        check(len(self.betas) == 2 and all(0.0 <= b < 1.0 for b in self.betas), "trainer.betas",
              "must be two numbers in [0, 1), e.g. [0.9, 0.999]")
        check_positive(self.adam_eps, "trainer.adam_eps")
        check_positive(self.grad_clip, "trainer.grad_clip", allow_null=True)
        check_positive(self.broadcast_bucket_mb, "trainer.broadcast_bucket_mb")
        check(self.broadcast_checksum_every >= 0, "trainer.broadcast_checksum_every", "must be >= 0 (0 = never)")
        check_choice(self.broadcast_delta, ("auto", "off"), "trainer.broadcast_delta")
        check_positive(self.data_timeout_s, "trainer.data_timeout_s")
        check_positive(self.delivery_fail_after_versions, "trainer.delivery_fail_after_versions")
        check(self.delivery_fail_after_s >= 0, "trainer.delivery_fail_after_s", "must be >= 0")
        check_positive(self.wait_log_s, "trainer.wait_log_s")
        check_positive(self.delivery_deadline_factor, "trainer.delivery_deadline_factor")
        check(self.delivery_deadline_margin_s >= 0, "trainer.delivery_deadline_margin_s", "must be >= 0")
        check_positive(self.delivery_deadline_floor_s, "trainer.delivery_deadline_floor_s")
        check(self.delivery_deadline_ceiling_s >= self.delivery_deadline_floor_s, "trainer.delivery_deadline_ceiling_s",
              f"got {self.delivery_deadline_ceiling_s}; must be >= trainer.delivery_deadline_floor_s "
              f"({self.delivery_deadline_floor_s})")
        check_choice(self.attn_implementation, ("auto", "sdpa", "flash_attention_2"), "trainer.attn_implementation")
        check_positive(self.dist_timeout_s, "trainer.dist_timeout_s")
        check_positive(self.jit_lock_stale_s, "trainer.jit_lock_stale_s")
        check(self.data_timeout_s < self.dist_timeout_s, "trainer.data_timeout_s",
              f"got {self.data_timeout_s}; must be < trainer.dist_timeout_s ({self.dist_timeout_s}), or a starved "
              "trainer dies of a collective timeout instead of saying what it waited for")
        check(1 <= self.broadcast_port <= 65535, "trainer.broadcast_port", "must be a free TCP port")
        check("train_batch_size" not in self.deepspeed_config
              and "gradient_accumulation_steps" not in self.deepspeed_config, "trainer.deepspeed_config",
              "batch sizes come from trainer.samples_per_step and micro_batch_tokens; remove them here")


@dataclass
class RLConfig:
    """The RL objective. Defaults are seed 000's simplified GRPO: importance-weighted policy gradient,
    no clipping, no KL, no entropy, no value function, loss normalised by the number of sequences.
    algorithm=dpo defaults to seed 004's online DPO: anchored at the initial model, mean loss per pair."""

    algorithm: str = doc("grpo", "grpo (policy gradient with group baselines) | dpo (online DPO on group pairs)")
    baseline: str = doc("mean", "group baseline: mean | leave_one_out (mean of the other G-1 rewards)")
    divide_by_std: bool = doc(False, "divide advantages by the group's reward std (+ 1e-6)")
    ppo_clip: float | None = doc(None, "PPO ratio clip epsilon, e.g. 0.2", null="no clipping (seed 000)")
    tis_cap: float | None = doc(None, "truncated importance sampling: cap ratios at this", null="no cap")
    max_token_lag: int | None = doc(None, "drop tokens whose lag exceeds this (seed 001)", unit="versions",
                                    null="keep all")
    kl_coef: float = doc(0.0, "weight of the k3 KL to the reference model (per-token log-ratio clamped to +-10, "
                              "rl/losses.py); 0 = no KL term")
    value_function: bool = doc(False, "train a critic head and use GAE advantages (seed 001's baseline)")
    gamma: float = doc(1.0, "GAE discount (value_function only)")
    gae_lambda: float = doc(1.0, "GAE lambda (value_function only)")
    value_coef: float = doc(0.5, "weight of the critic's squared error (value_function only)")
    filter_zero_variance: bool = doc(False, "dynamic sampling (DAPO): a group whose G rewards are all equal gets "
                                            "advantage 0 from the group baseline and is not trained; the actor "
                                            "writes it to the `filtered` stream topic instead of the rollouts and "
                                            "generates on, so every step trains samples_per_step informative "
                                            "samples (with rl.kl_coef > 0 such groups lose only their KL term)")
    overlong: str = doc(
        "none", "completions cut at the length limit (truncated rows): none (trained like any other; seed 000) | "
                "filter (DAPO's overlong filtering: their loss is masked; they stay in their group's baseline and "
                "count as trained samples) | soft (DAPO's soft overlong punishment of the math task's reward, "
                "zone and size from task.overlong_buffer_tokens and task.overlong_penalty)")
    dpo_beta: float = doc(0.1, "online DPO temperature (algorithm=dpo only); the DPO loss is the mean over the "
                               "step's pairs of -log sigmoid(beta * margin) (seed 004)")
    dpo_reference: str = doc("reference", "DPO's reference log-probs (algorithm=dpo only): reference (the frozen "
                                          "initial model's, from reference servers: seed 004's online DPO "
                                          "anchored at the start) | behaviour (the sampling policy's, no "
                                          "reference server; a moving trust region)")
    teacher: str | None = doc(None, "on-policy distillation: HF folder of a teacher with the policy's tokenizer. The "
                                     "reference servers serve it instead of model.path (reference log-probs are the "
                                     "teacher's), and each token's advantage is teacher_coef x (teacher - behaviour "
                                     "log-prob), the negative of its reverse-KL estimate, plus the task's group "
                                     "advantage x teacher_task_weight. rl.kl_coef > 0 then pulls toward the "
                                     "teacher too", null="no teacher")
    teacher_coef: float = doc(1.0, "weight of the per-token distillation advantage (rl.teacher only)")
    teacher_task_weight: float = doc(0.0, "weight of the task reward's group advantage mixed into the distillation "
                                          "advantage (rl.teacher only); 0 = pure distillation")
    teacher_top_k: int = doc(0, "rl.teacher only. 0: the sampled token's teacher - student gap is its advantage (one "
                                "sample of the reverse KL per position). k > 0: the reference servers also return the "
                                "teacher's k likeliest tokens at every position of the student's samples, and each "
                                "kept token adds teacher_coef x KL(teacher top-k || student) of its position to the "
                                "loss (exact over those k tokens; the teacher's mass outside them is left out) "
                                "instead of the sampled-token advantage; the task advantage still weighs "
                                "teacher_task_weight. k above 20 raises the reference servers' --max-logprobs")
    routing_replay: str = doc(
        "none", "a mixture of experts: none (the trainer routes every token itself) | r3 (rollout routing replay: each "
                "sampled token's forward row goes to the experts the server routed it to, with gates from the "
                "trainer's dense router probabilities over them; the servers return them, as with "
                "inference.return_routed_experts). Either way, when the servers return routing the share of "
                "token-layer routings the trainer would choose differently is logged (moe/routing_mismatch). "
                "Single-turn completions only: multi-turn episodes carry no routing yet")
    moe_aux_coef: float = doc(
        0.0, "a mixture of experts: weight of the load-balancing auxiliary loss (Switch Transformer's, as "
             "transformers computes it: k when the load is uniform) added to the loss; its value is logged "
             "(moe_aux_loss) either way, with each MoE layer's expert load (moe/...)")

    def __post_init__(self) -> None:
        check_choice(self.algorithm, ("grpo", "dpo"), "rl.algorithm")
        check_choice(self.baseline, ("mean", "leave_one_out"), "rl.baseline")
        check(self.moe_aux_coef >= 0, "rl.moe_aux_coef", "must be >= 0")
        check_choice(self.routing_replay, ("none", "r3"), "rl.routing_replay")
        check_positive(self.ppo_clip, "rl.ppo_clip", allow_null=True)
        check(self.tis_cap is None or self.tis_cap >= 1.0, "rl.tis_cap", "must be >= 1, or null for no cap")
        check(self.ppo_clip is None or self.tis_cap is None, "rl.tis_cap",
              "ppo_clip and tis_cap both reshape the importance ratio; set at most one of them")
        check(self.algorithm == "grpo" or not self.value_function, "rl.value_function",
              "the critic's GAE advantages apply to algorithm=grpo only; DPO uses no advantages")
        check(not (self.filter_zero_variance and self.value_function), "rl.filter_zero_variance",
              "the critic learns from every group (GAE advantages are not zero for equal rewards): turn one off")
        check(self.max_token_lag is None or self.max_token_lag >= 0, "rl.max_token_lag",
              "must be >= 0, or null to keep every token")
        check(self.kl_coef >= 0, "rl.kl_coef", "must be >= 0")
        check(0.0 <= self.gamma <= 1.0, "rl.gamma", "must be in [0, 1]")
        check(0.0 <= self.gae_lambda <= 1.0, "rl.gae_lambda", "must be in [0, 1]")
        check(self.value_coef >= 0, "rl.value_coef", "must be >= 0")
        check_positive(self.dpo_beta, "rl.dpo_beta")
        check_choice(self.dpo_reference, ("behaviour", "reference"), "rl.dpo_reference")
        check_choice(self.overlong, ("none", "filter", "soft"), "rl.overlong")
        check(self.teacher is None or (self.algorithm == "grpo" and not self.value_function), "rl.teacher",
              "distillation gives per-token advantages to the policy gradient: use algorithm=grpo without "
              "value_function")
        check(self.teacher_coef > 0, "rl.teacher_coef", "must be > 0")
        check(self.teacher_task_weight >= 0, "rl.teacher_task_weight", "must be >= 0")
        check(self.teacher_top_k >= 0, "rl.teacher_top_k", "must be >= 0 (0: the sampled token's gap alone)")
        check(self.teacher_top_k == 0 or self.teacher is not None, "rl.teacher_top_k",
              "needs rl.teacher (the teacher's top-k tokens are the distillation target)")

    @property
    def needs_reference_logprobs(self) -> bool:
        """Whether the trainer must fetch reference-model (with rl.teacher: teacher) log-probs for each sample."""
        return (self.kl_coef > 0 or (self.algorithm == "dpo" and self.dpo_reference == "reference")
                or self.teacher is not None)


@dataclass
class ConventionalConfig:
    """Conventional RL, the seeds' baseline (used only with `mode: conventional`): the servers generate a
    batch of B samples with frozen weights, the trainer then takes G optimizer steps on it (S =
    trainer.samples_per_step samples each), and only then are the weights synced, once per batch."""

    steps_per_batch: int = doc(4, "G: optimizer steps per generated batch; 1 = synchronous on-policy RL",
                               unit="steps")
    batch_size: int | None = doc(None, "B: samples generated per batch",
                                 null="G x trainer.samples_per_step (the only valid value: every batch must "
                                      "fill exactly G steps); derived in Config")

    def __post_init__(self) -> None:
        check_positive(self.steps_per_batch, "conventional.steps_per_batch")
        check_positive(self.batch_size, "conventional.batch_size", allow_null=True)
