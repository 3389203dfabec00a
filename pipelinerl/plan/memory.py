"""`pipelinerl plan`: per role and per GPU, the memory a config needs, against the GPU's memory.

`plan_config` is pure arithmetic on the config and the model's shape (no torch, no I/O); `check_before_start`
is what `pipelinerl run` and the Slurm launcher call before starting anything. GB = 10^9 bytes throughout.
P = parameters, N = trainer ranks, TP = tensor_parallel_size, b = bytes per element of model.dtype (2 in
bfloat16), T = trainer.micro_batch_tokens, C = trainer.logprob_chunk_tokens, H, L, I, V = hidden size,
layers, FFN width, vocabulary. The estimates, so that a measurement can correct them (tools/gpu_check.sh):

trainer rank  params: b x P, sharded over N by ZeRO-3; grads: the float32 accumulation (4 B x P in bfloat16
              with ZeRO >= 1, else b x P), sharded from ZeRO-2; optimizer (sharded from ZeRO-1): float32
              master (when b < 4) + Adam m and v = 12 B x P / N in bfloat16, so 18 B x P / N in all with
              ZeRO-3; zero_buffers: ZeRO-3's live gathered parameters (stage3_max_live_parameters, default
              1e9) + a gradient reduce bucket (reduce_bucket_size, default 5e8), b bytes each, at most P;
              activations: each layer keeps about b x (8H + 2 kv_dim + 4I) per token (RMSNorm's float32
              input counts double; q, k, v; attention output; MLP gate, up, act, product). With gradient
              checkpointing only each layer's input stays (L x T x H x b) plus one layer recomputed and its
              gradients (2 x T x layer); without, (L + 1) x T x layer. Log-prob chunk (model.LogprobHead):
              C x V x (8 + b) (a float32 chunk of logits or their gradient, one float32 temporary, the cast
              copy) + the head's float32 gradient and its cast V x H x (4 + b); unchunked, T x V x (8 + b).
              Every head GEMM takes the b-byte weight itself (no float32 copy, model.py). attention_mask:
              sdpa over packed sequences gets one block-diagonal boolean mask of T x T bytes per micro-batch
              (trainer.attn_implementation sdpa, or auto, which may fall back to it); flash_attention_2
              needs none. Optimizer step (torch AdamW after ZeRO's float32 gradient copy): 8 B x
              min(P / N, sub_group_size). The step and the forward/backward never coexist: the larger of the
              two counts. cuda_runtime: CUDA context, NCCL communicators, allocator fragmentation (a fixed
              2 GB). The plan is rank 0's, the fullest: with NCCL weight updates its two send buffers,
              2 x max(bucket, largest tensor x b), stay on its GPU from one round to the next.
              Host RAM of rank 0's node: the published versions, 2 x b x P (weights/publish.py; 3 x b x P
              with evaluation servers, whose delivery leases a version of its own), with delta updates
              each delivery's encoder base, b x P more each, and with ZeRO's offload_optimizer the float32
              master and Adam moments of the node's ranks (12 B x P x their share).
              A mixture of experts (shapes.ModelShape): P counts every expert; activations count the FFN
              width a token passes through (its k routed experts) and the router's float32 logits; the largest
              tensor (an update bucket's floor) is a layer's fused gate-up experts, E x 2 x I_e x H.
              trainer.backend=fsdp2: float32 master params, float32 grads and Adam m and v, all sharded over
              N: 16 B x P / N; fsdp_buffers: the root module's gathered params (embeddings, final norm, LM
              head: R = V x H x (1 or 2 untied) + H), which stay gathered from forward to backward, and two
              decoder layers' (the one computing and the one prefetched), b bytes each, plus the largest unit's
              unsharded gradient before and after its float32 reduce cast ((b + 4) x max(R, layer)); the
              optimizer step (torch AdamW's multi-tensor temporaries): 8 B x P / N.
              trainer.lora: gradients, optimizer state and the optimizer step count only the adapters'
              A = r x (in + out) parameters per adapted layer instead of P (the frozen base keeps its params
              share, b x P: no float32 master on either backend; FSDP2's adapters: 4 B x A / N), and the
              frozen LM head has no gradient.
policy server vLLM takes gpu_memory_utilization x GPU for weights (b x P / TP), its profiled activations
              (max_num_batched_tokens x (3I + q_dim + 2 kv_dim) / TP x b + 4 H x b, and the sampler's
              float32 logits of max_num_seqs rows, 4 copies), CUDA graphs and runtime (a fixed 2.5 GB); the rest
              is KV cache, which must hold at least one max_model_len sequence. Beyond vLLM's share: the update
              staging (inference.update_staging: host = two buckets, each at least the largest tensor, so that a
              bucket's copy to the host overlaps the next one's receive; device = the
              full model, TP 1 only) and the weight-update group's NCCL buffers (0.5 GB), both on the GPU of
              the server's first TP worker, the only one that receives. Host RAM per server (`host`): host
              staging, b x P (one copy: with TP > 1 in /dev/shm, which every TP worker loads from), and with
              delta updates the base, b x P more.
host RAM      per node: inference.num_servers servers (each counted as a policy server), plus rank 0's trainer
              share on the node that has it (locally: one node; on Slurm the first training node, which also
              serves when colocated), against launch.host_memory_gb (null: this machine's memory for a local
              run; on Slurm launch.slurm.mem when it names a size; otherwise not checked).
reference     the same without staging, plus the prompt log-probs it computes outside vLLM's profiled share:
              max_num_batched_tokens x V x (b + 8) (logits, their float32 copy, the log-softmax).
reward        the same as a reference server of the reward model's shape (reward.model_path/config.json, else
              the policy's), without the sampler's logits nor prompt log-probs: a one-logit head; a judge
              (reward.kind=judge) is a whole language model, with the sampler's logits.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import subprocess
from dataclasses import dataclass, field

from pipelinerl.config import Config, ConfigError
from pipelinerl.plan.shapes import ModelShape, load_shape, reward_shape, shape_at

log = logging.getLogger(__name__)

GB = 1e9
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
TRAINER_RUNTIME_GB = 2.0  # CUDA context + NCCL communicators + allocator fragmentation
SERVER_RUNTIME_GB = 2.5  # inside vLLM's share: CUDA graphs, CUDA context, TP communicators
UPDATE_GROUP_GB = 0.5  # the weight-update group's NCCL buffers, allocated after vLLM took its share
VLLM_BATCHED_TOKENS = 8192  # vLLM's default max_num_batched_tokens for its OpenAI server on large GPUs
SAMPLER_COPIES = 4  # float32 [max_num_seqs, V] buffers of vLLM's sampler (logits, tempered, probs, logprobs)
ZERO_DEFAULTS = {"stage3_max_live_parameters": 1e9, "reduce_bucket_size": 5e8, "sub_group_size": 1e9}


@dataclass
class RolePlan:
    """One role's budget on one of its GPUs: items in GB, their total, what does not fit and how to fix it."""

    title: str
    items: dict[str, float]
    per_gpu_gb: float
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    host: dict[str, float] = field(default_factory=dict)  # host RAM in GB: per server; the trainer's, rank 0's


