"""tools/gpu_check.py's checks beyond one model's trainer, plan and gather rows; each returns one Row:

5. bf16 vs float32: the tiny model's steps in bfloat16 (gradients accumulated in float32) and in float32 from the
   same weights and samples: per-step loss and gradient norm within bf16 rounding.
6. head GEMMs: the chunked LM head's forward + backward in bf16 (model.LogprobHead, plain and lm_head_fp32) timed
   against the same maths on float32 copies of the operands, with the largest relative error of the weight's
   gradient against a float64 reference (CUDA: a 151936 x 1536 head, 4096 tokens; the reference holds ~20 GB).
7. receive: a 512 MiB update received with host staging into CUDA buckets from a sender thread over gloo, with
   each bucket's copy to the host overlapping the next receive, and with every copy waited for (the old way).
8. NCCL: a 2-rank NCCL weight update needs 2 GPUs (NCCL refuses two ranks on one device); on one GPU the row says
   so, and the update path runs over gloo in the server step.
"""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path

from gpu_check_common import GB, Row, build_model, write_config
from gpu_check_trainer import measure_trainer, synchronize


def precision_row(workdir: Path, args) -> Row:
    """bf16 trainer steps (gradients accumulated in float32) against the same steps in float32 on the same
    model and samples: the largest relative difference of the per-step loss and gradient norm."""
    step = "bf16 vs float32 steps [tiny]"
    model_dir = workdir / "model_tiny"
    if not (model_dir / "config.json").is_file():
        build_model(model_dir, "tiny", args.device)
    runs = {}
    try:
        for dtype in ("bfloat16", "float32"):
            cfg_path = write_config(workdir / f"precision_{dtype}.yaml", model_dir,
                                    workdir / f"run_precision_{dtype}", args, (f"model.dtype={dtype}",))
            runs[dtype] = measure_trainer(cfg_path, args, workdir)
    except (RuntimeError, subprocess.TimeoutExpired) as err:
        return Row(step, f"FAILED: {err}")
    bf16, fp32 = runs["bfloat16"], runs["float32"]

    def rel(a, b):
        return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))

    values = {"loss_rel": rel(bf16["losses"], fp32["losses"]), "grad_accum": bf16["grad_accum"],
              "grad_norm_rel": rel(bf16["grad_norms"], fp32["grad_norms"]), "steps": bf16["steps"]}
    ok = values["grad_accum"] == "float32" and max(values["loss_rel"], values["grad_norm_rel"]) < 0.05
    return Row(step, "ok" if ok else "FAILED: gradients not accumulated in float32, or bf16 far from float32",
               f"{bf16['backend']}, {bf16['steps']} steps, gradients accumulated in {values['grad_accum']}: loss "
               f"within {values['loss_rel']:.1e}, grad norm within {values['grad_norm_rel']:.1e} of float32's "
               f"(relative; bf16 rounding is 3.9e-3)", values)


def head_gemm_row(args) -> Row:
    """Step 6 (module docstring): seconds per forward + backward, bf16 vs float32 operands, and the error."""
    import torch

    from pipelinerl.trainer.model import LogprobHead, chunked_logprobs

    cuda = args.device == "cuda"
    device = torch.device("cuda" if cuda else "cpu")
    V, H, N, chunk = (151936, 1536, 4096, 1024) if cuda else (4096, 256, 512, 128)
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(V, H, generator=g) * 0.05).to(device)
    hidden = torch.randn(N, H, generator=g).to(device)
    targets = torch.randint(V, (N,), generator=g).to(device)

    def run(dtype, fp32: bool):
        head = LogprobHead(H, V, bias=False, dtype=dtype, device=device)
        with torch.no_grad():
            head.weight.copy_(weight)
        head.fp32 = fp32
        h = hidden.to(dtype).requires_grad_(True)
        chunked_logprobs(head, h, targets, 1.0, chunk).sum().backward()
        return head.weight.grad

    def timed(dtype, fp32: bool) -> tuple[float, torch.Tensor]:
        run(dtype, fp32)  # warm-up
        synchronize(device)
        start = time.monotonic()
        grad = run(dtype, fp32)
        synchronize(device)
        return time.monotonic() - start, grad

    w64 = weight.to(torch.bfloat16).double().requires_grad_(True)
    logits = hidden.to(torch.bfloat16).double() @ w64.T
    logits.log_softmax(-1).gather(-1, targets[:, None]).sum().backward()
    ref = w64.grad
    numbers, values = [], {}
    for name, dtype, fp32 in (("bf16", torch.bfloat16, False), ("bf16+fp32head", torch.bfloat16, True),
                              ("fp32 operands", torch.float32, False)):
        s, grad = timed(dtype, fp32)
        err = ((grad.double() - ref).abs().max() / ref.abs().max()).item()
        values[name] = {"s": s, "rel_err": err}
        numbers.append(f"{name} {s * 1e3:.1f} ms (err {err:.1e})")
    ratio = values["fp32 operands"]["s"] / values["bf16"]["s"]
    numbers.append(f"fp32/bf16 x{ratio:.1f}")
    return Row(f"head GEMMs [{V}x{H}, {N} tokens]", "ok", "; ".join(numbers), values)


