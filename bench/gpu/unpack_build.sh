#!/usr/bin/env bash
# On a bare CUDA machine, from the project root: restores bench/gpu/pack_build.sh's pieces carried in
# .gpu/ (llama-cpp-python with libmtmd, llama-server, the ggml_ext build) and installs the bundled
# pure-Python wheels beside them, so bench/gpu/setup.sh and servers.sh find everything built.
set -euo pipefail
ls .gpu/prebuilt.tar.xz.* > /dev/null 2>&1 || exit 0
cat .gpu/prebuilt.tar.xz.* > /tmp/prebuilt.tar.xz
# the sum names /tmp/prebuilt.tar.xz, where pack_build.sh wrote it
sha256sum -c --quiet .gpu/prebuilt.sha256 || { echo "prebuilt pieces do not match their sha256: building instead"; exit 0; }
xz -dc -T0 /tmp/prebuilt.tar.xz | tar xf - -P
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/wheels/*.whl
PYTHONPATH=/tmp/site python3 -c "import llama_cpp; assert llama_cpp.llama_supports_gpu_offload(); print('prebuilt llama-cpp-python', llama_cpp.__version__, 'restored')"
