"""calculator_agent's loop as a command-line program (task.agent.command), on the synchronous `openai` client:
it reads OPENAI_BASE_URL / OPENAI_API_KEY as any openai program does, its item from PIPELINERL_ITEM, and prints
its reward. `--fail` exits 1 after its first turn; `--hang` sleeps after it."""

import json
import os
import sys
import time

import openai
from calculator_agent import CALCULATOR, calculate


def main() -> None:
    item = json.loads(os.environ["PIPELINERL_ITEM"])
    client = openai.OpenAI(max_retries=0)
    messages = [{"role": "user", "content": item["prompt"]}]
    for _ in range(3):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR]).choices[0].message
        if "--fail" in sys.argv:
            sys.exit("failed on purpose")  # exit code 1, the message on stderr
        if "--hang" in sys.argv:
            time.sleep(3600)
        messages.append(reply.model_dump(exclude_none=True))
        if not reply.tool_calls:
            print(float(reply.content == item["answer"]))
            return
        for call in reply.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": calculate(json.loads(call.function.arguments)["expression"])})
    print(0.0)


if __name__ == "__main__":
    main()
