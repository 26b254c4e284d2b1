#!/usr/bin/env bash
# Prepares what scripts/gpu_check.sh needs on a GPU machine that has CUDA, PyTorch, transformers and a
# compiler but no network: wheels of our gRPC, metrics and HTTP dependencies (.whl/, for Python 3.12),
# the default pair's tokenizer files (.gpu/tok.tar.xz: random weights get a real tokenizer, so the
# gateway can serve them), llama-cpp-python's Python files and the llama.cpp source it vendors,
# stripped to the library and its CPU and CUDA backends (.gpu/, about 20 MB). Run here, in the
# repository root, with the project's .venv set up and the default draft installed as a GGUF.
# With --prebuild it also builds that llama.cpp with CUDA here (.gpu/lib), from NVIDIA's CUDA 13.0
# compiler and library wheels on PyPI, for Hopper (sm_90) and any AVX2 CPU, so that the GPU
# machine's few minutes go to the checks instead of the build: about 45 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || printf '/.gpu/\n/.whl/\n' >> .git/info/exclude
version=$(.venv/bin/python -c 'import llama_cpp; print(llama_cpp.__version__)')
mkdir -p .whl .gpu/site
pins=$(.venv/bin/pip list --format=freeze 2>/dev/null |
       grep -iE '^(grpcio|grpcio-health-checking|grpcio-reflection|protobuf|prometheus.client|gguf|diskcache|fastapi|starlette|uvicorn|pydantic|pydantic.core|annotated.types|typing.inspection|opentelemetry.api|typing.extensions|cryptography|cffi|pycparser)==')
for pin in $pins; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "$pin"
done
tok=$(.venv/bin/python -c 'from common.model.store import resolve_gguf; print(resolve_gguf("qwen2.5-coder-0.5b"))')
tar -C "$tok" -cJf .gpu/tok.tar.xz tokenizer.json tokenizer_config.json chat_template.jinja generation_config.json config.json
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

if [ "${1:-}" = --prebuild ]; then
    cuda=/tmp/cuda-13.0  # a toolkit assembled from NVIDIA's wheels
    if [ ! -x $cuda/bin/nvcc ]; then
        rm -rf "$tmp" && tmp=$(mktemp -d)
        .venv/bin/pip download -q --no-deps -d "$tmp" "nvidia-cuda-nvcc==13.0.*" "nvidia-cuda-crt==13.0.*" \
            "nvidia-nvvm==13.0.*" "nvidia-cuda-runtime==13.0.*" "nvidia-cublas==13.0.*" "nvidia-cuda-cccl==13.0.*"
        mkdir -p $cuda
        for w in "$tmp"/*.whl; do python3 -m zipfile -e "$w" "$tmp/x"; done
        cp -r "$tmp"/x/nvidia/cu13/. $cuda/ && rm -rf "$tmp"
        chmod +x $cuda/bin/* $cuda/nvvm/bin/*
        (cd $cuda/lib && for l in cudart cublas cublasLt; do ln -sf lib$l.so.13 lib$l.so; done && ln -sfn lib ../lib64)
        # ggml links the driver for its virtual-memory pool: a stub of the calls it makes, as the
        # toolkit's own lib64/stubs holds; the real libcuda.so.1 is loaded there.
        mkdir -p $cuda/lib/stubs
        for f in cuDeviceGet cuDeviceGetAttribute cuGetErrorString cuMemAddressFree cuMemAddressReserve cuMemCreate \
                 cuMemGetAllocationGranularity cuMemMap cuMemRelease cuMemSetAccess cuMemUnmap; do
            echo "int $f(void) { return 0; }"
        done >$cuda/stub.c
        gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o $cuda/lib/stubs/libcuda.so $cuda/stub.c
    fi
    PATH=$cuda/bin:$PATH cmake -S .gpu/llama.cpp -B /tmp/llama-cuda-build -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DGGML_CUDA=ON -DCUDAToolkit_ROOT=$cuda -DCMAKE_CUDA_COMPILER=$cuda/bin/nvcc -DCMAKE_CUDA_ARCHITECTURES=90-real \
        -DGGML_CUDA_FA=OFF -DGGML_CUDA_NCCL=OFF -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON \
        -DGGML_F16C=ON -DGGML_BMI2=ON -DBUILD_SHARED_LIBS=ON -DLLAMA_BUILD_COMMON=OFF -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
        -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON '-DCMAKE_INSTALL_RPATH=$ORIGIN' >/dev/null
    PATH=$cuda/bin:$PATH cmake --build /tmp/llama-cuda-build --target llama -j "$(nproc)"
    rm -rf .gpu/lib && mkdir -p .gpu/lib && cp -P /tmp/llama-cuda-build/bin/*.so* .gpu/lib/
    strip --strip-unneeded .gpu/lib/*.so.*.*
fi
du -sh .gpu .whl
