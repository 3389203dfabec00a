"""The `actor` and `task` sections: what is sampled, how often, and how it is rewarded."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from pipelinerl.config.fields import ConfigError, check, check_choice, check_positive, doc, section

DEFAULT_EVAL_SET = "default"  # the task's held-out split (actor.eval_samples, actor.eval_greedy); reserved


@dataclass
class SamplingConfig:
    """Sampling parameters of the actor's rollouts (and of evaluation when actor.eval_greedy is false).

    The servers report the log-probs of the distribution actually sampled (vLLM's processed log-probs:
    logits / temperature), and the trainer scores with the same temperature, so importance ratios, ESS and
    KL compare like with like. Truncations the trainer cannot reproduce (top_p < 1) are refused.
    """

    temperature: float = doc(1.0, "softmax temperature of rollouts; the trainer scores with it too. 1.0 samples "
                                  "the policy itself")
    top_p: float = doc(1.0, "nucleus mass: only 1.0 (no truncation) is accepted; kept so that a config asking "
                            "for nucleus sampling gets a clear refusal rather than an unknown key")
    max_new_tokens: int = doc(8192, "completion length limit; longer ones are marked truncated", unit="tokens")
    min_new_tokens: int = doc(
        0, "every sampled completion has at least this many tokens (vLLM's `min_tokens`: EOS and stop tokens "
           "are masked until then); greedy evaluation ignores it. 0 = no minimum; must be <= max_new_tokens. "
           "The behaviour log-probs are then those of the masked distribution, which the trainer does not "
           "reproduce (ratios low by the EOS mass): for tests and benchmarks, not for training", unit="tokens")

    def __post_init__(self) -> None:
        check(0 < self.temperature <= 2, "actor.sampling.temperature",
              "must be in (0, 2]: vLLM refuses more, and greedy is not RL sampling")
        check(self.top_p == 1.0, "actor.sampling.top_p",
              f"got {self.top_p!r}; only 1.0 is supported: the trainer cannot reproduce nucleus truncation of "
              "the behaviour distribution, so importance ratios, ESS and KL would be wrong. Use temperature "
              "to sharpen sampling instead")
        check_positive(self.max_new_tokens, "actor.sampling.max_new_tokens")
        check(0 <= self.min_new_tokens <= self.max_new_tokens, "actor.sampling.min_new_tokens",
              f"got {self.min_new_tokens!r}; must be in [0, max_new_tokens={self.max_new_tokens}]")


@dataclass
class EpisodeConfig:
    """Multi-turn episodes (tasks with an environment, e.g. tool_sums): when one is cut, and how long its
    environment may take. Single-turn tasks ignore this section."""

    max_turns: int = doc(4, "model turns per episode; an environment asking for one more ends it truncated")
    max_tokens_per_turn: int | None = doc(None, "new tokens of one model turn (its request's max_tokens); a turn "
                                                "cut there ends the episode truncated", unit="tokens",
                                          null="actor.sampling.max_new_tokens")
    max_total_tokens: int = doc(4096, "tokens of a whole episode: prompt, model and environment tokens; at most "
                                      "inference.max_model_len", unit="tokens")
    step_timeout_s: float = doc(30.0, "one answer of the environment (its tools included); past it the episode "
                                      "ends with reward 0 and end reason env_error", unit="s")

    def __post_init__(self) -> None:
        check_positive(self.max_turns, "actor.episode.max_turns")
        check(self.max_tokens_per_turn is None or self.max_tokens_per_turn > 0, "actor.episode.max_tokens_per_turn",
              "must be > 0, or null for actor.sampling.max_new_tokens")
        check_positive(self.max_total_tokens, "actor.episode.max_total_tokens")
        check_positive(self.step_timeout_s, "actor.episode.step_timeout_s")


@dataclass
class ActorConfig:
    """The actor: prompts in, G attempts each, rewards, the lag throttle (`pipelinerl actor`)."""

    attempts: int = doc(8, "G: completions sampled per prompt; advantages are computed within each group")
    max_lag: int | None = doc(None, "bound on (trainer version - oldest version in flight); 0 = on-policy",
                              unit="versions", null="no bound")
    max_groups_in_flight: int = doc(32, "prompt groups awaiting completion at once (keeps servers at full batch)")
    request_timeout_s: float = doc(600.0, "one completion request; on timeout it is retried on another server",
                                   unit="s")
    max_retries: int = doc(3, "retries of one request before the actor fails with the server's error")
    server_silence_s: float = doc(
        60.0, "a policy server with requests in flight that answers no GET /status for this long (the actor "
              "probes such servers every few seconds) is set aside: its requests are cancelled and retried on "
              "another server, within max_retries, instead of waiting request_timeout_s for a hung server",
        unit="s")
    wait_log_s: float = doc(30.0, "while no server may take a request, a warning every this often names what the "
                                  "request waits for: the version it needs, each announced server's last reported "
                                  "version, the servers set aside and why; and while every group written goes to the "
                                  "`filtered` topic (rl.filter_zero_variance), a warning every this often says so",
                            unit="s")
    eval_every_steps: int = doc(20, "held-out evaluation every N trainer versions; 0 = never", unit="versions")
    eval_samples: int = doc(200, "prompts of the `default` eval set (the task's held-out split) per evaluation, one "
                                 "completion each (pass@1); 0 = no `default` set (task.eval_sets still run)")
    eval_greedy: bool = doc(True, "the `default` set's completions are greedy (temperature 0); false = sampled "
                                  "like training")
    eval_priority: int = doc(1, "vLLM request priority of evaluation requests (the servers run vLLM's priority "
                                "scheduling; training requests have 0, lower is scheduled first): when a "
                                "server's batch is full, queued training requests start before queued evaluation "
                                "ones. vLLM does not preempt a running request for priority while KV cache is "
                                "left, so running evaluation requests keep their batch share; 0 = first come, "
                                "first served")
    sampling: SamplingConfig = section(SamplingConfig)
    episode: EpisodeConfig = section(EpisodeConfig)

    def __post_init__(self) -> None:
        check(self.attempts >= 2, "actor.attempts", "group advantages need at least 2 attempts per prompt")
        check(self.max_lag is None or self.max_lag >= 0, "actor.max_lag", "must be >= 0, or null for no bound")
        check_positive(self.max_groups_in_flight, "actor.max_groups_in_flight")
        check_positive(self.request_timeout_s, "actor.request_timeout_s")
        check(self.max_retries >= 0, "actor.max_retries", "must be >= 0")
        check_positive(self.server_silence_s, "actor.server_silence_s")
        check_positive(self.wait_log_s, "actor.wait_log_s")
        check(self.eval_every_steps >= 0, "actor.eval_every_steps", "must be >= 0 (0 disables evaluation)")
        check(self.eval_samples >= 0, "actor.eval_samples", "must be >= 0")
        check(self.eval_priority >= 0, "actor.eval_priority", "must be >= 0 (0: as training requests)")


@dataclass
class EvalSetConfig:
    """One named eval set (an entry of task.eval_sets): a file of problems and how each is sampled."""

    path: str = doc("", "{question, answer} rows: a .jsonl/.json/.parquet file or a `datasets` folder, read like "
                        "task.dataset_path (a relative path is from the working directory); a missing file stops the "
                        "actor's or `pipelinerl eval`'s start naming the set")
    samples: int = doc(1, "completions per prompt: the set reports pass@1 (mean success) and pass@<samples> "
                          "(the unbiased estimator)")
    temperature: float = doc(0.0, "sampling temperature; 0 = greedy (then samples must be 1)")
    max_prompts: int | None = doc(None, "evaluate the file's first N rows", null="every row")
    question_field: str | None = doc(None, "question field of this file's rows", null="task.question_field")
    answer_field: str | None = doc(None, "gold answer field of this file's rows", null="task.answer_field")

    def validate(self, name: str) -> None:
        """The checks of __post_init__, named by the set's key (the set does not know its name)."""
        key = f"task.eval_sets.{name}"
        check(isinstance(self.path, str) and bool(self.path), f"{key}.path", "set it to the set's data file")
        check(isinstance(self.samples, int) and self.samples >= 1, f"{key}.samples",
              f"got {self.samples!r}; must be a whole number >= 1")
        check(isinstance(self.temperature, (int, float)) and 0 <= self.temperature <= 2, f"{key}.temperature",
              f"got {self.temperature!r}; must be in [0, 2] (0 = greedy)")
        check(self.samples == 1 or self.temperature > 0, f"{key}.samples",
              f"got {self.samples} greedy completions per prompt, which would all be the same: set "
              f"{key}.temperature > 0 to sample them, or samples: 1")
        check(self.max_prompts is None or (isinstance(self.max_prompts, int) and self.max_prompts >= 1),
              f"{key}.max_prompts", f"got {self.max_prompts!r}; must be >= 1, or null for every row")
        self.temperature = float(self.temperature)