def receive_row(args) -> Row:
    """Step 7: receive_staged with host staging into CUDA buckets, from a sender thread over gloo (one GPU:
    NCCL needs two), twice: as shipped (each bucket's device->host copy on its own stream, overlapping the next
    receive) and with every copy waited for at once (the serialized receive it replaced). Bytes checked."""
    step = "receive, host staging [512 MiB in 64 MiB buckets]"
    if args.device != "cuda":
        return Row(step, "skipped: needs CUDA (on CPU the received buckets are the staging: no copy to overlap)")

    import torch

    from pipelinerl.launch.procs import free_port
    from pipelinerl.weights import (
        InitRequest,
        StagingBuffers,
        TensorMeta,
        UpdateRequest,
        broadcast_async,
        open_group,
        plan_buckets,
        receive_staged,
        receiver,
        wait_work,
    )

    metas = [TensorMeta(f"t{i}", "bfloat16", [4096, 4096]) for i in range(16)]
    tensors = [torch.randn(4096, 4096, generator=torch.Generator().manual_seed(i)).bfloat16() for i in range(16)]
    req = UpdateRequest(1, 64 << 20, metas, False)

    def send(port: int) -> None:
        group = open_group(InitRequest("127.0.0.1", port, 1, 2, "gloo", 120.0), 0)
        for bucket in plan_buckets(metas, req.bucket_bytes):
            buf = torch.zeros(bucket.nbytes, dtype=torch.uint8)
            for i, off in zip(bucket.indexes, bucket.offsets):
                buf[off:off + tensors[i].nbytes] = tensors[i].reshape(-1).view(torch.uint8)
            wait_work(broadcast_async(group, buf), time.monotonic() + 120, "the receiver")

    def receive() -> float:
        port = free_port()
        sender = threading.Thread(target=send, args=(port,))
        sender.start()
        group = open_group(InitRequest("127.0.0.1", port, 1, 2, "gloo", 120.0), 1)
        start = time.monotonic()
        staged = receive_staged(group, req, torch.device("cuda"), time.monotonic() + 120, "sender", "host",
                                buffers=StagingBuffers())
        took = time.monotonic() - start
        sender.join()
        assert all(torch.equal(t, want) for (_, t), want in zip(staged, tensors)), "received bytes differ"
        return took

    receive()  # warm-up: CUDA context, pinned allocations
    overlapped = receive()
    copy = receiver._HostCopies.copy

    def serialized(self, slot, dst, src):
        out = copy(self, slot, dst, src)
        self.finish()
        return out

    receiver._HostCopies.copy = serialized
    try:
        waited = receive()
    finally:
        receiver._HostCopies.copy = copy
    gb = sum(m.nbytes for m in metas) / GB
    return Row(step, "ok", f"overlapped {overlapped:.3f} s ({gb / overlapped:.2f} GB/s), each copy waited for "
                           f"{waited:.3f} s: x{waited / overlapped:.2f} (gloo into CUDA buffers; bytes equal)",
               {"overlapped_s": overlapped, "serialized_s": waited, "gb": gb})


def nccl_row(args) -> Row:
    import torch

    gpus = torch.cuda.device_count() if args.device == "cuda" else 0
    step = "NCCL 2-rank weight update"
    if gpus < 2:
        return Row(step, f"skipped: needs 2 GPUs ({gpus} here): NCCL refuses two ranks on one device")
    return Row(step, "skipped: not part of the one-device check (tests/test_weights.py runs the path on gloo)")
