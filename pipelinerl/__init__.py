"""PipelineRL: reinforcement learning for LLMs with in-flight weight updates (vLLM + DeepSpeed)."""


def __getattr__(name: str) -> str:
    # The version has one source, setup.cfg; read from the installed metadata only when asked, so that
    # importing any pipelinerl module stays cheap.
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("pipelinerl")
        except PackageNotFoundError:  # a source tree on sys.path that was never pip-installed
            return "0+unknown"
    raise AttributeError(f"module 'pipelinerl' has no attribute {name!r}")
