"""An OpenEnv environment server written against openenv-core's own API, for the tests: the tiny tool task
(three 3-digit numbers drawn from the reset seed; `==a+b+c=` asks the calculator, any other text is the answer:
reward 1 for the exact sum). `python -m uvicorn openenv_tiny_sums:app --port P` from this folder."""

import random

from openenv.core.env_server import Action, Environment, Observation, State, create_app


class SumsAction(Action):
    message: str


class SumsObservation(Observation):
    prompt: str = ""
    tool_result: str = ""


class SumsEnv(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state, self.answer = State(step_count=0), ""

    def reset(self, seed=None, episode_id=None, **kwargs) -> SumsObservation:
        terms = [random.Random(f"{seed}/{k}").randint(100, 999) for k in range(3)]
        self._state, self.answer = State(episode_id=episode_id, step_count=0), str(sum(terms))
        return SumsObservation(prompt="+".join(map(str, terms)) + "=")

    def step(self, action: SumsAction, timeout_s=None, **kwargs) -> SumsObservation:
        self._state.step_count += 1
        text = action.message
        if text.startswith("==") and text.endswith("=") and len(text) > 3:
            terms = text[2:-1].split("+")
            return SumsObservation(tool_result=str(sum(map(int, terms))) if all(t.isdigit() for t in terms) else "*")
        return SumsObservation(done=True, reward=1.0 if text == self.answer else 0.0)

    @property
    def state(self) -> State:
        return self._state


app = create_app(SumsEnv, SumsAction, SumsObservation, env_name="tiny_sums", max_concurrent_envs=512)