@dataclass
class MemoryPlan:
    gpu_memory_gb: float
    model: str  # where the shape came from
    params: int
    roles: dict[str, RolePlan]  # "trainer", "server", and "reference" / "reward" when the run has those servers
    host_nodes: dict[str, float] = field(default_factory=dict)  # host RAM in GB per kind of node
    host_memory_gb: float | None = None  # one node's memory (None: not checked)

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def problems(self) -> list[str]:
        return [p for role in self.roles.values() for p in role.problems] + self.host_problems

    @property
    def host_problems(self) -> list[str]:
        if self.host_memory_gb is None:
            return []
        return [f"host RAM: {node} needs {gb:.1f} GB > {self.host_memory_gb:g} GB (launch.host_memory_gb); lower "
                "inference.num_servers per node, set trainer.broadcast_delta=off, or use inference.update_staging="
                "device" for node, gb in self.host_nodes.items() if gb > self.host_memory_gb]

    def to_json(self) -> dict:
        """The `--json` schema (tools/gpu_check.py reads it)."""
        return {"gpu_memory_gb": float(self.gpu_memory_gb), "fits": self.fits,
                "roles": {name: {"per_gpu_gb": round(r.per_gpu_gb, 3),
                                 "items": {k: round(v, 3) for k, v in r.items.items()}}
                          for name, r in self.roles.items()},
                "host_memory_gb": self.host_memory_gb,
                "host_nodes": {k: round(v, 3) for k, v in self.host_nodes.items()}}

    def render(self) -> str:
        lines = [f"memory plan on {self.gpu_memory_gb:g} GB GPUs (GB = 10^9 bytes); model: {self.params:,} "
                 f"parameters, shape from {self.model}"]
        for role in self.roles.values():
            lines.append(f"\n{role.title}: {role.per_gpu_gb:.1f} GB per GPU")
            lines += [f"  {k:<28} {v:8.2f} GB" for k, v in role.items.items()]
            per = "per server" if role.title != "trainer rank" else "on rank 0's node"
            lines += [f"  host RAM: {k:<18} {v:8.2f} GB {per}" for k, v in role.host.items()]
            lines += [f"  - {note}" for note in role.notes]
            lines += [f"  DOES NOT FIT: {p}" for p in role.problems]
        limit = (f"of {self.host_memory_gb:g} GB" if self.host_memory_gb is not None else
                 "(not checked: set launch.host_memory_gb)")
        lines.append(f"\nhost RAM per node {limit}")
        lines += [f"  {k:<28} {v:8.2f} GB" for k, v in self.host_nodes.items()]
        lines += [f"  DOES NOT FIT: {p}" for p in self.host_problems]
        lines.append("\nfits" if self.fits else "\ndoes not fit")
        return "\n".join(lines)


