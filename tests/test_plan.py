"""`pipelinerl plan` against budgets computed by hand here, and the weight-update staging policies on gloo.

Fast: no servers, no DeepSpeed. Byte counts are written out term by term from the estimates the module
docstring of pipelinerl/plan/memory.py states; GB = 1e9 bytes.
"""

import json
import logging
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import worker_port

from pipelinerl import cli
from pipelinerl.config import ConfigError, load_config
from pipelinerl.launch.procs import free_port
from pipelinerl.plan.memory import check_before_start, plan_for
from pipelinerl.plan.shapes import BUILTIN_SHAPES, load_shape
from pipelinerl.weights import (
    InitRequest,
    TensorMeta,
    UpdateRequest,
    broadcast_async,
    open_group,
    plan_buckets,
    receive_staged,
    wait_work,
)

REPO = Path(__file__).resolve().parent.parent
GB = 1e9
V = 152064  # Qwen2.5 vocabulary

# Qwen2.5-7B: hidden 3584, 28 layers, FFN 18944, 28 heads / 4 KV heads of 128, untied embeddings.
LAYER_7B = (3584 * 3584 + 3584) + 2 * (3584 * 512 + 512) + 3584 * 3584 + 3 * 3584 * 18944 + 2 * 3584
P_7B = 28 * LAYER_7B + 2 * V * 3584 + 3584
# Qwen2.5-32B: hidden 5120, 64 layers, FFN 27648, 40 heads / 8 KV heads of 128.
LAYER_32B = (5120 * 5120 + 5120) + 2 * (5120 * 1024 + 1024) + 5120 * 5120 + 3 * 5120 * 27648 + 2 * 5120
P_32B = 64 * LAYER_32B + 2 * V * 5120 + 5120
# Qwen3-30B-A3B: hidden 2048, 48 layers, 32 heads / 4 KV heads of 128, 128 experts of width 768 (top-8), a router
# per layer, vocabulary 151936, untied; q/k/v biases counted as for Qwen2 (it has q/k norms instead: 0.01 %).
ATTN_30B = (2048 * 4096 + 4096) + 2 * (2048 * 512 + 512) + 4096 * 2048
P_30B = 48 * (ATTN_30B + 128 * 3 * 2048 * 768 + 128 * 2048 + 2 * 2048) + 2 * 151936 * 2048 + 2048
ACTIVE_30B = 48 * (ATTN_30B + 8 * 3 * 2048 * 768 + 128 * 2048 + 2 * 2048) + 2 * 151936 * 2048 + 2048


def _cfg(name: str, *overrides: str):
    return load_config(str(REPO / "configs" / name), list(overrides))


def _plan(name: str, *overrides: str):
    """The plan of a config for the trainer ranks its launcher would start, as `pipelinerl plan` makes it."""
    cfg = _cfg(name, *overrides)
    return plan_for(cfg, cli.trainer_ranks(cfg))


def test_builtin_shapes_count_the_published_parameters(tmp_path):
    assert BUILTIN_SHAPES["Qwen2.5-7B"].params == P_7B == 7_615_616_512  # "7.61B" on the model card
    assert BUILTIN_SHAPES["Qwen2.5-32B"].params == P_32B == 32_763_876_352  # "32.5B" + embeddings
    hf = {"hidden_size": 3584, "num_hidden_layers": 28, "intermediate_size": 18944, "num_attention_heads": 28,
          "num_key_value_heads": 4, "vocab_size": V, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(hf))
    shape, source = load_shape(_cfg("qwen7b_orz.yaml", f"model.path={tmp_path}"))
    assert shape == BUILTIN_SHAPES["Qwen2.5-7B"] and source.endswith("config.json")


