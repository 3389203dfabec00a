"""Run a config while SIGKILLing its roles, then check the run healed: per kill the downtime and the samples
lost, and an exactly-once verdict over the whole run (issue #14).

    python tools/chaos.py configs/tiny_cpu.yaml --kills 10 --seed 0 --out runs/chaos inference.num_servers=2

`pipelinerl run CONFIG` runs as a subprocess (run_dir = --out, launch.max_restarts raised to cover the kills;
its output in RUN_DIR/logs/launcher.log). Kill k, drawn from --seed: a role of the allowed kinds (a server
slot drawn among the policy servers), after 1-3 more trainer steps and 0-2 s more. The first server kill, and
half the later ones, wait for a weight update instead: /status is polled until `updating` is true, then the
server dies within a poll interval (bounded; a broadcast not seen in time is said in the table's note).
Each kill waits for the previous one to heal: every role running, every server announced, a step done.
With --stop-after-steps N the run gets SIGTERM N trainer steps after the last kill healed (the trainer
checkpoints, the launcher exits 143): for a trainer.max_steps the kills must never reach.

Kinds: `server`, `actor`, `trainer` (one role), `servers` (every policy server at once: no server at the
trainer's version survives, the trap that weight delivery closes; with `actor.max_lag=0` or conventional mode
and no recent checkpoint every restarted server is behind the lag bound), and `hang` (a server SIGSTOPped: alive
and silent, which the launcher's health deadline, launch.server_health_timeout_s, must find and restart), and
`reward` (a reward server, reward.kind=model: its scoring requests fail and are retried on another reward server,
or wait until the launcher has restarted it; a group is written only once scored).

A kill is SIGKILL to the role's whole process group (every process of it: vLLM's engine, every trainer
rank), found by command line: `pipelinerl.cli serve RUN_DIR/config.yaml ... --port P` (server slot P -
inference.base_port), `... train RUN_DIR/config.yaml`, `... actor RUN_DIR/config.yaml`, the group leader.
That is a crash: nothing gets to clean up or checkpoint. Killing the leader alone would let the launcher
SIGTERM the rest, and a trainer that gets SIGTERM checkpoints first, which hides the steps a crash costs.

Per kill: the role, the trainer step logged last before it, seconds since the start, whether a weight
update was in progress, the downtime (kill -> the trainer's next "step N:" log line, which may come from
samples already in the stream), the stall (the longest wait for a step from the kill to the next kill: the
progress it cost; also in median step times), the groups/samples lost in flight (the restarted actor's
"lost N group(s)" line; a dead server's requests are retried elsewhere), a trainer's steps trained again.
Verdict: the final checkpoint's `samples_seen` samples at the head of the stream have unique ids and the
same multiset of behaviour log-probs as the per-token statistics of the final lineage (RUN_DIR/stats, steps
0..final-1): nothing lost, repeated or foreign. Exit 1 if the run failed or the verdict is not exactly-once.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from pipelinerl.config import Config, StreamsConfig, load_config  # noqa: E402
from pipelinerl.launch.commands import cli, server_port  # noqa: E402
from pipelinerl.launch.procs import die_with_parent  # noqa: E402
from pipelinerl.launch.status import snapshot  # noqa: E402
from pipelinerl.rundir import list_servers  # noqa: E402

KINDS = ("server", "actor", "trainer", "servers", "hang", "reward")
DEFAULT_KINDS = ("server", "actor", "trainer")
_STAMP = r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) "
STEP_LINE = re.compile(_STAMP + r"INFO .*?: step (\d+): ", re.M)
LOST_LINE = re.compile(_STAMP + r"WARNING .*? lost (\d+) group\(s\) in flight", re.M)


STOPPED = 143  # the launcher's exit code after SIGTERM (128 + 15): every role stopped cleanly


@dataclass
class Planned:
    kind: str  # server | actor | trainer | servers (all at once) | hang (a server SIGSTOPped)
    after_steps: int = 1  # trainer steps to wait for after the previous kill healed
    delay_s: float = 0.0  # then this many seconds more
    during_broadcast: bool = False  # a server: wait for /status `updating` instead of the delay
    slot: int = 0  # a server: which policy server; a reward kill: which reward server


@dataclass
class Kill:
    role: str
    step: int  # the trainer's last logged step before the kill
    t_s: float  # seconds since the launcher started
    at: float  # epoch seconds
    broadcast: bool  # a weight update was in progress at the kill
    note: str = ""
    down_s: float | None = None  # kill -> the trainer's next logged step
    stall_s: float | None = None  # the longest wait for a trainer step from the kill to the next kill (or end)
    lost_groups: int | None = None
    redone_steps: int | None = None  # a trainer: steps trained again since its last checkpoint
    hung: bool = False  # SIGSTOPped (kind `hang`), not killed
    # what `pipelinerl status` showed after the kill: the role's "state (restarts N)", and each wait past its limit
    seen: set[str] = field(default_factory=set)
    long_waits: set[str] = field(default_factory=set)

    @property
    def label(self) -> str:
        return f"{self.role}:hang" if self.hung else self.role


def make_plan(kills: int, seed: int, kinds: tuple[str, ...], num_servers: int,
              reward_servers: int = 0) -> list[Planned]:
    """Seeded random kills; the first server kill (and half the later ones) during a weight update."""
    rng, plan, seen_server = random.Random(seed), [], False
    for _ in range(kills):
        p = Planned(rng.choice(kinds), rng.randint(1, 3), round(rng.uniform(0, 2), 1))
        if p.kind in ("server", "hang"):
            p.slot = rng.randrange(num_servers)
        if p.kind == "reward":
            p.slot = rng.randrange(reward_servers)
        if p.kind == "server":
            p.during_broadcast = not seen_server or rng.random() < 0.5
            seen_server = True
        plan.append(p)
    return plan


def role_leaders(cfg: Config) -> dict[str, int]:
    """Role name (server<slot>, reference<i>, reward<i>, trainer, actor) -> pid of its process-group leader, live
    ones (not zombies, not stopped)."""
    config_path, found = str(Path(cfg.run_dir) / "config.yaml"), {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            leader = os.getpgid(pid) == pid
        except (OSError, UnicodeDecodeError):
            continue
        # a SIGSTOPped one (T) is hung, not running: a kill waits for its replacement (healed)
        if state in ("Z", "T") or not leader or "pipelinerl.cli" not in argv or config_path not in argv:
            continue
        sub = argv[argv.index("pipelinerl.cli") + 1]
        if sub == "serve":
            port = int(argv[argv.index("--port") + 1])
            kind = next((k for k in ("reference", "reward") if f"--{k}" in argv), "policy")
            found[f"{kind}{port - server_port(cfg, 0, kind)}" if kind != "policy" else
                  f"server{port - server_port(cfg, 0)}"] = pid
        elif sub in ("train", "actor"):
            found["trainer" if sub == "train" else "actor"] = pid
    return found


def _stamp(text: str) -> float:
    return datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def log_events(path: Path, pattern: re.Pattern) -> list[tuple[float, int]]:
    """(epoch seconds, number) of each line of a role's log matching `pattern` (timestamp, number)."""
    text = path.read_text(errors="replace") if path.exists() else ""
    return [(_stamp(m.group(1)), int(m.group(2))) for m in pattern.finditer(text)]