def _zero(cfg: Config) -> dict:
    """DeepSpeed's ZeRO settings the plan uses: the defaults, under trainer.deepspeed_config's overrides."""
    zero = dict(cfg.trainer.deepspeed_config.get("zero_optimization", {}))
    out = {k: float(zero.get(k, v)) for k, v in ZERO_DEFAULTS.items()}
    out["offload_optimizer"] = (zero.get("offload_optimizer") or {}).get("device") in ("cpu", "nvme")
    out["offload_param"] = (zero.get("offload_param") or {}).get("device") in ("cpu", "nvme")
    return out


def layer_activation_bytes(shape: ModelShape, b: int) -> int:
    """Bytes one decoder layer keeps per token for backward (module docstring)."""
    return b * (8 * shape.hidden + 2 * shape.kv_dim + 4 * shape.ffn_width) + 4 * shape.experts


def trainer_activations(shape: ModelShape, b: int, tokens: int, checkpointing: bool) -> float:
    layer = tokens * layer_activation_bytes(shape, b)
    if checkpointing:
        return shape.layers * tokens * shape.hidden * b + 2 * layer
    return (shape.layers + 1) * layer


def logprob_bytes(shape: ModelShape, b: int, tokens: int, chunk: int | None) -> tuple[float, float]:
    """(log-prob working set, LM-head gradient) of one micro-batch (module docstring)."""
    if chunk is None:
        return tokens * shape.vocab * (8 + b), shape.vocab * shape.hidden * b
    return min(chunk, tokens) * shape.vocab * (8 + b), shape.vocab * shape.hidden * (4 + b)


def lora_params(shape: ModelShape, cfg: Config) -> int:
    """Trainable parameters of trainer.lora: r x (in + out) per adapted linear layer (0: LoRA off)."""
    h, q, kv, i = shape.hidden, shape.q_dim, shape.kv_dim, shape.intermediate
    sizes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}
    if not shape.experts:  # a mixture of experts' fused expert tensors are no nn.Linear peft can adapt
        sizes.update(gate_proj=(h, i), up_proj=(h, i), down_proj=(i, h))
    lora = cfg.trainer.lora
    return lora.rank * shape.layers * sum(sum(sizes[t]) for t in lora.target_modules if t in sizes)


def trained_params(cfg: Config, shape: ModelShape) -> int:
    """The parameters with gradients and optimizer state: all, or LoRA's adapters."""
    return lora_params(shape, cfg) if cfg.trainer.lora.rank else shape.params


def zero_state_bytes(cfg: Config, shape: ModelShape, ranks: int) -> dict[str, float]:
    """ZeRO's per-rank params, grads, optimizer states and communication buffers (offloaded ones: 0)."""
    p, b, stage, zero = shape.params, DTYPE_BYTES[cfg.model.dtype], cfg.trainer.zero_stage, _zero(cfg)
    a = trained_params(cfg, shape)
    g = 4 if cfg.model.dtype == "bfloat16" and stage >= 1 else b  # deepspeed_backend: float32 accumulation
    items = {"params": b * p / (ranks if stage >= 3 else 1), "grads": g * a / (ranks if stage >= 2 else 1),
             "optimizer": ((4 if b < 4 else 0) + 8) * a / (ranks if stage >= 1 else 1)}
    if zero["offload_optimizer"]:
        items["optimizer"] = 0.0
    if zero["offload_param"] and stage >= 3:
        items["params"] = 0.0
    live = min(zero["stage3_max_live_parameters"], p) if stage >= 3 else 0
    items["zero_buffers"] = b * (live + min(zero["reduce_bucket_size"], p))
    return items


