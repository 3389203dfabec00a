"""`Config`: one run, its sections, and the checks and derived fields that span sections."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import MISSING

from pipelinerl.config.actor import ActorConfig, TaskConfig
from pipelinerl.config.fields import check, check_choice, doc, section
from pipelinerl.config.inference import InferenceConfig
from pipelinerl.config.launch import LaunchConfig
from pipelinerl.config.model import ModelConfig
from pipelinerl.config.reward import RewardConfig
from pipelinerl.config.run_dir import CheckpointConfig, LoggingConfig, StreamsConfig
from pipelinerl.config.trainer import ConventionalConfig, RLConfig, TrainerConfig

EPISODE_TASKS = ("math_tir", "tool_sums", "verifiers", "openenv", "agent")  # tasks whose samples are episodes


@dataclass
class Config:
    """One run. `run_dir` is the bus every role shares: config, discovery files, streams,
    checkpoints, TensorBoard and logs all live under it (docs/concepts/run-directory.md)."""

    run_dir: str = doc(MISSING, "the run directory on a filesystem all nodes see; re-using one resumes it")
    seed: int = doc(0, "seeds sampling, data order and initialisation")
    mode: str = doc("pipeline", "pipeline (in-flight updates after every step, lag bounded by actor.max_lag) | "
                                "conventional (generate a batch, G steps, one sync: the `conventional` section)")
    model: ModelConfig = section(ModelConfig)
    inference: InferenceConfig = section(InferenceConfig)
    actor: ActorConfig = section(ActorConfig)
    task: TaskConfig = section(TaskConfig)
    reward: RewardConfig = section(RewardConfig)
    trainer: TrainerConfig = section(TrainerConfig)
    rl: RLConfig = section(RLConfig)
    streams: StreamsConfig = section(StreamsConfig)
    checkpoints: CheckpointConfig = section(CheckpointConfig)
    logging: LoggingConfig = section(LoggingConfig)
    launch: LaunchConfig = section(LaunchConfig)
    conventional: ConventionalConfig = section(ConventionalConfig)

    @property
    def returns_routed_experts(self) -> bool:
        """Whether the policy servers return each sampled token's routed experts (and the stream carries them)."""
        return self.inference.return_routed_experts or self.rl.routing_replay == "r3"

    def __post_init__(self) -> None:
        check(bool(self.run_dir), "run_dir", "set it to a folder (it is created if missing)")
        check(self.trainer.samples_per_step % self.actor.attempts == 0, "trainer.samples_per_step",
              f"must be a multiple of actor.attempts ({self.actor.attempts}) so whole groups fill a step")
        groups = self.trainer.samples_per_step // self.actor.attempts
        check(self.trainer.num_gpus is None or groups % self.trainer.num_gpus == 0, "trainer.num_gpus",
              f"{groups} groups per step (trainer.samples_per_step / actor.attempts) do not split evenly over "
              f"{self.trainer.num_gpus} trainer ranks: make samples_per_step a multiple of attempts x ranks")
        check(self.actor.sampling.temperature == 1.0 or not self.rl.needs_reference_logprobs,
              "actor.sampling.temperature", f"got {self.actor.sampling.temperature}; the reference servers' "
              "log-probs (rl.kl_coef > 0, DPO against the reference) are of the untempered model, while the "
              "trainer scores the tempered one: sample at 1.0, or drop the reference term")
        check(self.task.overlong_buffer_tokens <= self.actor.sampling.max_new_tokens, "task.overlong_buffer_tokens",
              f"got {self.task.overlong_buffer_tokens}: the penalty zone must fit in actor.sampling.max_new_tokens "
              f"({self.actor.sampling.max_new_tokens})")
        check((self.rl.overlong == "soft") == (self.task.overlong_buffer_tokens > 0), "rl.overlong",
              f"got {self.rl.overlong!r} with task.overlong_buffer_tokens={self.task.overlong_buffer_tokens}: the soft "
              "overlong penalty is rl.overlong=soft over a zone of task.overlong_buffer_tokens > 0 tokens; set both, "
              "or neither")
        check(self.rl.overlong != "soft" or self.task.name == "math", "rl.overlong",
              f"soft: the math task's reward applies the penalty (its success is reward > 0, so a penalised correct "
              f"answer still counts); {self.task.name} rewards 1.0 for a success: use none or filter")
        check(self.task.name != "math_tir" or self.actor.episode.step_timeout_s > self.task.sandbox.timeout_s,
              "actor.episode.step_timeout_s", f"got {self.actor.episode.step_timeout_s}; a step runs the turn's "
              f"scripts, each up to task.sandbox.timeout_s ({self.task.sandbox.timeout_s}): set it above that")
        check(self.task.curriculum == "none" or self.streams.retention == "keep", "task.curriculum",
              "the curriculum counts the actor's published groups from the stream (an exact resume), so it needs "
              "every segment: set streams.retention=keep")
        check(self.reward.kind == "verify" or self.task.name not in EPISODE_TASKS
              or (self.task.name, self.reward.kind) == ("verifiers", "judge"), "reward.kind",
              f"got {self.reward.kind!r}: a reward model or judge scores single-turn completions; {self.task.name}'s "
              "episodes are graded by the task (reward.kind=verify; a verifiers environment's judges may use the "
              "run's judge servers: reward.kind=judge)")
        check(self.rl.routing_replay == "none" or self.task.name not in EPISODE_TASKS, "rl.routing_replay",
              f"r3 replays the routing of single-turn completions; {self.task.name}'s multi-turn episodes do not carry "
              "their model turns' routing yet: use none")
        check(self.task.name != "instructions" or self.reward.kind != "verify", "reward.kind",
              "the instructions task's prompts have no answer to check: set reward.kind=model (a reward model) or "
              "judge")
        check(self.task.name != "instructions" or self.actor.eval_every_steps == 0, "actor.eval_every_steps",
              "evaluation grades held-out prompts with the task's check, which the instructions task has none "
              "of: set it to 0 (actor/reward, the reward model's mean score, measures the run)")
        inf = self.inference
        ports = (inf.num_servers + inf.reference_servers + self.reward.servers_started + inf.eval_servers
                 + self.task.openenv_servers_started)
        check(inf.base_port + ports <= 65535, "inference.base_port",
              f"got {inf.base_port}: its {ports} server ports (policy, reference, reward, eval and OpenEnv "
              "environment servers) must fit below 65536")
        check(inf.eval_servers == 0 or self.trainer.broadcast_port < 65535, "trainer.broadcast_port",
              f"got {self.trainer.broadcast_port}; the eval servers' weight group listens on broadcast_port + 1, "
              "which must be a TCP port: lower it (or set inference.eval_servers=0)")
        check_choice(self.mode, ("pipeline", "conventional"), "mode")
        if self.mode == "conventional":
            self._check_conventional()

    def _check_conventional(self) -> None:
        G, S = self.conventional.steps_per_batch, self.trainer.samples_per_step
        if self.conventional.batch_size is None:
            self.conventional.batch_size = G * S  # derived here, the one place it is computed
        check(self.conventional.batch_size == G * S, "conventional.batch_size",
              f"got {self.conventional.batch_size}; a batch must fill exactly G = {G} steps of "
              f"trainer.samples_per_step = {S} samples: set it to {G * S} or null")
        check(self.trainer.max_steps is None or self.trainer.max_steps % G == 0, "trainer.max_steps",
              f"got {self.trainer.max_steps}; conventional mode trains whole batches: use a multiple of "
              f"conventional.steps_per_batch ({G})")
        check(self.actor.max_lag is None, "actor.max_lag",
              f"conventional mode bounds the lag by construction (at most G - 1 = {G - 1}); set it to null")
