"""`pipelinerl actor`: prompts in, G attempts each, rewards, whole groups out to the rollout stream.

Parts: `client` (the completions client: server pool, HTTP, retries, parsing), `scheduler` (the `Actor` and
`run_actor`: lag throttle, write ordering, evaluation), `rewards` (reward.kind=model: the reward servers' inputs
and scores).

Token in, token out: the actor tokenizes each prompt once with the model's chat template and sends the
ids to `/v1/completions`; the servers return completion token ids, their log-probs and the policy
version of every token (`policy_versions`), which go to the stream unchanged: no re-tokenisation
between generation and training.

Reference log-probs. When the RL objective needs them (`rl.needs_reference_logprobs`), each group's
G prompt + completion sequences go, as one request, to a reference server (RUN_DIR/reference_servers/,
the frozen initial model): vLLM's `prompt_logprobs` give every token's log-prob given what precedes it,
and the completion positions become the stream's `reference_logprobs`.

Reward models. With reward.kind=model each group's G prompt + completion sequences go, as one request, to a
reward server (RUN_DIR/reward_servers/, `POST /classify`); its scores are the rows' rewards, and the task's own
check of each completion is kept in the row's metadata (`verified_reward`) and logged as actor/verified_success.
A group is written once, after its scores arrived: a retried scoring request never writes a row twice.
"""

from pipelinerl.actor.client import Completion, CompletionsClient
from pipelinerl.actor.pool import ServerPool

# The Actor itself is imported from pipelinerl.actor.scheduler: the scheduler uses pipelinerl.eval, whose eval sets
# use this package's client, so importing the scheduler here would make `import pipelinerl.eval.sets` circular.
__all__ = ["Completion", "CompletionsClient", "ServerPool"]
