#!/usr/bin/env bash
# The prepared one-device check of issue #15 (tools/gpu_check.py says what it runs and prints).
#   tools/gpu_check.sh                # on a GPU machine: tiny + 1.5B-shaped models, one table
#   tools/gpu_check.sh --device cpu   # the CI smoke test: tiny model only, under a minute
# A machine without network (the lent GPU machine) can bring pure-Python wheels in .whl/ (or
# $GPU_CHECK_WHEELS): omegaconf and antlr4-python3-runtime at least. They are installed into a
# private folder first, nothing system-wide.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
wheels=${GPU_CHECK_WHEELS:-.whl}
if compgen -G "$wheels/*.whl" >/dev/null; then
  site=${TMPDIR:-/tmp}/gpu_check_site
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "$wheels"/*.whl
  export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # the package from this checkout, installed or not
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
exec "$python" tools/gpu_check.py "$@"
