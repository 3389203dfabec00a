"""A single-turn verifiers (v1) environment for the tests: the tiny addition task (two 2-digit numbers, the
sum written units-first, as tasks/addition.py), no tools, two weighted reward functions."""

import random

import verifiers.v1 as vf


class AddData(vf.TaskData):
    answer: str


class AddTask(vf.Task[AddData]):
    @vf.reward(weight=1.0)
    async def exact(self, trace: vf.Trace) -> float:
        return float((trace.last_reply or "") == self.data.answer)

    @vf.reward(weight=0.5)
    async def right_length(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply or "") == len(self.data.answer))


class AddConfig(vf.TasksetConfig):
    num_rows: int = 200


class AddTaskset(vf.Taskset[AddTask, AddConfig]):
    def load(self):
        rng = random.Random("vf_tiny_add")
        for i in range(self.config.num_rows):
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            yield AddTask(AddData(id=f"add-{i}", prompt=f"{a}+{b}=", answer=str(a + b)[::-1]), self.config.task)


__all__ = ["AddTaskset"]
