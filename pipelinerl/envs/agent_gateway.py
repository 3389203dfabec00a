"""Black-box agents on the OpenAI API, trained as they are: the actor's agent gateway.

For each episode the actor starts the user's agent, an `async def agent(client_kwargs: dict, item: dict) ->
float | None` (`task.agent.program`), with `client_kwargs = {"base_url": <the gateway>/v1, "api_key": <a key of
this episode only>}`, what `openai.AsyncOpenAI(**client_kwargs)` takes, and `item = {"id", "prompt", "answer"}`.
Every chat completion the agent asks with that key is one turn of the episode (envs/chat_program.py): messages
that extend those of its previous request (the stored conversation, our turn, then its new tool or user messages)
are rendered after the exact tokens so far; a request that goes back (a retried turn, an edited or dropped
message, a summarised context) branches the episode, and the model tokens it cuts off are counted
(actor/agent_drift_tokens), never trained. The model's turn comes back as
an OpenAI chat completion, its tool calls (written in task.agent.tool_format) as `tool_calls`, so an SDK runs
its function tools unchanged (an agent that neither returns nor posts a reward gets the task's own check of
the last model turn it read). With `stream: true` the same completion comes as server-sent chunks (the whole
turn in one chunk, once sampled), as SDKs that stream expect. The agent's return value is the episode's reward;
an agent that returns None must have posted one (`POST /rl/reward {"reward": x}` with its key).

Text completions (`POST /v1/completions`, one `prompt` string) serve agents that write the whole text themselves (a
ReAct loop on a base model): the episode is then plain text, no chat template (envs/episode.py's raw mode). A
prompt that goes on from the previous one with the model's text (its completion and the stop string that ended
it, which the completion leaves out as OpenAI's does) continues the exact tokens; one that does not branches, as
a chat request does. `stop` (a string or a list) is the server's: the turn ends at one, and keeps its tokens.
An episode keeps to the API of its first request.

The gateway answers bad requests with a clear error and never lets one touch another episode:
  401  no key, or a key of no running episode;   409  the episode has ended (a limit ended it first)
  400  a body that is not JSON (or nested past the parser's depth), no `messages` list (chat) or no one `prompt`
       string (text), `stream` not a boolean, `n` not 1, `stop` not strings, `echo` or `suffix` (text), the other
       API than the episode's first request, a reward not a finite number;   413  a body over MAX_BODY_BYTES
  429  a second request with a key whose previous one is still being answered (one turn at a time), with
       `retry-after-ms`; once the previous request's client has given up (closed its connection: a client
       timeout), the new request replaces it, and the turn answering the abandoned one is not trained
An agent that raises, or runs past task.agent.max_wall_s, ends its own episode as an environment error.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import secrets
import socket
import time
import uuid
from collections.abc import Awaitable, Callable

from aiohttp import web

from pipelinerl.envs.chat_program import ChatProgramEnv, ProgramEnd
from pipelinerl.envs.tool_calls import CallFormat

Agent = Callable[[dict, dict], Awaitable[float | None]]
MAX_BODY_BYTES = 8 * 2**20  # a request's body; larger ones get 413 (a conversation this size exceeds any episode)
RETRY_AFTER_MS = 200  # what a 429 asks the client to wait (the openai client honours it in its own retries)


class EpisodeEnded(Exception):
    """A request of an episode our runner has already ended."""


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status)


def completion(model: str, content: str | None, calls: list[dict]) -> dict:
    """An OpenAI chat.completion of one assistant message."""
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [{"id": c["id"], "type": "function",
                                  "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]
    return {"id": f"chatcmpl-{uuid.uuid4().hex[:16]}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": [{"index": 0, "message": message,
                                         "finish_reason": "tool_calls" if calls else "stop"}]}


def text_completion(model: str, text: str) -> dict:
    """An OpenAI text_completion of one text."""
    return {"id": f"cmpl-{uuid.uuid4().hex[:16]}", "object": "text_completion", "created": int(time.time()),
            "model": model, "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": "stop"}]}


def chunks(reply: dict) -> list[dict]:
    """A completion as the objects of a stream. A chat.completion: chat.completion.chunk objects, the message in
    one delta (tool calls with their index), then the finish reason; a text_completion: itself, whole."""
    if reply["object"] == "text_completion":
        return [reply]
    choice = reply["choices"][0]
    delta = {"role": "assistant", "content": choice["message"]["content"]}
    if "tool_calls" in choice["message"]:
        delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(choice["message"]["tool_calls"])]
    head = {k: reply[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    return [{**head, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]},
            {**head, "choices": [{"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}]}]


async def _stream(request: web.Request, reply: dict) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    for chunk in chunks(reply):
        await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


class Gateway:
    """The OpenAI-compatible endpoint on 127.0.0.1, served in the actor's event loop from the first episode on;
    each key routes to its episode."""

    def __init__(self):
        self.episodes: dict[str, AgentEnv] = {}
        self.runner: web.AppRunner | None = None
        self.loop: asyncio.AbstractEventLoop | None = None  # where it serves
        self.url = ""
        self._lock = asyncio.Lock()

    async def start(self) -> None:
        """Serve on a free port of 127.0.0.1 (once: later calls return at once); every route needs an episode's key
        (`Authorization: Bearer <key>`)."""
        async with self._lock:
            if self.runner is not None:
                return
            app = web.Application(client_max_size=MAX_BODY_BYTES)
            app.router.add_post("/v1/chat/completions", self._chat)
            app.router.add_post("/rl/reward", self._reward)
            app.router.add_post("/v1/completions", self._text_completions)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            self.runner, self.url = runner, f"http://127.0.0.1:{runner.addresses[0][1]}"
            self.loop = asyncio.get_running_loop()

    async def stop(self) -> None:
        if self.runner is not None:
            runner, self.runner, self.loop = self.runner, None, None
            await runner.cleanup()

    async def _request(self, request: web.Request) -> tuple[AgentEnv, dict] | web.Response:
        """The request's episode (by its key) and its JSON body, or the error response."""
        auth = request.headers.get("Authorization", "")
        env = self.episodes.get(auth.removeprefix("Bearer ").strip()) if auth.startswith("Bearer ") else None
        if env is None:
            return _error(401, "no running episode has this API key (a key is valid for its own episode only)")
        if env.ended:
            return _error(409, "the episode of this key has ended")
        try:
            body = await request.json()
        except web.HTTPRequestEntityTooLarge:
            return _error(413, f"the body is over {MAX_BODY_BYTES} bytes")
        except (ValueError, RecursionError) as err:  # not JSON, not UTF-8, or nested past the parser's depth
            return _error(400, f"the body is not JSON: {type(err).__name__}: {str(err)[:200]}")
        return (env, body) if isinstance(body, dict) else _error(400, "the body must be a JSON object")

    async def _chat(self, request: web.Request) -> web.Response:
        """One model turn of the key's episode as an OpenAI chat completion (streamed if asked); its tool calls
        come back as `tool_calls`."""
        got = await self._request(request)
        if isinstance(got, web.Response):
            return got
        env, body = got
        messages, tools = body.get("messages"), body.get("tools")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            return _error(400, "`messages` must be a non-empty list of message objects")
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) and "function" in t
                                                                         for t in tools)):
            return _error(400, "`tools` must be a list of function tools")
        return await _turn(request, env, body, "chat", lambda gone, stop: env.model_call(messages, tools or None,
                                                                                         gone, stop))

    async def _text_completions(self, request: web.Request) -> web.Response:
        """One model turn of the key's episode as an OpenAI text completion of one `prompt` string (a plain-text
        episode, no chat template)."""
        got = await self._request(request)
        if isinstance(got, web.Response):
            return got
        env, body = got
        prompt = body.get("prompt")
        prompt = prompt[0] if isinstance(prompt, list) and len(prompt) == 1 else prompt
        if not isinstance(prompt, str) or not prompt:
            return _error(400, "`prompt` must be one non-empty string (a request is one turn of the episode)")
        if body.get("echo") or body.get("suffix") is not None:
            return _error(400, "`echo` and `suffix` are not served: a turn's completion is the model's text alone")
        return await _turn(request, env, body, "text", lambda gone, stop: env.text_call(prompt, gone, stop))

    async def _reward(self, request: web.Request) -> web.Response:
        """`{"reward": x}`: the episode's reward, for an agent that returns None."""
        got = await self._request(request)
        if isinstance(got, web.Response):
            return got
        env, body = got
        reward = body.get("reward")
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            return _error(400, f"`reward` must be a finite number, got {reward!r}")
        env.posted_reward = float(reward)
        return web.json_response({"ok": True})


