"""PipelineRL against conventional RL on the same model, task, seed, budget and machine, one after the other.

Each mode is a real `pipelinerl run` of one config (default configs/tiny_long_tail.yaml: the long-tailed
arithmetic task, server and trainer on their own cores), the conventional one with `mode=conventional`, G
steps per batch and the whole batch in flight, while this process samples the servers' running-requests
gauge from /metrics. Then, side by side: samples trained per second and generated (model) tokens per second
(over the same window: first to last optimizer step), inference batch occupancy (running requests /
inference.max_num_seqs: mean, and per quarter of the window), trainer idle fraction (time waiting for data
/ step time), token lag mean and max next to tools/lag_model.py's prediction from the measured occupancy and
rates, mean ESS and KL(behaviour||current) (k3) of the steps, the completion lengths (model tokens), for
multi-turn tasks (configs/tiny_tools.yaml) the turns per sample, the share of samples straddling a weight
update (model tokens of more than one version) and the model turns' lengths, the wall time from the end of
the first optimizer step to the end of the step that made the first version evaluated at or above each --target
(the config's evaluation servers evaluate beside the run: inference.eval_servers), the episodes ended other than
by themselves or a limit (aborted: must be 0), and the longest weight delivery to the training servers (goal:
none over 1 s); then where the time goes:
the trainer's mean seconds per step waiting for data, training and broadcasting, and each role's CPU time
per trained sample (vLLM's engine core apart from its API server) with the cores all roles kept busy, from the
run's process tree sampled every 0.5 s; then pipeline / conventional ratios (goal: >= 1.5 in samples/s and
in time to the target, the inverse ratio for time).

A held-out curve that sits flat near the target makes the time to it a coin toss, so: several --target values
(on the steep part of the curve), the mean held-out success over a time budget (the area under the curve, which
no single crossing decides), and `--seeds N` repeats of both modes, each ratio then given as its median and
[min, max] over the repeats.

A `--variant NAME=key=value[,key=value...]` adds a pipeline-mode run with those overrides, compared with the
plain pipeline run in a table of its own (same seed, steps and machine): e.g.
`--variant dynamic=rl.filter_zero_variance=true --variant curriculum=task.curriculum=pass_rate`.

    python tools/bench_pipeline_vs_conventional.py [--config C] [--steps 120] [--target T [T ...]] [--G 4]
        [--seeds N] [--budget-s S] [--variant NAME=k=v,...] [--summary PATH] [key=value ...]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
from bench_summary import Summary

REPO = Path(__file__).resolve().parent.parent


def _lag_model():
    spec = importlib.util.spec_from_file_location("lag_model", REPO / "tools" / "lag_model.py")
    module = sys.modules["lag_model"] = importlib.util.module_from_spec(spec)  # dataclasses look it up
    spec.loader.exec_module(module)
    return module


class GaugeSampler(threading.Thread):
    """Polls vLLM's `vllm:num_requests_running` on every server every `period_s`: (unix time, sum)."""

    def __init__(self, urls: list[str], period_s: float = 0.5):
        super().__init__(daemon=True)
        self.urls, self.period_s, self.samples, self.stop = urls, period_s, [], threading.Event()

    def run(self) -> None:
        import httpx

        with httpx.Client(timeout=2.0) as http:
            while not self.stop.is_set():
                total = 0.0
                try:
                    for url in self.urls:
                        total += _running_requests(http.get(f"{url}/metrics").text)
                    self.samples.append((time.time(), total))
                except httpx.HTTPError:  # a server starting or stopping: no sample this time
                    pass
                self.stop.wait(self.period_s)


# A run's roles, by the `pipelinerl.cli` command of the process or its nearest such ancestor; vLLM's engine
# core (a child of its server, named by vLLM) is split out of its server.
ROLE_COMMANDS = {"serve": "server API", "train": "trainer", "actor": "actor", "run": "launcher"}
ENGINE_CORE = "server engine core"
# the end reasons of an episode ended as it should: by itself, or cut by a limit (anything else, env_error above
# all, counts as aborted; a weight update never aborts one)
FINISHED_OR_CUT = ("finished", "truncated", "max_turns", "max_tokens_per_turn", "max_total_tokens")
EVAL_SERVER = "evaluation server"  # `serve --eval` (inference.eval_servers), its engine core included