class Chaos:
    """One `pipelinerl run` under kills."""

    def __init__(self, config: str, overrides: list[str], out: Path, max_restarts: int, heal_timeout_s: float = 600,
                 start_timeout_s: float = 3600):
        """`heal_timeout_s` bounds each wait between kills; `start_timeout_s` the wait for the run's first step
        (which may build and warm-start the tiny model, then start the servers)."""
        self.run_dir = out.resolve()
        if (self.run_dir / "checkpoints").exists():
            raise SystemExit(f"{self.run_dir} already holds a run; chaos needs a fresh --out")
        overrides = [f"launch.max_restarts={max_restarts}", "logging.progress_bar=false", *overrides,
                     f"run_dir={self.run_dir}"]
        self.cfg = load_config(config, overrides)
        self.argv = [*cli(), "run", str(Path(config).resolve()), *overrides]
        self.heal_timeout_s, self.start_timeout_s, self.kills = heal_timeout_s, start_timeout_s, []
        self.trainer_log = self.run_dir / "logs" / "trainer.log"

    def start(self) -> None:
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        with open(self.run_dir / "logs" / "launcher.log", "ab") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                         start_new_session=True, preexec_fn=die_with_parent)  # noqa: PLW1509
        self.t0 = time.time()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def last_step(self) -> int:
        steps = log_events(self.trainer_log, STEP_LINE)
        return steps[-1][1] if steps else 0

    def _wait(self, what: str, done, timeout_s: float, poll_s: float = 0.5) -> bool:
        """Poll `done()` until true (True), the launcher exits (False) or `timeout_s` (TimeoutError)."""
        deadline = time.monotonic() + timeout_s
        while not done():
            if not self.alive():
                return False
            if self.kills:
                self._observe(self.kills[-1])
            if time.monotonic() > deadline:
                raise TimeoutError(f"chaos: {what} not within {timeout_s:.0f} s; see {self.run_dir}/logs/")
            time.sleep(poll_s)
        return True

    def _observe(self, kill: Kill) -> None:
        """What `pipelinerl status` shows of the killed role, and the waits past their limits."""
        snap = snapshot(self.run_dir)
        entry = snap["roles"].get(kill.role)
        if entry is not None:
            kill.seen.add(f"{entry['state']} (restarts {entry['restarts']})")
        kill.long_waits |= {f"{w['role']}: {w['for']}" for w in snap["long_waits"]}

    def healed(self) -> bool:
        """Every role running, every policy server announced, a trainer step logged after the last kill."""
        names = {"trainer", "actor", *(f"server{i}" for i in range(self.cfg.inference.num_servers)),
                 *(f"reward{i}" for i in range(self.cfg.reward.servers_started))}
        since = self.kills[-1].at if self.kills else 0.0
        servers = len(list_servers(self.run_dir)) >= self.cfg.inference.num_servers
        return (names <= set(role_leaders(self.cfg)) and servers
                and any(t > since for t, _ in log_events(self.trainer_log, STEP_LINE)))

    def execute(self, p: Planned) -> Kill | None:
        """Wait for the moment `p` names, then kill; None when the run ended first."""
        if not self.kills and not self._wait("the run's first trainer step", self.healed, self.start_timeout_s):
            return None
        if not self._wait("the previous kill healed", self.healed, self.heal_timeout_s):
            return None
        target = self.last_step() + p.after_steps
        if not self._wait(f"trainer step {target}", lambda: self.last_step() >= target, self.heal_timeout_s):
            return None
        role = {"server": f"server{p.slot}", "hang": f"server{p.slot}", "reward": f"reward{p.slot}"}.get(p.kind, p.kind)
        leaders = role_leaders(self.cfg)
        pids = ([leaders.get(f"server{i}") for i in range(self.cfg.inference.num_servers)] if p.kind == "servers"
                else [leaders.get(role)])
        note, broadcast = "", False
        if None in pids:
            return None
        if p.during_broadcast:
            broadcast = self._catch_update(p.slot, timeout_s=self.heal_timeout_s / 4)
            note = "" if broadcast else "no weight update seen in time: killed outside one"
        else:
            time.sleep(p.delay_s)
        if not self.alive():
            return None
        for pid in pids:
            os.killpg(pid, signal.SIGSTOP if p.kind == "hang" else signal.SIGKILL)
        kill = Kill(role, self.last_step(), time.time() - self.t0, time.time(), broadcast, note, hung=p.kind == "hang")
        self.kills.append(kill)
        print(f"chaos: {'stopped' if p.kind == 'hang' else 'killed'} {role} (pgids {pids}) at step {kill.step}, "
              f"{kill.t_s:.0f} s"
              f"{', during a weight update' if broadcast else ''}", flush=True)
        return kill

    def stop_after(self, steps: int) -> bool:
        """Once the last kill healed, `steps` more trainer steps, then SIGTERM to the launcher, which stops every
        role (the trainer checkpoints first) and exits STOPPED; False when the run ended first."""
        if not self._wait("the last kill healed", self.healed, self.heal_timeout_s):
            return False
        target = self.last_step() + steps
        if not self._wait(f"trainer step {target}", lambda: self.last_step() >= target, self.heal_timeout_s):
            return False
        self.proc.send_signal(signal.SIGTERM)
        print(f"chaos: stopped the run (SIGTERM to the launcher) at step {self.last_step()}", flush=True)
        return True

    def _catch_update(self, slot: int, timeout_s: float, poll_s: float = 0.01) -> bool:
        """Poll server `slot`'s /status until it reports a weight update in progress (True) or `timeout_s`."""
        import httpx

        port, deadline = self.cfg.inference.base_port + slot, time.monotonic() + timeout_s
        with httpx.Client(timeout=2.0) as http:
            while time.monotonic() < deadline and self.alive():
                url = next((u for u in list_servers(self.run_dir) if u.endswith(f":{port}")), None)
                try:
                    if url and http.get(f"{url}/status").json().get("updating"):
                        return True
                except (httpx.HTTPError, ValueError):
                    pass
                time.sleep(poll_s)
        return False

    def finish(self, timeout_s: float) -> int:
        """Wait for the launcher to end the run; its exit code. Then fill in each kill's downtime and losses."""
        try:
            code = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGTERM)
            code = self.proc.wait()
            print(f"chaos: the run did not end within {timeout_s:.0f} s; stopped it", flush=True)
        self._measure()
        return code

    def _measure(self) -> None:
        steps = log_events(self.trainer_log, STEP_LINE)
        lost = log_events(self.run_dir / "logs" / "actor.log", LOST_LINE)
        ends = [k.at for k in self.kills[1:]] + [float("inf")]
        for k, end in zip(self.kills, ends):
            k.down_s = next((t - k.at for t, _ in steps if t > k.at), None)
            times = [k.at, *(t for t, _ in steps if k.at < t <= end)]
            k.stall_s = float(np.diff(times).max()) if len(times) > 1 else k.down_s
            if k.role == "actor":  # a restarted actor logs its lost groups only when there are some
                k.lost_groups = next((n for t, n in lost if k.at < t <= end), 0)
            if k.role == "trainer":  # the restarted trainer's first step follows the one it resumed at (or 0)
                k.redone_steps = next((k.step - (n - 1) for t, n in steps if t > k.at), None)

    def step_time_s(self) -> float:
        """The median time between consecutive trainer steps (the unit of `down (steps)`)."""
        times = [t for t, _ in log_events(self.trainer_log, STEP_LINE)]
        return float(np.median(np.diff(times))) if len(times) > 1 else float("nan")


