"""Every server schedules by request priority (evaluation requests carry actor.eval_priority: tests/test_actor.py),
and a config asking for another policy is refused."""

import pytest

from pipelinerl.config import load_config


def test_every_server_schedules_by_priority_and_another_policy_is_refused(tmp_path):
    from pipelinerl.config import ConfigError
    from pipelinerl.inference.vllm_glue.serving import parse_vllm_args, vllm_argv

    def argv(*overrides, kind="policy"):
        return vllm_argv(load_config(None, [f"run_dir={tmp_path}", "model.path=m", "inference.max_model_len=64",
                                            *overrides]), "127.0.0.1", 1, kind)

    assert parse_vllm_args(argv()).scheduling_policy == "priority"
    assert parse_vllm_args(argv("inference.engine_args.scheduling_policy=priority")).scheduling_policy == "priority"
    with pytest.raises(ConfigError, match="inference.engine_args.scheduling_policy"):
        argv("inference.engine_args.scheduling_policy=fcfs")


def test_reward_servers_parse_with_vllms_own_parser_pooling_for_a_model_generation_for_a_judge(tmp_path):
    """`serve --reward`'s command line, read by vLLM's own argument parser: a reward model on the pooling runner
    within max_model_len, a judge on the default (generate) runner at its model's own length; both on their
    folder (reward.model_path), by priority, without the policy's weight-transfer engine or logprobs mode."""
    from pipelinerl.inference.vllm_glue.serving import parse_vllm_args, vllm_argv

    def parsed(kind):
        cfg = load_config(None, [f"run_dir={tmp_path}", "model.path=m", "inference.max_model_len=64",
                                 f"reward.kind={kind}", "reward.model_path=/rm"])
        return parse_vllm_args(vllm_argv(cfg, "127.0.0.1", 1, "reward"))

    model, judge = parsed("model"), parsed("judge")
    assert (model.model, model.runner, model.max_model_len) == ("/rm", "pooling", 64)
    assert (judge.model, judge.runner, judge.max_model_len) == ("/rm", "auto", None)
    for args in (model, judge):
        assert args.scheduling_policy == "priority" and args.worker_extension_cls in ("", None)
        assert args.logprobs_mode != "processed_logprobs"


def test_a_teacher_server_serves_rl_teacher_and_returns_the_top_k_it_is_asked_for(tmp_path):
    """rl.teacher_top_k above vLLM's default --max-logprobs (VLLM_MAX_LOGPROBS, checked against vLLM's own
    parser) raises it on the reference servers, which serve the teacher; within it the default stands."""
    from pipelinerl.inference.vllm_glue.serving import VLLM_MAX_LOGPROBS, parse_vllm_args, vllm_argv

    def parsed(k):
        cfg = load_config(None, [f"run_dir={tmp_path}", "model.path=m", "inference.max_model_len=64",
                                 "rl.teacher=/teacher", f"rl.teacher_top_k={k}"])
        return parse_vllm_args(vllm_argv(cfg, "127.0.0.1", 1, "reference"))

    assert parsed(8).max_logprobs == VLLM_MAX_LOGPROBS
    assert (parsed(32).model, parsed(32).max_logprobs) == ("/teacher", 32)


def test_an_eval_servers_command_line_is_the_policy_servers(tmp_path):
    """`serve --eval` runs vLLM exactly as a policy server does, read by vLLM's own parser: the policy's model, its
    weight-transfer engine and worker extension, its processed log-probs."""
    from pipelinerl.inference.vllm_glue import ENGINE_NAME, WORKER_EXTENSION
    from pipelinerl.inference.vllm_glue.serving import parse_vllm_args, vllm_argv

    cfg = load_config(None, [f"run_dir={tmp_path}", "model.path=m", "inference.max_model_len=64",
                             "inference.eval_servers=1", "rl.teacher=/teacher", "reward.kind=model",
                             "reward.model_path=/rm"])
    assert vllm_argv(cfg, "127.0.0.1", 1, "eval") == vllm_argv(cfg, "127.0.0.1", 1, "policy")
    args = parse_vllm_args(vllm_argv(cfg, "127.0.0.1", 1, "eval"))
    assert (args.model, args.max_model_len, args.logprobs_mode) == ("m", 64, "processed_logprobs")
    assert args.worker_extension_cls == WORKER_EXTENSION and args.weight_transfer_config.backend == ENGINE_NAME
