#!/usr/bin/env bash
# The checks only a GPU can make, as one script for a lent GPU machine (CUDA, PyTorch and a compiler,
# no network), in the repository root after scripts/gpu_prepare.sh ran where pip works:
#   1. the offloaded torch target's tests on CUDA (logits equal the resident model's, whole
#      generations equal the CPU's);
#   2. llama.cpp with CUDA: prebuilt by gpu_prepare.sh (.gpu/lib), else built here (7 minutes on
#      14 cores on 26 Nov);
#   3. llama.cpp loads and decodes with and without PyTorch in the process, under a crash handler
#      that prints the native stack: on 26 Nov a llama.cpp built on the H200 (GGML_NATIVE, the
#      system's CUDA 13.0) crashed at load in any process holding PyTorch 2.11+cu130; the prebuilt
#      library ran in all 8 cases on the H100. Each way around a crash is its own case; the first
#      that works is kept (a sitecustomize.py) for the steps after;
#   4. the llama.cpp tests' GPU cases (tree passes see only their ancestors, within TF32's error;
#      SpecExec parts from the one-token loop only at near ties; sessions sharing a pass equal each
#      alone);
#   5. llama.cpp's pass time on a random Q4_K GGUF of Qwen2.5-7B's shape, torch-free: every weight
#      in RAM (mapped, as llama.cpp loads by default, and read into pinned memory, as our backend
#      does on a GPU build), half the layers on the GPU, all of them (benchmarks/llama_pass_time.py),
#      then our backend's own curve with PyTorch loaded;
#   6. the offloaded torch target's pass time for the same shape, on the same card.
# On 26 Nov (H100) steps 1-6 took about 3 minutes with the prebuilt library (before the second pass-time run was added).
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
nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv
python3 -V
grep -m1 'model name' /proc/cpuinfo; nproc
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
cp -r .gpu/site/llama_cpp /tmp/site/
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda)"
TORCH_CUDA_LIB=$(python3 -c "import nvidia.cu13, os; print(os.path.join(list(nvidia.cu13.__path__)[0], 'lib'))" 2>/dev/null)
SYSTEM_CUDA_LIB=/usr/local/cuda/lib64
command -v nvcc >/dev/null && SYSTEM_CUDA_LIB=$(readlink -f "$(dirname "$(readlink -f "$(command -v nvcc)")")/../lib64")
echo "PyTorch's CUDA libraries: $TORCH_CUDA_LIB; the toolkit's: $SYSTEM_CUDA_LIB"

step "torch offload tests on CUDA" python3 -m pytest -q -p no:cacheprovider tests/test_offload.py -k cuda

