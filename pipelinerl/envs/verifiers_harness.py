"""The chat loop of a verifiers (v1) rollout, run as a coroutine in the actor's process.

verifiers runs each rollout through a harness: the agent program that sends model calls to the rollout's
interception endpoint and runs the tools the model calls. Its built-in ones (`bash`, `null`) are separate
programs prepared with `uv` (which fetches packages) and cost ~2 s of process start per rollout; this one is
the same loop in-process: the task's system prompt and prompt, then model call -> each tool call run on the
task's MCP tool servers -> the tool messages -> model call, until a reply calls no tool or verifiers refuses
the next call (a stop condition or a limit: HTTP 400). verifiers loads it by id (`task.verifiers.harness`:
`pipelinerl_chat`, the default, which verifiers_env.py registers as this module) through the one Harness
subclass in `__all__`.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from contextlib import AsyncExitStack

import aiohttp
import verifiers.v1 as vf
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.harnesses.utils.mcp import call_mcp, connect_mcp


def first_messages(system: str | None, prompt) -> list[dict]:
    """A rollout's opening chat messages from its task's system prompt and prompt (text or messages)."""
    messages = [{"role": "system", "content": system}] if system else []
    if isinstance(prompt, str):
        return messages + [{"role": "user", "content": prompt}]
    return messages + [message_to_wire(m) for m in prompt or []]


def tool_text(content) -> str:
    """A tool result as text: MCP returns a string or content parts; text parts are joined."""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, dict))


class InProcessChatConfig(vf.HarnessConfig):
    pass


class InProcessChat(vf.Harness[InProcessChatConfig]):
    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_MCP = True
    EXECUTES_CODE = False  # the model gets no execution of its own: only the task's tools
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None):
        messages = first_messages(*self.resolve_prompt(data))
        tools, dispatch, servers = await _TOOLS.get(mcp_urls, self.config.tool_timeout) if mcp_urls else ([], {}, {})
        while True:
            message = await _chat(endpoint, secret, {"model": ctx.model, "messages": messages,
                                                     **({"tools": tools} if tools else {})})
            if message is None:  # verifiers refused the call: a stop condition or a limit ended the rollout
                break
            messages.append(message)
            if not message.get("tool_calls"):
                break
            for call in message["tool_calls"]:
                messages.append({"role": "tool", "tool_call_id": call["id"], "name": call["function"]["name"],
                                 "content": await _run_tool(servers, dispatch, call["function"])})
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


async def _chat(endpoint: str, secret: str, body: dict) -> dict | None:
    """The assistant message of one chat completion from the rollout's interception endpoint (None: refused,
    HTTP 400). Plain aiohttp on one session per event loop: the OpenAI SDK's request building and httpx's
    pool cost ~4 ms of CPU per call at a few hundred rollouts in flight. Each parked call holds its connection
    until the runner's turn answers it, so the pool is unbounded (aiohttp's default of 100 made the 101st
    rollout in flight wait for a slot, and its `connect` timeout counts that wait); only opening a socket to the
    endpoint, which lives in this process, is bounded."""
    loop = asyncio.get_running_loop()
    session = _SESSIONS.get(loop)
    if session is None or session.closed:
        for old in [lp for lp in _SESSIONS if lp.is_closed()]:
            del _SESSIONS[old]
        session = _SESSIONS[loop] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                                            timeout=aiohttp.ClientTimeout(total=None, sock_connect=30))
    async with session.post(f"{endpoint.rstrip('/')}/chat/completions", json=body,
                            headers={"Authorization": f"Bearer {secret}"}) as response:
        if response.status == 400:
            return None
        if response.status != 200:
            raise RuntimeError(f"the interception endpoint answered HTTP {response.status}: "
                               f"{(await response.text())[:500]}")
        message = (await response.json())["choices"][0]["message"]
    return {k: v for k, v in message.items() if v is not None}


class _ToolConnections:
    """MCP connections reused by the rollouts that reach the same tool servers (a taskset's shared ones: one URL
    for every rollout): connecting costs an HTTP client, its SSL context and a tool listing per rollout. Each
    connection runs one call at a time, so POOL of them per set of servers are used in turn. The LAST sets
    reached most recently stay open (tool servers of each rollout's own come and go with their rollout)."""

    POOL, LAST = 4, 8

    def __init__(self):
        self.open: OrderedDict[tuple, list] = OrderedDict()  # (loop, urls) -> [(tools, dispatch, servers, stack)]
        self.turn = 0

    async def get(self, mcp_urls: dict[str, str], timeout_s: float):
        key = (asyncio.get_running_loop(), tuple(sorted(mcp_urls.items())))
        pool = self.open.setdefault(key, [])
        self.open.move_to_end(key)
        self.turn += 1
        if len(pool) < self.POOL:
            stack = AsyncExitStack()
            servers_cfg = {"mcpServers": {name: {"url": url, "timeout": timeout_s} for name, url in mcp_urls.items()}}
            pool.append((*await connect_mcp(servers_cfg, stack), stack))
            while len(self.open) > self.LAST:
                for *_, old in self.open.popitem(last=False)[1]:
                    await old.aclose()
            return pool[-1][:3]
        return pool[self.turn % self.POOL][:3]


_SESSIONS: dict[asyncio.AbstractEventLoop, aiohttp.ClientSession] = {}
_TOOLS = _ToolConnections()


async def close_connections() -> None:
    """Close this event loop's HTTP session and tool connections (the environment stops serving)."""
    loop = asyncio.get_running_loop()
    session = _SESSIONS.pop(loop, None)
    if session is not None:
        await session.close()
    for key in [k for k in _TOOLS.open if k[0] is loop]:
        for *_, stack in _TOOLS.open.pop(key):
            await stack.aclose()


async def _run_tool(servers, dispatch, function: dict) -> str:
    """The tool's answer, or the error the model reads instead (unknown tool, bad JSON, a failed call)."""
    name = function["name"]
    if name not in dispatch:
        return f"Error: unknown tool {name!r}"
    try:
        return tool_text(await call_mcp(servers, dispatch, name, json.loads(function.get("arguments") or "{}")))
    except Exception as err:  # noqa: BLE001 -- the model is told, the rollout goes on
        return f"Error: {type(err).__name__}: {err}"


__all__ = ["InProcessChat"]
