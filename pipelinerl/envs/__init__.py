"""Multi-turn episodes (episode.py: the token sequence; tool_calls.py, toolbox.py: tool calls answered) and the
tools they call (tools/: the calculator, the Python sandbox)."""