def role_of(proc) -> str | None:
    """The role a process of the run belongs to (a psutil.Process), None when it is not one of them."""
    import psutil

    try:
        argv = proc.cmdline()
        if not argv:  # exiting: its command line is gone, and its parents' would name the wrong role
            return None
        # vLLM's engine core (and, with several ranks, its workers): vLLM retitles them (command line, name)
        engine = proc.name().startswith("VLLM::") or argv[0].startswith("VLLM::")
        # the process, then its ancestors, nearest first; each command line read once: a process can exit
        # between two reads, and an empty second read would pass it on to its parent (an exiting role
        # counted as the launcher's, its own role gone from the samples)
        while "pipelinerl.cli" not in argv[:-1]:
            proc = proc.parent()
            if proc is None:
                return None
            argv = proc.cmdline()
            if not argv:  # that ancestor is exiting: the role it had can't be told now
                return None
        command = argv[argv.index("pipelinerl.cli") + 1]
        if command == "serve" and "--eval" in argv:
            return EVAL_SERVER
        return ENGINE_CORE if engine else ROLE_COMMANDS.get(command)
    except psutil.Error:
        return None


class RoleCpuSampler(threading.Thread):
    """Every `period_s`: (unix time, {role: CPU seconds used so far}) over the process tree of `root_pid` (the
    `pipelinerl run` launcher). A process that exits keeps the CPU time of its last sample."""

    def __init__(self, root_pid: int, period_s: float = 0.5):
        super().__init__(daemon=True)
        self.root_pid, self.period_s, self.samples, self.stop = root_pid, period_s, [], threading.Event()

    def run(self) -> None:
        import psutil

        seen: dict[int, tuple[str, float]] = {}  # pid -> (role, CPU seconds at its latest sample)
        while not self.stop.is_set():
            try:
                root = psutil.Process(self.root_pid)
                procs = [root, *root.children(recursive=True)]
            except psutil.Error:  # the run has exited
                break
            # classified afresh each time (vLLM retitles its engine core after it starts); a process that is
            # exiting (no role) keeps its last sample
            for proc in procs:
                role = role_of(proc)
                try:
                    times = proc.cpu_times()
                except psutil.Error:
                    continue
                if role is not None:
                    seen[proc.pid] = (role, times.user + times.system)
            totals: dict[str, float] = {}
            for role, cpu_s in seen.values():
                totals[role] = totals.get(role, 0.0) + cpu_s
            self.samples.append((time.time(), totals))
            self.stop.wait(self.period_s)


def cpu_per_role(samples: list[tuple[float, dict[str, float]]], t0: float, t1: float) -> dict[str, float]:
    """CPU seconds each role used between the samples nearest to t0 and t1."""
    if not samples:
        return {}
    start = min(samples, key=lambda s: abs(s[0] - t0))[1]
    end = min(samples, key=lambda s: abs(s[0] - t1))[1]
    return {role: end[role] - start.get(role, 0.0) for role in end}


def _running_requests(prometheus_text: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in prometheus_text.splitlines()
               if line.startswith("vllm:num_requests_running"))


def mode_overrides(config: Path, mode: str, G: int, overrides: list[str] = ()) -> list[str]:
    """What turns the (pipeline) config, with `overrides`, into `mode`: conventional = G optimizer steps per
    generated batch of G x samples_per_step, all of it in flight at once, the lag bounded by construction."""
    from pipelinerl.config import load_config

    if mode == "pipeline":
        return []
    cfg = load_config(config, list(overrides))
    groups = G * cfg.trainer.samples_per_step // cfg.actor.attempts
    return ["mode=conventional", f"conventional.steps_per_batch={G}", "actor.max_lag=null",
            f"actor.max_groups_in_flight={groups}"]


