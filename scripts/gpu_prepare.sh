#!/usr/bin/env bash
# Prepares what scripts/gpu_check.sh needs on a GPU machine that has CUDA, PyTorch and a compiler but
# no network: wheels of our pure-Python and gRPC dependencies (.whl/, for Python 3.12), llama-cpp-python's
# Python files and the llama.cpp source it vendors, stripped to the library and its CPU and CUDA
# backends (.gpu/, about 20 MB). Run here, in the repository root, with the project's .venv set up.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || printf '/.gpu/\n/.whl/\n' >> .git/info/exclude
version=$(.venv/bin/python -c 'import llama_cpp; print(llama_cpp.__version__)')
mkdir -p .whl .gpu/site
pins=$(.venv/bin/pip list --format=freeze 2>/dev/null |
       grep -iE '^(grpcio|grpcio-health-checking|grpcio-reflection|protobuf|prometheus.client|gguf|diskcache)==')
for pin in $pins; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "$pin"
done
site=$(.venv/bin/python -c 'import llama_cpp, os; print(os.path.dirname(llama_cpp.__file__))')
rm -rf .gpu/site/llama_cpp && cp -r "$site" .gpu/site/llama_cpp
rm -rf .gpu/site/llama_cpp/lib/* .gpu/site/llama_cpp/__pycache__ .gpu/site/llama_cpp/server
tmp=$(mktemp -d)
.venv/bin/pip download -q --no-deps --no-binary :all: -d "$tmp" "llama-cpp-python==$version"
tar xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp"
rm -rf .gpu/llama.cpp && cp -r "$tmp"/llama_cpp_python-*/vendor/llama.cpp .gpu/llama.cpp
(cd .gpu/llama.cpp && rm -rf models docs tools tests benches examples media gguf-py conversion .github vendor/cpp-httplib)
(cd .gpu/llama.cpp/ggml/src && ls -d ggml-*/ | grep -vE '^ggml-(cpu|cuda|blas)/$' | xargs rm -rf)
rm -rf "$tmp"
du -sh .gpu .whl
