#!/usr/bin/env bash
# Regenerate the committed Python stubs from proto/ (needs grpcio-tools, a test extra).
# Usage: bash scripts/gen_proto.sh [OUT_DIR]   (default common/pb)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-common/pb}
py=${PYTHON:-.venv/bin/python}
mkdir -p "$out"
"$py" -m grpc_tools.protoc -I proto --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
    proto/specexec/v1/specexec.proto
# protoc writes absolute imports (`from specexec.v1 import ...`); make them package-relative.
sed -i 's/^from specexec\.v1 import/from common.pb.specexec.v1 import/' "$out"/specexec/v1/*_grpc.py
touch "$out/__init__.py" "$out/specexec/__init__.py" "$out/specexec/v1/__init__.py"
