"""Evaluation, in one place: the eval sets and how they are sampled and graded (sets.py), their pure metrics
(pass@k, tables: metrics.py), an evaluation held at one policy version on the evaluation servers (servers.py),
and `pipelinerl eval`, a checkpoint evaluated on scratch servers (command.py). The actor's timing of its
evaluations stays in actor/scheduler.py."""
