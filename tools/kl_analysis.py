"""KL(behaviour || target) as a function of lag, from a run's checkpoints and rollout stream (seed 001's
"Exp 2": PipelineRL's in-flight behaviour policy against conventional RL's, at equal lag).

For every sample the trainer consumed at step t (the stream in the trainer's reading order: step t
trains samples t*S .. (t+1)*S - 1, split over the ranks), the target policy is the one trained at that step: version t,
i.e. checkpoint step_t (the base model for t = 0). Behaviour log-probs come from the stream (the
servers' log-probs of the sampled tokens); target log-probs from transformers on the checkpoint's HF
weights. With tokens x ~ behaviour and r = pi_target(x) / pi_behaviour(x), two per-token estimators:
k1 = -log r (unbiased, noisy) and k3 = (r - 1) - log r (unbiased, never negative). A token's lag is
t minus the version that generated it. Steps whose checkpoint was pruned are skipped: keep them with
`checkpoints.every_steps=1 checkpoints.keep_last=<many>`.

    python tools/kl_analysis.py RUN_DIR [RUN_DIR ...] [--max-samples-per-step N] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from pipelinerl.config import load_config
from pipelinerl.streams import ROLLOUT_TOPIC, StreamReader
from pipelinerl.trainer.checkpoints import checkpoint_path, complete_checkpoints


def consumed_by_step(run_dir: Path, max_samples_per_step: int | None) -> dict[int, list[dict]]:
    """Samples of every complete step, keyed by the step (= target version) that trained them."""
    cfg = load_config(run_dir / "config.yaml")
    checkpoints = complete_checkpoints(run_dir / "checkpoints")
    if not checkpoints:
        raise ValueError(f"{run_dir} has no checkpoint: the trained steps and their weights are unknown")
    meta = json.loads((checkpoints[-1] / "meta.json").read_text())
    steps, S = int(meta["version"]), cfg.trainer.samples_per_step
    by_step: dict[int, list[dict]] = defaultdict(list)
    reader = StreamReader(run_dir, ROLLOUT_TOPIC, cfg.streams)
    rows: list[dict] = []
    while len(rows) < steps * S:
        groups = reader.read_groups(max_groups=256, timeout_s=5.0)
        rows.extend(row for group in groups for row in group.to_pylist())
    for i, row in enumerate(rows[: steps * S]):
        if max_samples_per_step is None or len(by_step[i // S]) < max_samples_per_step:
            by_step[i // S].append(row)
    return dict(by_step)


def target_weights(run_dir: Path, step: int, base_model: str) -> Path | None:
    """HF folder of policy version `step`, or None when that checkpoint is gone."""
    if step == 0:
        return Path(base_model)
    path = checkpoint_path(run_dir / "checkpoints", step) / "hf"
    return path if path.is_dir() else None


@torch.inference_mode()
def completion_logprobs(model, rows: list[dict], temperature: float = 1.0, batch_size: int = 64) -> list[np.ndarray]:
    """log pi(completion token | prefix) of each row under `model` at the sampling temperature (the
    distribution the servers' behaviour log-probs describe), right-padded batches."""
    out = []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        seqs = [r["prompt_token_ids"] + r["completion_token_ids"] for r in chunk]
        width = max(map(len, seqs))
        ids_BL = torch.zeros(len(seqs), width, dtype=torch.long)
        mask_BL = torch.zeros(len(seqs), width, dtype=torch.long)
        for i, seq in enumerate(seqs):
            ids_BL[i, :len(seq)], mask_BL[i, :len(seq)] = torch.tensor(seq), 1
        logits_BLV = model(input_ids=ids_BL, attention_mask=mask_BL).logits.float() / temperature
        logp_BLV = torch.log_softmax(logits_BLV, dim=-1)
        for i, row in enumerate(chunk):
            p, n = len(row["prompt_token_ids"]), len(row["completion_token_ids"])
            # Logits at position j predict token j + 1: completion tokens p..p+n-1 come from p-1..p+n-2.
            picked = logp_BLV[i, p - 1:p + n - 1].gather(-1, torch.tensor(row["completion_token_ids"])[:, None])
            out.append(picked[:, 0].numpy().astype(np.float64))
    return out


def token_kl(run_dir: Path, max_samples_per_step: int | None = None) -> dict[str, np.ndarray]:
    """Per-token step (target version), lag, k1 and k3 of every consumed model token (loss mask 1: an episode's
    environment tokens have no behaviour policy) whose target exists."""
    from transformers import AutoModelForCausalLM

    cfg = load_config(run_dir / "config.yaml")
    steps, lags, k1, k3 = [], [], [], []
    for step, rows in sorted(consumed_by_step(run_dir, max_samples_per_step).items()):
        weights = target_weights(run_dir, step, cfg.model.path)
        rows = [r for r in rows if r["completion_token_ids"]]
        if weights is None or not rows:
            continue
        model = AutoModelForCausalLM.from_pretrained(weights, dtype=torch.float32).eval()
        for row, target in zip(rows, completion_logprobs(model, rows, cfg.actor.sampling.temperature)):
            model_tokens = np.asarray(row["loss_mask"], bool)
            log_r = (target - np.asarray(row["behaviour_logprobs"], dtype=np.float64))[model_tokens]
            steps.append(np.full(len(log_r), step))
            lags.append(step - np.asarray(row["versions"])[model_tokens])
            k1.append(-log_r)
            k3.append(np.expm1(log_r) - log_r)
    if not lags:
        raise ValueError(f"{run_dir}: no consumed step has its checkpoint; keep them (checkpoints.every_steps=1)")
    return {"step": np.concatenate(steps), "lag": np.concatenate(lags), "k1": np.concatenate(k1),
            "k3": np.concatenate(k3)}


def kl_by_lag(tokens: dict[str, np.ndarray]) -> list[dict]:
    """Mean k1 and k3 per lag value, with the token count."""
    rows = []
    for lag in np.unique(tokens["lag"]):
        sel = tokens["lag"] == lag
        rows.append({"lag": int(lag), "tokens": int(sel.sum()), "kl_k1": float(tokens["k1"][sel].mean()),
                     "kl_k3": float(tokens["k3"][sel].mean())})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="KL(behaviour || target) against lag, per run (seed 001 Exp 2)")
    parser.add_argument("run_dirs", nargs="+", type=Path)
    parser.add_argument("--max-samples-per-step", type=int, default=None, help="subsample to bound the cost")
    parser.add_argument("--json", type=Path, default=None, help="also write the table here")
    args = parser.parse_args(argv)
    report = {}
    print(f"{'run':<40} {'mode':<12} {'lag':>4} {'tokens':>8} {'KL k1':>11} {'KL k3':>11}")
    for run_dir in args.run_dirs:
        mode = load_config(run_dir / "config.yaml").mode
        table = kl_by_lag(token_kl(run_dir, args.max_samples_per_step))
        report[str(run_dir)] = {"mode": mode, "by_lag": table}
        for row in table:
            print(f"{str(run_dir)[-40:]:<40} {mode:<12} {row['lag']:>4} {row['tokens']:>8} "
                  f"{row['kl_k1']:>11.3e} {row['kl_k3']:>11.3e}")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