def run_mode(config: Path, mode: str, out_dir: Path, overrides: list[str], targets: list[float]) -> dict:
    """One `pipelinerl run` with the gauge sampled throughout; returns its measurements."""
    from pipelinerl.config import load_config
    from pipelinerl.rundir import bind_host

    run_dir = out_dir / mode
    shutil.rmtree(run_dir, ignore_errors=True)  # a run directory left by an earlier bench would be resumed
    args = [f"run_dir={run_dir}", *overrides]
    cfg = load_config(config, args)
    host = bind_host(cfg.inference.host)
    urls = [f"http://{host}:{cfg.inference.base_port + i}" for i in range(cfg.inference.num_servers)]
    sampler = GaugeSampler(urls)
    sampler.start()
    started = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "pipelinerl.cli", "run", str(config), *args,
                             "logging.progress_bar=false"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    cpu = RoleCpuSampler(proc.pid)
    cpu.start()
    stdout, stderr = proc.communicate()
    for thread in (sampler, cpu):
        thread.stop.set()
        thread.join()
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} run failed:\n{stdout[-2000:]}\n{stderr[-4000:]}")
    return measure(cfg, run_dir, sampler.samples, time.time() - started, targets, cpu.samples)


def _time_to_target(evals: list, steps: dict[int, float], target: float) -> tuple[float | None, int | None]:
    """(seconds from the end of the first optimizer step to the end of the step that made the first version
    evaluated at >= target, that version), or Nones. Timed by the step, not by when its evaluation ended: with
    evaluation servers (inference.eval_servers) that may come later, without delaying training."""
    first = min(steps.values())
    for e in sorted(evals, key=lambda e: e.step):
        if e.value >= target:
            return (steps[e.step] - first if e.step in steps else 0.0), e.step
    return None, None


def _curve(evals: list, steps: dict[int, float], t0: float) -> list[tuple[float, float]]:
    """The held-out success curve: (seconds from the end of the first step to the end of the step that made the
    version evaluated, its success), in version order; versions whose step is not logged are left out."""
    return [(steps[e.step] - t0, e.value) for e in sorted(evals, key=lambda e: e.step) if e.step in steps]


def mean_success(curve: list[tuple[float, float]], budget_s: float) -> float:
    """The held-out success averaged over the first `budget_s` seconds from the first step (the area under the
    curve / budget_s): each evaluated version counts from the end of the step that made it until the next one's,
    0 before the first. Unlike a time to one target, it does not hinge on one crossing of a flat curve."""
    area, last_t, last_v = 0.0, 0.0, 0.0
    for t, v in curve:
        if t >= budget_s:
            break
        area += (t - last_t) * last_v
        last_t, last_v = max(t, 0.0), v
    return (area + (budget_s - last_t) * last_v) / budget_s


def _stream_stats(run_dir: Path, t0: float, t1: float) -> dict:
    """From the rollout stream: model tokens received by the actor in [t0, t1] (`tokens`), every sample's model
    tokens (`lengths`), every model turn's length (a run of loss_mask 1s), the model turns per sample,
    whether a sample's model tokens come from more than one policy version (it straddled an update), and the
    rows per end reason."""
    import pyarrow as pa

    from pipelinerl.streams.segments import list_segments, list_writers, topic_dir

    tdir = topic_dir(run_dir, "rollouts")
    out = {"tokens": 0, "lengths": [], "turn_lengths": [], "turns": [], "straddling": [], "end_reasons": {}}
    for writer in list_writers(tdir):
        for segment in list_segments(tdir / writer):
            with pa.memory_map(str(segment.path)) as mapped:
                table = pa.ipc.open_file(mapped).read_all()
            for reason in table.column("end_reason").to_pylist():
                out["end_reasons"][reason] = out["end_reasons"].get(reason, 0) + 1
            rows = zip(table.column("loss_mask").to_pylist(), table.column("versions").to_pylist(),
                       table.column("turns").to_pylist(), table.column("created_at").to_pylist())
            for mask, versions, turns, created in rows:
                n = sum(mask)
                out["lengths"].append(n)
                out["tokens"] += n if t0 <= created <= t1 else 0
                out["turn_lengths"] += _runs_of_ones(mask)
                out["turns"].append(turns)
                out["straddling"].append(len({v for v, m in zip(versions, mask) if m}) > 1)
    return out


