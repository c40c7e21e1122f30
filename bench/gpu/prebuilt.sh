#!/usr/bin/env bash
# The device's CUDA build, done here ahead: a fresh device machine spent ~300 s of a session's 1,800 s of
# device time building llama-cpp-python with llama-server and the mtmd tools (bench/gpu/servers.sh's one
# build); with this it unpacks them in seconds. This machine has nvcc 13.0 (as the device has) but no
# cuBLAS and no driver: cuBLAS comes from PyPI's nvidia-cublas wheel (ggml-cuda's 13 cuBLAS symbols are all
# in 13.0's library too), the driver's libcuda.so.1 is a stub of the eleven symbols ggml-cuda calls (only
# linked against: the device's driver serves them).
#   bash bench/gpu/prebuilt.sh make     # here, from the project root: ~40 min on 2 cores, then `pack`
#   bash bench/gpu/prebuilt.sh pack     # -> .gpu/prebuilt.tar.xz (the rest, ~4.5 MB) and
#                                       #    .gpu-cuda/libggml-cuda.so.0.25.3.xz (~39 MB)
# On the device, carry [".gpu", ".gpu-cuda"] (with the tree, ~62 MB of the 64 MiB a call carries; should it
# pass, carry .gpu-cuda in a call of its own first, into /tmp/carry/, the next call back to back):
#   bash bench/gpu/prebuilt.sh unpack && PFLASH_TREE=... bash bench/gpu/queue.sh start ...
# `unpack` puts llama-cpp-python and the bundle's wheels into /tmp/site (so bench/gpu/setup.sh finds it and
# builds nothing), llama-server, llama-mtmd-cli and libmtmd into /tmp/lcp-build/bin (where servers.sh and
# mtmd_from_build.py look). The CPU part is built for AVX2 (GGML_NATIVE=OFF): the device's CPU is not this
# one, and a native build on an AMX CPU aborts at the first decode; the benches' work runs on the GPU.
set -euo pipefail
TK=/tmp/cudatk BUILD=/tmp/lcp-build SRC=${PREBUILT_SRC:-/tmp/lcp-prebuilt-src}
PACK=.gpu/prebuilt.tar.xz CUDA_LIB=libggml-cuda.so.0.25.3

toolkit() {  # nvcc's toolkit plus cuBLAS and a driver stub, in one folder CMake's FindCUDAToolkit takes
  [ -f "$TK/lib/stubs/libcuda.so" ] && return
  rm -rf "$TK" /tmp/cublas && cp -a "$(readlink -f /usr/local/cuda)" "$TK"
  pip download --no-deps -q -d /tmp/cublas 'nvidia-cublas>=13,<14'
  (cd /tmp/cublas && unzip -q nvidia_cublas-*.whl 'nvidia/cu13/include/*' 'nvidia/cu13/lib/*')
  cp -a /tmp/cublas/nvidia/cu13/include/* "$TK/include/" && cp -a /tmp/cublas/nvidia/cu13/lib/* "$TK/lib/"
  ln -sf libcublas.so.13 "$TK/lib/libcublas.so" && ln -sf libcublasLt.so.13 "$TK/lib/libcublasLt.so"
  local symbols="cuDeviceGet cuDeviceGetAttribute cuGetErrorString cuMemAddressFree cuMemAddressReserve
    cuMemCreate cuMemGetAllocationGranularity cuMemMap cuMemRelease cuMemSetAccess cuMemUnmap"
  mkdir -p "$TK/lib/stubs" && for s in $symbols; do echo "int $s(void) { return 0; }"; done > /tmp/cuda_stub.c
  gcc -shared -fPIC -Wl,-soname,libcuda.so.1 /tmp/cuda_stub.c -o "$TK/lib/stubs/libcuda.so"
  ln -sf libcuda.so "$TK/lib/stubs/libcuda.so.1"
}

make() {
  toolkit
  # the sources stay where they are and the build tree is kept: a second run (after a failure) rebuilds
  # only what is missing
  [ -d "$SRC" ] || { mkdir -p "$SRC" && tar xJf .gpu-src/llama-cpp-python.tar.xz -C "$SRC"; }
  rm -rf /tmp/prebuilt-wheel && mkdir -p /tmp/prebuilt-wheel
  # servers.sh's one-build arguments, for the AVX2 CPU part and this toolkit; the executables' links find
  # cuBLAS and the stub through LD_LIBRARY_PATH (ld's -rpath-link search)
  PATH=$TK/bin:$PATH CUDACXX=$TK/bin/nvcc SKBUILD_BUILD_DIR=$BUILD CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
  LD_LIBRARY_PATH=$TK/lib:$TK/lib/stubs \
  CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TOOLS=ON \
-DLLAMA_BUILD_SERVER=ON -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF \
-DLLAMA_CURL=OFF -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
-DCUDAToolkit_ROOT=$TK -DCUDA_cuda_driver_LIBRARY=$TK/lib/stubs/libcuda.so" \
    python3 -m pip wheel -q --no-deps -w /tmp/prebuilt-wheel "$SRC"/llama_cpp_python-*/
  pack
}

