"""A text-completions agent as users write them for base models, on the plain `openai` client: it writes the whole
text itself, a ReAct loop in the tiny alphabet. The model asks for the calculator by writing a sum and STOP (the
request's stop string, left out of the completion as OpenAI's API does); the agent writes STOP back, the sum's
value and "=", and asks again. A completion that is not a sum is the final answer: reward 1 for the exact sum.
`rewrites` is the tests' variant that goes back: its second prompt drops the model's text for one of its own."""

from calculator_agent import calculate, client

STOP = "*"


async def agent(client_kwargs: dict, item: dict) -> float:
    openai_client, text = client(client_kwargs), item["prompt"]
    for _ in range(3):
        completion = (await openai_client.completions.create(model="policy", prompt=text, stop=[STOP],
                                                             max_tokens=16)).choices[0].text
        if "+" not in completion:
            return float(completion == item["answer"])
        text += completion + STOP + calculate(completion) + "="
    return 0.0


async def rewrites(client_kwargs: dict, item: dict) -> float:
    """Asks once, then goes on from its prompt followed by a sum of its own, not the model's."""
    openai_client = client(client_kwargs)
    await openai_client.completions.create(model="policy", prompt=item["prompt"], stop=STOP)
    text = item["prompt"] + "1+2" + STOP + calculate("1+2") + "="
    completion = (await openai_client.completions.create(model="policy", prompt=text, stop=STOP)).choices[0].text
    return float(completion == "3")