def exactly_once(run_dir: Path) -> tuple[bool, str]:
    """The final lineage's trained tokens vs the stream prefix the final checkpoint says it consumed."""
    from pipelinerl.metrics import read_token_stats
    from pipelinerl.streams import ROLLOUT_TOPIC, StreamReader, StreamTimeout
    from pipelinerl.trainer.checkpoints import latest_checkpoint

    final = latest_checkpoint(run_dir / "checkpoints")
    if final is None:
        return False, "no complete checkpoint"
    meta = json.loads((final / "meta.json").read_text())
    seen, steps = int(meta["samples_seen"]), int(meta["version"])
    reader, rows = StreamReader(run_dir, ROLLOUT_TOPIC, StreamsConfig()), []
    try:
        while len(rows) < seen:
            for group in reader.read_groups(max_groups=64, timeout_s=5.0):
                rows.extend(group.to_pylist())
    except StreamTimeout:
        return False, f"the stream holds {len(rows)} samples, the final checkpoint consumed {seen}"
    rows = rows[:seen]
    unique = len({r["sample_id"] for r in rows})
    consumed = np.sort(np.concatenate([  # the model's tokens (loss mask 1): the trainer logs no others
        np.asarray(r["behaviour_logprobs"], dtype=np.float32)[np.asarray(r["loss_mask"], bool)] for r in rows]))
    stats = read_token_stats(run_dir)
    trained = np.sort(stats["behaviour_logprobs"])
    facts = (f"{steps} steps, {seen} samples consumed ({unique} unique ids), {len(trained)} tokens trained vs "
             f"{len(consumed)} consumed")
    ok = (unique == seen and set(np.unique(stats["step"])) == set(range(steps)) and len(trained) == len(consumed)
          and bool(np.array_equal(trained, consumed)))
    return ok, f"{'exactly-once' if ok else 'NOT exactly-once'}: {facts}"