def _runs_of_ones(mask: list[int]) -> list[int]:
    """The lengths of the runs of 1s: [1, 1, 0, 1] -> [2, 1]."""
    runs, n = [], 0
    for m in [*mask, 0]:
        if m:
            n += 1
        elif n:
            runs.append(n)
            n = 0
    return runs


def measure(cfg, run_dir: Path, gauge: list[tuple[float, float]], wall_s: float, targets: list[float],
            cpu_samples: list[tuple[float, dict[str, float]]]) -> dict:
    from pipelinerl.metrics import read_scalars, read_token_stats

    trainer = read_scalars(run_dir / "tb" / "trainer")
    steps = sorted(trainer["read_s"], key=lambda e: e.step)
    t0, t1 = steps[0].wall_time, steps[-1].wall_time  # from the end of step 1 to the end of the last
    window_s = t1 - t0
    stream = _stream_stats(run_dir, t0, t1)
    tokens, lengths, turn_lengths = stream["tokens"], stream["lengths"], stream["turn_lengths"]
    busy = [sum(e.value for e in trainer[k]) for k in ("read_s", "train_s", "broadcast_s")]
    running = [v for t, v in gauge if t0 <= t <= t1]
    slots = cfg.inference.max_num_seqs * cfg.inference.num_servers
    quarters = [[v for t, v in gauge if t0 + q * window_s / 4 <= t < t0 + (q + 1) * window_s / 4] for q in range(4)]
    lag = read_token_stats(run_dir)["lag"]
    cpu = cpu_per_role(cpu_samples, t0, t1)
    evals = read_scalars(run_dir / "tb" / "actor0").get("eval/success", [])
    step_times = {e.step: e.wall_time for e in steps}
    reached = {t: _time_to_target(evals, step_times, t) for t in targets}
    to_target_s, at_version = reached[targets[0]]
    turns = np.asarray(stream["turns"])
    ends = stream["end_reasons"]
    broadcasts = [e.value for e in trainer.get("broadcast_s", [])]
    return {"mode": cfg.mode, "samples_per_s": (len(steps) - 1) * cfg.trainer.samples_per_step / window_s,
            "tokens_per_s": tokens / window_s, "running_mean": float(np.mean(running)) if running else 0.0,
            "occupancy": (float(np.mean(running)) if running else 0.0) / slots,
            "occupancy_quarters": " ".join(f"{np.mean(q) / slots:.2f}" if q else "-" for q in quarters),
            "ess": _step_mean(trainer, "ess"), "kl_k3": _step_mean(trainer, "kl_k3"),
            "length_median": float(np.median(lengths)), "length_p99": float(np.percentile(lengths, 99)),
            "trainer_idle": busy[0] / sum(busy), "lag_mean": float(lag.mean()), "lag_max": int(lag.max()),
            "time_to_target_s": to_target_s, "target_version": at_version, "wall_s": wall_s,
            **{f"time_to_{t:.2f}_s": reached[t][0] for t in targets[1:]},
            "curve": _curve(evals, step_times, t0),
            "end_reasons": ends, "aborted": sum(n for r, n in ends.items() if r not in FINISHED_OR_CUT),
            "broadcast_max_s": max(broadcasts, default=0.0), "broadcasts_over_1s": sum(b > 1.0 for b in broadcasts),
            "mean_length": float(np.mean(lengths)), "lengths": lengths,
            "turns_mean": float(np.mean(turns)), "turns_p99": float(np.percentile(turns, 99)),
            "turns_max": int(turns.max()), "multi_turn": float(np.mean(turns > 1)),
            "straddling": float(np.mean(stream["straddling"])),
            "turn_length_median": float(np.median(turn_lengths)),
            "turn_length_p99": float(np.percentile(turn_lengths, 99)),
            "steps": steps[-1].step, "samples_per_step": cfg.trainer.samples_per_step, "max_lag": cfg.actor.max_lag,
            # where the trainer's time goes, per optimizer step
            **{f"step_{k}": float(np.mean([e.value for e in trainer[k]]))
               for k in ("read_s", "train_s", "broadcast_s")},
            # where the CPU goes: each role's CPU seconds over the window, per trained sample, and in cores
            **{f"cpu_ms_{role}": 1e3 * cpu_s / ((len(steps) - 1) * cfg.trainer.samples_per_step)
               for role, cpu_s in cpu.items()},
            "cores_busy": sum(cpu.values()) / window_s}