def parse_eval_set(name: str, value) -> EvalSetConfig:
    """One task.eval_sets entry, short form (a path) or long form (a mapping of EvalSetConfig's fields)."""
    key = f"task.eval_sets.{name}"
    check(re.fullmatch(r"[A-Za-z0-9_.-]+", str(name)) is not None, key,
          "a set name is letters, digits, `_`, `.` or `-` (it becomes the TensorBoard tag eval/<name>/...)")
    check(name != DEFAULT_EVAL_SET, key, f"`{DEFAULT_EVAL_SET}` is the task's held-out split, set by "
          "actor.eval_samples and actor.eval_greedy; give this set another name")
    if isinstance(value, EvalSetConfig):
        parsed = value
    elif isinstance(value, str):
        parsed = EvalSetConfig(path=value)
    elif isinstance(value, dict):
        known = {f.name for f in dataclasses.fields(EvalSetConfig)}
        unknown = sorted(set(map(str, value)) - known)
        check(not unknown, key, f"unknown key(s) {unknown}; a set's keys are {', '.join(sorted(known))}")
        parsed = EvalSetConfig(**value)
    else:
        raise ConfigError(f"config `{key}`: got {value!r}; give a data file path or a mapping "
                          "{path, samples, temperature, max_prompts}")
    parsed.validate(name)
    return parsed