def _trainer_7b_bytes(gpu_checkpointing: bool = True) -> dict[str, float]:
    ranks, tokens, b = 8, 16384, 2
    layer = tokens * b * (8 * 3584 + 2 * 512 + 4 * 18944)  # what one layer keeps for backward
    acts = 28 * tokens * 3584 * b + 2 * layer if gpu_checkpointing else 29 * layer
    return {"zero3_shards": 18 * P_7B / ranks,  # bf16 params 2 + fp32 accumulated grads 4 + fp32 master/m/v 12
            "zero_buffers": 2 * (1e9 + 5e8),  # live params + reduce bucket, bf16
            # + log-prob chunk + head gradient + sdpa's boolean T x T mask over the packed sequences
            "fwd_bwd": acts + 1024 * V * (8 + b) + V * 3584 * (4 + b) + tokens**2,
            "optimizer_step": 8 * P_7B / ranks,  # fp32 grads + AdamW temporary, shard < sub_group_size
            # rank 0's two NCCL send buffers, each the 152064 x 3584 bf16 embedding (> the 1 GiB bucket)
            "send_buffers": 2 * V * 3584 * 2,
            "cuda_runtime": 2e9}


def test_7b_on_80_and_141_gb_matches_the_hand_budget():
    t = _trainer_7b_bytes()
    trainer = (t["zero3_shards"] + t["zero_buffers"] + max(t["fwd_bwd"], t["optimizer_step"]) + t["send_buffers"]
               + t["cuda_runtime"])
    for gpu in (80, 141):
        plan = _plan("qwen7b_orz.yaml", f"launch.gpu_memory_gb={gpu}")
        assert plan.fits, plan.problems
        got = plan.roles["trainer"]
        shards = got.items["params"] + got.items["grads"] + got.items["optimizer"]
        assert shards == pytest.approx(t["zero3_shards"] / GB)
        assert got.per_gpu_gb == pytest.approx(trainer / GB) and round(trainer / GB, 2) == 39.61
        server = plan.roles["server"]
        weights = 2 * P_7B  # bf16, TP 1
        acts = 8192 * (3 * 18944 + 3584 + 2 * 512 + 4 * 3584) * 2 + 256 * V * 4 * 4
        assert server.items["kv_cache"] == pytest.approx((0.9 * gpu * GB - weights - acts - 2.5e9) / GB)
        # host staging: two buckets, each at least the largest tensor (the 152064 x 3584 bf16 embedding > 1 GiB)
        staging = 2 * max(1024 * 2**20, V * 3584 * 2)
        assert server.per_gpu_gb == pytest.approx((0.9 * gpu * GB + staging + 0.5e9) / GB)
        assert "reference" not in plan.roles  # rl.kl_coef = 0


def test_7b_on_fsdp2_matches_the_hand_budget():
    """Float32 master params, grads and Adam m, v sharded over 8 ranks; the root (both 152064 x 3584 matrices
    and the final norm) and two layers gathered in bf16, plus the root's gradient before and after its
    float32 cast; the activations are the backend's forward, the same as on DeepSpeed."""
    t = _trainer_7b_bytes()
    root = 2 * V * 3584 + 3584
    shards = 16 * P_7B / 8
    buffers = 2 * (root + 2 * LAYER_7B) + (2 + 4) * root
    trainer = shards + buffers + max(t["fwd_bwd"], 8 * P_7B / 8) + t["send_buffers"] + t["cuda_runtime"]
    plan = _plan("qwen7b_orz.yaml", "launch.gpu_memory_gb=80", "trainer.backend=fsdp2")
    got = plan.roles["trainer"]
    assert got.items["params"] + got.items["grads"] + got.items["optimizer"] == pytest.approx(shards / GB)
    assert got.items["fsdp_buffers"] == pytest.approx(buffers / GB)
    assert got.per_gpu_gb == pytest.approx(trainer / GB) and plan.fits
    assert "8 rank(s), FSDP2" in got.notes[0]
    assert "zero_buffers" not in got.items


