#!/usr/bin/env bash
# The checks only a GPU can make, as one script for a lent GPU machine (CUDA, PyTorch and a compiler,
# no network), in the repository root after scripts/gpu_prepare.sh ran where pip works:
#   1. the offloaded torch target's tests on CUDA (logits equal the resident model's, whole
#      generations equal the CPU's), while llama.cpp builds with CUDA (7 minutes on 14 cores);
#   2. llama.cpp loads and decodes with and without PyTorch in the process, then the llama.cpp
#      tests' GPU cases (tree passes see only their ancestors; SpecExec equals the same backend's
#      one-token loop; sessions sharing a pass equal each alone);
#   3. llama.cpp's pass time on a random Q4_K GGUF of Qwen2.5-7B's shape: every weight in RAM,
#      half the layers on the GPU, all of them (benchmarks/llama_pass_time.py, torch-free);
#   4. the offloaded torch target's pass time against the tree size for the same shape.
# On 26 Nov (H200) the build took about 7 minutes and the torch bench, beside it, another 7 (making
# 7.6B random weights on 4 cores); a device call lasts at most 10, so plan for the last steps to
# be cut off: each writes its own JSON when it ends.
# Results and logs go to $OUT (default ./gpu-out). Steps go on after a failure; the exit status is
# the number of failed steps.
set -u
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
start=$(date +%s)
failed=0
step() {  # step NAME COMMAND...: run, time and log one step
    local name=$1
    shift
    echo "== [$(($(date +%s) - start)) s] $name"
    "$@" || { echo "!! $name failed ($?)"; failed=$((failed + 1)); }
}
pin() {  # pin CORES COMMAND...: on those cores where taskset exists
    local cores=$1
    shift
    if command -v taskset >/dev/null; then taskset -c "$cores" "$@"; else "$@"; fi
}
nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv
python3 -V
grep -m1 'model name' /proc/cpuinfo; nproc
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
cp -r .gpu/site/llama_cpp /tmp/site/
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false

# llama.cpp with CUDA, the library only, for Hopper (sm_90); flash attention's kernels left out to
# halve the build (llama.cpp then runs attention without them). AMX off as in scripts/setup.sh.
build() {
    CFLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" CXXFLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" \
        cmake -S .gpu/llama.cpp -B /tmp/llama-build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
        -DCMAKE_CUDA_ARCHITECTURES=90-real -DGGML_CUDA_FA=OFF -DGGML_CUDA_NCCL=OFF -DGGML_NATIVE=ON \
        -DBUILD_SHARED_LIBS=ON -DLLAMA_BUILD_COMMON=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF &&
        timeout "${BUILD_LIMIT_S:-330}" cmake --build /tmp/llama-build --target llama -j 14
}
(pin 2-15 bash -c "$(declare -f build); build" >"$OUT/build.txt" 2>&1; echo $? >/tmp/build.rc) &
builder=$!

step "torch offload tests on CUDA" pin 0-1 env OMP_NUM_THREADS=2 python3 -m pytest -q -p no:cacheprovider \
    tests/test_offload.py -k cuda

echo "== [$(($(date +%s) - start)) s] waiting for the llama.cpp build"
wait $builder
tail -3 "$OUT/build.txt"
if [ "$(cat /tmp/build.rc)" = 0 ]; then
    cp -P /tmp/llama-build/bin/*.so* /tmp/site/llama_cpp/lib/
    step "llama.cpp sees the GPU" python3 -c \
        "import llama_cpp, sys; print(llama_cpp.llama_print_system_info().decode()); sys.exit(not llama_cpp.llama_supports_gpu_offload())"
    # On 26 Nov (H200, torch 2.11+cu130) a load crashed in any process that had imported PyTorch
    # and succeeded in one that had not: which half of that holds?
    step "tiny GGUF" python3 -c "from tests.tiny_models import gguf_model_dir, make_tiny_model as m
gguf_model_dir(m('/tmp/tiny', arch='qwen2', layers=4, seed=3), '/tmp/tiny-gguf', 'F32')"
    for case in "no torch, 99 GPU layers:" "no torch, 0 GPU layers:" "torch, 0 GPU layers:import torch" \
                "torch, 99 GPU layers:import torch"; do
        label=${case%%:*} pre=${case#*:} layers=${label##*, }
        step "llama.cpp load and decode, $label" python3 -c "$pre
import llama_cpp as l
l.llama_backend_init(); p = l.llama_model_default_params(); p.n_gpu_layers = ${layers%% *}
m = l.llama_model_load_from_file(b'/tmp/tiny-gguf/model.gguf', p); assert m
c = l.llama_init_from_model(m, l.llama_context_default_params()); assert c
b = l.llama_batch_get_one((l.llama_token * 3)(72, 101, 108), 3); assert l.llama_decode(c, b) == 0
print('ok', l.llama_get_logits_ith(c, -1)[0])"
    done
    step "llama.cpp tests, GPU cases" python3 -m pytest -q -p no:cacheprovider tests/test_llama_cpp.py -k gpu -rs
    step "random Q4_K GGUF, Qwen2.5-7B shape" python3 -m benchmarks.bench_offload --shape qwen2.5-7b \
        --write-gguf /tmp/random-7b.gguf
    step "llama.cpp pass time, Qwen2.5-7B shape, no torch in the process" python3 -m benchmarks.llama_pass_time \
        --gguf /tmp/random-7b.gguf --layers 0 14 99 --ks 1 16 32 64 128 256 --out "$OUT/llama-7b.json"
else
    echo "!! llama.cpp build failed"
    failed=$((failed + 1))
fi
step "torch offload pass time, Qwen2.5-7B shape" python3 -m benchmarks.bench_offload \
    --shape qwen2.5-7b --ks 1 16 64 256 1024 4096 --resident-layers 0 14 --seconds 0.5 \
    --out "$OUT/offload-torch-7b.json"
echo "== [$(($(date +%s) - start)) s] done, $failed failed"
exit $failed