def stream_gaps(run_dir: Path) -> int:
    """Prompt numbers never published below each actor's highest: groups lost over the whole run (a group
    of equal rewards that rl.filter_zero_variance kept from the trainer is in the `filtered` topic)."""
    from pipelinerl.streams import FILTERED_TOPIC, ROLLOUT_TOPIC, StreamReader, StreamTimeout

    numbers = {}
    for topic in (ROLLOUT_TOPIC, FILTERED_TOPIC):
        reader = StreamReader(run_dir, topic, StreamsConfig())
        try:
            while True:
                for group in reader.read_groups(max_groups=256, timeout_s=1.0):
                    actor, _, k = group.column("group_id")[0].as_py().rpartition("/")
                    numbers.setdefault(actor, set()).add(int(k)) if k.isdigit() else None
        except StreamTimeout:
            pass
    return sum(max(ks) + 1 - len(ks) for ks in numbers.values())


def table(chaos: Chaos, code: int, verdict: str) -> str:
    step_s, g = chaos.step_time_s(), chaos.cfg.actor.attempts
    lines = [f"run {chaos.run_dir}: launcher exit {code}; median step {step_s:.1f} s; "
             f"{len(chaos.kills)} kill(s)",
             f"{'#':>2} {'role':<12} {'step':>4} {'t_s':>6} {'update':<6} {'down_s':>7} {'stall_s':>7} "
             f"{'stall_steps':>11} {'lost groups/samples':>19} {'redone':>6}  note"]
    for i, k in enumerate(chaos.kills):
        down = f"{k.down_s:7.1f}" if k.down_s is not None else f"{'-':>7}"
        down += f" {k.stall_s:7.1f} {k.stall_s / step_s:11.1f}" if k.stall_s is not None else f" {'-':>7} {'-':>11}"
        lost = "n/a (not logged)" if k.role == "actor" and k.lost_groups is None else "-"
        lost = f"{k.lost_groups}/{k.lost_groups * g}" if k.lost_groups is not None else lost
        redone = "-" if k.redone_steps is None else str(k.redone_steps)
        lines.append(f"{i:>2} {k.label:<12} {k.step:>4} {k.t_s:6.0f} {'yes' if k.broadcast else 'no':<6} {down} "
                     f"{lost:>19} {redone:>6}  {k.note}")
    lines += [f"groups missing from the stream (lost in flight, whole run): {stream_gaps(chaos.run_dir)}", verdict]
    return "\n".join(lines)