def _step_mean(scalars: dict[str, list], tag: str) -> float | None:
    """Mean over the optimizer steps of a trainer scalar (None when the trainer did not log it)."""
    return float(np.mean([e.value for e in scalars[tag]])) if tag in scalars else None


def predicted_lag(result: dict, G: int) -> tuple[float, float]:
    """tools/lag_model.py's token lag (mean, max) for the measured occupancy and rates."""
    if result["mode"] == "conventional":
        return (G - 1) / 2, float(G - 1)
    lengths = np.asarray(result["lengths"])
    # A decode step produces one token per running sequence: t(b) = running / tokens_per_s.
    decode_step_s = result["running_mean"] / result["tokens_per_s"]
    step_period_s = result["samples_per_step"] / result["samples_per_s"]
    lags = _lag_model()._pipeline_lags(lengths, decode_step_s, step_period_s)
    if result["trainer_idle"] < 0.5:  # training is the bottleneck: samples queue up to the throttle's bound
        return max(result["max_lag"] - 0.5, lags["lag_mean"]), max(float(result["max_lag"]), lags["lag_max"])
    return lags["lag_mean"], lags["lag_max"]


ROWS = [("samples trained / s", "samples_per_s", "{:.1f}"), ("generated tokens / s", "tokens_per_s", "{:.0f}"),
        ("mean running requests", "running_mean", "{:.1f}"), ("inference batch occupancy", "occupancy", "{:.3f}"),
        ("occupancy per quarter", "occupancy_quarters", "{}"),
        ("trainer idle fraction", "trainer_idle", "{:.3f}"), ("lag mean (tokens)", "lag_mean", "{:.3f}"),
        ("lag max", "lag_max", "{}"), ("lag mean / max, lag model", "predicted", "{}"),
        ("ESS (mean of steps)", "ess", "{:.3f}"), ("KL(behaviour||current) k3", "kl_k3", "{:.3g}"),
        ("completion length median", "length_median", "{:.0f}"), ("completion length p99", "length_p99", "{:.0f}"),
        ("model turns per sample", "turns_mean", "{:.2f}"), ("  p99", "turns_p99", "{:.0f}"),
        ("  max", "turns_max", "{}"), ("  samples of > 1 turn", "multi_turn", "{:.3f}"),
        ("aborted episodes", "aborted", "{}"),
        ("  straddling an update", "straddling", "{:.3f}"),
        ("model turn length median", "turn_length_median", "{:.0f}"),
        ("model turn length p99", "turn_length_p99", "{:.0f}"),
        ("s to target success", "time_to_target_s", "{:.0f}"), ("  reached at version", "target_version", "{}"),
        ("wall s (whole run)", "wall_s", "{:.0f}"),
        ("trainer s/step: waiting", "step_read_s", "{:.3f}"), ("trainer s/step: training", "step_train_s", "{:.3f}"),
        ("trainer s/step: broadcast", "step_broadcast_s", "{:.3f}"),
        ("weight delivery: longest s", "broadcast_max_s", "{:.3f}"),
        ("  steps with one > 1 s", "broadcasts_over_1s", "{}"),
        *[(f"CPU ms/sample: {role}", f"cpu_ms_{role}", "{:.2f}")
          for role in (ENGINE_CORE, *ROLE_COMMANDS.values(), EVAL_SERVER)],
        ("cores busy (of all roles)", "cores_busy", "{:.2f}")]


