"""What N concurrent episodes cost one actor (issue 46 item 2), for N = 100, 1,000 and 10,000: the actor's own
episode machinery (actor/episodes.py `sample_episodes`: one `run_episode` per episode, every model turn a
`CompletionsClient.complete` over the actor's HTTP client, actor/transport.py) runs the tiny tool task
(`tool_sums`, the char-level tiny tokenizer: a calculator call `==123+456+789=`, the environment's calculator,
then the answer) against a minimal token-in/token-out server in a process of its own, announced in RUN_DIR/servers/
like a vLLM server and answering the same routes (GET /status, POST /v1/completions) with the same JSON.

The server answers at once, so the numbers are the actor's own cost, not a model's:
- actor CPU ms per model turn: the actor process's CPU time (time.process_time) over a round / its model turns;
- memory per open episode: the actor's RSS with all N episodes open mid-episode, minus its RSS before the round,
  / N. All N are open at once by construction: the server holds every first-turn reply until the actor has seen
  N requests held there, reads its RSS, and releases them;
- event-loop lag p50 / p99: a task on the actor's loop sleeps 10 ms over and over and records the overshoot;
- how each grows from the smallest N to the largest (the goals: CPU per turn flat, memory linear in N, p99 lag
  <= 50 ms at the largest N).

Each N runs in a fresh actor process (two warm-up groups first), so one N's freed memory does not hide the next
one's. An N below MIN_EPISODES runs rounds of N one after the other, each held and released likewise and each on
a client of its own (its N connections opened anew, as with a larger N), until MIN_EPISODES episodes have run:
memory is read in the first round, CPU per turn is the rounds' median. The actor's
HTTP client readies the process as in a run (actor/transport.py `actor_client`: the open-files limit, one socket per
request in flight, raised to the hard limit; the garbage collector's thresholds); the run prints the limit it
starts with.

    python tools/bench_actor_scale.py [--episodes 100 1000 10000] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_summary import Summary  # noqa: E402

from pipelinerl.rundir import publish_server  # noqa: E402
from pipelinerl.tiny.model import ALPHABET, BOS, EOS, PAD  # noqa: E402

VOCAB = [PAD, BOS, EOS, *ALPHABET]  # the tiny tokenizer's ids (tiny_model.build_tokenizer)
EOS_ID = VOCAB.index(EOS)
LAG_PERIOD_S = 0.01
STARTUP_S = 60.0  # for the fake server to write its port
HOLD_WAIT_S = 600.0  # for all N first-turn requests to reach the server
CONTROL_TIMEOUT_S = 120.0  # the bench's own requests to the server, which accepts 10,000 connections at once
ROUND_TIMEOUT_S = 1800.0
WARMUP_GROUPS = 2
MIN_EPISODES = 1000  # a smaller N runs several rounds, one after the other, for a steady CPU time per turn


# ------------------------------------------------------------------ the fake server (its own process)

def reply_text(prompt_ids: list[int]) -> tuple[str, bool]:
    """The scripted policy's turn for a tool_sums prefix, and whether it is a first turn: with no model turn yet
    (no EOS) the calculator call of the prompt's sum, else the calculator's answer (the text after the last EOS)."""
    text = "".join(VOCAB[i] for i in prompt_ids[1:])  # after BOS
    if EOS not in text:
        return f"=={text[:-1]}=", True
    return text.rsplit(EOS, 1)[1], False


def serve(port_file: Path) -> None:
    """GET /status and POST /v1/completions as a policy server answers them, at once, except that after
    POST /bench/hold {"count": N} the next N first-turn requests wait for POST /bench/release; GET /bench/held
    counts those waiting."""
    from aiohttp import web

    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # one socket per request the actor sends
    held: list[asyncio.Future] = []
    hold = {"left": 0}

    async def status(request: web.Request) -> web.Response:
        return web.json_response({"version": 0, "num_ranks": 1, "group_ready": False, "updating": False})

    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        text, first = reply_text(body["prompt"])
        if first and hold["left"] > 0:
            hold["left"] -= 1
            waiter = asyncio.get_running_loop().create_future()
            held.append(waiter)
            await waiter
        ids = [VOCAB.index(c) for c in text] + [EOS_ID]
        return web.json_response({"choices": [{
            "index": 0, "text": text, "token_ids": ids, "logprobs": {"token_logprobs": [-0.5] * len(ids)},
            "policy_versions": [0] * len(ids), "finish_reason": "stop"}]})

    async def arm(request: web.Request) -> web.Response:
        hold["left"] = (await request.json())["count"]
        return web.json_response({})

    async def count(request: web.Request) -> web.Response:
        return web.json_response({"held": len(held)})

    async def release(request: web.Request) -> web.Response:
        for waiter in held:
            waiter.set_result(None)
        held.clear()
        return web.json_response({})

    async def main() -> None:
        app = web.Application()
        app.add_routes([web.get("/status", status), web.post("/v1/completions", completions),
                        web.post("/bench/hold", arm), web.get("/bench/held", count),
                        web.post("/bench/release", release)])
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, backlog=4096)
        await site.start()
        port = runner.addresses[0][1]
        tmp = port_file.with_suffix(".tmp")
        tmp.write_text(str(port))
        tmp.rename(port_file)
        await asyncio.Event().wait()

    asyncio.run(main())


# ------------------------------------------------------------------ one round (a fresh actor process)

def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def lag_monitor(lags: list[float], stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        start = loop.time()
        await asyncio.sleep(LAG_PERIOD_S)
        lags.append(loop.time() - start - LAG_PERIOD_S)


async def run_round(n: int, url: str, run_dir: str) -> dict:
    from pipelinerl.actor.client import KEEPALIVE_S, CompletionsClient
    from pipelinerl.actor.episodes import sample_episodes
    from pipelinerl.actor.transport import actor_client
    from pipelinerl.config import load_config
    from pipelinerl.tasks import get_task
    from pipelinerl.tiny.model import build_tokenizer

    cfg = load_config(REPO / "configs" / "tiny_tools.yaml", [f"run_dir={run_dir}", "actor.request_timeout_s=600"])
    task, tok, g = get_task(cfg.task), build_tokenizer(), cfg.actor.attempts
    client = CompletionsClient(cfg.actor, run_dir, reference=False, max_lag=cfg.actor.max_lag)

    def groups(http, count: int, first_item: int) -> list[asyncio.Task]:
        sizes = [min(g, count - start) for start in range(0, count, g)]
        return [asyncio.ensure_future(sample_episodes(client, http, task, tok, task.train_items[first_item + i], cfg,
                                                      size, greedy=False))
                for i, size in enumerate(sizes)]

    async with actor_client(KEEPALIVE_S) as http:
        if http.max_requests < n:  # the rest would wait in the actor, and the server's hold for ever
            raise SystemExit(f"the open-files limit lets {http.max_requests} requests be in flight, fewer than {n}: "
                             "raise the hard limit (ulimit -Hn)")
        await client.serving_version(http)
        await asyncio.gather(*groups(http, WARMUP_GROUPS * g, 0))
    gc.collect()
    rss_before, rss_open, fds_open, results, per_turn = rss_bytes(), None, None, [], []
    lags, stop = [], asyncio.Event()
    monitor = asyncio.ensure_future(lag_monitor(lags, stop))
    wall = time.perf_counter()
    for k in range(math.ceil(MIN_EPISODES / n)):
        cpu = time.process_time()
        async with actor_client(KEEPALIVE_S) as http:  # a client of its own: each round opens its N connections
            await http.post(f"{url}/bench/hold", json={"count": n}, timeout=CONTROL_TIMEOUT_S)
            running = groups(http, n, WARMUP_GROUPS + k * math.ceil(n / g))
            deadline = time.monotonic() + HOLD_WAIT_S
            while (await http.get(f"{url}/bench/held", timeout=CONTROL_TIMEOUT_S)).json()["held"] < n:
                failed = [t for t in running if t.done() and t.exception() is not None]
                if failed:
                    raise failed[0].exception()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{n} first-turn requests did not all reach the server in {HOLD_WAIT_S:.0f} s")
                await asyncio.sleep(0.05)
            if rss_open is None:
                rss_open, fds_open = rss_bytes(), len(os.listdir("/proc/self/fd"))
            await http.post(f"{url}/bench/release", timeout=CONTROL_TIMEOUT_S)
            done = [r for group in await asyncio.gather(*running) for r in group]
        per_turn.append((time.process_time() - cpu) / sum(len(r.episode.model_turns) for r in done))
        results += done
    wall = time.perf_counter() - wall
    stop.set()
    await monitor
    turns = sum(len(r.episode.model_turns) for r in results)
    return {"episodes": n, "turns": turns, "reward": sum(r.reward for r in results) / len(results), "wall_s": wall,
            "cpu_ms_per_turn": 1000 * statistics.median(per_turn), "rss_before_mib": rss_before / 2**20,
            "rss_open_mib": rss_open / 2**20, "kib_per_episode": (rss_open - rss_before) / 1024 / n,
            "fds_open": fds_open, "lag_p50_ms": 1000 * percentile(lags, 0.5),
            "lag_p99_ms": 1000 * percentile(lags, 0.99), "lag_max_ms": 1000 * max(lags)}


# ------------------------------------------------------------------ the driver

def start_server(folder: Path) -> tuple[subprocess.Popen, int]:
    port_file = folder / "port"
    proc = subprocess.Popen([sys.executable, __file__, "--serve", str(port_file)], start_new_session=True)
    deadline = time.monotonic() + STARTUP_S
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the fake server did not start (exit code {proc.poll()})")
        time.sleep(0.1)
    return proc, int(port_file.read_text())


def measure(n: int, url: str, run_dir: Path) -> dict:
    out = subprocess.run([sys.executable, __file__, "--round", str(n), "--url", url, "--run-dir", str(run_dir)],
                         capture_output=True, text=True, timeout=ROUND_TIMEOUT_S)
    if out.returncode != 0:
        raise RuntimeError(f"the round of {n} episodes failed (exit code {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.splitlines()[-1])


def print_table(rows: list[dict]) -> None:
    print(f"{'episodes':>9} {'turns':>6} {'wall s':>7} {'CPU ms/turn':>11} {'RSS before':>10} {'RSS open':>9} "
          f"{'KiB/episode':>11} {'open fds':>8} {'lag p50 ms':>10} {'lag p99 ms':>10} {'lag max ms':>10} reward")
    for r in rows:
        print(f"{r['episodes']:>9} {r['turns']:>6} {r['wall_s']:>7.1f} {r['cpu_ms_per_turn']:>11.3f} "
              f"{r['rss_before_mib']:>9.0f}M {r['rss_open_mib']:>8.0f}M {r['kib_per_episode']:>11.1f} "
              f"{r['fds_open']:>8} {r['lag_p50_ms']:>10.2f} {r['lag_p99_ms']:>10.1f} {r['lag_max_ms']:>10.1f} "
              f"{r['reward']:.2f}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--episodes", type=int, nargs="+", default=[100, 1000, 10000])
    p.add_argument("--quick", action="store_true", help="--episodes 100 1000 (a smoke test)")
    p.add_argument("--summary", type=Path, default=None)
    p.add_argument("--serve", type=Path, help=argparse.SUPPRESS)  # the fake server's process: its port file
    p.add_argument("--round", type=int, help=argparse.SUPPRESS)  # one actor round's process: N
    p.add_argument("--url", help=argparse.SUPPRESS)
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve is not None:
        serve(args.serve)
        return 0
    if args.round is not None:
        print(json.dumps(asyncio.run(run_round(args.round, args.url, args.run_dir))))
        return 0
    sizes = [100, 1000] if args.quick else sorted(args.episodes)
    summary = Summary("actor_scale")
    print(f"open-files limit (soft, hard): {resource.getrlimit(resource.RLIMIT_NOFILE)}; load average "
          f"{os.getloadavg()[0]:.2f}; an instant fake server: the numbers are the actor's own cost")
    with tempfile.TemporaryDirectory(prefix="bench_actor_scale_") as tmp:
        server, port = start_server(Path(tmp))
        try:
            publish_server(tmp, "127.0.0.1", port)
            rows = []
            for n in sizes:
                rows.append(measure(n, f"http://127.0.0.1:{port}", Path(tmp)))
                print(f"  {n} episodes: {rows[-1]['wall_s']:.1f} s", flush=True)
        finally:
            server.terminate()
            server.wait()
    print_table(rows)
    first, last = rows[0], rows[-1]
    growth = {key: last[key] / first[key] for key in ("cpu_ms_per_turn", "kib_per_episode", "lag_p99_ms")}
    print(f"growth from {first['episodes']} to {last['episodes']} episodes: CPU per turn "
          f"{growth['cpu_ms_per_turn']:.2f}x, memory per episode {growth['kib_per_episode']:.2f}x, lag p99 "
          f"{growth['lag_p99_ms']:.2f}x")
    for r in rows:
        n = r["episodes"]
        summary.add(f"{n} episodes: actor CPU per turn", r["cpu_ms_per_turn"], "ms")
        summary.add(f"{n} episodes: memory per open episode", r["kib_per_episode"], "KiB")
        summary.add(f"{n} episodes: event-loop lag p50", r["lag_p50_ms"], "ms")
        summary.add(f"{n} episodes: event-loop lag p99", r["lag_p99_ms"], "ms", "<= 50" if r is last else None)
    summary.add(f"CPU per turn, {last['episodes']} / {first['episodes']} episodes", growth["cpu_ms_per_turn"], "x",
                "<= 1.5")
    summary.add(f"memory per episode, {last['episodes']} / {first['episodes']} episodes",
                growth["kib_per_episode"], "x", "<= 1.5")
    summary.write(args.summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