def test_32b_on_80_and_141_gb_matches_the_hand_budget():
    ranks, tokens, b = 16, 8192, 2
    layer = tokens * b * (8 * 5120 + 2 * 1024 + 4 * 27648)
    fwd_bwd = 64 * tokens * 5120 * b + 2 * layer + 1024 * V * (8 + b) + V * 5120 * (4 + b) + tokens**2
    step = 8 * 1e9  # the 2.05e9-parameter shard is stepped in sub-groups of 1e9
    send = 2 * V * 5120 * 2  # rank 0's two send buffers, each the embedding (> the 1 GiB bucket)
    trainer = 18 * P_32B / ranks + 3e9 + max(fwd_bwd, step) + send + 2e9
    for gpu in (80, 141):
        plan = _plan("qwen32b_orz.yaml", f"launch.gpu_memory_gb={gpu}")
        assert plan.fits, plan.problems
        assert plan.roles["trainer"].per_gpu_gb == pytest.approx(trainer / GB) and round(trainer / GB, 1) == 61.7
        server = plan.roles["server"]
        assert server.items["weights"] == pytest.approx(2 * P_32B / 4 / GB)  # TP 4
        # on the receiving worker's GPU: two buckets, each at least the embedding (> 1 GiB); the other three
        # receive none
        assert server.items["update_staging"] == pytest.approx(2 * V * 5120 * 2 / GB)
        assert server.per_gpu_gb == pytest.approx(0.9 * gpu + (2 * V * 5120 * 2 + 0.5e9) / GB)


def test_32b_tp4_stages_one_model_copy_of_host_ram_per_server():
    """The server receives once (its first TP worker, into /dev/shm) and its 4 workers load from that copy:
    2 B x 32,763,876,352 = 65.53 GB per server, not 4 x 65.53 = 262.1 GB; 2 servers per inference node."""
    plan = _plan("qwen32b_orz.yaml", "launch.gpu_memory_gb=141")
    server = plan.roles["server"]
    assert server.host["update_staging"] == pytest.approx(2 * P_32B / GB) and round(2 * P_32B / GB, 2) == 65.53
    assert server.host["delta_base"] == pytest.approx(2 * P_32B / GB)  # broadcast_delta=auto: the base, once
    assert "host staging: 65.5 GB of host RAM per server" in " ".join(server.notes)
    assert "131.1 GB per inference node" in " ".join(server.notes)  # 2 servers x 65.53
    assert "host RAM: update_staging" in plan.render() and "65.53 GB per server" in plan.render()
    device = _plan("qwen7b_orz.yaml", "launch.gpu_memory_gb=141", "inference.update_staging=device",
                   "inference.gpu_memory_utilization=0.85")
    assert "update_staging" not in device.roles["server"].host  # device staging: no host copy


def test_device_staging_costs_the_full_model_per_gpu_and_names_the_knobs():
    plan = _plan("qwen7b_orz.yaml", "launch.gpu_memory_gb=80", "inference.update_staging=device")
    assert plan.roles["server"].items["update_staging"] == pytest.approx(2 * P_7B / GB)
    assert not plan.fits
    (problem,) = plan.problems
    # 72 GB of vLLM + 15.23 GB staging + 0.5 GB group = 87.7 GB; (80 - 15.73) / 80 = 0.803 -> 0.80
    assert problem.startswith("policy server: update staging (device) 15.7 GB + vLLM's 72.0 GB = 87.7 GB > 80 GB")
    assert "inference.gpu_memory_utilization to 0.80" in problem and "inference.update_staging=host" in problem
    ok = _plan("qwen7b_orz.yaml", "launch.gpu_memory_gb=141", "inference.update_staging=device",
               "inference.gpu_memory_utilization=0.85")
    assert ok.fits  # 0.85 x 141 + 15.7 = 135.6 GB
    # with TP > 1 one worker receives for the server and the others read host memory: device staging is refused
    with pytest.raises(ConfigError, match="update_staging.*tensor_parallel_size 1.*update_staging=host"):
        _cfg("qwen32b_orz.yaml", "inference.update_staging=device")