def print_table(results: dict[str, dict], target: float) -> None:
    """The two runs side by side (in `results`' order), and the first / second ratio."""
    (first, pipe), (second, conv) = results.items()
    print(f"\n{'':<28}{first:>21}{second:>21}{'ratio ' + first[0] + '/' + second[0]:>11}")
    for label, key, fmt in ROWS:
        p, c = pipe.get(key), conv.get(key)
        missing = "not reached" if "target" in key else "-"
        show = [fmt.format(v) if v is not None else missing for v in (p, c)]
        # no ratio to a float-noise denominator (KL(behaviour||current) at lag 0 is ~1e-13)
        numbers = all(isinstance(v, (int, float)) for v in (p, c)) and abs(c) > 1e-9 and key != "target_version"
        ratio = f"{p / c:.2f}" if numbers else ""
        label = label.replace("target", f"{target:.2f}")
        print(f"{label:<28}{show[0]:>21}{show[1]:>21}{ratio:>11}")


def spread(values: list[float | None]) -> str:
    """A metric over the repeats: the median and [min, max] (`n/a` when a repeat has none: a target not reached)."""
    if not values or any(v is None for v in values):
        return "n/a" if values else "-"
    return f"{np.median(values):.2f} [{min(values):.2f}, {max(values):.2f}]"


def seed_rows(per_seed: list[dict[str, dict]], targets: list[float]) -> list[tuple[str, list, list, list]]:
    """(label, pipeline values, conventional values, ratios) over the repeats: samples/s, mean held-out success over
    the budget, and the time to each target (its ratio conventional / pipeline, so > 1 favours the pipeline)."""
    rows = []
    keys = [("samples trained / s", "samples_per_s", False), ("mean held-out success", "mean_success", False),
            *[(f"s to held-out {t:.2f}", "time_to_target_s" if k == 0 else f"time_to_{t:.2f}_s", True)
              for k, t in enumerate(targets)]]
    for label, key, inverse in keys:
        pipe = [r["pipeline"].get(key) for r in per_seed]
        conv = [r["conventional"].get(key) for r in per_seed]
        ratios = [None if p is None or c is None or not (c if inverse else p) else (c / p if inverse else p / c)
                  for p, c in zip(pipe, conv)]
        rows.append((label, pipe, conv, ratios))
    return rows


def print_seeds(per_seed: list[dict[str, dict]], targets: list[float], budget_s: float) -> None:
    print(f"\nover {len(per_seed)} repeat(s), median [min, max]; mean held-out success over the first {budget_s:.0f} s "
          "from the first step; ratios: pipeline / conventional (time: conventional / pipeline)")
    print(f"{'':<28}{'pipeline':>24}{'conventional':>24}{'ratio':>24}")
    for label, pipe, conv, ratios in seed_rows(per_seed, targets):
        print(f"{label:<28}{spread(pipe):>24}{spread(conv):>24}{spread(ratios):>24}")


def write_summary(summary: Summary, per_seed: list[dict[str, dict]], targets: list[float], path: Path | None) -> None:
    """The ratios' medians over the repeats with their goals (tools/bench_summary.py), and each mode's."""
    for label, pipe, conv, ratios in seed_rows(per_seed, targets):
        med = None if any(r is None for r in ratios) else float(np.median(ratios))
        goal = ">= 1.5" if label != "mean held-out success" else None
        summary.add(f"{label}, ratio (median of {len(ratios)})", med, "ratio", goal)
        for mode, values in (("pipeline", pipe), ("conventional", conv)):
            summary.add(f"{mode}: {label} (median)", None if None in values else float(np.median(values)))
    pipe = [r["pipeline"] for r in per_seed]
    summary.add("pipeline: longest weight delivery", max(r["broadcast_max_s"] for r in pipe), "s", "<= 1")
    summary.add("pipeline: aborted episodes", sum(r["aborted"] for r in pipe), "episodes", "<= 0")
    for mode in ("pipeline", "conventional"):
        summary.add(f"{mode}: inference batch occupancy", float(np.mean([r[mode]["occupancy"] for r in per_seed])),
                    "fraction")
        summary.add(f"{mode}: trainer idle fraction", float(np.mean([r[mode]["trainer_idle"] for r in per_seed])),
                    "fraction")
    summary.write(path)