def fsdp2_state_bytes(cfg: Config, shape: ModelShape, ranks: int) -> dict[str, float]:
    """FSDP2's per-rank float32 shards and its gathered units (module docstring)."""
    p, b, a = shape.params, DTYPE_BYTES[cfg.model.dtype], trained_params(cfg, shape)
    root = shape.vocab * shape.hidden * (1 if shape.tied else 2) + shape.hidden
    layer = (p - root) / shape.layers
    params = b * p + 4 * a if cfg.trainer.lora.rank else 4 * p  # LoRA: the frozen base has no float32 master
    return {"params": params / ranks, "grads": 4 * a / ranks, "optimizer": 8 * a / ranks,
            "fsdp_buffers": b * (root + 2 * layer) + (b + 4) * max(root, layer)}


def trainer_plan(cfg: Config, shape: ModelShape, ranks: int, gpu_gb: float) -> RolePlan:
    t, b = cfg.trainer, DTYPE_BYTES[cfg.model.dtype]
    fsdp2 = t.backend == "fsdp2"
    items = fsdp2_state_bytes(cfg, shape, ranks) if fsdp2 else zero_state_bytes(cfg, shape, ranks)
    items["activations"] = trainer_activations(shape, b, t.micro_batch_tokens, t.gradient_checkpointing)
    items["logprob_chunk"], items["logprob_head_grad"] = logprob_bytes(shape, b, t.micro_batch_tokens,
                                                                       t.logprob_chunk_tokens)
    if t.lora.rank:
        items["logprob_head_grad"] = 0.0  # the LM head is frozen
    items["attention_mask"] = t.micro_batch_tokens ** 2 if t.attn_implementation != "flash_attention_2" else 0.0
    items["broadcast_buffers"] = 2 * update_bucket_bytes(cfg, shape) if _nccl(cfg) else 0.0
    zero, trained = _zero(cfg), trained_params(cfg, shape)
    if fsdp2:
        items["optimizer_step"] = 8 * trained / ranks
    else:
        opt_shard = trained / (ranks if t.zero_stage >= 1 else 1)
        items["optimizer_step"] = 0.0 if zero["offload_optimizer"] else 8 * min(opt_shard, zero["sub_group_size"])
    items = {k: v / GB for k, v in items.items()}
    items["cuda_runtime"] = TRAINER_RUNTIME_GB
    fwd_bwd = items["activations"] + items["logprob_chunk"] + items["logprob_head_grad"] + items["attention_mask"]
    total = sum(items.values()) - fwd_bwd - items["optimizer_step"] + max(fwd_bwd, items["optimizer_step"])
    other = trainer_activations(shape, b, t.micro_batch_tokens, not t.gradient_checkpointing) / GB
    sharding = "FSDP2" if fsdp2 else f"ZeRO-{t.zero_stage}"
    notes = [f"{ranks} rank(s), {sharding}, micro-batches of {t.micro_batch_tokens} tokens; gradient "
             f"checkpointing {'on' if t.gradient_checkpointing else 'off'} (activations {other:.1f} GB with it "
             f"{'off' if t.gradient_checkpointing else 'on'})",
             f"forward/backward {fwd_bwd:.1f} GB and optimizer step {items['optimizer_step']:.1f} GB never coexist: "
             "the total counts the larger"]
    if shape.experts:
        notes.append(moe_note(shape) + "; every expert's weights, gradients and optimizer state are sharded like "
                     "any weight (no expert parallelism)")
    if t.lora.rank:
        notes.append(f"LoRA rank {t.lora.rank} on {', '.join(t.lora.target_modules)}: {trained:,} trained "
                     f"parameters of {shape.params:,}; gradients and optimizer state for those alone")
    host = trainer_host_bytes(cfg, shape)
    if not fsdp2 and zero["offload_optimizer"]:
        slurm = cfg.launch.backend == "slurm" and cfg.launch.slurm.gpus_per_node
        on_node = min(cfg.launch.slurm.gpus_per_node, ranks) if slurm else ranks
        host["offloaded_optimizer"] = ((4 if b < 4 else 0) + 8) * trained * on_node / ranks / GB
    role = RolePlan("trainer rank", items, total, notes, host=host)
    role.notes.append(f"rank 0's plan (the fullest rank): its host RAM {sum(role.host.values()):.1f} GB holds "
                      "the published versions" + (" and the delta base" if t.broadcast_delta == "auto" else "") +
                      (" and its node's ranks' offloaded optimizer state" if "offloaded_optimizer" in host else ""))
    if total > gpu_gb:
        role.problems.append(f"trainer rank: {total:.1f} GB > {gpu_gb:g} GB; {_trainer_knobs(cfg)}")
    return role


