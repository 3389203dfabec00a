"""The tiny tool task's agent written with the OpenAI Agents SDK (`openai-agents`): an `Agent` with a calculator
`function_tool`, run by `Runner.run` (or `Runner.run_streamed`: `streamed`) on the SDK's chat-completions model
pointed at the gateway. Tracing is off (it would export to OpenAI's servers). Its reward: 1 for the exact sum as
the final output."""

from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
from agents.exceptions import MaxTurnsExceeded
from calculator_agent import calculate, client

set_tracing_disabled(True)


@function_tool
def calculator(expression: str) -> str:
    """Sum the numbers of an expression like 123+456+789."""
    return calculate(expression)


async def agent(client_kwargs: dict, item: dict) -> float:
    model = OpenAIChatCompletionsModel(model="policy", openai_client=client(client_kwargs))
    summer = Agent(name="summer", instructions=None, tools=[calculator], model=model)
    try:
        result = await Runner.run(summer, item["prompt"], max_turns=3)
    except MaxTurnsExceeded:
        return 0.0
    return float(str(result.final_output) == item["answer"])


async def streamed(client_kwargs: dict, item: dict) -> float:
    """The same agent run by `Runner.run_streamed`: its model calls are `stream=True` requests."""
    model = OpenAIChatCompletionsModel(model="policy", openai_client=client(client_kwargs))
    summer = Agent(name="summer", instructions=None, tools=[calculator], model=model)
    result = Runner.run_streamed(summer, item["prompt"], max_turns=3)
    try:
        async for _ in result.stream_events():
            pass
    except MaxTurnsExceeded:
        return 0.0
    return float(str(result.final_output) == item["answer"])
