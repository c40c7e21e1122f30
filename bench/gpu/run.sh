#!/usr/bin/env bash
# On the CUDA machine, from the project root with .gpu/ carried (../shared/gpu/prepare-bundle.sh):
# builds llama-cpp-python and ggml_ext for CUDA, checks the GPU scorer against numpy, writes the
# random-weight models once per machine, and runs bench/gpu/pflash_gpu.py with the given arguments.
#   bash bench/gpu/run.sh --out $OUT/pflash_gpu.json [pflash_gpu.py args...]
set -euo pipefail
bash .gpu/on-device.sh
export PYTHONPATH=/tmp/site:$PWD
suffix=$(python3 -c "from importlib.machinery import EXTENSION_SUFFIXES as e; print(e[0])")
PFLASH_EXT_BACKEND=cuda CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=90" \
  python3 ggml_ext/pflash_build.py "pflash_plugin/_pflash_ext$suffix" > /tmp/ext-build.log 2>&1 || { cat /tmp/ext-build.log; exit 1; }
python3 - <<'PY'
import time
import numpy as np
from pflash_plugin.llama import native
from pflash_plugin.pflash.scoring import attention_mass
assert native.gpu_count() > 0, "the CUDA scorer sees no GPU"
rng = np.random.default_rng(0)
for n, h, kv, d in [(1001, 8, 1, 36), (65536, 32, 8, 128)]:
    q = rng.standard_normal((n, h, d)).astype(np.float32); k = rng.standard_normal((n, kv, d)).astype(np.float32)
    ref = attention_mass(q, k, n - 8)
    for _ in range(2):
        t0 = time.perf_counter(); got = native.attention_mass(q, k, n - 8, n, use_gpu=True); t1 = time.perf_counter()
    print(f"gpu scorer n={n}: max rel err {np.max(np.abs(got - ref) / ref):.2e}, {1000 * (t1 - t0):.1f} ms with copies", flush=True)
PY
mkdir -p /tmp/models
write() {  # in its own process: loading a GGUF where the gguf package wrote it segfaulted here
  [ -f "$1" ] || python3 -c "import sys; from pflash_plugin.testing import write_tiny_llama as w; w(sys.argv[1], $2, f16=True, tiled=True, n_ctx_train=262144)" "$1"
}
start=$(date +%s)
write /tmp/models/target-8b.gguf "n_layer=32, n_embd=4096, n_head=32, n_head_kv=8, n_ff=14336"
write /tmp/models/drafter-0.6b.gguf "n_layer=28, n_embd=1024, n_head=16, n_head_kv=8, n_ff=3072"
echo "models ready in $(( $(date +%s) - start )) s: $(du -sh /tmp/models | cut -f1)"
# bench/gpu/pflash_gpu.py imports numpy after llama_cpp: numpy first made the CUDA model load segfault here
python3 bench/gpu/pflash_gpu.py --target /tmp/models/target-8b.gguf --drafter /tmp/models/drafter-0.6b.gguf "$@"