def moe_note(shape: ModelShape) -> str:
    """A mixture of experts' parameter counts, and the expert ids a routing-replay stream would carry per token."""
    id_bytes = 1 if shape.experts <= 256 else 2
    return (f"mixture of experts: {shape.params / 1e9:.2f}B parameters, {shape.active_params / 1e9:.2f}B active per "
            f"token (top-{shape.experts_per_token} of {shape.experts} experts in each of {shape.layers} layers); "
            f"its routed expert ids are {shape.layers * shape.experts_per_token * id_bytes} B per model token")


def _trainer_knobs(cfg: Config) -> str:
    t = cfg.trainer
    more = "launch.slurm.training_nodes" if cfg.launch.backend == "slurm" else "trainer.num_gpus"
    knobs = [] if t.gradient_checkpointing else ["set trainer.gradient_checkpointing=true"]
    knobs += [f"raise {more} (the trainer shards over more ranks)", "lower trainer.micro_batch_tokens"]
    if t.logprob_chunk_tokens is None:
        knobs.append("set trainer.logprob_chunk_tokens=1024")
    return " or ".join(knobs)


def server_plan(cfg: Config, shape: ModelShape, gpu_gb: float, kind: str = "policy") -> RolePlan:
    """A server's plan; `kind`: policy, reference or reward (`shape`: the reward model's for a reward server)."""
    inf, b = cfg.inference, DTYPE_BYTES[cfg.model.dtype]
    tp, gpu = inf.tensor_parallel_size, gpu_gb * GB
    batched = int(inf.engine_args.get("max_num_batched_tokens", VLLM_BATCHED_TOKENS))
    model_bytes = b * shape.params
    classifier = kind == "reward" and cfg.reward.kind == "model"
    sampler = 0.0 if classifier else inf.max_num_seqs * shape.vocab * 4 * SAMPLER_COPIES
    items = {"weights": model_bytes / tp,
             "activations": batched * ((3 * shape.ffn_width + shape.q_dim + 2 * shape.kv_dim) / tp
                                       + 4 * shape.hidden) * b + sampler,
             "cuda_graphs_runtime": SERVER_RUNTIME_GB * GB}
    budget = inf.gpu_memory_utilization * gpu
    items["kv_cache"] = budget - sum(items.values())
    if kind == "reference":
        items["prompt_logprobs"] = batched * shape.vocab * (b + 8)
    elif kind == "policy":
        items["update_staging"] = model_bytes if inf.update_staging == "device" else 2 * update_bucket_bytes(cfg, shape)
        items["update_group"] = UPDATE_GROUP_GB * GB if _nccl(cfg) else 0.0
    items = {k: v / GB for k, v in items.items()}
    role = RolePlan(f"{kind} server", items, budget / GB + sum(
        v for k, v in items.items() if k in ("prompt_logprobs", "update_staging", "update_group")))
    if shape.experts:
        role.notes.append(moe_note(shape) + "; the weights count every expert on each server's GPUs (TP shards "
                          "them; expert parallelism is not used)")
    _server_checks(cfg, shape, gpu_gb, role, kind, model_bytes / GB)
    return role


