"""A single-turn verifiers (v1) environment for the tests whose reward is an LLM judge's verdict: the tiny
addition task, the judge asked through a `vf.Judge` whose endpoint is JUDGE_URL (the run's judge servers)."""

import random

import verifiers.v1 as vf

from pipelinerl.envs.verifiers_judge import JUDGE_URL


class YesJudge(vf.Judge[float]):
    prompt = "Q: {question} A: {answer} R: {response}"

    def parse(self, response: vf.JudgeResponse) -> float:
        return float(response.text.strip() == "yes")


class JudgedData(vf.TaskData):
    answer: str


class JudgedTask(vf.Task[JudgedData]):
    @vf.reward
    async def judged(self, trace: vf.Trace) -> float:
        judge = YesJudge(vf.JudgeConfig(base_url=JUDGE_URL, model="a-judge"))
        verdict = await judge.evaluate(trace=trace, question=self.data.prompt, answer=self.data.answer,
                                       response=trace.last_reply or "")
        return verdict.parsed


class JudgedConfig(vf.TasksetConfig):
    num_rows: int = 20


class JudgedTaskset(vf.Taskset[JudgedTask, JudgedConfig]):
    def load(self):
        rng = random.Random("vf_tiny_judged")
        for i in range(self.config.num_rows):
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            yield JudgedTask(JudgedData(id=f"judged-{i}", prompt=f"{a}+{b}=", answer=str(a + b)[::-1]),
                             self.config.task)


__all__ = ["JudgedTaskset"]
