"""The actor's evaluation on an evaluation server (eval/servers.py) against a scripted server (httpx's
MockTransport): the score is kept only when every token came from the held version and the hold was still in
force at the release; a server that stops answering ends the evaluation instead of leaving it waiting."""

import asyncio

import httpx
import pytest

from pipelinerl.actor import Completion
from pipelinerl.config import load_config
from pipelinerl.eval import servers as module
from pipelinerl.eval.metrics import ItemOutcome
from pipelinerl.eval.servers import EvalServers
from pipelinerl.eval.sets import SampledItem
from pipelinerl.rundir import EVAL_SERVERS_DIR, publish_server
from pipelinerl.tasks import PromptItem

URL = "http://127.0.0.1:18777"


class Scripted:
    """An evaluation server's control routes: /status at `version`, /hold and /release with a hold that `lapse`
    ends early; `dead` makes every route fail from then on. Records the routes called."""

    def __init__(self, version: int):
        self.version, self.held, self.dead, self.lapse, self.calls = version, False, False, False, []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        self.calls.append(path)
        if self.dead:
            raise httpx.ConnectError("connection refused", request=request)
        if path == "/status":
            return httpx.Response(200, json={"version": self.version, "num_ranks": 1, "group_ready": True,
                                             "updating": False, "held_s": 60.0 if self.held else 0.0})
        if path == "/hold":
            self.held = True
            return httpx.Response(200, json={"version": self.version, "held_s": 60.0})
        if path == "/release":
            was, self.held = self.held and not self.lapse, False
            return httpx.Response(200, json={"version": self.version, "held": was})
        return httpx.Response(404)


def _item(versions: list[int]) -> SampledItem:
    c = Completion([1] * len(versions), [0.0] * len(versions), versions, "x", True)
    return SampledItem(PromptItem("p0", "1+1=", "2"), [3], [c], ItemOutcome("p0", ["x"], [1.0], [True], [1], [True]))


def _run(tmp_path, server: Scripted, sample, due: int = 0):
    cfg = load_config(None, [f"run_dir={tmp_path}", "model.path=m", "inference.eval_servers=1"])
    publish_server(tmp_path, "127.0.0.1", 18777, EVAL_SERVERS_DIR)

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(server)) as http:
            evals = EvalServers(cfg, run="")
            picked = await evals.pick(http, due)
            if picked is None:
                return None, None
            return picked, await evals.evaluate(http, picked[0], sample)

    return asyncio.run(go())


def test_an_evaluation_of_one_version_is_kept_and_the_server_released(tmp_path):
    server = Scripted(version=8)

    async def sample(http, client):
        assert server.held and client.pool.only == URL and client.pool.refresh() == [URL]
        return [[_item([8, 8, 8])]]

    picked, done = _run(tmp_path, server, sample, due=8)
    assert picked == (URL, 8)
    assert done[0] == 8 and len(done[1][0]) == 1
    assert server.calls == ["/status", "/hold", "/release"] and not server.held


def test_a_server_behind_the_due_version_is_not_picked(tmp_path):
    server = Scripted(version=3)
    picked, _ = _run(tmp_path, server, None, due=4)
    assert picked is None and server.calls == ["/status"]


@pytest.mark.parametrize("case", ["token of another version", "the hold lapsed"])
def test_an_evaluation_that_is_not_one_versions_is_dropped(tmp_path, caplog, case):
    server = Scripted(version=8)
    server.lapse = case == "the hold lapsed"
    versions = [8, 9] if case == "token of another version" else [8, 8]

    async def sample(http, client):
        return [[_item(versions)]]

    _, done = _run(tmp_path, server, sample)
    assert done is None and "dropped" in caplog.text
    assert server.calls[-1] == "/release"


def test_a_server_that_dies_mid_evaluation_ends_it_within_a_renewal(tmp_path, caplog, monkeypatch):
    """The sampling would wait for the server's return; the failed renewal of the hold ends it instead."""
    monkeypatch.setattr(module, "HOLD_S", 0.3)
    server = Scripted(version=2)
    never = asyncio.Event()

    async def sample(http, client):
        server.dead = True
        await never.wait()  # a request that never comes back

    _, done = _run(tmp_path, server, sample)
    assert done is None and "failed, dropped" in caplog.text
    assert server.calls[-2:] == ["/hold", "/release"]  # the renewal failed, then the release was tried