@dataclass
class SandboxConfig:
    """The Python sandbox of the math_tir task's tool calls (pipelinerl/envs/tools/sandbox.py): each call one
    fresh confined process; these limits apply to each."""

    workers: int = doc(4, "tool calls run at once per actor; more wait their turn, and the wait counts against "
                          "actor.episode.step_timeout_s, not against timeout_s")
    timeout_s: float = doc(10.0, "wall clock of one call; the model is told the script failed (timeout). Keep "
                                 "actor.episode.step_timeout_s above it", unit="s")
    cpu_s: float = doc(5.0, "CPU time of one call, all its processes together; the model is told (cpu_limit)",
                       unit="s")
    memory_mb: int = doc(1024, "address space of each process of a call, and the memory (proportional set size) of "
                               "all its processes together; numpy needs ~256", unit="MiB")
    max_output_bytes: int = doc(4096, "kept of a call's stdout and of its stderr each: the tool message's size "
                                      "(more stops the call: output_limit)", unit="bytes")
    allow_unconfined_fs: bool = doc(False, "accept the weakest confinement (rlimits and seccomp only), where the "
                                           "code can read every file the user can (a run's auth_token included); "
                                           "false = the sandbox refuses to start on such a node")
    run_as_uid_base: int | None = doc(2_100_000_000, "an actor run as root runs each call under a uid of "
                                                     "[base, base + 4096) of its own (a per-call process limit; "
                                                     "no root file or process open to the code): uids no one on "
                                                     "the node owns", null="the code runs as root")

    def __post_init__(self) -> None:
        for name in ("workers", "timeout_s", "cpu_s", "memory_mb", "max_output_bytes"):
            check_positive(getattr(self, name), f"task.sandbox.{name}")


