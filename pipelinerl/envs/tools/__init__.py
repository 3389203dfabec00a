"""Tools that environments call: `sandbox` runs model-written Python code confined (tiers in confine.py)."""

from pipelinerl.envs.tools.sandbox import PythonSandbox, SandboxLimits, SandboxResult

__all__ = ["PythonSandbox", "SandboxLimits", "SandboxResult"]
