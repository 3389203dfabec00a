"""A hold keeps a policy server on one version while the actor evaluates on it (updates.py `WeightUpdater.hold`).

Fast (no vLLM): the real update state machine on test_inference_vllm_glue's recording engine, a settable clock
instead of sleeping out a hold, and events instead of races for an update caught mid-receive; then the real
routes over HTTP (memory_servers' server) with the trainer's blocking client and the actor's async helpers, and
every control route's refusal of a body it cannot take (server.py `read_json_body`) on a connection that serves on.
"""

import asyncio
import http.client
import math
import socket

import httpx
import pytest
from memory_servers import TOKEN, Server
from prometheus_client import CollectorRegistry
from test_inference_vllm_glue import EXPECTED, INIT, UPDATE, RecordingEngine

from pipelinerl.control import ControlClient, ControlError, hold_server, read_status, release_server
from pipelinerl.inference.server import MAX_DEPTH, SMALL_BODY_BYTES, UPDATE_BODY_BYTES
from pipelinerl.inference.updates import UpdateError, WeightUpdater


class Clock:
    """A settable `time.monotonic`."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _updater(clock: Clock | None = None) -> tuple[RecordingEngine, WeightUpdater]:
    engine = RecordingEngine()
    updater = WeightUpdater(engine, EXPECTED, "float32", "keep", version=3, registry=CollectorRegistry(),
                            clock=clock or Clock())
    return engine, updater


def _loads(engine: RecordingEngine) -> list[tuple]:
    return [c for c in engine.calls if c[0] in ("pause", "receive", "load", "resume")]


def test_a_hold_during_an_update_waits_for_it_and_holds_the_new_version():
    async def scenario():
        engine, updater = _updater()
        await updater.init_group(INIT)
        receiving, finish = asyncio.Event(), asyncio.Event()

        async def receive(req):
            receiving.set()
            await finish.wait()

        engine.receive = receive
        update = asyncio.create_task(updater.update(UPDATE))
        await receiving.wait()
        hold = asyncio.create_task(updater.hold({"seconds": 60}))
        for _ in range(5):  # let the hold run up to its wait
            await asyncio.sleep(0)
        assert not hold.done() and updater.busy
        finish.set()
        assert await hold == {"version": 7, "held_s": 60.0}
        assert (await update)["version"] == 7 and updater.status()["version"] == 7

    asyncio.run(scenario())


def test_an_update_while_held_is_refused_before_it_touches_the_engine_until_released():
    async def scenario():
        clock = Clock()
        engine, updater = _updater(clock)
        await updater.init_group(INIT)
        assert await updater.hold({"seconds": 30}) == {"version": 3, "held_s": 30.0}
        clock.t += 10
        with pytest.raises(UpdateError, match=r"held for evaluation at version 3 for 20\.0 more s "
                                              r"\(POST /release ends it\)") as err:
            await updater.update(UPDATE)
        assert err.value.status == 423 and err.value.details == {"version": 3, "held_s": 20.0}
        assert _loads(engine) == [] and not updater.busy
        assert updater.status()["held_s"] == 20.0 and updater.status()["version"] == 3
        await updater.init_group(INIT)  # joining a group changes no weights: allowed while held
        assert await updater.release() == {"version": 3, "held": True}
        assert updater.status()["held_s"] == 0.0
        assert (await updater.update(UPDATE))["version"] == 7
        assert ("load", 7) in engine.calls

    asyncio.run(scenario())


def test_an_expired_hold_blocks_nothing_and_release_says_it_was_not_held():
    async def scenario():
        clock = Clock()
        engine, updater = _updater(clock)
        await updater.init_group(INIT)
        assert await updater.release() == {"version": 3, "held": False}  # never held: not an error
        await updater.hold({"seconds": 0.5})
        clock.t += 0.5
        assert updater.status()["held_s"] == 0.0
        assert (await updater.update(UPDATE))["version"] == 7
        assert await updater.release() == {"version": 7, "held": False}

    asyncio.run(scenario())


def test_a_second_hold_replaces_the_deadline():
    async def scenario():
        clock = Clock()
        _, updater = _updater(clock)
        await updater.hold({"seconds": 30})
        clock.t += 10
        assert await updater.hold({"seconds": 5}) == {"version": 3, "held_s": 5.0}
        assert updater.status()["held_s"] == 5.0

    asyncio.run(scenario())


@pytest.mark.parametrize("body", [None, [], {}, {"seconds": None}, {"seconds": -1}, {"seconds": 0},
                                  {"seconds": math.nan}, {"seconds": math.inf}, {"seconds": "10"},
                                  {"seconds": True}, {"seconds": 600.5}, {"seconds": 1e308}, {"seconds": 10**400}])
def test_a_hold_without_a_number_of_seconds_in_0_to_the_maximum_is_a_400(body):
    _, updater = _updater()
    with pytest.raises(UpdateError, match=r'bad request body: a hold takes \{"seconds": <a number > 0, at most 600 '
                                          r'\(inference.max_hold_s\)>\}') as err:
        asyncio.run(updater.hold(body))
    assert err.value.status == 400 and updater.status()["held_s"] == 0.0


@pytest.fixture
def server():
    server = Server({})
    server.updater.engine = RecordingEngine()  # the memory engine would open a real gloo group
    server.updater.expected, server.updater.dtype = EXPECTED, "float32"
    yield server
    server.stop()


def test_over_http_the_trainer_gets_423_while_the_actor_holds(server):
    client = ControlClient(TOKEN)
    client.init_group(server.url, INIT)

    async def actor():
        async with httpx.AsyncClient() as http:
            assert await hold_server(http, server.url, TOKEN, 60.0) == {"version": 0, "held_s": 60.0}
            assert 59.0 < (await read_status(http, server.url)).held_s <= 60.0
            with pytest.raises(ControlError, match=f"POST {server.url}/hold -> HTTP 401") as err:
                await hold_server(http, server.url, "wrong", 60.0)
            assert err.value.status == 401
            with pytest.raises(ControlError, match="HTTP 400") as err:
                await hold_server(http, server.url, TOKEN, -1.0)
            assert err.value.status == 400

    asyncio.run(actor())
    with pytest.raises(ControlError, match=f"{server.url}/request_weight_update -> HTTP 423") as err:
        client.request_update(server.url, UPDATE)
    assert err.value.status == 423 and err.value.body["version"] == 0 and "POST /release" in err.value.body["error"]

    async def release():
        async with httpx.AsyncClient() as http:
            return await release_server(http, server.url, TOKEN)

    assert asyncio.run(release()) == {"version": 0, "held": True}
    assert client.request_update(server.url, UPDATE)["version"] == 7
    assert client.hold(server.url, 5.0)["version"] == 7 and client.status(server.url).held_s > 0
    assert client.release(server.url) == {"version": 7, "held": True}
    assert client.status(server.url).held_s == 0.0


def test_the_actor_helpers_name_the_server_when_it_is_unreachable():
    async def scenario():
        async with httpx.AsyncClient() as http:
            with pytest.raises(ControlError, match=r"POST http://127\.0\.0\.1:9/release failed") as err:
                await release_server(http, "http://127.0.0.1:9", TOKEN, timeout_s=5.0)
        assert err.value.status is None

    asyncio.run(scenario())


NESTED = b"[" * 60_000  # the json decoder recurses once per level: RecursionError long before the end (64 KiB cap)
NESTED_OBJECTS = b'{"a": ' * 100_000
DEEP_BUT_PARSED = b'{"version": ' + b"[" * 500 + b"]" * 500 + b"}"  # within the decoder's recursion, past MAX_DEPTH
TOO_DEEP = f"nested deeper than {MAX_DEPTH} levels"
HOLD_BOUNDS = "at most 600 (inference.max_hold_s)"
BAD_BODIES = [  # (route, body, status, what the reply says)
    ("/hold", NESTED, 400, TOO_DEEP),
    ("/request_weight_update", NESTED_OBJECTS, 400, TOO_DEEP),
    ("/init_process_group", NESTED, 400, TOO_DEEP),
    ("/request_weight_update", DEEP_BUT_PARSED, 400, TOO_DEEP),
    ("/hold", b'{"seconds": 1, "pad": "' + b"x" * (10 << 20) + b'"}', 413, f"at most {SMALL_BODY_BYTES} bytes"),
    ("/init_process_group", b'{"pad": "' + b"x" * SMALL_BODY_BYTES + b'"}', 413, f"at most {SMALL_BODY_BYTES} bytes"),
    ("/request_weight_update", b'{"pad": "' + b"x" * UPDATE_BODY_BYTES + b'"}', 413,
     f"at most {UPDATE_BODY_BYTES} bytes"),
    ("/hold", b'{"seconds": 1e308}', 400, HOLD_BOUNDS),
    ("/hold", b'{"seconds": 600.5}', 400, HOLD_BOUNDS),
    ("/hold", b'{"seconds": -1}', 400, HOLD_BOUNDS),
    ("/hold", b'{"seconds": "x"}', 400, HOLD_BOUNDS),
    ("/hold", b'{"seconds": NaN}', 400, "NaN is not a number this server takes"),
    ("/init_process_group", b'{"timeout_s": -Infinity}', 400, "-Infinity is not a number this server takes"),
    ("/hold", b'{"seconds": 1e400}', 400, "number 1e400 is out of the float range"),
    ("/hold", b'{"seconds": 1' + b"0" * 5000 + b"}", 400, "malformed JSON body"),  # past Python's 4300 digits
    ("/request_weight_update", b"[1, 2]", 400, "must be a JSON object, got [1, 2]"),
    ("/init_process_group", b'"x"', 400, 'must be a JSON object, got "x"'),
    ("/hold", b"null", 400, "must be a JSON object, got null"),
]


def _local_port(resp: httpx.Response) -> int:
    """The client side's port of the connection that carried `resp`: the same port, the same connection."""
    return resp.extensions["network_stream"].get_extra_info("client_addr")[1]


