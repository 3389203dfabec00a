"""Every server schedules by request priority (evaluation requests carry actor.eval_priority: tests/test_actor.py),
and a config asking for another policy is refused."""

import pytest

from pipelinerl.config import load_config


def test_every_server_schedules_by_priority_and_another_policy_is_refused(tmp_path):
    from pipelinerl.config import ConfigError
    from pipelinerl.inference.vllm_glue.serving import parse_vllm_args, vllm_argv

    def argv(*overrides):
        return vllm_argv(load_config(None, [f"run_dir={tmp_path}", "model.path=m", "inference.max_model_len=64",
                                            *overrides]), "127.0.0.1", 1, reference=False)

    assert parse_vllm_args(argv()).scheduling_policy == "priority"
    assert parse_vllm_args(argv("inference.engine_args.scheduling_policy=priority")).scheduling_policy == "priority"
    with pytest.raises(ConfigError, match="inference.engine_args.scheduling_policy"):
        argv("inference.engine_args.scheduling_policy=fcfs")
