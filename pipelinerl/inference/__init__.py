"""Inference servers: vLLM's OpenAI server + async engine, extended with in-flight weight updates.

Light on purpose: importing this package does not import vLLM (the trainer and actor use `rundir`).
"""
