"""A verifiers environment's judges answered by the run's judge servers (reward.kind=judge).

A verifiers `vf.Judge` calls an OpenAI-compatible endpoint of its config (`vf.JudgeConfig.base_url`). A judge
whose base_url is JUDGE_URL is answered by the run's own judge servers instead: the reward servers that
reward.kind=judge starts (`serve --reward`, the instruct model of reward.model_path), through the actor's
completions client, so each call goes to the least-loaded judge server and is retried on another one when its
server fails, as the actor's own judge calls are. The body is the judge's chat completion less its `model` (a
judge server serves one model). verifiers builds each judge call's client with `build_async_openai`: this module
replaces it, for JUDGE_URL only, by a client whose transport is ROUTE; any other base_url reaches its endpoint
as before. The actor hands ROUTE its client when it starts (`VerifiersTask.use_servers`); outside an actor (no
judge servers) such a judge fails, and its rollout ends as an environment error that says why.
"""

from __future__ import annotations

import json

import httpx
import openai
import verifiers.v1.judge as vf_judge

JUDGE_URL = "http://pipelinerl.judge.invalid/v1"  # a judge config's base_url that selects the run's judge servers


class JudgeRoute(httpx.AsyncBaseTransport):
    """The transport of JUDGE_URL's clients: each POST .../chat/completions to a judge server of `client`
    (actor.client.CompletionsClient, built with reward=True) over `http`, once `use` has set them."""

    def __init__(self):
        self.client, self.http = None, None

    def use(self, client, http: httpx.AsyncClient) -> None:
        self.client, self.http = client, http

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if self.client is None or self.client.reward_pool is None:
            return httpx.Response(503, json={"error": {"message": f"a judge at {JUDGE_URL} is answered by the run's "
                                                                  "judge servers: set reward.kind=judge and "
                                                                  "reward.model_path (the judge model)"}})
        if not request.url.path.endswith("/chat/completions"):
            return httpx.Response(404, json={"error": {"message": "the judge servers answer chat completions only"}})
        body = {k: v for k, v in json.loads(request.content).items() if k != "model"}
        return httpx.Response(200, json=await self.client.chat(self.http, body))


ROUTE = JudgeRoute()
_build_async_openai = vf_judge.build_async_openai


def _judge_client(config) -> openai.AsyncOpenAI:
    """verifiers' judge client factory: ROUTE's for JUDGE_URL, verifiers' own for any other endpoint."""
    if getattr(config, "base_url", None) != JUDGE_URL:
        return _build_async_openai(config)
    return openai.AsyncOpenAI(base_url=JUDGE_URL, api_key="pipelinerl", max_retries=0,
                              http_client=httpx.AsyncClient(transport=ROUTE))


vf_judge.build_async_openai = _judge_client  # Judge.complete looks the factory up in its module at each call
