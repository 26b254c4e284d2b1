#!/usr/bin/env bash
# The checks only a GPU can make, as one script for a lent GPU machine (CUDA and PyTorch, no network),
# run in the repository root after scripts/gpu_prepare.sh --prebuild ran where pip works (carry .whl,
# .gpu/lib and .gpu/site):
#   1. the offloaded torch target's tests on CUDA (logits equal the resident model's, whole
#      generations equal the CPU's);
#   2. the prebuilt llama.cpp (CUDA 13.0, sm_90) loads and decodes, with and without PyTorch in the
#      process, under a crash handler that prints the native stack (on 26 Nov a llama.cpp built on an
#      H200 crashed at load beside PyTorch's CUDA build; the prebuilt one ran in all 8 cases tried);
#   3. the llama.cpp tests' GPU cases: tree passes see only their ancestors, sessions sharing a pass
#      equal each alone, SpecExec parts from the one-token loop only at near ties, and a whole
#      generation through real nodes (`specexec target`, torch-free, and `specexec draft`, lookahead
#      on) with every layer on the GPU;
#   4. the forward-time curves the nodes would measure at start, through our backend (1 to 256 tree
#      tokens): a target of Qwen2.5-7B's shape with every layer in RAM and with half on the GPU, and
#      drafts of Qwen2.5-0.5B's and 1.5B's shapes on the GPU, on random Q4_K GGUFs
#      (benchmarks/bench_offload.py --write-gguf: a pass costs what a real file of the shape costs).
#      `benchmarks/pipeline_sim.py --target-curve/--draft-curve` plays the default pair's real
#      acceptance on them;
#   5. whole generations in one process at that scale, the 7B-shape target streamed from RAM and the
#      0.5B-shape draft on the GPU, each step's time against what the curves predict
#      (benchmarks/gpu_generation.py);
#   6. many sessions on that target, and with half its layers on the GPU (1, 2, 4, 8 threads of one
#      process on the same engines, as the nodes serve them): passes that wait for sessions due
#      back, passes that wait for none, and one session a pass; the target alone and fixed trees
#      (benchmarks/gpu_load.py);
#   7. many streaming clients through real nodes and the gateway's OpenAI endpoint (`specexec bench
#      --load`, 1 and 8 clients, 32-token answers): the 7B-shape target node streamed from RAM on 12
#      cores, the 0.5B-shape draft node on the GPU, both with the default pair's tokenizer. Random
#      weights give no real acceptance (the planner soon runs the target alone), so this measures
#      the serving path: gRPC, the gateway, streaming, and passes shared across processes.
# ONLY=REGEX runs only the steps whose names match (the setup always runs).
# On 26 Nov (H100) steps 1-4 took 3.6 minutes and step 5 about 1 minute; on 27 Nov step 6 with two
# contestants 2.6 minutes (0 GPU layers) and 0.4 (14); on 27 Nov (H200) step 7 took 4.4 minutes. On 29 Nov
# (H200) the setup took 30 s, step 6 with LOAD_CLIENTS='1 8' LOAD_TREES=16 and two contestants 33 and 25 s.
# Results and logs go to $OUT (default ./gpu-out). Steps go on after a failure; the exit status is
# the number of failed steps.
set -u
export OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
start=$(date +%s)
failed=0
step() {  # step NAME COMMAND...: run, time and log one step
    local name=$1
    shift
    [[ $name =~ ${ONLY:-.} ]] || return 0
    echo "== [$(($(date +%s) - start)) s] $name"
    "$@" || { echo "!! $name failed ($?)"; failed=$((failed + 1)); }
}
nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max --format=csv
python3 -V
grep -m1 'model name' /proc/cpuinfo; nproc
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
cp -r .gpu/site/llama_cpp /tmp/site/ && cp -P .gpu/lib/* /tmp/site/llama_cpp/lib/ || exit 1
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
python3 -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda)"
python3 -c "import client.cli.commands, transformers" || exit 1  # the CLI, the gateway and its HTTP stack
# Built against CUDA 13.0's wheels: the runtime and cuBLAS come from the toolkit here, else PyTorch's.
cuda_lib=/usr/local/cuda/lib64
command -v nvcc >/dev/null && cuda_lib=$(readlink -f "$(dirname "$(readlink -f "$(command -v nvcc)")")/../lib64")
[ -e "$cuda_lib/libcublas.so.13" ] ||
    cuda_lib=$(python3 -c "import nvidia.cu13, os; print(os.path.join(list(nvidia.cu13.__path__)[0], 'lib'))")
export LD_LIBRARY_PATH=$cuda_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
echo "CUDA libraries from $cuda_lib"

step "torch offload tests on CUDA" timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_offload.py -k cuda

cat >/tmp/segv.c <<'EOF'
#include <execinfo.h>
#include <signal.h>
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
rm -rf /tmp/tiny /tmp/tiny-gguf
python3 -c "from tests.tiny_models import gguf_model_dir, make_tiny_model as m
gguf_model_dir(m('/tmp/tiny', arch='qwen2', layers=4, seed=3), '/tmp/tiny-gguf', 'F32')"
for first in "" "import torch; torch.cuda.init(); "; do
    step "llama.cpp loads and decodes on the GPU${first:+, CUDA started by PyTorch first}" env LD_PRELOAD=/tmp/segv.so \
        timeout 120 python3 -c "${first}import llama_cpp as l
assert l.llama_supports_gpu_offload()
l.llama_backend_init(); p = l.llama_model_default_params(); p.n_gpu_layers = 99
m = l.llama_model_load_from_file(b'/tmp/tiny-gguf/model.gguf', p); assert m
c = l.llama_init_from_model(m, l.llama_context_default_params()); assert c
b = l.llama_batch_get_one((l.llama_token * 3)(72, 101, 108), 3); assert l.llama_decode(c, b) == 0
print('ok', l.llama_get_logits_ith(c, -1)[0])"
done

step "llama.cpp tests, GPU cases" timeout 300 python3 -m pytest -q -p no:cacheprovider -rs \
    tests/test_llama_cpp.py tests/test_llama_draft.py -k "gpu ${GPU_TESTS:+and ($GPU_TESTS)}"

for shape in qwen2.5-7b qwen2.5-1.5b qwen2.5-0.5b; do
    step "random Q4_K GGUF, $shape shape" python3 -m benchmarks.bench_offload --shape $shape --write-gguf /tmp/$shape.gguf
done
# role|shape|GPU layers: as `specexec target|draft --model M --n-gpu-layers N` profile at start.
step "forward-time curves through our backend" timeout 240 python3 - <<'PY'
import json, os, time
from common.model.llama_cpp import LlamaCppModel
from common.model.profiling import forward_curve
runs = {"target 7b, 0 GPU layers": ("qwen2.5-7b", 0), "target 7b, 14 GPU layers": ("qwen2.5-7b", 14),
        "draft 0.5b, on the GPU": ("qwen2.5-0.5b", 99), "draft 1.5b, on the GPU": ("qwen2.5-1.5b", 99)}
out = {}
for label, (shape, layers) in runs.items():
    started = time.perf_counter()
    model = LlamaCppModel(f"/tmp/{shape}.gguf", n_gpu_layers=layers)
    curve = forward_curve(model, 256, 1.0, progress=False)
    model.close()
    out[label] = {"shape": shape, "n_gpu_layers": layers, "curve": curve}
    print(label, f"({time.perf_counter() - started:.0f} s):",
          ", ".join(f"{n}: {t * 1e3:.1f} ms" for n, t in curve if n in (1, 2, 4, 8, 16, 32, 64, 128, 256)))
    with open(os.path.join(os.environ["OUT"], "curves.json"), "w") as f:
        json.dump(out, f, indent=1)
PY
step "whole generations, 7B-shape target streamed, 0.5B-shape draft on the GPU" timeout 240 \
    python3 -m benchmarks.gpu_generation --target /tmp/qwen2.5-7b.gguf --draft /tmp/qwen2.5-0.5b.gguf \
    --target-layers 0 --draft-layers 99 --budgets 4 16 64 128 --out "$OUT/generation.json"
# The target's curves as step 4 measured them on an H100 on 26 November. LOAD_CONTESTANTS='A|B': only
# those of benchmarks/gpu_load.py's contestants (default: all); LOAD_CLIENTS='1 8', LOAD_TREES='16': fewer rounds.
curves=docs/gpu/h100-26nov-evening/curves.json
IFS='|' read -ra contestants <<<"${LOAD_CONTESTANTS:-}"
step "many sessions on one streamed 7B-shape target" timeout 300 \
    python3 -m benchmarks.gpu_load --target /tmp/qwen2.5-7b.gguf --draft /tmp/qwen2.5-0.5b.gguf \
    --target-layers 0 --draft-layers 99 --clients ${LOAD_CLIENTS:-1 2 4 8} --trees ${LOAD_TREES:-16 64} --steps 16 --out "$OUT/load.json" \
    --curves-from $curves --target-curve "target 7b, 0 GPU layers" ${contestants[@]+--contestants "${contestants[@]}"}
step "many sessions on a 7B-shape target with 14 of 28 layers on the GPU" timeout 240 \
    python3 -m benchmarks.gpu_load --target /tmp/qwen2.5-7b.gguf --draft /tmp/qwen2.5-0.5b.gguf \
    --target-layers 14 --draft-layers 99 --clients 1 8 --trees 16 --steps 16 --out "$OUT/load-14.json" \
    --curves-from $curves --target-curve "target 7b, 14 GPU layers" ${contestants[@]+--contestants "${contestants[@]}"}
gateway_load() {
    for role in target draft; do
        mkdir -p /tmp/gw-$role && tar -C /tmp/gw-$role -xJf .gpu/tok.tar.xz
    done
    ln -sf /tmp/qwen2.5-7b.gguf /tmp/gw-target/model.gguf && ln -sf /tmp/qwen2.5-0.5b.gguf /tmp/gw-draft/model.gguf
    python3 -m client.cli.main bench --load --target-model /tmp/gw-target --draft-model /tmp/gw-draft \
        --load-target-backend llama.cpp --load-draft-backend llama.cpp --load-draft-n-gpu-layers 99 \
        --draft-cores 0,1,2,3 --target-cores 4,5,6,7,8,9,10,11,12,13,14,15 --clients ${GATEWAY_CLIENTS:-1 8} \
        --max-new-tokens ${GATEWAY_TOKENS:-32} --out "$OUT/gateway"
}
export -f gateway_load
step "many clients through the gateway, 7B-shape target streamed" timeout 420 bash -c gateway_load
echo "== [$(($(date +%s) - start)) s] done, $failed failed"
exit $failed
