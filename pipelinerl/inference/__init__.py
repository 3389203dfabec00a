"""Inference servers: vLLM's OpenAI server + async engine, extended with in-flight weight updates.

server.py     `pipelinerl serve`: the control routes, discovery, start-up checks
updates.py    the weight-update state machine, against the engine-neutral `UpdatableEngine` steps
vllm_glue/    every vLLM-internal touch point (a `vllm.general_plugins` plugin, with a version check)

Light on purpose: importing this package does not import vLLM. Discovery files and the control client every
role uses are not here: `pipelinerl.rundir` and `pipelinerl.control`.
"""
