#!/usr/bin/env bash
# On the CUDA machine after a setup (bench/gpu/servers.sh), from the project root: packs what the
# ~5.5-minute CUDA build made (llama-cpp-python in /tmp/site with libmtmd, llama-server and its
# libraries from /tmp/lcp-build, the ggml_ext build) into OUT_DIR/prebuilt.tar.xz.NN pieces of 15 MiB,
# so a later cold machine carries them in .gpu/ and skips the build (bench/gpu/queue.sh start unpacks
# them). Only the pinned sources' build: rebuild after a change to vendor_patches/ or the sdist.
#   bash bench/gpu/pack_build.sh OUT_DIR [MAX_MIB]   # nothing is written past MAX_MIB (default 45)
set -euo pipefail
out=$1; max_mib=${2:-45}
server=/tmp/lcp-build/bin/llama-server
[ -x "$server" ] || { echo "no $server: nothing to pack"; exit 1; }
# llama-server's own libraries from the build tree, and libmtmd beside them (bench/gpu/mtmd_from_build.py)
libs=$(ldd "$server" | awk '{print $3}' | grep '^/tmp/lcp-build/' || true)
mtmd=$(find /tmp/lcp-build -name 'libmtmd.so*' 2>/dev/null || true)
start=$(date +%s)
tar cf - -P /tmp/site/llama_cpp "$server" $libs $mtmd /tmp/pflash-ext 2>/dev/null | xz -T0 -6 > /tmp/prebuilt.tar.xz
size=$(( $(stat -c %s /tmp/prebuilt.tar.xz) / 1048576 ))
echo "prebuilt: ${size} MiB packed in $(( $(date +%s) - start )) s (llama-server libs: $(echo $libs | wc -w))"
if [ "$size" -gt "$max_mib" ]; then echo "over ${max_mib} MiB: not copied"; exit 0; fi
split -b 15M -d -a 2 /tmp/prebuilt.tar.xz "$out/prebuilt.tar.xz."
sha256sum /tmp/prebuilt.tar.xz | tee "$out/prebuilt.sha256"