pack() {  # the installed package (each library once, its other names as links) and the tools
  local stage=/tmp/prebuilt-stage
  rm -rf "$stage" && mkdir -p "$stage/bin" .gpu-cuda
  python3 -m pip install -q --no-deps --no-compile --target "$stage/site" /tmp/prebuilt-wheel/*.whl
  # the wheel's second copy of the libraries, and a llama-server without its libllama-server-impl
  rm -rf "$stage/site/lib" "$stage/site/bin"
  (cd "$stage/site/llama_cpp/lib" && for f in *.so.*.*.*; do
    base=${f%%.so.*}.so; major=${f#"$base".}; major=$base.${major%%.*}
    ln -sf "$f" "$major" && ln -sf "$f" "$base"; done)
  xz -T0 -6 -c "$stage/site/llama_cpp/lib/$CUDA_LIB" > ".gpu-cuda/$CUDA_LIB.xz" && rm "$stage/site/llama_cpp/lib/$CUDA_LIB"
  cp -a "$BUILD"/bin/{llama-server,llama-mtmd-cli,libllama-server-impl.so,libllama-common.so*,libmtmd.so*} "$stage/bin/"
  tar cJf "$PACK" -C "$stage" site bin
  ls -la "$PACK" ".gpu-cuda/$CUDA_LIB.xz"
}

unpack() {  # on the device: the CUDA library from .gpu-cuda, or /tmp/carry where an earlier call left it
  local lib=/tmp/site/llama_cpp/lib packed=.gpu-cuda/$CUDA_LIB.xz
  [ -f "$packed" ] || packed=/tmp/carry/$CUDA_LIB.xz
  [ -f "$packed" ] || { echo "no $CUDA_LIB.xz in .gpu-cuda or /tmp/carry: carry .gpu-cuda" >&2; exit 1; }
  local stage=/tmp/prebuilt-stage
  rm -rf /tmp/site "$BUILD" "$stage" && mkdir -p "$stage" "$BUILD" && tar xJf "$PACK" -C "$stage"
  mv "$stage/site" /tmp/site && mv "$stage/bin" "$BUILD/bin"
  xz -dc "$packed" > "$lib/$CUDA_LIB"
  for name in libggml-base libggml-cpu libggml-cuda libggml libllama; do  # llama-server's copies: the package's
    ln -sf "$lib/$name.so.0" "$BUILD/bin/$name.so.0"; done
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/wheels/*.whl
  PYTHONPATH=/tmp/site python3 -c "import llama_cpp; assert llama_cpp.llama_supports_gpu_offload(), 'no GPU offload'; print('llama-cpp-python', llama_cpp.__version__, 'prebuilt, with GPU offload')"
  "$BUILD/bin/llama-server" --version 2>&1 | tail -2
}

"${1:?usage: bash bench/gpu/prebuilt.sh make | pack | unpack}"
