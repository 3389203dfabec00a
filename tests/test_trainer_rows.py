"""Stream rows -> trainer samples: advantages, lags and indices against hand-computed values."""

import pytest

from pipelinerl.config import ConfigError, load_config
from pipelinerl.streams.schema import group_batch
from pipelinerl.trainer.dist import DistInfo
from pipelinerl.trainer.loop import check_supported, rows_to_samples


def _group(gid, rewards, versions):
    return group_batch([
        {"run_id": "r", "group_id": gid, "sample_id": f"{gid}-{i}", "prompt_token_ids": [1, 5],
         "completion_token_ids": [4 + i] * len(v), "behaviour_logprobs": [-0.5 * (i + 1)] * len(v), "versions": v,
         "reward": r, "finished": True, "truncated": False, "task": "t", "actor_id": "a"}
        for i, (r, v) in enumerate(zip(rewards, versions))])


def test_rows_become_samples_with_group_advantages_and_lags():
    cfg = load_config(None, ["run_dir=x", "model.path=m", "actor.attempts=2", "trainer.samples_per_step=4"])
    batches = [_group("a", [1.0, 0.0], [[3, 4], [4]]), _group("b", [0.5, 0.5], [[2], [2, 2, 4]])]
    samples = rows_to_samples(batches, version=5, first_index=10, cfg=cfg)
    assert [s.index for s in samples] == [10, 11, 12, 13]
    assert [s.token_fields["advantage"] for s in samples] == [[0.5, 0.5], [-0.5], [0.0], [0.0, 0.0, 0.0]]
    assert [s.token_fields["lag"] for s in samples] == [[2, 1], [1], [3], [3, 3, 1]]
    assert samples[1].token_fields["behaviour"] == [-1.0]
    assert [s.token_fields["group"][0] for s in samples] == [0, 0, 1, 1]
    assert samples[0].prompt_ids == [1, 5] and samples[3].completion_ids == [5, 5, 5]


def test_dpo_roles_mark_the_best_and_worst_attempt():
    cfg = load_config(None, ["run_dir=x", "model.path=m", "actor.attempts=3", "trainer.samples_per_step=3",
                             "rl.algorithm=dpo"])
    samples = rows_to_samples([_group("a", [0.2, 0.9, 0.1], [[0], [0], [0]])], version=0, first_index=0, cfg=cfg)
    assert [s.token_fields["advantage"][0] for s in samples] == [0.0, 1.0, -1.0]


def test_unsupported_configs_fail_before_loading_anything():
    two = DistInfo(rank=0, world_size=2, local_rank=0, backend="gloo")
    cfg = load_config(None, ["run_dir=x", "model.path=m", "actor.attempts=4", "trainer.samples_per_step=12"])
    with pytest.raises(ConfigError, match="multiple of the rank count"):
        check_supported(cfg, two)  # 3 groups over 2 ranks
    cfg = load_config(None, ["run_dir=x", "model.path=m", "rl.kl_coef=0.1"])
    with pytest.raises(ConfigError, match="reference"):
        check_supported(cfg, DistInfo(rank=0, world_size=1, local_rank=0, backend="gloo"))