async def _turn(request: web.Request, env: AgentEnv, body: dict, api: str,
                call: Callable[[Callable[[], bool], tuple[str, ...]], Awaitable[tuple[str | None, list[dict]]]]
                ) -> web.Response:
    """One turn of `env` through `api` ("chat" or "text"): the checks both share, then `call(gone, stop)`'s
    answer as a completion of that API (streamed if asked)."""
    if not isinstance(body.get("stream", False), bool):
        return _error(400, "`stream` must be true or false")
    if body.get("n", 1) != 1 or isinstance(body.get("n"), bool):
        return _error(400, "`n` must be 1: a request is one turn of its episode")
    stop = body.get("stop")
    stop = (stop,) if isinstance(stop, str) else tuple(stop) if isinstance(stop, list) else stop
    if stop is not None and not all(isinstance(x, str) and x for x in stop):
        return _error(400, "`stop` must be a non-empty string or a list of them")
    if env.api not in (None, api):
        return _error(400, f"this episode's requests are {env.api} completions: an episode keeps to one API")
    env.api = api
    if env.inflight is not None and not env.inflight():
        response = _error(429, "this episode's previous request is still being answered: one turn at a time")
        response.headers["retry-after-ms"] = str(RETRY_AFTER_MS)
        return response
    env.inflight = gone = _gone(request)  # replaces a request whose client is gone, if any
    try:
        content, calls = await call(gone, stop or ())
    except EpisodeEnded:
        return _error(409, "the episode of this key has ended")
    finally:
        if env.inflight is gone:
            env.inflight = None
    model = str(body.get("model", "policy"))
    reply = completion(model, content, calls) if api == "chat" else text_completion(model, content or "")
    return await _stream(request, reply) if body.get("stream") else web.json_response(reply)