@dataclass
class VerifiersConfig:
    """A verifiers (v1) environment as the task (task.name=verifiers, `pip install -e '.[verifiers]'`):
    its rows are the task's items, its rollouts our episodes (pipelinerl/envs/verifiers_env.py)."""

    env: str | None = doc(None, "the taskset id verifiers loads: a module importable here (installed, or on "
                                "PYTHONPATH) that exports one vf.Taskset subclass in `__all__`; a hub id "
                                "owner/name@version names the module `name`", null="required by task.name=verifiers")
    path: str | None = doc(None, "a folder the environment's module is imported from (put on sys.path, and on "
                                 "PYTHONPATH for the tool servers verifiers starts), relative to the launch folder",
                           null="the module is installed")
    args: dict = doc({}, "the taskset's config fields (its vf.TasksetConfig subclass), e.g. {split: train}")
    eval_args: dict | None = doc(None, "the held-out rows' taskset fields, over args (e.g. {split: test})",
                                 null="hold out task.eval_fraction of the training rows")
    harness: str = doc("pipelinerl_chat",
                       "the harness (agent program) of each rollout, by verifiers id: pipelinerl_chat is a chat "
                       "loop with the task's MCP tools in the actor's process (pipelinerl/envs/verifiers_harness.py); "
                       "`null` or `bash` are verifiers' own programs (a process per rollout, prepared with uv: "
                       "untested here)")
    tool_format: str = doc("qwen", "how the model writes the tool calls the rollout's tools receive: qwen "
                                   "(<tool_call>{json}</tool_call>) | compact (the tiny model's ==expression=)")
    max_rows: int = doc(100_000, "rows read from the taskset (a generated taskset may be endless)")

    def __post_init__(self) -> None:
        check_choice(self.tool_format, ("qwen", "compact"), "task.verifiers.tool_format")
        check_positive(self.max_rows, "task.verifiers.max_rows")
        check(isinstance(self.args, dict), "task.verifiers.args", "must be a mapping of taskset fields")
        check(self.eval_args is None or isinstance(self.eval_args, dict), "task.verifiers.eval_args",
              "must be a mapping of taskset fields, or null")


@dataclass
class OpenEnvConfig:
    """An OpenEnv environment server as the task (task.name=openenv, `pip install -e '.[openenv]'`): each item is a
    reset seed, each episode one WebSocket session (pipelinerl/envs/openenv_env.py)."""

    url: str | None = doc(None, "the base URL, http://host:port, of an environment server you run (sessions on its "
                                "/ws); its max_concurrent_envs must hold actor.max_groups_in_flight x "
                                "actor.attempts episodes. Exclusive with serve",
                          null="the launcher serves `serve`")
    serve: str | None = doc(None, "`module:app`, an ASGI app (openenv-core's create_app) that the launcher serves "
                                  "with uvicorn as a role of its own (`pipelinerl openenv-serve`), `servers` of "
                                  "them, restarted like every server; each episode's session goes to the announced "
                                  "server with the fewest open. Exclusive with url",
                            null="you run the server: url")
    path: str | None = doc(None, "a folder serve's module is imported from (put on sys.path and PYTHONPATH), "
                                 "relative to the launch folder", null="the module is installed")
    servers: int = doc(1, "environment servers of serve: on this machine (`pipelinerl run`, on the actor's cores), "
                          "on each server node (Slurm); ports after every vLLM server's (launch/commands.py). "
                          "Together they must hold actor.max_groups_in_flight x actor.attempts sessions")
    action_field: str = doc("message", "the action's field that carries the model turn's text")
    observation_fields: list = doc(["prompt", "message", "text"], "the observation's fields the model reads: the "
                                                                  "first non-empty string of them")
    message_role: str = doc("user", "the role of the messages made of step observations: user | tool")
    reset_args: dict = doc({}, "more keyword arguments of every reset (the server drops those its environment's "
                               "reset does not take)")
    num_items: int = doc(10_000, "training items: reset seeds 0 .. num_items-1")
    num_eval_items: int = doc(200, "held-out items: seeds from eval_seed_start on")
    eval_seed_start: int = doc(1_000_000_000, "the first held-out seed (never a training seed)")
    connect_timeout_s: float = doc(10.0, "to open a session's WebSocket", unit="s")
    message_timeout_s: float = doc(600.0, "the client's own bound on each reply; actor.episode.step_timeout_s "
                                          "bounds each step as well", unit="s")

    def __post_init__(self) -> None:
        check(not (self.url and self.serve), "task.openenv.serve",
              "give url (a server you run) or serve (an app the launcher runs), not both")
        check(self.serve is None or re.fullmatch(r"[\w.]+:[\w.]+", str(self.serve)) is not None,
              "task.openenv.serve", f"got {self.serve!r}; must be `module:app` (an ASGI app, as uvicorn takes it)")
        check(self.path is None or bool(self.serve), "task.openenv.path",
              "is the folder of serve's module: set task.openenv.serve too, or path to null")
        check_positive(self.servers, "task.openenv.servers")
        check_choice(self.message_role, ("user", "tool"), "task.openenv.message_role")
        check_positive(self.num_items, "task.openenv.num_items")
        check_positive(self.num_eval_items, "task.openenv.num_eval_items")
        check(self.eval_seed_start >= self.num_items, "task.openenv.eval_seed_start",
              "must be >= num_items: held-out seeds are never training seeds")
        check(isinstance(self.observation_fields, list) and bool(self.observation_fields)
              and all(isinstance(f, str) for f in self.observation_fields), "task.openenv.observation_fields",
              "must be a non-empty list of field names")
        check_positive(self.connect_timeout_s, "task.openenv.connect_timeout_s")
        check_positive(self.message_timeout_s, "task.openenv.message_timeout_s")


