"""`pipelinerl plan`: per role and per GPU, the memory a config needs (memory.py), from the model's shape
(shapes.py); the launchers check it before a run starts."""
