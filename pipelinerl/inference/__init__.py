"""Inference servers: vLLM's OpenAI server + async engine, extended with in-flight weight updates.

server.py     `pipelinerl serve`: the control routes, discovery, start-up checks
updates.py    the weight-update state machine, against the engine-neutral `UpdatableEngine` steps
rundir.py     the run directory's token and server discovery files
vllm_glue/    every vLLM-internal touch point (a `vllm.general_plugins` plugin, with a version check)

Light on purpose: importing this package does not import vLLM (the trainer and actor use `rundir`).
"""