@dataclass
class AgentTaskConfig:
    """A black-box agent on the OpenAI API as the task (task.name=agent): each episode runs the agent against the
    actor's agent gateway under a key of its own (pipelinerl/envs/agent_gateway.py)."""

    program: str | None = doc(None, "the agent: `module:function`, an `async def agent(client_kwargs, item) -> "
                                    "float | None` (client_kwargs: base_url and api_key for openai.AsyncOpenAI; "
                                    "item: id, prompt, answer)", null="task.agent.command is the agent")
    command: list | None = doc(None, "the agent as a command line (argv list), one process per episode: it gets "
                                     "OPENAI_BASE_URL, OPENAI_API_KEY (what the openai client reads) and "
                                     "PIPELINERL_ITEM (the item as JSON); the last line it prints is its reward "
                                     "(or `None`: posted to /rl/reward); a non-zero exit is an environment error",
                               null="task.agent.program is the agent")
    path: str | None = doc(None, "a folder the agent's module is imported from (put on sys.path)",
                           null="the module is installed")
    items: str = doc("tool_sums", "the tiny task whose train and held-out items the agent gets: addition | "
                                  "arithmetic | tool_sums")
    tool_format: str = doc("qwen", "how the model writes the tool calls returned as `tool_calls`: qwen | compact")
    max_wall_s: float = doc(600.0, "one episode's agent, start to return; past it the episode ends as an "
                                   "environment error", unit="s")

    def __post_init__(self) -> None:
        check(self.program is None or (isinstance(self.program, str) and self.program.count(":") == 1),
              "task.agent.program", "must be `module:function`")
        check(self.command is None or (isinstance(self.command, list) and bool(self.command)
                                       and all(isinstance(a, str) for a in self.command)),
              "task.agent.command", "must be a non-empty list of strings (an argv)")
        check_choice(self.items, ("addition", "arithmetic", "tool_sums"), "task.agent.items")
        check_choice(self.tool_format, ("qwen", "compact"), "task.agent.tool_format")
        check_positive(self.max_wall_s, "task.agent.max_wall_s")


@dataclass
class ToolSumsConfig:
    """task.name=tool_sums made slow and long-tailed, as agentic episodes are (configs/tiny_agent_long_tail.yaml):
    a busy calculator some items must call again and again, and a delay on every call."""

    max_busy: int = doc(0, "each item's calculator first answers busy (`-`, the call is to be made again) k "
                           "times, k drawn once per item from a geometric law (half of the items 0, a quarter 1, "
                           "...) capped at max_busy: episodes of 2 to max_busy + 2 turns. 0 = never busy")
    latency_s: float = doc(0.0, "every calculator call (busy ones too) waits a delay drawn uniformly in "
                                "[0, latency_s], as a search tool or a sandbox does. 0 = instant", unit="s")

    def __post_init__(self) -> None:
        check(isinstance(self.max_busy, int) and self.max_busy >= 0, "task.tool_sums.max_busy",
              "must be an int >= 0")
        check(self.latency_s >= 0, "task.tool_sums.latency_s", "must be >= 0")