def main() -> int:
    parser = argparse.ArgumentParser(description="PipelineRL vs conventional RL, side by side (tiny model, CPU)")
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "tiny_long_tail.yaml",
                        help="the pipeline-mode config both modes run (conventional: with mode overrides)")
    parser.add_argument("--steps", type=int, default=160, help="optimizer steps per mode (a multiple of G)")
    parser.add_argument("--G", type=int, default=4, help="conventional: optimizer steps per generated batch")
    parser.add_argument("--target", type=float, nargs="+", default=[0.5],
                        help="held-out greedy success(es) to time; the first is the summary's headline")
    parser.add_argument("--seeds", type=int, default=1,
                        help="repeats of both modes (repeat k: seed=k; vLLM's sampling is not seeded either)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="mean held-out success over this many seconds from the first step (default: up to "
                             "the earliest last evaluation among all runs)")
    parser.add_argument("--out-dir", type=Path, default=REPO / "runs" / "bench_pipeline_vs_conventional")
    parser.add_argument("--base-port", type=int, default=18650)
    parser.add_argument("--summary", type=Path, default=None, help="also write the ratios here (bench_all)")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=k=v,...",
                        help="also a pipeline run with these overrides, compared with the plain one (first repeat)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides applied to both modes")
    args = parser.parse_args()
    summary = Summary("pipeline_vs_conventional")  # the load average before the runs
    variants = dict(v.split("=", 1) for v in args.variant)
    common = [f"trainer.max_steps={args.steps}", f"actor.eval_every_steps={args.G}",
              f"inference.base_port={args.base_port}", f"trainer.broadcast_port={args.base_port + 40}", *args.overrides]
    per_seed = []
    for k in range(args.seeds):
        out_dir = args.out_dir / f"seed{k}" if args.seeds > 1 else args.out_dir
        seeded = [*common, f"seed={k}"] if args.seeds > 1 else common
        results = {}
        for mode in ("pipeline", "conventional"):
            print(f"running {mode} ({args.steps} steps, repeat {k + 1} of {args.seeds})...", flush=True)
            overrides = mode_overrides(args.config, mode, args.G) + seeded
            results[mode] = run_mode(args.config, mode, out_dir, overrides, args.target)
            results[mode]["predicted"] = "{:.2f} / {:.2f}".format(*predicted_lag(results[mode], args.G))
        print_table(results, args.target[0])
        if k == 0:
            for name, extra in variants.items():
                print(f"running pipeline with {extra} ({args.steps} steps)...", flush=True)
                overrides = mode_overrides(args.config, "pipeline", args.G) + common + extra.split(",")
                results[name] = run_mode(args.config, name, out_dir, overrides, args.target)
                print_table({name: results[name], "pipeline": results["pipeline"]}, args.target[0])
        per_seed.append(results)
    runs = [r for results in per_seed for r in results.values()]
    budget_s = args.budget_s or min((r["curve"][-1][0] for r in runs if r["curve"]), default=1.0)
    for r in runs:
        r["mean_success"] = mean_success(r["curve"], budget_s)
    print_seeds(per_seed, args.target, budget_s)
    saved = [{m: {k: v for k, v in r.items() if k != "lengths"} for m, r in results.items()} for results in per_seed]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "results.json").write_text(json.dumps({"budget_s": budget_s, "repeats": saved}, indent=1))
    write_summary(summary, per_seed, args.target, args.summary)
    print(f"\nwrote {args.out_dir / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