def _server_checks(cfg: Config, shape: ModelShape, gpu_gb: float, role: RolePlan, kind: str,
                   model_gb: float) -> None:
    inf, b = cfg.inference, DTYPE_BYTES[cfg.model.dtype]
    name, tp = role.title, inf.tensor_parallel_size
    outside = role.per_gpu_gb - inf.gpu_memory_utilization * gpu_gb
    kv_token = 2 * shape.layers * shape.head_dim * max(1, shape.kv_heads // tp) * b  # K and V, per GPU
    kv_tokens = role.items["kv_cache"] * GB / kv_token
    seq = (inf.max_model_len or 0) + (1 if kind == "reference" else 0)
    role.notes.append(f"TP {tp}; vLLM's share {inf.gpu_memory_utilization:g} x {gpu_gb:g} GB; KV cache holds "
                      f"{kv_tokens:,.0f} tokens ({kv_tokens / max(seq, 1):.0f} sequences of {seq} tokens; "
                      f"max_num_seqs {inf.max_num_seqs})")
    if kind == "policy" and inf.update_staging == "host":
        role.host["update_staging"] = model_gb
        shm = " in /dev/shm, which every TP worker loads from" if tp > 1 else ""
        role.notes.append(f"host staging: {model_gb:.1f} GB of host RAM per server (one copy, received by its first "
                          f"TP worker{shm}), {model_gb * inf.num_servers:.1f} GB per inference node")
    if kind == "policy" and cfg.trainer.broadcast_delta == "auto":
        role.host["delta_base"] = model_gb
        role.notes.append(f"delta base: {model_gb:.1f} GB of host RAM per server (host staging's dense tensors "
                          "become the base, so a dense update needs up to twice that while it lands)")
    if role.per_gpu_gb > gpu_gb:
        most = math.floor(100 * (gpu_gb - outside) / gpu_gb) / 100
        # a reward server has nothing outside vLLM's share: only a reference or policy server gets here
        what = ("prompt log-probs" if kind == "reference" else f"update staging ({inf.update_staging})") + \
               f" {outside:.1f} GB + vLLM's {inf.gpu_memory_utilization * gpu_gb:.1f} GB"
        fix = ("or set inference.engine_args.max_num_batched_tokens lower" if kind == "reference" else
               "or set inference.update_staging=host" if inf.update_staging == "device" else
               "or lower trainer.broadcast_bucket_mb")
        role.problems.append(f"{name}: {what} = {role.per_gpu_gb:.1f} GB > {gpu_gb:g} GB; lower "
                             f"inference.gpu_memory_utilization to {most:.2f} {fix}")
    elif kv_tokens < max(seq, 1):
        role.problems.append(f"{name}: KV cache {role.items['kv_cache']:.1f} GB holds {max(kv_tokens, 0):,.0f} tokens "
                             f"< one {seq}-token sequence; raise inference.gpu_memory_utilization or "
                             "inference.tensor_parallel_size, or lower inference.max_model_len")


def update_bucket_bytes(cfg: Config, shape: ModelShape) -> float:
    """One weight-update bucket: trainer.broadcast_bucket_mb, at least the largest tensor (sent alone)."""
    largest = shape.largest_tensor * DTYPE_BYTES[cfg.model.dtype]
    return max(cfg.trainer.broadcast_bucket_mb * 2**20, largest)


def _nccl(cfg: Config) -> bool:
    return (cfg.inference.weight_update_backend or "nccl") == "nccl"  # a plan is for GPUs: null means NCCL


def trainer_host_bytes(cfg: Config, shape: ModelShape) -> dict[str, float]:
    """Host RAM in GB of trainer rank 0 (module docstring)."""
    model = DTYPE_BYTES[cfg.model.dtype] * shape.params / GB
    deliveries = 1 + (cfg.inference.eval_servers > 0)  # the evaluation servers' delivery: a reader and a base more
    return {"published_versions": (1 + deliveries) * model,
            **({"delta_base": deliveries * model} if cfg.trainer.broadcast_delta == "auto" else {})}


def host_nodes(cfg: Config, roles: dict[str, RolePlan]) -> dict[str, float]:
    """Host RAM in GB per kind of node (module docstring)."""
    servers = cfg.inference.num_servers * sum(roles["server"].host.values())
    trainer = sum(roles["trainer"].host.values())
    if cfg.launch.backend != "slurm":  # evaluation servers: policy servers beside num_servers (on Slurm, among them)
        servers += cfg.inference.eval_servers * sum(roles["server"].host.values())
        return {"this machine (servers + trainer rank 0)": servers + trainer}
    if cfg.launch.slurm.inference_nodes == 0:
        return {"first training node (servers + trainer rank 0)": servers + trainer}
    return {"inference node": servers, "first training node": trainer}


def plan_config(cfg: Config, gpu_gb: float, shape: ModelShape, source: str, trainer_ranks: int,
                host_gb: float | None = None) -> MemoryPlan:
    """Every role's per-GPU budget for `cfg` on GPUs of `gpu_gb` GB, and each node's host RAM against `host_gb`
    (None: not checked)."""
    roles = {"trainer": trainer_plan(cfg, shape, trainer_ranks, gpu_gb), "server": server_plan(cfg, shape, gpu_gb)}
    if cfg.rl.needs_reference_logprobs:
        teacher, source = (shape, "") if cfg.rl.teacher is None else shape_at(
            cfg.rl.teacher, cfg.model.build_tiny_if_missing, cfg, "rl.teacher")
        roles["reference"] = server_plan(cfg, teacher, gpu_gb, "reference")
        if cfg.rl.teacher is not None:
            roles["reference"].notes.append(f"teacher: {teacher.params / 1e9:.2f}B parameters, from {source}")
    if cfg.reward.kind != "verify":
        rm_shape, rm_source = reward_shape(cfg, shape)
        roles["reward"] = server_plan(cfg, rm_shape, gpu_gb, "reward")
        roles["reward"].notes.append(f"reward model: {rm_shape.params / 1e9:.2f}B parameters, from {rm_source}")
    return MemoryPlan(gpu_gb, source, shape.params, roles, host_nodes(cfg, roles), host_gb)


# -- inputs from the machine and the launchers (I/O) ------------------------------------------------------

def nvidia_smi_gpu_gb() -> float | None:
    """The smallest GPU's memory in GB as nvidia-smi reports it; None without a GPU."""
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=False, timeout=60)
    mib = [float(x) for x in out.stdout.split() if x.replace(".", "", 1).isdigit()]
    return min(mib) * 2**20 / GB if out.returncode == 0 and mib else None