def test_a_trainer_that_does_not_fit_names_the_number_and_the_knob():
    t = _trainer_7b_bytes(gpu_checkpointing=False)
    trainer = (t["zero3_shards"] + t["zero_buffers"] + max(t["fwd_bwd"], t["optimizer_step"]) + t["send_buffers"]
               + t["cuda_runtime"])
    plan = _plan("qwen7b_orz.yaml", "launch.gpu_memory_gb=80", "trainer.gradient_checkpointing=false")
    assert plan.roles["trainer"].per_gpu_gb == pytest.approx(trainer / GB)
    (problem,) = plan.problems
    assert problem.startswith(f"trainer rank: {trainer / GB:.1f} GB > 80 GB; set trainer.gradient_checkpointing=true")
    assert "launch.slurm.training_nodes" in problem
    assert _plan("qwen7b_orz.yaml", "launch.gpu_memory_gb=141", "trainer.gradient_checkpointing=false").fits


def test_reference_servers_appear_with_their_prompt_logprobs():
    plan = _plan("qwen7b_orz.yaml", "launch.gpu_memory_gb=141", "rl.kl_coef=0.05")
    ref = plan.roles["reference"]
    assert ref.items["prompt_logprobs"] == pytest.approx(8192 * V * (2 + 8) / GB)  # outside vLLM's share
    assert "update_staging" not in ref.items and plan.fits
    assert not _plan("qwen7b_orz.yaml", "launch.gpu_memory_gb=80", "rl.kl_coef=0.05").fits  # 72 + 12.5


def test_the_tir_7b_config_plans_as_the_7b_run():
    """configs/qwen7b_tir.yaml: the 7B run's cluster, servers and sequence length, so the same budget."""
    for gpu in (80, 141):
        tir, orz = (_plan(name, f"launch.gpu_memory_gb={gpu}") for name in ("qwen7b_tir.yaml", "qwen7b_orz.yaml"))
        assert tir.fits, tir.problems
        assert {r: p.items for r, p in tir.roles.items()} == {r: p.items for r, p in orz.roles.items()}


