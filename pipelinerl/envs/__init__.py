"""Environments of multi-turn episodes and the tools they call (tools/: the Python sandbox)."""
