"""The trap that weight delivery closes (issue #27), through tools/chaos.py on a short `pipelinerl run`: the one
server is SIGKILLed, and its launcher restarts it on the base model (no checkpoint yet: version 0) while the
trainer is at version >= 2 and waits for the data of its next step. With `actor.max_lag=0` (and in conventional
mode, whose lag bound is its batch's version) that data may come only from a server at the trainer's version,
so the trap holds by construction: the run moves again only if the trainer's delivery thread brings the
restarted server to the published version without a step. Before, the trainer sent weights only after its next
step, and the run stood still until trainer.data_timeout_s killed the trainer.
"""

import importlib.util
import sys
from pathlib import Path

import pytest
from helpers import worker_port

pytestmark = pytest.mark.slow  # two short `pipelinerl run`s with one server restart each: ~2 x 2 min

REPO = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("chaos", REPO / "tools" / "chaos.py")
chaos = sys.modules["chaos"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(chaos)


# The kill must come while data of a later version is still to be generated: trainer.max_steps is out of reach
# (a multiple of the conventional batch's G = 4 steps), and chaos stops the run (SIGTERM, the trainer checkpoints)
# 4 steps after the restarted server's first one. A short run could end between two of chaos's looks at the
# trainer's log (every 0.5 s; a conventional batch trains in well under a second), before the kill.
@pytest.mark.parametrize("config,max_lag,port", [("tiny_cpu.yaml", "0", 19400),
                                                 ("tiny_cpu_conventional.yaml", "null", 19450)])
def test_a_server_restarted_behind_the_lag_bound_gets_the_weights_while_the_trainer_waits(
        tmp_path, tiny_model_dir, config, max_lag, port):
    port = worker_port(port)
    overrides = [f"model.path={tiny_model_dir}", "model.build_tiny_if_missing=false", "trainer.max_steps=100000",
                 "trainer.samples_per_step=32", "trainer.warmup_steps=0", f"actor.max_lag={max_lag}",
                 "actor.eval_every_steps=0", "checkpoints.every_steps=null", "inference.max_model_len=64",
                 "streams.segment_max_seconds=0.5", f"inference.base_port={port}",
                 f"trainer.broadcast_port={port + 40}", "trainer.wait_log_s=5"]
    out = tmp_path / "run"
    plan = [chaos.Planned("servers", after_steps=2)]
    res = chaos.run_chaos(str(REPO / "configs" / config), plan, out, overrides, timeout_s=900, stop_after_steps=4)
    print(res.table)
    launcher = (out / "logs" / "launcher.log").read_text()
    trainer = (out / "logs" / "trainer.log").read_text()
    assert res.code == chaos.STOPPED and res.exactly_once, res.table + launcher[-3000:]
    (kill,) = res.kills
    assert kill.step >= 2, res.table
    assert kill.down_s is not None, res.table  # restarted at version 0 < the trainer's, and a step followed
    assert "role `trainer` exited" not in launcher  # no trainer restart: delivery, not a resumed trainer
    assert "weight delivery: version" in trainer
