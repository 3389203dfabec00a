"""A verifiers (v1) environment written against verifiers' own API, for the tests and the docs' example
(docs/guides/environments.md): the tool_sums task (three 3-digit numbers summed with a calculator, in the tiny
model's alphabet) with the calculator as a shared MCP tool server, two reward functions and a stop condition.
verifiers loads it by its module name (`task.verifiers.env=vf_tiny_sums`, this folder on PYTHONPATH) and starts
its tool server as `python -m vf_tiny_sums`."""

import random

import verifiers.v1 as vf


class SumsData(vf.TaskData):
    answer: str


class Calculator(vf.Toolset[vf.ToolsetConfig]):
    TOOL_PREFIX = None  # the model calls it `calculator`, as the compact format writes

    @vf.tool
    def calculator(self, expression: str) -> str:
        """Sum the numbers of an expression like 123+456+789 (`*` when it is not one)."""
        terms = expression.split("+")
        return str(sum(map(int, terms))) if all(t.isdigit() for t in terms) else "*"


class SumsTaskConfig(vf.TaskConfig):
    raise_in_reward: bool = False  # the reward function raises (the tests' failing environments)
    raise_in_setup: bool = False  # the task's setup raises: the rollout fails before its first model call


class SumsTask(vf.Task[SumsData, vf.State, SumsTaskConfig]):
    async def setup(self, trace, runtime) -> None:
        if self.config.raise_in_setup:
            raise OSError("the task's setup failed on purpose")

    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        if self.config.raise_in_reward:
            raise ValueError("the reward function failed on purpose")
        return float((trace.last_reply or "").strip() == self.data.answer)

    @vf.reward(weight=0.0)
    async def called_calculator(self, trace: vf.Trace) -> float:
        return float(len(trace.tool_messages) > 0)

    @vf.stop
    async def three_tool_calls(self, trace: vf.Trace) -> bool:
        return len(trace.tool_messages) >= 3


class SumsConfig(vf.TasksetConfig):
    task: SumsTaskConfig = SumsTaskConfig()
    tools: vf.SharedToolsetConfig = vf.SharedToolsetConfig()
    split: str = "train"
    num_rows: int = 2000


class SumsTaskset(vf.Taskset[SumsTask, SumsConfig]):
    @classmethod
    def toolsets(cls, config: SumsConfig) -> list[vf.Toolset]:
        return [Calculator(config.tools)]

    def load(self):
        rng = random.Random(f"vf_tiny_sums/{self.config.split}")
        for i in range(self.config.num_rows):
            terms = [rng.randint(100, 999) for _ in range(3)]
            expression = "+".join(map(str, terms))
            yield SumsTask(SumsData(id=f"{self.config.split}-{i}", prompt=f"{expression}=", answer=str(sum(terms))),
                           self.config.task)


__all__ = ["SumsTaskset"]

if __name__ == "__main__":
    Calculator.run()