def test_bodies_the_control_routes_cannot_take_get_a_4xx_and_the_connection_serves_on(server):
    auth = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    with httpx.Client(base_url=server.url, timeout=60.0, limits=httpx.Limits(max_connections=1)) as client:
        port = _local_port(client.get("/status"))
        for route, body, status, says in BAD_BODIES:
            case = f"POST {route} {body[:40]!r}... ({len(body)} bytes)"
            resp = client.post(route, content=body, headers=auth)
            assert (resp.status_code, _local_port(resp)) == (status, port), f"{case}: {resp.text[:300]}"
            assert says in resp.json()["error"], case
            after = client.get("/status")
            assert (after.status_code, _local_port(after)) == (200, port), case
        chunked = client.post("/hold", content=iter([b" " * (1 << 20)] * 10), headers=auth)  # no Content-Length
        assert chunked.status_code == 413 and f"at most {SMALL_BODY_BYTES} bytes" in chunked.json()["error"]
        assert client.get("/status").json()["held_s"] == 0.0 and _local_port(chunked) == port
        assert client.post("/hold", json={"seconds": 600}, headers=auth).json()["held_s"] == 600.0


def test_a_declared_length_over_the_cap_is_refused_before_the_body_is_sent(server):
    """The 413 comes back while the client has sent only the headers (today's server waited for the body);
    the promised body, sent afterwards, is skipped and the connection serves the next request."""
    head = (f"POST /hold HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {SMALL_BODY_BYTES + 1}\r\n\r\n")
    with socket.create_connection(("127.0.0.1", server.port), timeout=30.0) as sock:
        sock.sendall(head.encode())
        refused = http.client.HTTPResponse(sock)
        refused.begin()  # a socket timeout here: the server waits for a body it should not read
        assert refused.status == 413 and f"at most {SMALL_BODY_BYTES} bytes" in refused.read().decode()
        sock.sendall(b" " * (SMALL_BODY_BYTES + 1) + b"GET /status HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        status = http.client.HTTPResponse(sock)
        status.begin()
        assert status.status == 200 and b'"held_s":0.0' in status.read()