if [ -d .gpu/lib ]; then
    cp -P .gpu/lib/* /tmp/site/llama_cpp/lib/
    # Built against CUDA 13.0's wheels: the runtime and cuBLAS come from the toolkit here, else PyTorch's.
    cuda_lib=$SYSTEM_CUDA_LIB
    [ -e "$cuda_lib/libcublas.so.13" ] || cuda_lib=$TORCH_CUDA_LIB
    export LD_LIBRARY_PATH=$cuda_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
else
    echo "== [$(($(date +%s) - start)) s] building llama.cpp with CUDA"
    CFLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" CXXFLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" \
        cmake -S .gpu/llama.cpp -B /tmp/llama-build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
        -DCMAKE_CUDA_ARCHITECTURES=90-real -DGGML_CUDA_FA=OFF -DGGML_CUDA_NCCL=OFF -DGGML_NATIVE=ON \
        -DBUILD_SHARED_LIBS=ON -DLLAMA_BUILD_COMMON=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF >"$OUT/build.txt" 2>&1 &&
        timeout "${BUILD_LIMIT_S:-420}" cmake --build /tmp/llama-build --target llama -j "$(nproc)" >>"$OUT/build.txt" 2>&1 ||
        { tail -5 "$OUT/build.txt"; echo "!! llama.cpp build failed"; exit $((failed + 1)); }
    cp -P /tmp/llama-build/bin/*.so* /tmp/site/llama_cpp/lib/
fi
ldd /tmp/site/llama_cpp/lib/libggml-cuda.so* | grep -E 'cuda|cublas|gomp|stdc'
step "llama.cpp sees the GPU" python3 -c \
    "import llama_cpp, sys; print(llama_cpp.llama_print_system_info().decode()); sys.exit(not llama_cpp.llama_supports_gpu_offload())"

# A crash prints its native stack (cuda-gdb, where it runs, prints more).
cat >/tmp/segv.c <<'EOF'
#include <execinfo.h>
#include <signal.h>
#include <stdlib.h>
#include <unistd.h>
static char stack[1 << 16];
static void dump(int sig) {
    void *frames[64];
    int n = backtrace(frames, 64);
    write(2, "native stack:\n", 14);
    backtrace_symbols_fd(frames, n, 2);
    signal(sig, SIG_DFL);
    raise(sig);
}
__attribute__((constructor)) static void install(void) {
    stack_t ss = {.ss_sp = stack, .ss_size = sizeof stack};
    sigaltstack(&ss, 0);
    struct sigaction sa = {.sa_handler = dump, .sa_flags = SA_ONSTACK};
    sigaction(SIGSEGV, &sa, 0);
    sigaction(SIGBUS, &sa, 0);
    sigaction(SIGABRT, &sa, 0);
}
EOF
gcc -shared -fPIC -O1 -o /tmp/segv.so /tmp/segv.c
step "tiny GGUF" python3 -c "from tests.tiny_models import gguf_model_dir, make_tiny_model as m
gguf_model_dir(m('/tmp/tiny', arch='qwen2', layers=4, seed=3), '/tmp/tiny-gguf', 'F32')"
cat >/tmp/load_decode.py <<'EOF'
import sys
layers = int(sys.argv[1])
import llama_cpp as l
l.llama_backend_init(); p = l.llama_model_default_params(); p.n_gpu_layers = layers
m = l.llama_model_load_from_file(b'/tmp/tiny-gguf/model.gguf', p); assert m
c = l.llama_init_from_model(m, l.llama_context_default_params()); assert c
b = l.llama_batch_get_one((l.llama_token * 3)(72, 101, 108), 3); assert l.llama_decode(c, b) == 0
print('ok', l.llama_get_logits_ith(c, -1)[0])
EOF
# case: label | LD_LIBRARY_PATH first | LD_PRELOAD | Python run first (a sitecustomize.py) | GPU layers
cases=(
    "no torch||||99"
    "no torch||||0"
    "torch|||import torch|0"
    "torch|||import torch|99"
    "torch, CUDA initialised by torch first|||import torch; torch.cuda.init()|99"
    "llama.cpp loaded first, then torch|||import llama_cpp, torch|99"
    "torch, PyTorch's CUDA libraries first|$TORCH_CUDA_LIB||import torch|99"
    "torch, the toolkit's CUDA libraries preloaded||$SYSTEM_CUDA_LIB/libcudart.so.13:$SYSTEM_CUDA_LIB/libcublasLt.so.13:$SYSTEM_CUDA_LIB/libcublas.so.13|import torch|99"
)
chosen=""
traced=""
for case in "${cases[@]}"; do
    IFS='|' read -r label libs preload pre layers <<<"$case"
    rm -rf /tmp/pre && mkdir -p /tmp/pre && echo "$pre" >/tmp/pre/sitecustomize.py
    echo "== [$(($(date +%s) - start)) s] llama.cpp load and decode: $label, $layers GPU layers"
    if LD_LIBRARY_PATH="$libs${libs:+:}${LD_LIBRARY_PATH:-}" LD_PRELOAD="/tmp/segv.so${preload:+:$preload}" \
        PYTHONPATH="/tmp/pre:$PYTHONPATH" timeout 120 python3 /tmp/load_decode.py "$layers" 2>"$OUT/case.err"; then
        [ -z "$chosen" ] && [[ $pre == *torch* ]] && [ "$layers" = 99 ] && chosen=$case
    else
        echo "!! crashed or failed"
        grep -A40 -E 'native stack|Traceback|rror' "$OUT/case.err" | head -50
        if [ -z "$traced" ] && [[ $pre == *torch* ]] && command -v cuda-gdb >/dev/null; then
            traced=1
            PYTHONPATH="/tmp/pre:$PYTHONPATH" timeout 60 cuda-gdb -q -batch -ex run -ex bt \
                --args python3 /tmp/load_decode.py "$layers" >"$OUT/gdb.txt" 2>&1
            grep -E '^#|SIG' "$OUT/gdb.txt" | head -40
        fi
    fi
done
echo "== kept for the steps below: ${chosen:-none (every torch case failed)}"
rm -rf /tmp/pre && mkdir -p /tmp/pre
if [ -n "$chosen" ]; then
    IFS='|' read -r label libs preload pre layers <<<"$chosen"
    echo "$pre" >/tmp/pre/sitecustomize.py
    [ -n "$libs" ] && export LD_LIBRARY_PATH=$libs:${LD_LIBRARY_PATH:-}
    [ -n "$preload" ] && export LD_PRELOAD=$preload
fi
export PYTHONPATH=/tmp/pre:$PYTHONPATH
step "llama.cpp tests, GPU cases" timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_llama_cpp.py -k gpu -rs
step "random Q4_K GGUF, Qwen2.5-7B shape" python3 -m benchmarks.bench_offload --shape qwen2.5-7b \
    --write-gguf /tmp/random-7b.gguf
# Every layer in RAM, mapped (llama.cpp's default: streamed from pageable pages, from 32 rows) and
# read into pinned memory, streamed from 2 rows (ours); then 14 and all 28 layers on the GPU.
for run in "mapped|0|32|" "read|0 14 99|2|--no-mmap"; do
    IFS='|' read -r label layers rows flag <<<"$run"
    step "llama.cpp pass time, Qwen2.5-7B shape, $label, streamed from $rows rows, no torch in the process" \
        env PYTHONPATH=/tmp/site:$PWD GGML_OP_OFFLOAD_MIN_BATCH=$rows timeout 200 python3 -m benchmarks.llama_pass_time \
        --gguf /tmp/random-7b.gguf --layers $layers --ks 1 2 4 16 32 64 256 1024 $flag --out "$OUT/llama-7b-$label.json"
done
step "our llama.cpp backend's curve, Qwen2.5-7B shape, PyTorch loaded" timeout 150 python3 -c "
import torch
from common.model.llama_cpp import LlamaCppModel
for layers in (0, 14):
    m = LlamaCppModel('/tmp/random-7b.gguf', n_gpu_layers=layers)
    row = {k: round(m.time_tree(k, 64, torch.arange(-1, k - 1), budget_seconds=0.4), 4) for k in (1, 2, 4, 16, 64, 256)}
    print(layers, 'GPU layers:', row, m.curve_key())
    m.close()"
step "torch offload pass time, Qwen2.5-7B shape" timeout 200 python3 -m benchmarks.bench_offload \
    --shape qwen2.5-7b --ks 1 16 64 256 1024 4096 --resident-layers 0 14 --seconds 0.5 \
    --out "$OUT/offload-torch-7b.json"
echo "== [$(($(date +%s) - start)) s] done, $failed failed"
exit $failed