@dataclass
class TaskConfig:
    """The data set and its reward."""

    name: str = doc("addition", "addition (2-digit sums, answer written units-first; CPU) | arithmetic (sums "
                                "mixed with remainders by repeated subtraction: long-tailed lengths; CPU) | "
                                "math (math-verify) | math_tir (math with a Python tool: multi-turn episodes, "
                                "actor.episode and task.sandbox; the final answer graded as math's) | tool_sums "
                                "(3-digit sums with a calculator tool: multi-turn episodes, actor.episode; CPU) | "
                                "instructions (prompts without answers, e.g. a chat data set's: scored only by a "
                                "reward model, reward.kind=model) | verifiers (a verifiers environment: "
                                "task.verifiers; multi-turn episodes, actor.episode) | openenv (an OpenEnv "
                                "environment server: task.openenv; multi-turn episodes) | agent (a black-box "
                                "agent on the OpenAI API: task.agent; its requests are an episode's turns)")
    dataset_path: str | None = doc(None, "math training rows: a .jsonl/.json/.parquet file (or a Hugging Face "
                                         "`datasets` folder) of {question, answer} "
                                         "rows (or problem/answer, or Open-Reasoner-Zero pairs)",
                                   null="none: the tiny tasks (addition, arithmetic) read no file")
    eval_dataset_path: str | None = doc(None, "math test rows (e.g. MATH-500, AIME 2024), same formats",
                                        null="hold out eval_fraction of dataset_path instead")
    eval_fraction: float = doc(0.06, "share of the data held out for evaluation (never trained on)")
    # A plain dict, not dict[str, EvalSetConfig]: omegaconf would refuse the short form (name -> path).
    eval_sets: dict = doc({}, "named eval sets, evaluated beside the held-out split (`default`) every "
                              "actor.eval_every_steps and by `pipelinerl eval --sets`: name -> data file path, or "
                              "name -> {path, samples (per prompt), temperature (0 = greedy), max_prompts, "
                              "question_field, answer_field} (EvalSetConfig); a null entry drops a set. Logged as "
                              "eval/<name>/pass@1, pass@<samples>, mean_length, truncation_rate")
    seed: int = doc(0, "data order and the held-out split")
    reward_timeout_s: int = doc(5, "math-verify limit per parse and per comparison, whole seconds (signal.alarm); "
                                   "a pathological answer then scores 0 instead of stalling the actor", unit="s")
    reward_workers: int = doc(1, "math grading processes; each completion is a job, started by an idle worker. "
                                 "Raise it when grading cannot keep up (tools/bench_grading.py measures "
                                 "completions per second per worker count)")
    question_field: str | None = doc(None, "name of the question field in the data rows (any case)",
                                     null="question, else problem")
    answer_field: str | None = doc(None, "name of the gold answer field in the data rows (any case)",
                                   null="answer")
    credit_truncated: bool = doc(False, "grade completions cut at actor.sampling.max_new_tokens too, and reward a "
                                        "correct final answer in one as if it had finished (the original "
                                        "PipelineRL's option); false = a truncated completion scores 0")
    overlong_buffer_tokens: int = doc(
        0, "overlong penalty (rl.overlong=soft): a completion whose length reaches into the last N tokens before "
           "actor.sampling.max_new_tokens loses overlong_penalty x (how far into that zone it reaches) / N, "
           "so the full penalty at the limit and none before the zone (DAPO's soft overlong punishment, "
           "rescaled to 0/1 rewards). 0 = off", unit="tokens")
    overlong_penalty: float = doc(0.5, "the penalty at the length limit (rl.overlong=soft); below 1 so that a "
                                       "correct answer always outscores a wrong one")
    curriculum: str = doc("none", "none | pass_rate: a prompt the actor's own published groups always or never "
                                  "solved (every attempt, in at least curriculum_min_groups groups) is sampled "
                                  "with weight curriculum_weight, every other prompt with weight 1 "
                                  "(pipelinerl/actor/curriculum.py); counted from the stream, so a restarted "
                                  "actor resumes it exactly; needs streams.retention=keep")
    curriculum_min_groups: int = doc(2, "groups of a prompt before its pass rate may lower its weight")
    curriculum_weight: float = doc(0.1, "sampling weight of a saturated prompt (always or never solved), in (0, 1]")
    sandbox: SandboxConfig = section(SandboxConfig)
    verifiers: VerifiersConfig = section(VerifiersConfig)
    openenv: OpenEnvConfig = section(OpenEnvConfig)
    agent: AgentTaskConfig = section(AgentTaskConfig)
    tool_sums: ToolSumsConfig = section(ToolSumsConfig)

    def __post_init__(self) -> None:
        check_choice(self.name, ("addition", "arithmetic", "math", "math_tir", "tool_sums", "instructions",
                                 "verifiers", "openenv", "agent"), "task.name")
        check(self.name != "agent" or (self.agent.program is None) != (self.agent.command is None),
              "task.agent.program", "the agent task needs its agent: a program (module:function) or a command, "
                                    "not both")
        check(self.name != "openenv" or bool(self.openenv.url or self.openenv.serve), "task.openenv.url",
              "the openenv task needs its environment server: url (one you run) or serve (module:app, run by the "
              "launcher)")
        check(self.name != "verifiers" or bool(self.verifiers.env), "task.verifiers.env",
              "the verifiers task needs the id of the environment's taskset module")
        check(self.name not in ("math", "math_tir") or bool(self.dataset_path), "task.dataset_path",
              f"the {self.name} task needs a file of {{question, answer}} rows (.jsonl, .json or .parquet)")
        check(self.name != "instructions" or bool(self.dataset_path), "task.dataset_path",
              "the instructions task needs a file of prompt rows (.jsonl, .json or .parquet)")
        # math_tir grades only an episode's answer turn, which the model ended: a cut turn ends the episode
        # truncated with reward 0 (envs/runner.py) before any grading, and episodes have no completion length.
        check(self.name != "math_tir" or not self.credit_truncated, "task.credit_truncated",
              "math_tir never grades a cut turn (its episode ends truncated with reward 0); set it to false")
        check(self.name != "math_tir" or self.overlong_buffer_tokens == 0, "task.overlong_buffer_tokens",
              "the overlong penalty is per single-turn completion; math_tir's episodes are cut by actor.episode's "
              "limits instead: set it to 0")
        check(0.0 < self.eval_fraction < 1.0, "task.eval_fraction", "must be in (0, 1)")
        check(isinstance(self.reward_timeout_s, int) and self.reward_timeout_s >= 1, "task.reward_timeout_s",
              "must be a whole number of seconds >= 1")
        check_positive(self.reward_workers, "task.reward_workers")
        check(self.overlong_buffer_tokens >= 0, "task.overlong_buffer_tokens", "must be >= 0 (0 = no penalty)")
        check(0.0 <= self.overlong_penalty < 1.0, "task.overlong_penalty",
              "must be in [0, 1): a correct answer must keep a positive reward (success is reward > 0)")
        check_choice(self.curriculum, ("none", "pass_rate"), "task.curriculum")
        check_positive(self.curriculum_min_groups, "task.curriculum_min_groups")
        check(0.0 < self.curriculum_weight <= 1.0, "task.curriculum_weight", "must be in (0, 1]")
        check(isinstance(self.eval_sets, dict), "task.eval_sets", "must be a mapping of set name -> path or set")
        # Normalised here, the one place: the long form of every set (a saved config round-trips).
        self.eval_sets = {name: parse_eval_set(name, value) for name, value in self.eval_sets.items()
                          if value is not None}

    @property
    def openenv_servers_started(self) -> int:
        """How many OpenEnv environment servers a launcher starts per server host (this machine, or each Slurm
        server node): task.openenv.servers when the openenv task's server is task.openenv.serve, else none."""
        return self.openenv.servers if self.name == "openenv" and self.openenv.serve else 0
