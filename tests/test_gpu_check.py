"""tools/gpu_check.sh as the CI smoke test of the one-GPU check: `--device cpu` runs the tiny model and the tiny
mixture of experts (with routing replay) through the trainer, the plan and the gather, and prints one table; the
bucket packing it times is checked against the wire format's layout."""

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent


def load_tool(name: str = "gpu_check"):
    """A module of tools/gpu_check*.py, imported as the tool imports its siblings (tools/ on sys.path)."""
    if str(REPO / "tools") not in sys.path:
        sys.path.insert(0, str(REPO / "tools"))
    return importlib.import_module(name)


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    """One `tools/gpu_check.sh --device cpu` (about 2 minutes on 2 quiet cores: four Python processes start;
    several times that under load)."""
    work = tmp_path_factory.mktemp("gpu_check")
    out = subprocess.run([str(REPO / "tools" / "gpu_check.sh"), "--device", "cpu", "--workdir", str(work),
                          "--json", str(work / "rows.json")], capture_output=True, text=True, timeout=840, cwd=REPO)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = {r["step"]: r for r in json.loads((work / "rows.json").read_text())}
    return out.stdout, rows


def test_cpu_table_has_a_measured_trainer_row(cpu_run):
    stdout, rows = cpu_run
    table = stdout[stdout.index("\nstep "):]
    assert "trainer [tiny]" in table and "peak" in table
    trainer = rows["trainer [tiny]"]
    assert trainer["result"] == "ok"
    m = trainer["values"]
    assert m["params"] == 497_024  # the tiny shape: hidden 128, 2 layers, FFN 512, 17-token vocabulary, untied
    assert m["steps"] == 3 and 0 < m["step_s"] < 30
    # The peak holds at least the weights and AdamW's two moments (float32) and stays far under a GB.
    assert 3 * 4 * m["params"] < m["peak_bytes"] < 2e9
    assert m["gather_bytes"] == 4 * m["params"] and m["buckets"] == 1


def test_cpu_table_plan_gather_and_server_rows(cpu_run):
    _, rows = cpu_run
    plan = rows["plan vs measured [tiny]"]
    assert plan["result"] == "ok" or plan["result"] == "skipped: pipelinerl plan not available"
    if plan["result"] == "ok":
        assert plan["values"]["predicted_gb"] > 0
        v = plan["values"]
        assert 0 < v["predicted_tensors_gb"] <= v["predicted_gb"]
        assert v["ratio"] == pytest.approx(v["predicted_tensors_gb"] / v["measured_gb"])
    gather = rows["gather for broadcast [tiny]"]
    assert gather["result"] == "ok" and gather["values"]["gather_s"] > 0
    assert rows["server: update + versions + lag-0 log-probs"]["result"].startswith("skipped:")
    assert not any(step.startswith("server MoE") for step in rows)  # not asked: no server is started
    assert not any(r["result"].startswith("FAILED") for r in rows.values())


def test_cpu_table_trains_the_tiny_moe_with_routing_replay(cpu_run):
    _, rows = cpu_run
    trainer = rows["trainer [tiny_moe]"]
    assert trainer["result"] == "ok"
    m = trainer["values"]
    # Per layer: attention 128x128 (q, o) + 128x64 (k, v), q/k norms 2x32, layer norms 2x128, router 8x128, and
    # 8 experts of gate, up and down 128x64; plus untied 17x128 embeddings and head, and the final norm.
    layer = 2 * 128 * 128 + 2 * 128 * 64 + 2 * 32 + 2 * 128 + 8 * 128 + 8 * 3 * 128 * 64
    assert m["params"] == 2 * layer + 2 * 17 * 128 + 128
    moe = m["moe"]
    assert (moe["layers"], moe["experts"], moe["top_k"], moe["replay"]) == (2, 8, 2, "r3")
    # 3 steps x 8 sequences x 28 completion tokens x 2 layers, each given a random routing to replay
    assert moe["replayed"] == 3 * 8 * 28 * 2
    assert moe["chance_mismatch"] == pytest.approx(1 - 1 / 28)
    replay = rows["routing replay [tiny_moe]"]
    assert replay["result"] == "ok", replay
    assert replay["values"]["self_replay_bitwise"] and replay["values"]["self_replay_max_diff"] == 0.0


def test_replay_row_fails_when_replay_changes_the_forward_or_the_mismatch_is_not_chance():
    tool = load_tool()
    good = {"layers": 2, "experts": 8, "top_k": 2, "replay": "r3", "replayed": 1344.0, "random_mismatch": 0.95,
            "chance_mismatch": 1 - 1 / 28, "self_replay_max_diff": 0.0, "rerun_max_diff": 0.0}
    assert tool.replay_row("x", good).result == "ok"
    assert tool.replay_row("x", {**good, "self_replay_max_diff": 1e-6}).failed
    assert tool.replay_row("x", {**good, "self_replay_max_diff": 1e-6, "rerun_max_diff": 1e-6}).result == "ok"
    assert tool.replay_row("x", {**good, "random_mismatch": 0.0}).failed  # replay never compared or applied
    assert tool.replay_row("x", {**good, "replayed": 0.0}).failed
    assert tool.replay_row("x", {}).result.startswith("skipped:")


def test_pack_buckets_lays_tensors_out_as_the_wire_format_says():
    """What the gather row times is the broadcaster's packing: each tensor's bytes at plan_buckets' offset."""
    from pipelinerl.weights import TensorMeta, dtype_name, plan_buckets

    tool = load_tool("gpu_check_trainer")
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(shape, generator=g).to(dtype) for shape, dtype in
               (((3, 5), torch.float32), ((7,), torch.bfloat16), ((4, 4), torch.float32), ((1,), torch.bfloat16))]
    metas = [TensorMeta(f"t{i}", dtype_name(t.dtype), list(t.shape)) for i, t in enumerate(tensors)]
    captured = list(tool.pack_buckets(metas, iter(tensors), 128, torch.device("cpu")))
    buckets = plan_buckets(metas, 128)
    assert len(captured) == len(buckets) > 1
    for bucket, buf in zip(buckets, captured):
        assert buf.numel() == bucket.nbytes
        for i, off in zip(bucket.indexes, bucket.offsets):
            t = tensors[i]
            assert torch.equal(buf[off:off + t.nbytes].view(t.dtype).view(t.shape), t)


def test_cpu_table_times_the_head_gemms_and_says_nccl_needs_two_gpus(cpu_run):
    _, rows = cpu_run
    head = next(r for step, r in rows.items() if step.startswith("head GEMMs"))
    assert head["result"] == "ok"
    for name in ("bf16", "bf16+fp32head", "fp32 operands"):
        assert head["values"][name]["s"] > 0 and head["values"][name]["rel_err"] < 2**-6  # bf16 gradient rounding
    assert rows["NCCL 2-rank weight update"]["result"].startswith("skipped: needs 2 GPUs")