def _gone(request: web.Request) -> Callable[[], bool]:
    """Whether the request's client has closed its connection: aiohttp has dropped the transport, or the socket
    already holds the end of the stream (a peek reads b""), which a client that timed out and sent its next request
    closed before connecting again, whether or not the loop has run aiohttp's callback for it yet."""
    def gone() -> bool:
        transport = request.transport
        if transport is None or transport.is_closing():
            return True
        sock = transport.get_extra_info("socket")
        if sock is None:
            return False
        with socket.socket(fileno=os.dup(sock.fileno())) as peek:  # asyncio's own socket object has no recv
            try:
                return peek.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
            except BlockingIOError:  # open, nothing to read
                return False
            except OSError:  # reset
                return True
    return gone


class AgentEnv(ChatProgramEnv):
    """One episode of `agent` on `item` through `gateway`, under its own key."""

    def __init__(self, gateway: Gateway, agent: Agent, item: dict, call_format: CallFormat, max_wall_s: float,
                 check: Callable[[str], float] | None = None):
        """`check`: the task's own check of a final answer, the reward of an agent that neither returns nor posts
        one (on the text of the last model turn it got)."""
        super().__init__(call_format)
        self.gateway, self.agent, self.item, self.max_wall_s, self.check = gateway, agent, item, max_wall_s, check
        self.key = f"pl-{secrets.token_urlsafe(24)}"
        self.inflight: Callable[[], bool] | None = None  # the request being answered: whether its client is gone
        self.posted_reward: float | None = None
        self.api: str | None = None  # "chat" or "text": the API of the episode's first request, kept by the rest

    @property
    def raw_text(self) -> bool:
        return self.api == "text"

    async def text_call(self, prompt: str, gone: Callable[[], bool], stop: tuple[str, ...]) -> tuple[str | None,
                                                                                                  list[dict]]:
        """A text completion of `prompt`: the model call of its segments (`segments`)."""
        return await self.model_call(self.segments(prompt), None, gone, stop)

    def segments(self, prompt: str) -> list[dict]:
        """A text call's prompt as the episode's messages, text segments (episode.py's raw mode): the messages of
        the last answered call whose prompt it starts with; then, if it goes on with that call's model text (the
        answer the program got and the stop string after it), that answer as the assistant message; then the rest
        as the program's text. No such call: the prompt alone. The chat machinery then places it (extends the
        last turn, or branches) as it places chat messages. Joined, the segments are the prompt."""
        for done in reversed(self.answered):
            before = done.call.messages
            base = "".join(m["content"] for m in before)
            if not prompt.startswith(base):
                continue
            rest = prompt[len(base):]
            if rest.startswith(done.text):
                before, rest = [*before, {"role": "assistant", "content": done.text}], rest[len(done.text):]
            return [*before, {"role": "user", "content": rest}] if rest else before
        return [{"role": "user", "content": prompt}]

    async def start(self) -> None:
        await self.gateway.start()
        self.gateway.episodes[self.key] = self
        await super().start()

    async def run_program(self) -> ProgramEnd:
        client_kwargs = {"base_url": f"{self.gateway.url}/v1", "api_key": self.key}
        try:
            reward = await asyncio.wait_for(self.agent(client_kwargs, dict(self.item)), self.max_wall_s)
        except TimeoutError:
            raise RuntimeError(f"the agent ran past task.agent.max_wall_s ({self.max_wall_s:g} s)") from None
        if reward is None:
            reward = self.posted_reward
        last = self.answered[-1] if self.answered else None
        if reward is None and self.check is not None and last is not None and not last.call.gone():
            reward = self.check(last.text)
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise RuntimeError(f"the agent's reward must be a finite number (returned, or posted to /rl/reward), "
                               f"got {reward!r}")
        return ProgramEnd(float(reward))

    def opening_messages(self) -> list[dict]:
        return [{"role": "user", "content": self.item["prompt"]}]

    def ended_error(self) -> Exception:
        return EpisodeEnded()

    async def close(self) -> None:
        try:
            await super().close()
        finally:
            self.gateway.episodes.pop(self.key, None)
