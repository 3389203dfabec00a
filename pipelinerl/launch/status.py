"""`pipelinerl status RUN_DIR [--watch [S]] [--json]`: how a run is doing, from its run directory alone.

It reads only files, so it works on a login node over the parallel filesystem and on a finished run:
- RUN_DIR/status/*.json (rundir.StatusFile), written by the roles: the launcher's (`launch`; on Slurm also each
  node's servers agent, `launch_<node>`) lists every role with its pid, state, restarts and log, and each server's
  URL, kind, health and what its GET /status said (version, updating, held); trainer rank 0's has the step,
  samples/s and lag; each actor's the servers' version, its groups in flight and what holds it back. Each records
  what its role is waiting for and since when.
- RUN_DIR/config.yaml for the wait limits (trainer.wait_log_s, actor.wait_log_s): a wait longer than its limit is
  listed apart.
- RUN_DIR/logs/*.log for each role's last error line (the end of each log only).
- RUN_DIR/checkpoints for the last complete checkpoint.
A status file not rewritten for STALE_S while its role has not stopped is shown as stale: its writer is gone or
stuck (on the writer's own host the pid is checked too).
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from pathlib import Path

from pipelinerl.rundir import SERVER_FOLDERS, read_statuses

STALE_S = 30.0  # a status file older than this, of a role not stopped, is stale (roles rewrite theirs every ~2 s)
TAIL_BYTES = 256 * 1024  # of each log, searched for its last error
ERROR_LINE = re.compile(r"\bERROR\b|\[ERROR\]")
TRACEBACK = "Traceback (most recent call last):"
CHAINED = re.compile(r"During handling of the above exception|The above exception was the direct cause")
SHUTDOWN_NOISE = re.compile(r"CancelledError|KeyboardInterrupt")  # a role stopped by a signal, not an error
KINDS = {folder: kind for kind, folder in SERVER_FOLDERS.items()}


def snapshot(run_dir: str | Path, now: float | None = None) -> dict:
    """Everything `pipelinerl status` shows, as one JSON-able dict."""
    run_dir, now = Path(run_dir), time.time() if now is None else now
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir}: no such run directory")
    limits = _wait_limits(run_dir)
    statuses = {name: {**st, "age_s": now - st["time"], "stale": _stale(st, now)}
                for name, st in read_statuses(run_dir).items() if _well_formed(st)}
    for st in statuses.values():
        if "step_at" in st:
            st["age_step_s"] = now - st["step_at"]
        if st.get("waiting"):
            st["waiting"]["waited_s"] = now - st["waiting"]["since"]
    roles = {}  # a Slurm node's servers agent (launch_<node>) names its roles <node>:<role>
    for name, st in statuses.items():
        if name.startswith("launch"):
            prefix = "" if name == "launch" else name.removeprefix("launch_") + ":"
            for role, entry in st.get("roles", {}).items():
                if not isinstance(entry, dict):
                    continue
                roles[prefix + role] = {**entry, "launcher": name,
                                        "kind": KINDS.get(entry.get("kind"), entry.get("kind"))}
    waits = []
    for name, st in statuses.items():
        wait, limit = st.get("waiting"), limits["trainer" if name == "trainer" else "actor"]
        if wait and not st["stale"] and st.get("state") != "stopped" and wait["waited_s"] > limit:
            waits.append({"role": name, "limit_s": limit, **wait})
    return {"run_dir": str(run_dir), "time": now, "checkpoint_step": _checkpoint_step(run_dir), "roles": roles,
            "statuses": statuses, "long_waits": waits, "errors": last_errors(run_dir / "logs")}


def _well_formed(status: object) -> bool:
    """A status file as the roles write it (anything else in the folder is left out, never a crash)."""
    if not isinstance(status, dict) or not isinstance(status.get("time"), (int, float)):
        return False
    wait = status.get("waiting")
    return (wait is None or isinstance(wait, dict) and isinstance(wait.get("since"), (int, float))) \
        and isinstance(status.get("roles", {}), dict)


def _wait_limits(run_dir: Path) -> dict[str, float]:
    limits = {"trainer": 30.0, "actor": 30.0}  # the config's defaults, where it cannot be read
    try:
        from pipelinerl.config import load_config

        cfg = load_config(run_dir / "config.yaml")
        limits.update(trainer=cfg.trainer.wait_log_s, actor=cfg.actor.wait_log_s)
    except (OSError, ValueError, KeyError, TypeError):  # unreadable, or not a config of this version
        pass
    return limits


def _stale(status: dict, now: float) -> str | None:
    """Why a status file no longer says what its role does (None: it does)."""
    if status.get("state") == "stopped":
        return None
    if status.get("host") == socket.gethostname() and not _alive(status.get("pid")):
        return f"its writer (pid {status.get('pid')}) is gone"
    age = now - status.get("time", now)
    return f"not rewritten for {age:.0f} s" if age > STALE_S else None


def _alive(pid: int | None) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, TypeError, ValueError):  # another user's process; no pid written
        return True
    return True


def _checkpoint_step(run_dir: Path) -> int | None:
    from pipelinerl.trainer.checkpoints import checkpoint_meta, latest_checkpoint

    return checkpoint_meta(latest_checkpoint(run_dir / "checkpoints")).get("step")


def last_errors(logs: Path) -> dict[str, dict]:
    """Each log's last error (its end only: TAIL_BYTES), with the log's path."""
    found = {}
    for path in sorted(logs.glob("*.log")) if logs.is_dir() else []:
        try:
            with open(path, "rb") as f:
                f.seek(max(0, path.stat().st_size - TAIL_BYTES))
                error = last_error(f.read().decode(errors="replace").splitlines())
        except OSError:  # a folder named *.log, a log not readable by this user
            continue
        if error is not None:
            found[path.stem] = {"line": error[:300], "log": str(path)}
    return found


def last_error(lines: list[str]) -> str | None:
    """The last ERROR line or traceback's exception (the first unindented line after it) among `lines`; a
    traceback of a role stopped by a signal (CancelledError, KeyboardInterrupt) is not an error."""
    last, i = None, 0
    while i < len(lines):
        line, i = lines[i], i + 1
        if TRACEBACK in line:
            while i < len(lines) and (not lines[i].strip() or lines[i][0].isspace()):
                i += 1
            if i == len(lines):  # cut off before its exception
                break
            line, i = lines[i], i + 1
            if CHAINED.match(line):  # another traceback follows: its exception is the one raised
                continue
        elif not ERROR_LINE.search(line):
            continue
        if not SHUTDOWN_NOISE.search(line):
            last = line.strip()
    return last


# ---- text --------------------------------------------------------------------------------------------------

def render(snap: dict) -> str:
    lines = [_headline(snap)]
    statuses = snap["statuses"]
    for name, st in statuses.items():
        if name.startswith("launch"):
            lines.append(f"{name}: pid {st.get('pid')} on {st.get('host')}, {_ago(st)}")
    if snap["roles"]:
        lines += ["", "roles", *_table(["role", "state", "pid", "restarts", "log"],
                                       [[n, str(r.get("state", "?")) + (f" (down {r['down_s']:.0f} s)"
                                                                         if r.get("down_s") else ""),
                                         r.get("pid"), r.get("restarts", 0), r.get("log", "")]
                                        for n, r in snap["roles"].items()])]
    servers = {n: r for n, r in snap["roles"].items() if r.get("kind")}
    if servers:
        lines += ["", "servers", *_table(["server", "kind", "url", "health", "version", "doing"],
                                         [[n, r["kind"], r.get("url", "(not announced)"), r.get("health", "-"),
                                           r.get("server", {}).get("version", "-"), _doing(r)]
                                          for n, r in servers.items()])]
    lines.append("")
    for name, st in statuses.items():
        if not name.startswith("launch"):
            lines.append(f"{name:<9} {_role_line(name, st)}")
    if snap["long_waits"]:
        lines += ["", "waits longer than wait_log_s"]
        lines += [f"  {w['role']} has waited {w['waited_s']:.0f} s for {w['for']}{_detail(w)} "
                  f"(limit {w['limit_s']:g} s)" for w in snap["long_waits"]]
    if snap["errors"]:
        lines += ["", "last error of each log"]
        lines += [f"  {name}: {e['line']}\n    ({e['log']})" for name, e in snap["errors"].items()]
    return "\n".join(lines) + "\n"


def _headline(snap: dict) -> str:
    trainer = snap["statuses"].get("trainer", {})
    head = f"run {snap['run_dir']}"
    if "step" in trainer:
        head += f": step {trainer['step']}" + (f" of {trainer['max_steps']}" if trainer.get("max_steps") else "")
    step = snap["checkpoint_step"]
    head += f"; last checkpoint at step {step}" if step is not None else "; no checkpoint yet"
    return head if snap["statuses"] else head + "\n(no status files: the run has not started, or predates them)"


def _role_line(name: str, st: dict) -> str:
    if name == "trainer":
        parts = [f"step {st.get('step', 0)}" + (f" ({max(0.0, st['age_step_s']):.0f} s ago)" if "age_step_s" in st
                                                else ""),
                 f"{st['samples_per_s']:.1f} samples/s" if "samples_per_s" in st else "",
                 f"lag mean {st['lag_mean']:.2f} max {st.get('lag_max', 0):.0f}" if "lag_mean" in st else "",
                 f"data wait {st['data_wait_fraction']:.0%}" if "data_wait_fraction" in st else ""]
    else:
        parts = [f"servers at version {st.get('version')}", f"{st.get('groups_in_flight', 0)} groups in flight",
                 f"held by {st['held_by']}" if st.get("held_by") else "", f"{st.get('samples_started', 0)} samples "
                 f"started", f"{st['lost']} groups lost" if st.get("lost") else ""]
    if st.get("state") == "stopped":
        parts.append("stopped")
    if st.get("waiting"):
        parts.append(f"waiting {st['waiting']['waited_s']:.0f} s for {st['waiting']['for']}")
    parts.append(f"stale: {st['stale']}" if st.get("stale") else _ago(st))
    return ", ".join(p for p in parts if p)


def _doing(server: dict) -> str:
    status = server.get("server")
    if not status:
        return "-"
    if status.get("updating"):
        return "updating"
    if status.get("held_s"):
        return f"held ({status['held_s']:.0f} s left)"
    return f"serving ({status.get('updates', 0)} updates)"


def _detail(wait: dict) -> str:
    extra = {k: v for k, v in wait.items() if k not in ("role", "waited_s", "limit_s", "for", "since")}
    extra = {k.replace("_", " "): v for k, v in extra.items()}
    return f" ({', '.join(f'{k} {v}' for k, v in extra.items())})" if extra else ""


def _ago(st: dict) -> str:
    return f"updated {max(0.0, st['age_s']):.0f} s ago"  # clocks a little apart (another host) read as now


def _table(header: list[str], rows: list[list]) -> list[str]:
    cells = [header, *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]


def show(run_dir: str | Path, watch_s: float | None = None, as_json: bool = False) -> None:
    """Print the status once, or every `watch_s` seconds until interrupted."""
    while True:
        snap = snapshot(run_dir)
        text = json.dumps(snap, indent=1, default=str) + "\n" if as_json else render(snap)
        print(("\x1b[2J\x1b[H" if watch_s else "") + text, end="", flush=True)
        if not watch_s:
            return
        time.sleep(watch_s)
