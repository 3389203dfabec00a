"""An agent program as users write them, on the plain `openai` client with a function tool, for the tests and
configs/tiny_agent.yaml: the tiny tool task (three 3-digit numbers to sum) with a calculator the agent runs
itself. Its reward: 1 for the exact sum as its final reply. `hang`, `crash`, `post_reward` and `no_reward` are the
tests' misbehaving variants; `retry_turn`, `edit_reply`, `summarise`, `gives_up` and `gives_up_last` go back in their
conversation; `relay` asks several prompts in turn.

The episodes' clients share one HTTP client per event loop: an `AsyncOpenAI` of its own builds an SSL context
(~30 ms of CPU), and hundreds of episodes starting at once on the actor's loop would hold the gateway (on the
same loop) past the client's 5 s connect timeout."""

import asyncio
import json

import httpx
import openai

_HTTP: dict[asyncio.AbstractEventLoop, httpx.AsyncClient] = {}


def client(client_kwargs: dict) -> openai.AsyncOpenAI:
    loop = asyncio.get_running_loop()
    if loop not in _HTTP:
        # every episode's request waits at the gateway for its turn: a connection each (httpx's default is 100)
        _HTTP[loop] = httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=30.0),
                                        limits=httpx.Limits(max_connections=4096, max_keepalive_connections=4096))
    return openai.AsyncOpenAI(**client_kwargs, max_retries=0, http_client=_HTTP[loop])

CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Sum the numbers of an expression like 123+456+789",
    "parameters": {"type": "object", "required": ["expression"],
                   "properties": {"expression": {"type": "string"}}}}}


def calculate(expression: str) -> str:
    terms = expression.split("+")
    return str(sum(map(int, terms))) if all(t.isdigit() for t in terms) else "*"


async def agent(client_kwargs: dict, item: dict, messages: list[dict] | None = None) -> float:
    openai_client = client(client_kwargs)
    messages = messages or [{"role": "user", "content": item["prompt"]}]
    for _ in range(3):
        reply = (await openai_client.chat.completions.create(model="policy", messages=messages,
                                                             tools=[CALCULATOR])).choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        if not reply.tool_calls:
            return float(reply.content == item["answer"])
        for call in reply.tool_calls:
            expression = json.loads(call.function.arguments)["expression"]
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calculate(expression)})
    return 0.0


async def post_reward(client_kwargs: dict, item: dict) -> None:
    """Answers in one turn and posts its reward instead of returning it."""
    messages = [{"role": "user", "content": item["prompt"]}]
    reply = await client(client_kwargs).chat.completions.create(model="policy", messages=messages)
    base = client_kwargs["base_url"].removesuffix("/v1")
    async with httpx.AsyncClient() as http:
        r = await http.post(f"{base}/rl/reward", json={"reward": 0.25 if reply.choices[0].message.content else 0.0},
                            headers={"Authorization": f"Bearer {client_kwargs['api_key']}"})
        r.raise_for_status()
    return None


async def no_reward(client_kwargs: dict, item: dict) -> None:
    """Answers in one turn and returns no reward, posting none."""
    await client(client_kwargs).chat.completions.create(model="policy", messages=[{"role": "user",
                                                                                   "content": item["prompt"]}])


async def crash(client_kwargs: dict, item: dict) -> float:
    await client(client_kwargs).chat.completions.create(model="policy", messages=[{"role": "user",
                                                                                   "content": item["prompt"]}])
    raise ValueError("the agent failed on purpose")


async def hang(client_kwargs: dict, item: dict) -> float:
    await client(client_kwargs).chat.completions.create(model="policy", messages=[{"role": "user",
                                                                                   "content": item["prompt"]}])
    await asyncio.sleep(3600)
    return 0.0


async def _ask(client_kwargs: dict, messages: list[dict], **kwargs):
    return (await client(client_kwargs).chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR],
                                                                **kwargs)).choices[0].message


async def retry_turn(client_kwargs: dict, item: dict) -> float:
    """Asks its first turn twice (as an agent whose check rejected the first answer), then goes on as `agent`."""
    opening = [{"role": "user", "content": item["prompt"]}]
    await _ask(client_kwargs, opening)
    return await agent(client_kwargs, item, opening)


async def edit_reply(client_kwargs: dict, item: dict) -> float:
    """Runs the calculator call it gets, then sends the conversation with the model's turn rewritten as its own
    text and the result as a user message (an agent that keeps its own history format)."""
    opening = [{"role": "user", "content": item["prompt"]}]
    reply = await _ask(client_kwargs, opening)
    result = calculate(json.loads(reply.tool_calls[0].function.arguments)["expression"])
    final = await _ask(client_kwargs, opening + [{"role": "assistant", "content": "=="},
                                                 {"role": "user", "content": result}])
    return float(final.content == item["answer"])


async def summarise(client_kwargs: dict, item: dict) -> float:
    """Runs the calculator call it gets, then starts over from one message holding the prompt and the result."""
    reply = await _ask(client_kwargs, [{"role": "user", "content": item["prompt"]}])
    result = calculate(json.loads(reply.tool_calls[0].function.arguments)["expression"])
    final = await _ask(client_kwargs, [{"role": "user", "content": item["prompt"] + result}])
    return float(final.content == item["answer"])


async def gives_up(client_kwargs: dict, item: dict) -> float:
    """Its first request times out (the test holds its turn until the gateway has seen the client go), and it
    sends the same request again, then goes on as `agent`."""
    opening = [{"role": "user", "content": item["prompt"]}]
    try:
        await _ask(client_kwargs, opening, timeout=0.5)
    except openai.APITimeoutError:
        pass
    return await agent(client_kwargs, item, opening)


async def gives_up_last(client_kwargs: dict, item: dict) -> float:
    """Its only request times out, and it returns 0 without the answer."""
    try:
        await _ask(client_kwargs, [{"role": "user", "content": item["prompt"]}], timeout=0.5)
    except openai.APITimeoutError:
        return 0.0
    return 1.0


async def relay(client_kwargs: dict, item: dict) -> float:
    """Asks the item's space-separated prompts in turn, each as a user message after the model's last answer."""
    messages = []
    for prompt in item["prompt"].split():
        messages.append({"role": "user", "content": prompt})
        reply = (await client(client_kwargs).chat.completions.create(model="policy", messages=messages)).choices[0]
        messages.append(reply.message.model_dump(exclude_none=True))
    return 1.0
