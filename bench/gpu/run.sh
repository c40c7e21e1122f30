#!/usr/bin/env bash
# On the CUDA machine, from the project root with .gpu/ carried (../shared/gpu/prepare-bundle.sh):
# builds llama-cpp-python and ggml_ext for CUDA (bench/gpu/setup.sh), checks the GPU scorer against
# numpy, and runs bench/gpu/pflash_gpu.py on the random-weight models with the given arguments.
#   bash bench/gpu/run.sh --out $OUT/pflash_gpu.json [pflash_gpu.py args...]
set -euo pipefail
source bench/gpu/setup.sh
python3 - <<'PY'
import time
import numpy as np
from pflash_plugin.llama import native
from pflash_plugin.pflash.attention_mass import attention_mass
assert native.gpu_count() > 0, "the CUDA scorer sees no GPU"
rng = np.random.default_rng(0)
for n, h, kv, d in [(1001, 8, 1, 36), (65536, 32, 8, 128)]:
    q = rng.standard_normal((n, h, d)).astype(np.float32); k = rng.standard_normal((n, kv, d)).astype(np.float32)
    ref = attention_mass(q, k, n - 8)
    for _ in range(2):
        t0 = time.perf_counter(); got = native.attention_mass(q, k, n - 8, n, use_gpu=True); t1 = time.perf_counter()
    print(f"gpu scorer n={n}: max rel err {np.max(np.abs(got - ref) / ref):.2e}, {1000 * (t1 - t0):.1f} ms with copies", flush=True)
PY
# bench/gpu/pflash_gpu.py imports numpy after llama_cpp: numpy first made the CUDA model load segfault here
python3 bench/gpu/pflash_gpu.py --target "$TARGET" --drafter "$DRAFTER" "$@"