@dataclass
class Result:
    code: int  # the launcher's exit code
    exactly_once: bool
    kills: list[Kill]
    table: str


def run_chaos(config: str, plan: list[Planned], out: Path, overrides: list[str] = (),
              timeout_s: float = 3600, stop_after_steps: int | None = None) -> Result:
    """Run `config` under `plan`'s kills, then measure and check it. `stop_after_steps`: once the plan is done and
    healed, this many more trainer steps, then SIGTERM to the launcher (exit STOPPED; the trainer checkpoints
    first), for a trainer.max_steps the plan must never reach: on a fast machine a run of a few dozen steps can
    end between two of chaos's looks at the trainer's log, before its kills."""
    chaos = Chaos(config, list(overrides), out, max_restarts=len(plan) + 1, start_timeout_s=timeout_s)
    chaos.start()
    clean = 0
    try:
        for p in plan:
            if chaos.execute(p) is None:
                print(f"chaos: the run ended before kill {len(chaos.kills)} of {len(plan)}", flush=True)
                break
        else:
            if stop_after_steps is not None and chaos.stop_after(stop_after_steps):
                clean = STOPPED
    except BaseException:
        chaos.finish(0)  # stop the run now rather than let it go on unobserved
        raise
    code = chaos.finish(timeout_s)
    ok, verdict = exactly_once(chaos.run_dir) if code == clean else (False, "no verdict: the run failed")
    return Result(code, ok, chaos.kills, table(chaos, code, verdict))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides")
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--roles", default=",".join(DEFAULT_KINDS),
                        help=f"comma-separated kinds of {','.join(KINDS)} (see the module)")
    parser.add_argument("--out", type=Path, default=None, help="the run directory (default runs/chaos_<seed>)")
    parser.add_argument("--timeout-s", type=float, default=3600, help="the whole run's limit")
    parser.add_argument("--stop-after-steps", type=int, default=None,
                        help="SIGTERM the run this many trainer steps after the last kill healed (default: let it "
                             "run to trainer.max_steps)")
    args, extra = parser.parse_known_args()
    kinds = tuple(args.roles.split(","))
    if set(kinds) - set(KINDS) or any("=" not in x for x in extra):
        parser.error(f"--roles takes {','.join(KINDS)}; overrides are key=value")
    overrides = [*args.overrides, *extra]
    cfg = load_config(args.config, overrides)
    if "reward" in kinds and not cfg.reward.servers_started:
        parser.error("--roles reward needs a config with reward.kind=model")
    out = args.out or REPO / "runs" / f"chaos_{args.seed}"
    plan = make_plan(args.kills, args.seed, kinds, cfg.inference.num_servers, cfg.reward.servers_started)
    result = run_chaos(args.config, plan, out, overrides, args.timeout_s, args.stop_after_steps)
    print(result.table, flush=True)
    (out / "chaos_table.txt").write_text(result.table + "\n")
    return 0 if result.exactly_once else 1


if __name__ == "__main__":
    sys.exit(main())
