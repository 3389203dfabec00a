"""Multi-turn episodes: the environment contract (environment.py), one episode's run (runner.py), its token
sequence (episode.py), tool calls parsed and answered (tool_calls.py, toolbox.py), and the tools they call
(tools/: the calculator, the Python sandbox)."""