def plan_for(cfg: Config, trainer_ranks: int) -> MemoryPlan | None:
    """The plan on launch.gpu_memory_gb (null: nvidia-smi's) for the `trainer_ranks` the launcher places; None
    when neither gives a number (CPU)."""
    gpu_gb = cfg.launch.gpu_memory_gb
    if gpu_gb is None and os.environ.get("CUDA_VISIBLE_DEVICES") != "":
        gpu_gb = nvidia_smi_gpu_gb()
    if gpu_gb is None:
        return None
    shape, source = load_shape(cfg)
    return plan_config(cfg, gpu_gb, shape, source, trainer_ranks, node_memory_gb(cfg))


def node_memory_gb(cfg: Config) -> float | None:
    """One node's memory in GB: launch.host_memory_gb; else this machine's (local runs) or launch.slurm.mem's
    size (Slurm; "0", the whole node, is unknown here); else None."""
    if cfg.launch.host_memory_gb is not None:
        return cfg.launch.host_memory_gb
    if cfg.launch.backend == "slurm":
        return slurm_mem_gb(cfg.launch.slurm.mem)
    with open("/proc/meminfo") as f:
        kib = next((int(line.split()[1]) for line in f if line.startswith("MemTotal:")), None)
    return None if kib is None else kib * 1024 / GB


def slurm_mem_gb(mem: str | None) -> float | None:
    """GB of an sbatch --mem value ("512G", "500000M", a number of MB; Slurm's units are powers of 1024);
    None for null or "0" (the whole node, size unknown)."""
    if mem is None:
        return None
    units = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    text = mem.strip().upper()
    factor = units.get(text[-1:], None)
    try:
        number = float(text[:-1] if factor else text)
    except ValueError:
        raise ConfigError(f"launch.slurm.mem={mem!r} is not a size (e.g. 512G, 500000M, or 0)") from None
    return None if number == 0 else number * (factor or 2**20) / GB


SKIPPED = "memory plan skipped: no GPU (launch.gpu_memory_gb is null and nvidia-smi finds none)"


def check_before_start(cfg: Config, trainer_ranks: int) -> None:
    """The launchers' check, given the trainer ranks they place: log each role's per-GPU total; ConfigError
    naming the number that does not fit and the knob that fixes it. On a CPU machine, one line says the plan
    was skipped."""
    plan = plan_for(cfg, trainer_ranks)
    if plan is None:
        log.info(SKIPPED)
        return
    for role in plan.roles.values():
        log.info("memory plan: %s %.1f GB per GPU of %g GB", role.title, role.per_gpu_gb, plan.gpu_memory_gb)
    if not plan.fits:
        raise ConfigError("memory plan (`pipelinerl plan` shows it whole): " + "; ".join(plan.problems))