def test_json_schema_and_exit_codes(capsys):
    assert cli.main(["plan", str(REPO / "configs/qwen32b_orz.yaml"), "--gpu-memory-gb", "141", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {"gpu_memory_gb", "fits", "roles", "host_memory_gb", "host_nodes"}
    assert out["gpu_memory_gb"] == 141.0 and out["fits"] is True
    assert set(out["roles"]) == {"trainer", "server"}
    for role in out["roles"].values():
        assert set(role) == {"per_gpu_gb", "items"} and isinstance(role["per_gpu_gb"], float)
        assert all(isinstance(v, float) for v in role["items"].values())
    bad = subprocess.run([sys.executable, "-m", "pipelinerl.cli", "plan", "configs/qwen7b_orz.yaml", "--json",
                          "--gpu-memory-gb", "30"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and json.loads(bad.stdout)["fits"] is False
    assert "does not fit: trainer rank: 39.6 GB > 30 GB; raise launch.slurm.training_nodes" in bad.stderr


def test_a_cpu_config_skips_the_plan_with_one_line(monkeypatch, caplog, capsys):
    monkeypatch.setenv("PATH", "/nonexistent")  # no nvidia-smi
    cfg = _cfg("tiny_cpu.yaml")
    assert plan_for(cfg, 1) is None
    with caplog.at_level(logging.INFO, logger="pipelinerl.plan.memory"):
        check_before_start(cfg, 1)
    assert [r.message for r in caplog.records] == ["memory plan skipped: no GPU (launch.gpu_memory_gb is null and "
                                                   "nvidia-smi finds none)"]
    assert cli.main(["plan", str(REPO / "configs/tiny_cpu.yaml")]) == 0
    assert "skipped" in capsys.readouterr().err
    assert _plan("tiny_cpu.yaml", "launch.gpu_memory_gb=24").fits  # the tiny shape, before it is built


# -- the staging policies (inference.update_staging) on gloo -------------------------------------------------

def _tensors():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(512, 1024, generator=g), torch.randn(300, generator=g).bfloat16(),
            torch.randn(1024, 700, generator=g)]  # ~5 MB in 3 buckets of <= 2 MiB (+ one oversize tensor)


def _req(version=1) -> UpdateRequest:
    metas = [TensorMeta("a", "float32", [512, 1024]), TensorMeta("b", "bfloat16", [300]),
             TensorMeta("c", "float32", [1024, 700])]
    return UpdateRequest(version, 2 << 20, metas, checksums=True)


def _send(port: int, req: UpdateRequest, tensors, buckets: int | None = None) -> None:
    """The trainer's side, as rank 0; `buckets` stops after that many (a broadcast that breaks)."""
    from pipelinerl.weights import tensor_checksum

    group = open_group(InitRequest("127.0.0.1", port, 1, 2, "gloo", 10.0), 0)
    for k, bucket in enumerate(plan_buckets(req.tensors, req.bucket_bytes)):
        if buckets is not None and k == buckets:
            return
        buf = torch.zeros(bucket.nbytes, dtype=torch.uint8)
        for i, off in zip(bucket.indexes, bucket.offsets):
            buf[off:off + tensors[i].nbytes].view(tensors[i].dtype).view(tensors[i].shape).copy_(tensors[i])
        wait_work(broadcast_async(group, buf), time.monotonic() + 10, "the receiver")
    sums = torch.tensor([tensor_checksum(t) for t in tensors])
    wait_work(broadcast_async(group, sums), time.monotonic() + 10, "the receiver")


@pytest.mark.parametrize("staging", ["host", "device"])
def test_receive_staged_returns_equal_bytes_on_the_policys_device(staging):
    port, tensors, req = free_port(worker_port(18700)), _tensors(), _req()
    sender = threading.Thread(target=_send, args=(port, req, tensors))
    sender.start()
    group = open_group(InitRequest("127.0.0.1", port, 1, 2, "gloo", 10.0), 1)
    device = torch.device("cpu")  # gloo: the device is the host (on a GPU, host staging copies each bucket out)
    staged = receive_staged(group, req, device, time.monotonic() + 10, "trainer", staging)
    sender.join()
    assert [n for n, _ in staged] == ["a", "b", "c"]
    for (_, got), want in zip(staged, tensors):
        assert got.device == device and got.dtype == want.dtype and torch.equal(got, want)


@pytest.mark.parametrize("staging", ["host", "device"])
def test_the_policy_travels_to_the_worker_engine_and_a_broken_broadcast_stages_nothing(staging):
    """StagedWeightEngine as vLLM's worker runs it (the server adds `staging` to the init info), without vLLM's
    engine around it: one complete update, then one whose broadcast stops after a bucket."""
    from pipelinerl.inference.vllm_glue.transfer import StagedWeightEngine

    pc = SimpleNamespace(data_parallel_index=0, world_size=1, rank=0, tensor_parallel_size=1)
    engine = StagedWeightEngine(None, SimpleNamespace(parallel_config=pc, model_config=None), torch.device("cpu"),
                                model=None)
    port, tensors = free_port(worker_port(18720)), _tensors()
    sender = threading.Thread(target=_send, args=(port, _req(1), tensors))
    sender.start()
    engine.init_transfer_engine(engine.parse_init_info(
        {"master_addr": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2, "backend": "gloo",
         "timeout_s": 2.0, "staging": staging}))
    assert engine.staging == staging and engine.request.timeout_s == 2.0
    engine.receive_weights(engine.parse_update_info({**_body(_req(1))}))
    sender.join()
    assert all(torch.equal(got, want) for (_, got), want in zip(engine.staged, tensors))

    engine.shutdown()
    engine.staged = None
    port = free_port(worker_port(18740))
    sender = threading.Thread(target=_send, args=(port, _req(2), tensors, 1))
    sender.start()
    engine.init_transfer_engine(engine.parse_init_info(
        {"master_addr": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2, "backend": "gloo",
         "timeout_s": 2.0, "staging": staging}))
    with pytest.raises(Exception, match="bucket 2/3"):
        engine.receive_weights(engine.parse_update_info(_body(_req(2))))
    sender.join()
    assert engine.staged is None and engine.group is None  # nothing to load; the trainer must re-init


def _body(req: UpdateRequest) -> dict:
    from pipelinerl.weights import update_body

    return update_body(req)


def test_lora_counts_gradients_and_optimizer_state_of_the_adapters_alone():
    """Rank 16 on q and v of the 7B (28 layers): 16 x 28 x ((3584 + 3584) + (3584 + 512)) adapter parameters;
    ZeRO-3 keeps the bf16 base's share and the adapters' float32 grads (4 B) and master + Adam (12 B), over 8 ranks;
    no LM-head gradient."""
    adapters = 16 * 28 * ((3584 + 3584) + (3584 + 512))
    plan = _plan("qwen7b_orz.yaml", "launch.gpu_memory_gb=80", "trainer.lora.rank=16",
                 "trainer.lora.target_modules=[q_proj,v_proj]")
    got = plan.roles["trainer"]
    assert got.items["params"] == pytest.approx(2 * P_7B / 8 / GB)
    assert got.items["grads"] == pytest.approx(4 * adapters / 8 / GB)
    assert got.items["optimizer"] == pytest.approx(12 * adapters / 8 / GB)
    assert got.items["logprob_head_grad"] == 0.0
    assert any(f"{adapters:,} trained parameters" in n for n in got.notes)
    full = _plan("qwen7b_orz.yaml", "launch.gpu_memory_gb=80").roles["trainer"]
    assert got.per_gpu_gb < full.per_gpu_gb - 10  # 16 B x P / 8 of grads and optimizer state are gone


def test_fsdp2_lora_keeps_the_frozen_base_in_bf16_and_float32_adapters():
    """FSDP2 with LoRA: the frozen base's shard in bf16 (no float32 master), the adapters' float32 master,
    gradients and Adam m, v, all over 8 ranks."""
    adapters = 16 * 28 * ((3584 + 3584) + (3584 + 512))
    plan = _plan("qwen7b_orz.yaml", "launch.gpu_memory_gb=80", "trainer.backend=fsdp2", "trainer.lora.rank=16",
                 "trainer.lora.target_modules=[q_proj,v_proj]")
    got = plan.roles["trainer"]
    assert got.items["params"] == pytest.approx((2 * P_7B + 4 * adapters) / 8 / GB)
    assert got.items["grads"] == pytest.approx(4 * adapters / 8 / GB)
    assert got.items["optimizer"] == pytest.approx(8 * adapters / 8 / GB)
    assert got.items["optimizer_step"] == pytest.approx(8 * adapters / 8 / GB)


def test_host_ram_per_node_is_checked_against_the_nodes_memory():
    """7B, Slurm, one inference node of 8 servers: each stages the model in host RAM and keeps a delta base
    (2 x 2 B x P); the first training node holds rank 0's two published versions and its delta base (3 x 2 B x P).
    Checked against launch.host_memory_gb, else launch.slurm.mem's size; "0" (the whole node) is not checked."""
    model = 2 * P_7B / GB
    plan = _plan("qwen7b_orz.yaml", "launch.gpu_memory_gb=80")
    assert plan.host_nodes == pytest.approx({"inference node": 8 * 2 * model, "first training node": 3 * model})
    assert round(8 * 2 * model, 1) == 243.7 and plan.host_memory_gb is None and plan.fits
    assert plan.roles["trainer"].host == pytest.approx({"published_versions": 2 * model, "delta_base": model})
    small = _plan("qwen7b_orz.yaml", "launch.gpu_memory_gb=80", "launch.host_memory_gb=200")
    assert not small.fits and small.problems == small.host_problems
    assert "inference node needs 243.7 GB > 200 GB" in small.problems[0] and len(small.problems) == 1
    assert "host RAM per node of 200 GB" in small.render()
    sized = _plan("qwen7b_orz.yaml", "launch.gpu_memory_gb=80", "launch.slurm.mem=256G")
    assert sized.host_memory_gb == pytest.approx(256 * 2**30 / GB) and sized.fits  # 274.9 GB
    no_delta = _plan("qwen7b_orz.yaml", "launch.gpu_memory_gb=80", "launch.host_memory_gb=200",
                     "trainer.broadcast_delta='off'")
    assert no_delta.host_nodes == pytest.approx({"inference node": 8 * model, "first training node": 2 * model})
    assert no_delta.fits


def test_slurm_mem_sizes():
    from pipelinerl.plan.memory import slurm_mem_gb

    assert slurm_mem_gb("512G") == pytest.approx(512 * 2**30 / GB)
    assert slurm_mem_gb("500000M") == slurm_mem_gb("500000") == pytest.approx(500000 * 2**20 / GB)
    assert slurm_mem_gb("2T") == pytest.approx(2 * 2**40 / GB)
    assert slurm_mem_gb("0") is None and slurm_mem_gb(None) is None
    with pytest.raises(ConfigError, match="launch.slurm.mem"):
        slurm_mem_gb("lots")


def test_flash_attention_needs_no_mask_and_gloo_updates_no_send_buffers_on_the_gpu():
    sdpa = _plan("qwen7b_orz.yaml", "launch.gpu_memory_gb=80").roles["trainer"].items
    assert sdpa["attention_mask"] == pytest.approx(16384**2 / GB)
    assert sdpa["broadcast_buffers"] == pytest.approx(2 * V * 3584 * 2 / GB)
    flash = _plan("qwen7b_orz.yaml", "launch.gpu_memory_gb=80", "trainer.attn_implementation=flash_attention_2",
                  "inference.weight_update_backend=gloo").roles["trainer"].items
    assert flash["attention_mask"] == 0 and flash["broadcast_buffers"] == 0


def test_a_reward_server_is_planned_with_the_reward_models_shape_and_no_staging(tmp_path):
    """reward.kind=model: the reward servers' plan uses reward.model_path/config.json (here a Qwen2.5-7B-shaped
    classifier: its one-logit head in place of the V x H LM head), and holds no update staging, update group,
    sampler logits nor prompt log-probs; without the folder, the policy's shape, said in a note."""
    rm = tmp_path / "rm"
    rm.mkdir()
    rm.joinpath("config.json").write_text(json.dumps({
        "hidden_size": 3584, "num_hidden_layers": 28, "intermediate_size": 18944, "num_attention_heads": 28,
        "num_key_value_heads": 4, "vocab_size": V, "num_labels": 1}))
    plan = _plan("qwen7b_orz.yaml", "launch.gpu_memory_gb=80", "reward.kind=model", f"reward.model_path={rm}")
    reward = plan.roles["reward"]
    assert set(reward.items) == {"weights", "activations", "cuda_graphs_runtime", "kv_cache"}
    assert reward.items["weights"] == pytest.approx(2 * (P_7B - V * 3584) / GB)  # bf16, one embedding matrix
    batched = 8192 * ((3 * 18944 + 3584 + 2 * 512) + 4 * 3584) * 2  # vLLM's profiled activations, no sampler
    assert reward.items["activations"] == pytest.approx(batched / GB)
    assert reward.per_gpu_gb == pytest.approx(0.9 * 80) and plan.fits
    assert any(str(rm / "config.json") in note for note in reward.notes)
    missing = _plan("qwen7b_orz.yaml", "launch.gpu_memory_gb=80", "reward.kind=model", "reward.model_path=/nowhere/rm")
    assert missing.roles["reward"].items["weights"] == pytest.approx(reward.items["weights"])
    assert any("the policy's shape" in note for note in missing.roles["reward"].notes)
    assert "reward" not in _plan("qwen7b_orz.yaml", "launch.gpu_memory_gb=80").roles


def test_30b_a3b_counts_every_expert_and_fits_one_training_node_with_the_optimizer_in_host_ram():
    plan = _plan("qwen3_30b_a3b.yaml")
    assert plan.fits, plan.problems
    assert plan.params == P_30B and round(P_30B / 1e9, 1) == 30.5
    trainer, server = plan.roles["trainer"], plan.roles["server"]
    assert f"{ACTIVE_30B / 1e9:.2f}B active per token (top-8 of 128 experts" in " ".join(trainer.notes)
    assert "384 B per model token" in " ".join(trainer.notes)  # 48 layers x 8 uint8 expert ids
    assert trainer.items["params"] == pytest.approx(2 * P_30B / 8 / GB)  # ZeRO-3 over 8 ranks
    assert trainer.items["grads"] == pytest.approx(4 * P_30B / 8 / GB)  # float32 accumulation
    assert trainer.items["optimizer"] == 0 and trainer.items["optimizer_step"] == 0  # offloaded
    assert trainer.host["offloaded_optimizer"] == pytest.approx(12 * P_30B / GB)  # the node's 8 ranks
    # a layer's fused gate-up experts (805 MB in bf16) fit the 1 GiB bucket: two buckets on the receiving GPU
    assert server.items["update_staging"] == pytest.approx(2 * 2**30 / GB)
    assert server.items["weights"] == pytest.approx(2 * P_30B / 2 / GB)  # TP 2, every expert
    tokens = 8192
    layer = tokens * (2 * (8 * 2048 + 2 * 512 + 4 * 8 * 768) + 4 * 128)  # the 8 routed experts' FFN, the router
    assert trainer.items["activations"] == pytest.approx((48 * tokens * 2048 * 2 + 2 * layer) / GB)
    # FSDP2 keeps float32 master weights and Adam moments on the GPUs: 16 B x P over 8 ranks does not fit one
    # node, and does over two
    fsdp2 = _plan("qwen3_30b_a3b.yaml", "trainer.backend=fsdp2")
    assert not fsdp2.fits and fsdp2.roles["trainer"].items["params"] == pytest.approx(4 * P_30B / 8 / GB)
    assert _plan("qwen3_30b_a3b.yaml", "trainer.backend=fsdp2", "launch.slurm.training_nodes=2",
                 "trainer.num_gpus=16").fits


def test_the_tiny_moe_to_be_built_is_counted_as_transformers_counts_it(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from pipelinerl.plan.shapes import load_shape, shape_from_hf_config
    from pipelinerl.tiny.model import build_tokenizer, tiny_config

    cfg = _cfg("tiny_moe.yaml", f"model.path={tmp_path / 'absent'}")
    shape, source = load_shape(cfg)
    assert source == "model.tiny (to be built)" and (shape.experts, shape.experts_per_token) == (8, 2)
    hf = tiny_config(cfg.model.tiny, build_tokenizer())
    assert shape_from_hf_config(hf.to_dict()) == shape  # from the config.json it will have
    with torch.device("meta"):
        built = sum(p.numel() for p in AutoModelForCausalLM.from_config(hf).parameters())
    layers, q, kv = 2, 128, 64
    assert shape.params - built == layers * (q + 2 * kv - 2 * 32)  # q/k/v biases counted, q/k norms not
