"""`pipelinerl` entry point (also `python -m pipelinerl`): parse, build, run. Heavy libraries are imported
inside each command so that `pipelinerl --help` and `show-config` answer instantly.

Every command that runs a role takes the config the same way: `CONFIG [key=value ...]`, the overrides
before or after the command's options."""

from __future__ import annotations

import argparse
import os
import sys

from pipelinerl.config import Config, ConfigError, TinyModelConfig, load_config, to_doc_yaml, to_yaml
from pipelinerl.logs import setup_logging


def _add_config_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", metavar="CONFIG", help="YAML config file (configs/*.yaml)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="config overrides, e.g. trainer.lr=1e-5 run_dir=runs/x (also after the options)")


class _VersionAction(argparse.Action):
    """`--version`: reads the installed version only when asked (importlib.metadata is not free)."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help="print the version and exit")

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        import pipelinerl

        print(f"pipelinerl {pipelinerl.__version__}")
        parser.exit()


def cmd_show_config(args: argparse.Namespace) -> None:
    render = to_doc_yaml if args.doc else to_yaml
    print(render(load_config(args.config, args.overrides)), end="")


def cmd_make_tiny_model(args: argparse.Namespace) -> None:
    shape = TinyModelConfig(seed=args.seed, num_experts=args.experts)
    kind = f"Qwen3-MoE ({args.experts} experts, top-{shape.experts_per_token})" if args.experts else "Qwen2"
    if args.reward_model:
        if args.experts:
            raise SystemExit("make-tiny-model: --experts builds a policy; the tiny reward model is dense")
        from pipelinerl.config import TaskConfig
        from pipelinerl.tiny.reward_model import build_tiny_reward_model

        r = build_tiny_reward_model(args.out_dir, shape, TaskConfig(name=args.task, seed=args.seed), seed=args.seed)
        kinds = ", ".join(f"{kind} {accuracy:.3f}" for kind, accuracy in r["heldout_by_kind"].items())
        print(f"tiny reward model ({r['parameters']:,} parameters, seed {args.seed}) saved to {args.out_dir}, trained "
              f"on {args.task}: {r['steps']} steps in {r['seconds']:.0f} s, loss {r['first_loss']:.3f} -> "
              f"{r['last_loss']:.3f}, held-out pairwise accuracy {r['heldout_accuracy']:.3f} ({kinds})")
        return
    if args.warm_start:
        from pipelinerl.config import TaskConfig
        from pipelinerl.tiny.warm_start import build_warm_tiny_model

        result = build_warm_tiny_model(args.out_dir, shape, TaskConfig(name=args.task, seed=args.seed))
        print(f"tiny {kind} model saved to {args.out_dir}, warm-started on {args.task}: {result['steps']} steps in "
              f"{result['seconds']:.0f} s, held-out greedy success {result['heldout_greedy']:.3f}")
        return
    from pipelinerl.tiny.model import build_tiny_model

    model, _ = build_tiny_model(args.out_dir, shape)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"tiny {kind} model ({n_params:,} parameters, seed {args.seed}) saved to {args.out_dir}")


def cmd_streams_inspect(args: argparse.Namespace) -> None:
    import json

    from pipelinerl.streams import format_inspect, inspect

    try:
        report = inspect(args.run_dir)
    except FileNotFoundError as err:
        raise SystemExit(f"pipelinerl streams inspect: error: {err}") from None
    print(json.dumps(report, indent=2) if args.json else format_inspect(report))


def cmd_status(args: argparse.Namespace) -> None:
    from pipelinerl.launch.status import show

    try:
        show(args.run_dir, args.watch, args.json)
    except FileNotFoundError as err:
        raise SystemExit(f"pipelinerl status: error: {err}") from None
    except KeyboardInterrupt:
        pass


def cmd_serve(args: argparse.Namespace) -> None:
    from pipelinerl.inference.server import serve
    from pipelinerl.rundir import POLICY_KINDS

    overrides = list(args.overrides)
    if args.model is not None:
        overrides.append(f"model.path={args.model}")
    if args.run_dir is not None:
        overrides.append(f"run_dir={args.run_dir}")
    kind = "reference" if args.reference else "reward" if args.reward else "eval" if args.eval else "policy"
    if kind not in POLICY_KINDS and args.version != 0:
        raise ConfigError(f"--version is the policy version of a policy server's weights; a {kind} server serves "
                          "a frozen model: drop --version")
    cfg = load_config(args.config, overrides)
    serve(cfg, args.port if args.port is not None else cfg.inference.base_port, args.version, kind)


def cmd_openenv_serve(args: argparse.Namespace) -> None:
    from pipelinerl.envs.openenv_server import serve
    from pipelinerl.launch.commands import server_port

    cfg = load_config(args.config, args.overrides)
    if not cfg.task.openenv.serve:
        raise ConfigError("config `task.openenv.serve`: openenv-serve serves it; set it to the app, module:app")
    serve(cfg, args.port if args.port is not None else server_port(cfg, 0, "openenv"))


# `train --nproc` takes the first free port from here for rank 0; PIPELINERL_MASTER_PORT_BASE moves the range
# (runs started side by side, e.g. the test suite's workers, each in a range of their own).
MASTER_PORT_BASE = 29400


def cmd_train(args: argparse.Namespace) -> None:
    cfg = load_config(args.config, args.overrides)
    if args.nproc is None:
        from pipelinerl.trainer.dist import close_process_group
        from pipelinerl.trainer.loop import train

        train(cfg)
        close_process_group()
        return
    from pipelinerl.launch.placement import parse_gpu_ids
    from pipelinerl.launch.procs import free_port
    from pipelinerl.launch.ranks import run_ranks

    argv = [sys.executable, "-m", "pipelinerl.cli", "train", args.config, *args.overrides]
    gpus = parse_gpu_ids(args.gpus) if args.gpus else None
    # Outside the kernel's ephemeral range (32768-60999), which busy HTTP clients churn through.
    base = int(os.environ.get("PIPELINERL_MASTER_PORT_BASE", MASTER_PORT_BASE))
    code = run_ranks(argv, args.nproc, args.master_port or free_port(base), gpus)
    if code:
        raise SystemExit(code)


def cmd_actor(args: argparse.Namespace) -> None:
    from pipelinerl.actor.scheduler import run_actor

    run_actor(load_config(args.config, args.overrides), args.actor_id)


def cmd_run(args: argparse.Namespace) -> None:
    from pipelinerl.launch.local import run_local

    run_local(load_config(args.config, args.overrides), dry_run=args.dry_run)


def trainer_ranks(cfg: Config) -> int:
    """The trainer ranks the config's launcher would start, for `pipelinerl plan`: trainer.num_gpus, else as
    that launcher's placement derives them."""
    if cfg.trainer.num_gpus is not None:
        return cfg.trainer.num_gpus
    if cfg.launch.backend == "slurm":
        from pipelinerl.launch.slurm import trainer_ranks as job_ranks

        return job_ranks(cfg)
    from pipelinerl.launch.local import machine_gpus, placement

    return placement(cfg, machine_gpus()).trainer_ranks


def cmd_plan(args: argparse.Namespace) -> None:
    import json

    from pipelinerl.plan.memory import SKIPPED, plan_for

    overrides = list(args.overrides)
    if args.gpu_memory_gb is not None:
        overrides.append(f"launch.gpu_memory_gb={args.gpu_memory_gb}")
    cfg = load_config(args.config, overrides)
    plan = plan_for(cfg, trainer_ranks(cfg))
    if plan is None:
        print(f"{SKIPPED}; give --gpu-memory-gb to plan for a GPU", file=sys.stderr)
        return
    print(json.dumps(plan.to_json(), indent=2) if args.json else plan.render())
    if not plan.fits:
        for problem in plan.problems:
            print(f"pipelinerl plan: does not fit: {problem}", file=sys.stderr)
        raise SystemExit(1)


def cmd_eval(args: argparse.Namespace) -> None:
    from pipelinerl.eval.command import run_eval

    run_eval(args.target, args.overrides, config=args.config, step=args.step, sets=[args.sets], samples=args.samples,
             temperature=args.temperature, greedy=not args.no_greedy, out=args.out)


def cmd_slurm(args: argparse.Namespace) -> None:
    from pipelinerl.launch.slurm_cli import main as slurm_main

    slurm_main(args.slurm_args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pipelinerl", description="Reinforcement learning for LLMs with in-flight weight updates.")
    parser.add_argument("--version", action=_VersionAction)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                help="`pipelinerl COMMAND --help` describes each")

    p = sub.add_parser("show-config", help="print the resolved config (YAML + overrides) as YAML")
    _add_config_args(p)
    p.add_argument("--doc", action="store_true",
                   help="with each field's unit and meaning as a comment (the same YAML data)")
    p.set_defaults(func=cmd_show_config)

    p = sub.add_parser("make-tiny-model", help="build the offline tiny Qwen2 (or Qwen3-MoE) model + tokenizer "
                                                            "(HF format)")
    p.add_argument("out_dir", help="folder to write (replaced if it exists)")
    p.add_argument("--seed", type=int, default=0, help="initialisation and data seed (default 0)")
    p.add_argument("--experts", type=int, default=0,
                   help="a Qwen3-MoE model with this many routed experts per layer, top-2 (default 0: dense Qwen2)")
    kind = p.add_mutually_exclusive_group()
    kind.add_argument("--warm-start", action="store_true",
                      help="then train it briefly (supervised) on --task so RL starts above 0 success")
    kind.add_argument("--reward-model", action="store_true",
                      help="build a tiny reward model instead: the same shape with a one-logit head, trained to score "
                           "--task's correct answers above wrong ones (vLLM serves it with --runner pooling)")
    p.add_argument("--task", choices=("addition", "arithmetic", "tool_sums"), default="addition",
                   help="the tiny task of --warm-start or --reward-model (default addition; a reward model: addition "
                        "or arithmetic)")
    p.set_defaults(func=cmd_make_tiny_model)

    p = sub.add_parser("streams", help="rollout stream tools")
    streams = p.add_subparsers(dest="streams_command", required=True, metavar="STREAMS_COMMAND",
                               help="`pipelinerl streams STREAMS_COMMAND --help` describes each")
    p = streams.add_parser("inspect", help="per-writer counts, tokens, reward mean and lag histograms")
    p.add_argument("run_dir", help="the run directory (its streams/ folder is read, never modified)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=cmd_streams_inspect)

    p = sub.add_parser("status", help="how a run is doing, from its run directory alone: roles, restarts, servers' "
                                      "versions and health, the trainer's step, the actors, long waits, last errors")
    p.add_argument("run_dir", help="the run directory (read only: works on a login node and on a finished run)")
    p.add_argument("--watch", type=float, nargs="?", const=2.0, default=None, metavar="S",
                   help="refresh every S seconds (default 2) until Ctrl-C")
    p.add_argument("--json", action="store_true", help="print everything as JSON")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("serve", help="run one vLLM inference server with in-flight weight updates")
    _add_config_args(p)
    p.add_argument("--model", default=None, help="HF-format model folder to serve (default: the config's model.path)")
    p.add_argument("--port", type=int, default=None, help="TCP port (default: inference.base_port)")
    p.add_argument("--run-dir", default=None, help="run directory: auth token + discovery (or run_dir=)")
    p.add_argument("--version", type=int, default=0, help="policy version of the weights loaded (default 0)")
    kind = p.add_mutually_exclusive_group()
    kind.add_argument("--reference", action="store_true",
                      help="a frozen reference server for reference log-probs: announced in "
                           "RUN_DIR/reference_servers/, refuses weight updates")
    kind.add_argument("--reward", action="store_true",
                      help="a reward server of reward.model_path (vLLM's pooling runner, POST /classify): announced "
                           "in RUN_DIR/reward_servers/, refuses weight updates")
    kind.add_argument("--eval", action="store_true",
                      help="an eval server (inference.eval_servers): a policy server that only evaluates, announced in "
                           "RUN_DIR/eval_servers/ (the trainer updates it over a weight group of its own)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("openenv-serve", help="run one OpenEnv environment server of task.openenv.serve (uvicorn), "
                                             "announced in RUN_DIR/openenv_servers/ once its /health answers")
    _add_config_args(p)
    p.add_argument("--port", type=int, default=None,
                   help="TCP port (default: the first OpenEnv server's, after every vLLM server's)")
    p.set_defaults(func=cmd_openenv_serve)

    p = sub.add_parser("train", help="run one trainer rank (RANK, WORLD_SIZE, ... from torchrun or srun), or "
                                     "--nproc local ranks")
    _add_config_args(p)
    p.add_argument("--nproc", type=int, default=None,
                   help="start this many ranks on this machine (gloo on CPU, one GPU each with --gpus) and wait")
    p.add_argument("--gpus", default=None, help="with --nproc: the ranks' GPU ids, e.g. 4-7 (rank r uses the r-th)")
    p.add_argument("--master-port", type=int, default=None,
                   help=f"with --nproc: rank 0's port (default: the first free one from {MASTER_PORT_BASE})")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("actor", help="run one actor: prompts -> servers -> rewards -> rollout stream")
    _add_config_args(p)
    p.add_argument("--actor-id", default="actor0", help="unique name of this actor (its stream writer id)")
    p.set_defaults(func=cmd_actor)

    p = sub.add_parser("run", help="run the whole pipeline on this machine (servers, trainer, actor)")
    _add_config_args(p)
    p.add_argument("--dry-run", action="store_true", help="print where each role runs and its command; start nothing")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("plan", help="per role and per GPU, the memory a config needs (weights, update staging, KV "
                                    "cache, ZeRO shards, activations, log-prob chunk); exit 1 if it does not fit")
    _add_config_args(p)
    p.add_argument("--gpu-memory-gb", type=float, default=None,
                   help="memory of one GPU in GB (10^9 bytes); default launch.gpu_memory_gb, else nvidia-smi's")
    p.add_argument("--json", action="store_true",
                   help='print {"gpu_memory_gb", "fits", "roles": {role: {"per_gpu_gb", "items"}}} instead of a table')
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("eval", help="evaluate a checkpoint on the task's held-out items with its own servers: pass@k, "
                                    "mean length, truncation rate; a JSON report and a table")
    p.add_argument("target", metavar="CHECKPOINT_OR_RUN_DIR",
                   help="a run directory (its latest checkpoint, or --step) or an HF model folder (a checkpoint's hf/)")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="config overrides, e.g. actor.eval_samples=500 actor.sampling.max_new_tokens=4096 (also "
                        "after the options)")
    p.add_argument("--config", default=None,
                   help="config file (default: the run's config.yaml; required for a model folder outside a run)")
    p.add_argument("--step", type=int, default=None, help="with a run directory: the checkpoint of this step")
    p.add_argument("--sets", default="default", metavar="A,B",
                   help="comma-separated eval sets: `default` (the task's held-out split) and names of task.eval_sets")
    p.add_argument("--samples", type=int, default=0,
                   help="sampled completions per item (pass@k for k = 1, 2, 4, ... up to it); 0 = greedy only")
    p.add_argument("--temperature", type=float, default=None,
                   help="temperature of the sampled completions (default actor.sampling.temperature)")
    p.add_argument("--no-greedy", action="store_true", help="skip the greedy (n = 1, temperature 0) evaluation")
    p.add_argument("--out", default=None,
                   help="JSON report path (default RUN_DIR/eval/step_<K>.json, or ./eval_report.json outside a run)")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("slurm", add_help=False,
                       help="Slurm: script | launch | servers | submit (`pipelinerl slurm --help`)")
    p.add_argument("slurm_args", nargs=argparse.REMAINDER, metavar="...",
                   help="arguments of `pipelinerl slurm` (see `pipelinerl slurm --help`)")
    p.set_defaults(func=cmd_slurm)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse a command line; `key=value` overrides may come before or after the command's options."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["slurm"]:  # everything after it is the Slurm tool's own command line, options first too
        return argparse.Namespace(command="slurm", func=cmd_slurm, slurm_args=argv[1:])
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # argparse fills `overrides` with the key=value items before the first option only; take the rest too.
    # (parse_intermixed_args would, but it refuses subcommands.)
    if extra and hasattr(args, "overrides") and all("=" in x and not x.startswith("-") for x in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank = os.environ.get("RANK") if args.command == "train" and args.nproc is None else None
    setup_logging(args.command, rank)  # ranks may share one log: each line names its rank
    try:
        args.func(args)
    except ConfigError as err:  # user errors: a message that says how to fix it, not a traceback
        print(f"pipelinerl {args.command}: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
