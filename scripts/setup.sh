#!/usr/bin/env bash
# Create or reuse .venv and install the project. torch is installed first, pinned to the local CPU
# wheel, so the project's wider torch range is already satisfied and pip never fetches CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/pip install -q "torch==${TORCH_VERSION:-2.13.0}"
# Reinstall only when the project's requirements changed since the last setup.
stamp=.venv/.specexec-setup
# llama-cpp-python compiles llama.cpp (about 4-5 minutes on 2 cores): the library only, tuned to
# this CPU. Set CMAKE_ARGS yourself for CUDA (-DGGML_CUDA=on) or Metal (-DGGML_METAL=on).
export CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF}"
if [ "$(uname -m)" = x86_64 ]; then
    # ggml's AMX kernels (Xeon Sapphire Rapids and newer) crash in llama_decode on some models
    # (ggml-org/llama.cpp#20824; seen here on a Q8_0 file), so the native build leaves them out.
    export CFLAGS="${CFLAGS:-} -mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    export CXXFLAGS="${CXXFLAGS:-} -mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
fi
want=$( (cat pyproject.toml; echo "$CMAKE_ARGS ${CFLAGS:-} ${CXXFLAGS:-}") | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
    # A llama.cpp built under other flags (or pip's cached wheel of one) must not be kept.
    .venv/bin/pip uninstall -q -y llama-cpp-python 2>/dev/null || true
    .venv/bin/pip install -q --no-cache-dir -e ".[test,llama]"
    echo "$want" > "$stamp"
fi
