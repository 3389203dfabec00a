"""A prepared one-device check (issue #15): what one GPU runs, measured, in one table. Also a CPU smoke test.

Each step runs what the device and the installed libraries allow, and says "skipped: <why>" otherwise:

1. trainer: optimizer steps of the project's trainer on a random-init model built offline (the tiny model,
   and on CUDA a Qwen2-1.5B-shaped one; mixtures of experts: the tiny Qwen3-MoE, and on CUDA four layers of
   Qwen3-30B-A3B's shape, trained with rollout routing replay, rl.routing_replay=r3). With DeepSpeed: the
   DeepSpeed backend, ZeRO-3 on one rank, built from a Config by `backends.build_trainer` (`--trainer fsdp2`:
   the FSDP2 backend, the same way). Without it: plain torch in the same precision scheme (bf16 weights and
   gradients, float32 master weights and AdamW states), with the same chunked log-prob head.
   Peak memory (CUDA: max_memory_allocated; CPU: growth of the process's peak RSS, getrusage) and step time.
2. plan: `pipelinerl plan`'s predicted trainer memory per GPU for the same config, beside the measured peak.
3. gather: the trainer's full-model gather (ZeRO-3: module by module) packed into the wire format's buckets
   on the device: what WeightBroadcaster does before each broadcast, without the collective.
4. server (vLLM): `pipelinerl serve` on the tiny model, one weight update over gloo, per-token versions of a
   sampled completion, and the lag-0 agreement of the server's log-probs with the trainer's.
5-8. bf16 vs float32 trainer steps, the LM head's GEMMs, the double-buffered receive, and what NCCL needs
   (tools/gpu_check_device.py says what each runs).
9. routing replay (MoE shapes): replaying the trainer's own routing reproduces its log-probs bit for bit, and
   the steps' replayed random routing differs from the trainer's own about as often as chance says.
10. server MoE (MoE shapes, with the server step): the server returns each token's routed experts, and at lag 0
   they agree with the trainer's router (tools/gpu_check_server.py).

Each trainer measurement runs in a child process (`--child`), so peaks are per model.

    tools/gpu_check.sh                    # CUDA: tiny + 1.5B-shaped + the two MoE shapes, server steps when
                                          # vLLM imports
    tools/gpu_check.sh --device cpu       # CI smoke test: tiny + tiny_moe, no server unless --with-server
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BASE_CONFIG = REPO / "configs" / "tiny_cpu.yaml"
GB = 1e9  # decimal, as the plan reports (the issue: 16384 x 152k x 4 B "= 10 GB")

# name -> (hidden, layers, heads, kv heads, FFN, vocab); vocab None keeps the tiny tokenizer's.
SHAPES = {
    "tiny": (128, 2, 4, 2, 512, None),
    "small": (512, 8, 8, 4, 1536, None),  # ~25M params: step times above the per-call overheads on CPU
    "base": (768, 14, 12, 4, 2048, None),  # ~88M params: the bench's larger CPU model
    "1.5b": (1536, 28, 12, 2, 8960, 151936),  # Qwen2.5-1.5B's shape (untied here, as every tiny build)
    "tiny_moe": (128, 2, 4, 2, 512, None),  # configs/tiny_moe.yaml's model
    # Qwen3-30B-A3B's layer (width 2048, 32 query / 4 KV heads of 128, 128 experts of width 768, top-8) x 4 of its
    # 48 layers, ~2.4B params: the experts, routers and attention at the flagship's size. The tiny vocabulary
    # keeps the served model decodable; the 1.5b row measures a real-size LM head.
    "a3b_4l": (2048, 4, 32, 4, 6144, None),
}
# MoE shapes -> (experts, experts per token, expert FFN width, head_dim or None for hidden / heads)
MOE_SHAPES = {"tiny_moe": (8, 2, 64, None), "a3b_4l": (128, 8, 768, 128)}


@dataclass
class Row:
    step: str
    result: str  # "ok" | "FAILED: <why>" | "skipped: <why>"
    numbers: str = ""
    values: dict = field(default_factory=dict)  # the numbers, raw (--json)

    @property
    def failed(self) -> bool:
        return self.result.startswith("FAILED")


def importable(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


# ---- models and configs -------------------------------------------------------------------------------

def build_model(out_dir: Path, shape: str, device: str):
    """The project's tiny-model builder at another shape; a real-size vocabulary where the shape has one
    (ids past the character tokenizer's are never decoded: the check feeds token ids)."""
    import torch
    from transformers import AutoModelForCausalLM

    from pipelinerl.config import TinyModelConfig
    from pipelinerl.tiny_model import build_tokenizer, save_model, tiny_config

    hidden, layers, heads, kv, ffn, vocab = SHAPES[shape]
    experts, top_k, expert_ffn, head_dim = MOE_SHAPES.get(shape, (0, 2, 64, None))
    tiny = TinyModelConfig(hidden_size=hidden, num_layers=layers, num_attention_heads=heads,
                           num_key_value_heads=kv, intermediate_size=ffn, max_position_embeddings=4096,
                           num_experts=experts, experts_per_token=top_k, moe_intermediate_size=expert_ffn)
    tokenizer = build_tokenizer()
    config = tiny_config(tiny, tokenizer)
    if vocab is not None:
        config.vocab_size = vocab
    if head_dim is not None:
        config.head_dim = head_dim
    torch.manual_seed(tiny.seed)
    # A 1.5B model initialises in seconds on the GPU, minutes on CPU; bf16 halves what is written.
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    save_model(model, tokenizer, out_dir)
    return sum(p.numel() for p in model.parameters())


def write_config(path: Path, model_dir: Path, run_dir: Path, args, extra: tuple[str, ...] = ()) -> Path:
    """configs/tiny_cpu.yaml with the check's model and trainer settings, resolved and saved: the one file
    that the trainer child, `pipelinerl plan` and the server all read."""
    from pipelinerl.config import load_config, save_config

    overrides = [f"run_dir={run_dir}", f"model.path={model_dir}", "model.build_tiny_if_missing=false",
                 f"model.dtype={args.dtype}", "trainer.zero_stage=3", "trainer.num_gpus=1",
                 f"trainer.backend={'fsdp2' if args.trainer == 'fsdp2' else 'deepspeed'}",
                 f"trainer.micro_batch_tokens={args.tokens}", f"trainer.logprob_chunk_tokens={args.chunk}",
                 f"trainer.broadcast_bucket_mb={args.bucket_mb}", "actor.sampling.min_new_tokens=0", *extra]
    save_config(load_config(BASE_CONFIG, overrides), path)
    return path


# ---- step 1 and 3, in a child process: trainer steps, peak memory, gather into buckets ------------------

def random_samples(vocab: int, tokens: int, seq_len: int, seed: int, routing: tuple[int, int, int] | None = None):
    """Packed-sequence samples of random ids (1/8 prompt), filling one micro-batch of `tokens`. routing
    (MoE layers, experts, top-k): each completion token also carries a random routing, k distinct experts per
    layer, as the stream's `routed_experts` field does."""
    import torch

    from pipelinerl.trainer.packing import Sample

    g = torch.Generator().manual_seed(seed)
    prompt = max(1, seq_len // 8)
    out = []
    for i in range(max(1, tokens // seq_len)):
        ids = torch.randint(3, vocab, (seq_len,), generator=g).tolist()
        adv = float(torch.randn((), generator=g))
        fields = {"advantage": [adv] * (seq_len - prompt)}
        if routing is not None:
            layers, experts, k = routing
            chosen = torch.rand(seq_len - prompt, layers, experts, generator=g).argsort(-1)[..., :k]
            fields["routed_experts"] = chosen.reshape(seq_len - prompt, layers * k).tolist()
        out.append(Sample(ids[:prompt], ids[prompt:], index=i, token_fields=fields))
    return out


def pg_loss(mb, new_N, values_N, num_sequences: int):
    """A policy-gradient loss of the trainer's form (a share of the step's sum over sequences)."""
    loss = -(new_N * mb.fields_N["advantage"].to(new_N)).sum() / num_sequences
    return loss, {"loss": loss.item()}


class BackendStepper:
    """The project's trainer backend (cfg.trainer.backend) on one rank, built as `pipelinerl train` builds it."""

    def __init__(self, cfg):
        from pipelinerl.launch.procs import free_port
        from pipelinerl.trainer.backends import build_trainer
        from pipelinerl.trainer.dist import init_process_group, read_dist_env

        self.name = "deepspeed zero-3" if cfg.trainer.backend == "deepspeed" else cfg.trainer.backend

        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
        dist = read_dist_env()
        init_process_group(dist, cfg.trainer.dist_timeout_s, cfg.trainer.jit_lock_stale_s)
        self.trainer = build_trainer(cfg, dist, publisher=None)
        self.trainer.init(cfg.model.path)
        self.device = self.trainer.device
        self.vocab = self.trainer.lm.config.vocab_size
        self.tap = self.trainer.router_tap  # a mixture of experts: replays the samples' routing (r3)
        self.compared = [0.0, 0.0]  # over the steps: token-layer routings replayed, of them the trainer's differs

    def step(self, mbs, num_sequences: int) -> tuple[float, float]:
        """One optimizer step; (the step's loss, the gradient norm)."""
        import functools

        stats = self.trainer.accumulate(mbs, functools.partial(pg_loss, num_sequences=num_sequences))
        for s in stats:
            if "moe_compared" in s:
                self.compared = [a + float(b) for a, b in zip(self.compared, s["moe_compared"])]
        return sum(s["loss"] for s in stats), self.trainer.optimizer_step()["grad_norm"]

    def self_replay(self, mb) -> dict:
        """The micro-batch's completion log-probs routed by the trainer, then replaying that same routing: their
        largest difference, and that of a second unreplayed forward (the kernels' run-to-run noise: 0 unless
        they reduce with atomics). trainer/moe.py's claim is that replay adds nothing to that noise."""
        import torch

        with torch.no_grad():
            own_N, _ = self.trainer.forward(mb)
            ids_TLk = torch.stack([layer.experts for layer in self.tap.layers], dim=1)
            again_N, _ = self.trainer.forward(mb)
            with self.tap.replaying(ids_TLk):
                replayed_N, _ = self.trainer.forward(mb)
        return {"self_replay_max_diff": float((own_N - replayed_N).abs().max()),
                "rerun_max_diff": float((own_N - again_N).abs().max()),
                "self_replay_bitwise": bool(torch.equal(own_N, replayed_N))}

    def weights(self):
        from pipelinerl.weights import TensorMeta

        metas = [TensorMeta(n, d, s) for n, d, s in self.trainer.named_shapes()]
        return metas, (t for _, t in self.trainer.gathered_parameters())


class TorchStepper:
    """Plain torch, one device, ZeRO-3's precision scheme at world size 1: 16-bit weights and gradients,
    float32 master weights and AdamW states (16 bytes per parameter), the same chunked log-prob head."""

    name = "torch adamw (no deepspeed)"

    def __init__(self, cfg, device: str):
        import torch
        from transformers import AutoModelForCausalLM

        from pipelinerl.dtypes import torch_dtype
        from pipelinerl.trainer.model import attention_implementation, enable_chunked_logprobs

        self.cfg, self.device = cfg, torch.device(device)
        attn = attention_implementation(cfg.trainer.attn_implementation, self.device, cfg.model.dtype)
        self.lm = AutoModelForCausalLM.from_pretrained(
            cfg.model.path, dtype=torch_dtype(cfg.model.dtype), attn_implementation=attn).to(self.device)
        self.lm.config.use_cache = False
        enable_chunked_logprobs(self.lm)
        self.params = [p for p in self.lm.parameters()]
        mixed = self.params[0].dtype != torch.float32
        self.masters = [p.detach().float().requires_grad_() for p in self.params] if mixed else self.params
        t = cfg.trainer
        self.opt = torch.optim.AdamW(self.masters, lr=t.lr, betas=tuple(t.betas), eps=t.adam_eps,
                                     weight_decay=t.weight_decay)
        self.vocab = self.lm.config.vocab_size

    def step(self, mbs, num_sequences: int) -> tuple[float, float]:
        """One optimizer step; (the step's loss, the gradient norm). Gradients are float32 from the first
        micro-batch's backward on (the masters' .grad), as ZeRO's float32 accumulation keeps them."""
        import torch

        from pipelinerl.trainer.model import completion_forward

        loss_sum = 0.0
        for mb in mbs:
            new_N, _ = completion_forward(self.lm, mb, self.device, self.cfg.actor.sampling.temperature,
                                          self.cfg.trainer.logprob_chunk_tokens)
            loss = pg_loss(mb, new_N, None, num_sequences)[0]
            loss.backward()
            loss_sum += loss.item()
            if self.masters is not self.params:
                for m, p in zip(self.masters, self.params):
                    m.grad = p.grad.float() if m.grad is None else m.grad.add_(p.grad)
                    p.grad = None
        clip = self.cfg.trainer.grad_clip or float("inf")
        norm = float(torch.nn.utils.clip_grad_norm_(self.masters, clip))
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.masters is not self.params:
            with torch.no_grad():
                for m, p in zip(self.masters, self.params):
                    p.copy_(m)
        return loss_sum, norm

    def weights(self):
        from pipelinerl.weights import TensorMeta, dtype_name

        named = list(self.lm.named_parameters())
        return [TensorMeta(n, dtype_name(p.dtype), list(p.shape)) for n, p in named], (p.detach() for _, p in named)


def pack_buckets(metas, tensors, bucket_bytes: int, device):
    """Each bucket's buffer on the device, packed as WeightBroadcaster packs it before broadcasting
    (plan_buckets layout). No collective: one device has no receiver."""
    import torch

    from pipelinerl.weights import plan_buckets

    it = iter(tensors)
    for bucket in plan_buckets(metas, bucket_bytes):
        buf = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)
        for off in bucket.offsets:
            t = next(it)
            buf[off:off + t.nbytes].view(t.dtype).view(t.shape).copy_(t)
        yield buf
    assert next(it, None) is None, "more tensors than metas"


def synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_bytes(device, rss_baseline: int) -> tuple[int, str]:
    import torch

    if device.type == "cuda":
        reserved = torch.cuda.max_memory_reserved(device) / GB
        return torch.cuda.max_memory_allocated(device), f"max_memory_allocated; reserved {reserved:.2f} GB"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    return rss - rss_baseline, "peak RSS (getrusage) above the RSS after imports"


def current_rss() -> int:
    """Resident bytes now (Linux /proc); the high-water mark where /proc is absent."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_child(args) -> dict:
    """One trainer measurement (this process only): steps, peak memory, then gather + bucket packing."""
    import torch

    from pipelinerl.config import load_config
    from pipelinerl.trainer.packing import pack

    torch.set_num_threads(args.threads or torch.get_num_threads())
    cfg = load_config(args.child)
    import transformers.models.qwen2.modeling_qwen2  # noqa: F401 - loaded before the baseline: not the model's memory

    if args.trainer != "torch":
        import deepspeed  # noqa: F401 - both backends' process group starts through deepspeed.init_distributed
    rss0 = current_rss()
    stepper = TorchStepper(cfg, args.device) if args.trainer == "torch" else BackendStepper(cfg)
    tap = getattr(stepper, "tap", None)
    routing = (len(tap.routers), tap.num_experts, tap.top_k) if tap is not None else None
    times, losses, norms = [], [], []
    for step in range(args.steps):
        samples = random_samples(stepper.vocab, args.tokens, min(args.seq_len, args.tokens), seed=step,
                                 routing=routing)
        mbs = pack(samples, cfg.trainer.micro_batch_tokens)
        synchronize(stepper.device)
        start = time.perf_counter()
        loss, norm = stepper.step(mbs, len(samples))
        synchronize(stepper.device)
        times.append(time.perf_counter() - start)
        losses.append(loss)
        norms.append(norm)
    peak, how = peak_bytes(stepper.device, rss0)
    moe = {}
    if routing is not None:
        layers, experts, k = routing
        moe = {"layers": layers, "experts": experts, "top_k": k, "replay": cfg.rl.routing_replay,
               "replayed": stepper.compared[0], "random_mismatch": stepper.compared[1] / max(stepper.compared[0], 1),
               "chance_mismatch": 1 - 1 / math.comb(experts, k), **stepper.self_replay(mbs[0])}
    metas, tensors = stepper.weights()
    start = time.perf_counter()
    buckets = sum(1 for _ in pack_buckets(metas, tensors, int(cfg.trainer.broadcast_bucket_mb * 2**20),
                                          stepper.device))
    synchronize(stepper.device)
    gather_s = time.perf_counter() - start
    return {"backend": stepper.name, "dtype": cfg.model.dtype, "steps": len(times), "first_step_s": times[0],
            "step_s": statistics.median(times[1:] or times), "tokens_per_step": args.tokens,
            "losses": losses, "grad_norms": norms, "grad_accum": grad_accum_dtype(stepper),
            "peak_bytes": peak, "peak_how": how, "gather_s": gather_s, "buckets": buckets,
            "gather_bytes": sum(m.nbytes for m in metas), "params": sum(_numel(m.shape) for m in metas), "moe": moe}


def grad_accum_dtype(stepper) -> str:
    """The dtype gradients accumulate in: the DeepSpeed engine's, else what this check's stepper does (float32
    masters' .grad for the torch stepper, FSDP2's float32 shards)."""
    engine = getattr(getattr(stepper, "trainer", None), "engine", None)
    if engine is not None:
        return str(engine.get_data_types()[1]).removeprefix("torch.")
    return "float32"


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def measure_trainer(cfg_path: Path, args, workdir: Path) -> dict:
    """run_child in a fresh process; its JSON result (RuntimeError with its output's tail on failure)."""
    argv = [sys.executable, __file__, "--child", str(cfg_path), "--device", args.device,
            "--trainer", args.trainer, "--tokens", str(args.tokens), "--seq-len", str(args.seq_len),
            "--steps", str(args.steps), "--threads", str(args.threads)]
    out = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=args.step_timeout_s)
    (workdir / f"{cfg_path.stem}.child.log").write_text(out.stdout + out.stderr)
    if out.returncode != 0:
        raise RuntimeError(f"exit {out.returncode}: {(out.stdout + out.stderr).strip()[-800:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---- step 2: the plan's prediction ----------------------------------------------------------------------

def plan_trainer(cfg_path: Path, gpu_memory_gb: float) -> dict | str:
    """`pipelinerl plan`'s trainer role ({"per_gpu_gb", "items"}), or the reason it is unavailable (a str)."""
    argv = [sys.executable, "-m", "pipelinerl.cli", "plan", str(cfg_path), "--gpu-memory-gb",
            str(gpu_memory_gb), "--json"]
    out = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=120)
    if out.returncode == 2 and "invalid choice" in out.stderr:
        return "pipelinerl plan not available"
    try:  # a plan that does not fit may exit non-zero and still print its JSON
        trainer = json.loads(out.stdout)["roles"]["trainer"]
        return {"per_gpu_gb": float(trainer["per_gpu_gb"]), "items": dict(trainer.get("items", {}))}
    except (ValueError, KeyError, TypeError) as err:
        raise RuntimeError(f"plan exit {out.returncode}, no trainer per_gpu_gb ({err!r}): "
                           f"{(out.stdout + out.stderr).strip()[-500:]}") from None


def trainer_rows(shape: str, workdir: Path, args) -> list[Row]:
    """Steps 1-3 for one model shape."""
    model_dir = workdir / f"model_{shape}"
    start = time.monotonic()
    build_model(model_dir, shape, args.device)
    build_s = time.monotonic() - start
    extra = ("rl.routing_replay=r3",) if shape in MOE_SHAPES else ()
    cfg_path = write_config(workdir / f"{shape}.yaml", model_dir, workdir / f"run_{shape}", args, extra)
    try:
        m = measure_trainer(cfg_path, args, workdir)
    except (RuntimeError, subprocess.TimeoutExpired) as err:
        return [Row(f"trainer [{shape}]", f"FAILED: {err}")]
    rows = [Row(f"trainer [{shape}]", "ok",
                f"{m['backend']}, {m['dtype']}, {m['params'] / 1e6:.1f}M params (built in {build_s:.0f} s); "
                f"{m['tokens_per_step']} tokens/step, chunk {args.chunk}: step {m['step_s']:.2f} s "
                f"(first {m['first_step_s']:.2f} s), {m['tokens_per_step'] / m['step_s']:.0f} tok/s; "
                f"peak {m['peak_bytes'] / GB:.3f} GB ({m['peak_how']})", m)]
    rows.append(plan_row(shape, cfg_path, m, args))
    rows.append(Row(f"gather for broadcast [{shape}]", "ok",
                    f"{m['gather_bytes'] / 1e6:.1f} MB {m['dtype']} in {m['buckets']} bucket(s) of "
                    f"{args.bucket_mb:g} MiB: {m['gather_s']:.3f} s, {m['gather_bytes'] / m['gather_s'] / GB:.2f} GB/s "
                    f"(gather + pack on the device, no collective)",
                    {k: m[k] for k in ("gather_s", "gather_bytes", "buckets")}))
    if shape in MOE_SHAPES:
        rows.append(replay_row(shape, m["moe"]))
    return rows


def replay_row(shape: str, moe: dict) -> Row:
    """Step 9: what the trainer's routing replay did in the steps (random routing replayed) and after them (its
    own routing replayed)."""
    step = f"routing replay [{shape}]"
    if not moe:
        return Row(step, "skipped: needs the project's trainer backend (deepspeed or fsdp2)")
    n, p = moe["replayed"], moe["chance_mismatch"]
    bound = 5 * math.sqrt(p * (1 - p) / max(n, 1)) + 1e-3  # 5 standard errors of a binomial share
    numbers = (f"{moe['layers']} layers x {moe['experts']} experts, top-{moe['top_k']}: random routing replayed on "
               f"{n:.0f} token-layers differs from the trainer's {moe['random_mismatch']:.3f} (chance {p:.3f}); own "
               f"routing replayed: max |dlogprob| {moe['self_replay_max_diff']:.1e} (rerun noise "
               f"{moe['rerun_max_diff']:.1e})")
    if moe["self_replay_max_diff"] > moe["rerun_max_diff"]:
        return Row(step, "FAILED: replaying the trainer's own routing changed its log-probs", numbers, moe)
    if n == 0 or abs(moe["random_mismatch"] - p) > bound:
        return Row(step, f"FAILED: the replayed routing's mismatch is not chance's (+-{bound:.3f})", numbers, moe)
    return Row(step, "ok", numbers, moe)


def plan_row(shape: str, cfg_path: Path, measured: dict, args) -> Row:
    step = f"plan vs measured [{shape}]"
    try:
        plan = plan_trainer(cfg_path, args.gpu_memory_gb)
    except (RuntimeError, subprocess.TimeoutExpired) as err:
        return Row(step, f"FAILED: {err}")
    if isinstance(plan, str):
        return Row(step, f"skipped: {plan}")
    # The measured peak counts tensors only (allocated bytes or RSS growth), not the CUDA context and
    # library workspaces the plan adds as "*runtime*" items: compare it with the plan's tensors alone.
    predicted, runtime = plan["per_gpu_gb"], sum(v for k, v in plan["items"].items() if "runtime" in k)
    peak = measured["peak_bytes"] / GB
    ratio = (predicted - runtime) / max(peak, 1e-9)
    return Row(step, "ok", f"predicted trainer {predicted:.3f} GB/GPU ({predicted - runtime:.3f} GB of tensors "
                           f"+ {runtime:.3f} GB runtime), measured {peak:.3f} GB: tensors predicted/measured "
                           f"x{ratio:.2f}",
               {"predicted_gb": predicted, "predicted_tensors_gb": predicted - runtime, "measured_gb": peak,
                "ratio": ratio, "items": plan["items"]})


def print_table(rows: list[Row]) -> None:
    w_step = max(len(r.step) for r in rows)
    w_res = max(len("result"), *(min(len(r.result), 60) for r in rows))
    print(f"\n{'step':<{w_step}}  {'result':<{w_res}}  numbers")
    print(f"{'-' * w_step}  {'-' * w_res}  {'-' * 7}")
    for r in rows:
        print(f"{r.step:<{w_step}}  {r.result:<{w_res}}  {r.numbers}")


def run_checks(args) -> list[Row]:
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="gpu_check_"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"gpu_check: device {args.device}, trainer {args.trainer}, models {args.models}; work in {workdir}",
          flush=True)
    rows = []
    for shape in args.models.split(","):
        start = time.monotonic()
        rows += trainer_rows(shape, workdir, args)
        print(f"gpu_check: {shape} model measured in {time.monotonic() - start:.0f} s", flush=True)
    from gpu_check_device import head_gemm_row, nccl_row, precision_row, receive_row

    for check in (lambda a: precision_row(workdir, a), head_gemm_row, receive_row, nccl_row):
        try:
            rows.append(check(args))
        except Exception as err:  # noqa: BLE001 - one failed step is a row, the table still prints
            rows.append(Row(check.__name__, f"FAILED: {type(err).__name__}: {str(err)[-500:]}"))
    step = "server: update + versions + lag-0 log-probs"
    if not args.with_server:
        rows.append(Row(step, "skipped: not asked (--with-server)"))
    elif not importable("vllm"):
        rows.append(Row(step, "skipped: vllm not importable"))
    else:
        from gpu_check_server import server_check

        moe_shapes = [s for s in args.models.split(",") if s in MOE_SHAPES]
        for shape, moe in [("tiny", False)] + [(s, True) for s in moe_shapes]:
            try:
                rows.append(server_check(workdir / f"model_{shape}", workdir, args, moe=moe))
            except Exception as err:  # noqa: BLE001 - one failed step is a row, the table still prints
                rows.append(Row(f"server [{shape}]", f"FAILED: {type(err).__name__}: {str(err)[-500:]}"))
    return rows


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--trainer", choices=("auto", "deepspeed", "fsdp2", "torch"), default="auto",
                   help="auto: the DeepSpeed backend when deepspeed imports, else plain torch")
    p.add_argument("--models", help="comma-separated shapes of " + ", ".join(SHAPES) +
                   " (default: tiny,1.5b,tiny_moe,a3b_4l on CUDA, tiny,tiny_moe on CPU)")
    p.add_argument("--dtype", help="trainer dtype (default: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--tokens", type=int, help="tokens per step, one micro-batch (default 8192 CUDA, 256 CPU)")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per packed sequence")
    p.add_argument("--chunk", type=int, help="trainer.logprob_chunk_tokens (default 1024 CUDA, 64 CPU)")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps; the first is warm-up")
    p.add_argument("--bucket-mb", type=float, default=256.0, help="trainer.broadcast_bucket_mb")
    p.add_argument("--gpu-memory-gb", type=float, help="for `pipelinerl plan` (default: this GPU's, or 80)")
    p.add_argument("--with-server", action=argparse.BooleanOptionalAction, default=None,
                   help="run the vLLM server step (default: on CUDA when vllm imports; off on CPU)")
    p.add_argument("--max-logprob-diff", type=float, default=1e-3, help="lag-0 max |dlogprob| that passes")
    p.add_argument("--max-routing-mismatch", type=float, default=0.02,
                   help="MoE: the lag-0 share of token-layers routed otherwise by server and trainer that passes")
    p.add_argument("--threads", type=int, default=0, help="torch threads in the trainer child (0: torch's)")
    p.add_argument("--step-timeout-s", type=float, default=420.0, help="limit of one trainer measurement")
    p.add_argument("--json", help="also write the rows (with their raw numbers) to this JSON file")
    p.add_argument("--workdir", help="where models, configs and logs go (default: a new temporary folder)")
    p.add_argument("--child", help=argparse.SUPPRESS)  # a config: run one trainer measurement, print JSON
    return resolve_defaults(p.parse_args(argv))


def resolve_defaults(args: argparse.Namespace) -> argparse.Namespace:
    import torch

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check: --device cuda, but torch sees no CUDA device")
    gpu = args.device == "cuda"
    if args.trainer == "auto":
        args.trainer = "deepspeed" if importable("deepspeed") else "torch"
    args.models = args.models or ("tiny,1.5b,tiny_moe,a3b_4l" if gpu else "tiny,tiny_moe")
    unknown = set(args.models.split(",")) - set(SHAPES)
    if unknown:
        raise SystemExit(f"gpu_check: unknown --models {sorted(unknown)}; choose from {', '.join(SHAPES)}")
    args.dtype = args.dtype or ("bfloat16" if gpu else "float32")
    args.tokens = args.tokens or (8192 if gpu else 256)
    args.seq_len = min(args.seq_len, args.tokens) if gpu else min(args.seq_len, 32)
    args.chunk = args.chunk or (1024 if gpu else 64)
    if args.gpu_memory_gb is None:
        args.gpu_memory_gb = torch.cuda.get_device_properties(0).total_memory / GB if gpu else 80.0
    if args.with_server is None:
        args.with_server = gpu
    return args


def main() -> None:
    if not importable("omegaconf"):  # pipelinerl.config's one dependency a bare PyTorch machine lacks
        raise SystemExit("gpu_check: pipelinerl needs omegaconf and antlr4-python3-runtime; without network, "
                         "put their wheels in .whl/ (tools/gpu_check.sh installs them into a private folder)")
    args = parse_args()
    if args.child:
        print(json.dumps(run_child(args)))
        return
    rows = run_checks(args)
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=2))
    failed = [r.step for r in rows if r.failed]
    if failed:
        print(f"gpu_check: FAILED: {', '.join(failed)}")
        sys.exit(1)


if __name__ == "__main__":
    main()
