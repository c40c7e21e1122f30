#!/usr/bin/env bash
# On a CUDA machine, from the project root with .gpu/ carried and ../shared/gpu/build-llama-server.sh
# copied into .gpu/: builds llama-server (with the llama-cpp-python build, once per machine), writes
# the random-weight models (bench/gpu/setup.sh), then runs a bench script that compares ours with it:
#   bash bench/gpu/servers.sh bench/gpu/concurrent_gpu.py --out $OUT/concurrent_gpu.json [args...]
set -euo pipefail
script=$1; shift
# servers left by an earlier call that ended inside a hang keep their GPU busy: stop them first (only
# those of the bench's models: bench/gpu/quality_gpu.sh's gate on the demo model may be running beside)
for pid in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader); do
  if grep -qs /tmp/models/ "/proc/$pid/cmdline"; then kill -9 "$pid"; fi
done
# llama-server comes from llama-cpp-python's own build: its CMake adds the vendored llama.cpp, so
# the same build tree, kept in /tmp/lcp-build, also makes llama-server (one CUDA compile where two
# side by side took ~11 min of a session's 30: on the H200 the setup with it, the CUDA ext and the
# drafters, without the 8B target, took 315 s, llama-server --version ran). A machine with
# llama-cpp-python installed before and no llama-server builds it apart (.gpu/build-llama-server.sh,
# ~250 s on 16 cores).
lcp_build=/tmp/lcp-build
build_apart() { bash .gpu/build-llama-server.sh > /tmp/ls-build-out.log 2>&1 & building=$!; }
server=$(ls "$lcp_build/bin/llama-server" /tmp/ls-src/*/vendor/llama.cpp/build/bin/llama-server 2>/dev/null | head -1 || true)
if [ -z "$server" ] && [ -z "${NO_LLAMA_SERVER:-}" ]; then  # NO_LLAMA_SERVER=1: arms that need none
  if ! PYTHONPATH=/tmp/site python3 -c "import llama_cpp" 2>/dev/null; then
    one_build=1
    export SKBUILD_BUILD_DIR=$lcp_build EXTRA_CMAKE_ARGS="${EXTRA_CMAKE_ARGS:-} -DLLAMA_BUILD_TOOLS=ON \
-DLLAMA_BUILD_SERVER=ON -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF"
  else
    build_apart
  fi
fi
source bench/gpu/setup.sh
if [ -n "${one_build:-}" ]; then
  if [ -d "$lcp_build" ]; then  # built with the wheel (`all`); this only checks it is there
    cmake --build "$lcp_build" --target llama-server -j"$(nproc)" > /tmp/ls-build.log 2>&1 || { tail -40 /tmp/ls-build.log; exit 1; }
    server=$lcp_build/bin/llama-server
  else  # the wheel came from an earlier build (.gpu/build): no build tree to take it from
    build_apart
  fi
fi
if [ -n "${building:-}" ]; then
  wait "$building" || { cat /tmp/ls-build-out.log; exit 1; }
  server=$(tail -1 /tmp/ls-build-out.log)
  head -n -1 /tmp/ls-build-out.log
fi
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv
python3 "$script" --target "$TARGET" --drafter "$DRAFTER" --llama-server "${server:-none}" "$@"
