"""CPU placement (launch.inference_cpus / training_cpus / actor_cpus): the pure split, the config's
checks, the roles the local launcher builds, and real role processes (with grandchildren and trainer
ranks) reading back the CPU affinity they run with."""

import dataclasses
import json
import os
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pipelinerl.config import ConfigError, load_config
from pipelinerl.launch.local import _roles, placement
from pipelinerl.launch.placement import CpuPlacement, format_ids, parse_cpu_ids, split_cpus, split_evenly
from pipelinerl.launch.procs import Supervisor, free_port

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "configs" / "tiny_cpu.yaml"
EIGHT = list(range(8))


def test_core_lists_parse_format_and_split_into_contiguous_blocks():
    assert parse_cpu_ids("0-2,5") == [0, 1, 2, 5] and format_ids([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    for bad in ("x", "1-", "0,0"):
        with pytest.raises(ValueError):
            parse_cpu_ids(bad)
    assert split_evenly(list(range(7)), 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert split_evenly([4, 5], 2) == [[4], [5]]


def test_split_defaults_and_bad_specs():
    assert split_cpus(EIGHT, None, None, None, 2, 1) is None  # today's behaviour: nothing pinned
    # seed 001's 50/50 split on this 2-core machine; the actor floats (no core is left for it)
    assert split_cpus([0, 1], "0", None, None, 1, 1) == CpuPlacement([[0]], [1], None)
    assert split_cpus(EIGHT, "0-5", "6", None, 2, 1) == CpuPlacement([[0, 1, 2], [3, 4, 5]], [6], [7])
    assert split_cpus(EIGHT, None, "4-7", "7", 3, 1) == CpuPlacement([[0, 1], [2], [3]], [4, 5, 6, 7], [7])
    errors = {("0-8", None, None, 1, 1): "core.s. 8 that this launcher may not use; it has cores 0-7",
              ("0-2", None, None, 2, 2): "gives 3 core.s. .0-2.; it needs at least 4",
              ("0-3", None, "4-7", 1, 1): "launch.training_cpus gives 0 core.s. .none: the other lists",
              (None, None, "3", 1, 1): "actor_cpus is set without"}
    for (inference, training, actor, servers, tp), message in errors.items():
        with pytest.raises(ValueError, match=message):
            split_cpus(EIGHT, inference, training, actor, servers, tp)


def test_config_refuses_bad_overlapping_or_slurm_core_lists():
    for overrides, message in ((["launch.inference_cpus=0-x"], "launch.inference_cpus"),
                               (["launch.inference_cpus=0-3", "launch.training_cpus=3-5"], "shares core.s. \\[3\\]"),
                               (["launch.backend=slurm", "launch.actor_cpus=1"], "on Slurm, Slurm places")):
        with pytest.raises(ConfigError, match=message):
            load_config(TINY, overrides)
    cfg = load_config(TINY, ["launch.inference_cpus=0", "launch.training_cpus=100"])
    with pytest.raises(ConfigError, match="config `launch`: .*may not use"):  # checked against this machine
        placement(cfg, [], cores=[0, 1])


def test_local_roles_get_their_cores_threads_and_vllm_binding(tmp_path):
    cfg = load_config(TINY, [f"run_dir={tmp_path}", "inference.num_servers=2", "inference.tensor_parallel_size=2",
                             "launch.inference_cpus=0-4", "launch.training_cpus=5-7", "trainer.num_gpus=2",
                             "trainer.samples_per_step=32"])
    servers, trainer, actor = _roles(cfg, tmp_path / "config.yaml", placement(cfg, [], cores=list(range(9))))
    assert [r.cpus for r in servers] == [[0, 1, 2], [3, 4]]
    assert [r.env["VLLM_CPU_OMP_THREADS_BIND"] for r in servers] == ["0-1|2", "3|4"]  # one list per TP worker
    assert servers[0].env["OMP_NUM_THREADS"] == "2"
    assert trainer.cpus == [5, 6, 7] and trainer.env["OMP_NUM_THREADS"] == "1"  # 3 cores // 2 ranks
    assert actor.cpus == [8] and actor.env["OMP_NUM_THREADS"] == "1"
    plain = load_config(TINY, [f"run_dir={tmp_path}"])  # nothing set: nothing pinned, launch.torch_threads
    servers, trainer, actor = _roles(plain, tmp_path / "config.yaml", placement(plain, []))
    assert all(r.cpus is None for r in (*servers, trainer, actor))
    assert all(r.env == {"OMP_NUM_THREADS": "1"} for r in (trainer, actor))
    assert all(r.env == {"OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"} for r in servers)


# A role's stand-in: records its own affinity, its environment's thread settings and its grandchild's
# affinity (vLLM and DeepSpeed start processes of their own), then sleeps until stopped.
ROLE = textwrap.dedent("""
    import json, os, subprocess, sys, time
    child = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                           capture_output=True, text=True, check=True)
    record = {"pid": os.getpid(), "cores": sorted(os.sched_getaffinity(0)), "child": json.loads(child.stdout),
              "omp": os.environ.get("OMP_NUM_THREADS"), "bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND")}
    name = sys.argv[2] + os.environ.get("RANK", "")
    (open(os.path.join(sys.argv[1], name + ".tmp"), "w").write(json.dumps(record)))
    os.rename(os.path.join(sys.argv[1], name + ".tmp"), os.path.join(sys.argv[1], name + ".json"))
    time.sleep(600)
""")


def _wait_records(folder: Path, names: list[str], sup: Supervisor, timeout_s: float = 60.0) -> dict[str, dict]:
    deadline = time.monotonic() + timeout_s
    while not all((folder / f"{n}.json").exists() for n in names):
        sup.check()
        assert time.monotonic() < deadline, f"roles never reported: {sorted(p.name for p in folder.iterdir())}"
        time.sleep(0.05)
    return {n: json.loads((folder / f"{n}.json").read_text()) for n in names}


def _cpus_allowed_list(pid: int) -> str:
    with open(f"/proc/{pid}/status") as f:
        return next(line.split(":")[1].strip() for line in f if line.startswith("Cpus_allowed_list"))


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPU cores to give the roles disjoint ones")
def test_roles_really_run_on_their_cores(tmp_path):
    """The launcher's own roles and Supervisor, with stand-in programs: servers, trainer ranks (through
    the real `train --nproc` rank starter) and grandchildren all run with the affinity placed."""
    first, second = sorted(os.sched_getaffinity(0))[:2]
    cfg = load_config(TINY, [f"run_dir={tmp_path}", f"launch.inference_cpus={first}",
                             f"launch.training_cpus={second}", "trainer.num_gpus=2", "trainer.samples_per_step=32"])
    servers, trainer, actor = _roles(cfg, tmp_path / "config.yaml", placement(cfg, []))
    out = tmp_path / "records"
    out.mkdir()
    script = tmp_path / "role.py"
    script.write_text(ROLE)
    ranks = (f"import sys; from pipelinerl.launch.ranks import run_ranks; "
             f"sys.exit(run_ranks([sys.executable, {str(script)!r}, {str(out)!r}, 'trainer'], 2, {free_port()}))")
    stand_ins = [dataclasses.replace(servers[0], argv=[sys.executable, str(script), str(out), "server0"]),
                 dataclasses.replace(trainer, argv=[sys.executable, "-c", ranks]),
                 dataclasses.replace(actor, argv=[sys.executable, str(script), str(out), "actor"])]
    sup = Supervisor()
    try:
        for role in stand_ins:
            sup.start(role)
        got = _wait_records(out, ["server0", "trainer0", "trainer1", "actor"], sup)
        assert got["server0"]["cores"] == got["server0"]["child"] == [first]
        assert got["server0"]["bind"] == str(first) and got["server0"]["omp"] == "1"
        assert _cpus_allowed_list(got["server0"]["pid"]) == str(first)
        for rank in ("trainer0", "trainer1"):  # the ranks inherit the trainer role's cores
            assert got[rank]["cores"] == got[rank]["child"] == [second] and got[rank]["omp"] == "1"
            assert _cpus_allowed_list(got[rank]["pid"]) == str(second)
        everything = sorted(os.sched_getaffinity(0))  # the actor: no core left, so it floats
        assert actor.cpus is None and got["actor"]["cores"] == got["actor"]["child"] == everything
    finally:
        sup.stop_all(grace_s=5)
