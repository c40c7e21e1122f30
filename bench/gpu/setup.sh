# Sourced on the CUDA machine, from the project root with .gpu/ carried (../shared/gpu/prepare-bundle.sh):
# installs llama-cpp-python built for CUDA into /tmp/site (built once per machine), builds ggml_ext for
# CUDA, writes the random-weight models into /tmp/models once per machine, and exports PYTHONPATH.
# Later calls on the same warm machine skip what is already there (carrying .gpu again drops its wheel).
# NO_TARGET=1 skips the 8B target (drafter-only runs).
PYTHONPATH=/tmp/site python3 -c "import llama_cpp" 2>/dev/null || bash .gpu/on-device.sh
export PYTHONPATH=/tmp/site:$PWD
suffix=$(python3 -c "from importlib.machinery import EXTENSION_SUFFIXES as e; print(e[0])")
ext=/tmp/pflash-ext/$(cat ggml_ext/* | sha256sum | cut -c1-16)$suffix  # kept per source version on this machine
if [ -n "${NO_EXT:-}" ]; then  # NO_EXT=1: PFlash scores with numpy (the serving arms do not compress)
  ext=""
elif [ ! -f "$ext" ]; then
  mkdir -p /tmp/pflash-ext
  PFLASH_EXT_BACKEND=cuda CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=90" \
    python3 ggml_ext/pflash_build.py "$ext" > /tmp/ext-build.log 2>&1 || { cat /tmp/ext-build.log; exit 1; }
fi
# copied only when it differs: a server running beside (bench/gpu/quality_gpu.sh) has the copy loaded
[ -z "$ext" ] || cmp -s "$ext" "pflash_plugin/_pflash_ext$suffix" || cp "$ext" "pflash_plugin/_pflash_ext$suffix"
mkdir -p /tmp/models
# VOCAB_EXTRA=N adds N tokens to the models' 1,341 (e.g. 127000 for a Llama-3-sized vocabulary, where
# sampling a row costs what it does on real models); the files then carry the suffix -vN
vocab=${VOCAB_EXTRA:-0}
suffix=$([ "$vocab" = 0 ] || echo "-v$vocab")
write() {  # in its own process: loading a GGUF where the gguf package wrote it segfaulted here
  [ -f "$1" ] || python3 -c "import sys; from pflash_plugin.testing import write_tiny_llama as w; w(sys.argv[1], $2, f16=True, tiled=True, n_ctx_train=262144, vocab_extra=$vocab)" "$1"
}
start=$(date +%s)
export TARGET=/tmp/models/target-8b$suffix.gguf DRAFTER=/tmp/models/drafter-0.6b$suffix.gguf
[ -n "${NO_TARGET:-}" ] || write "$TARGET" "n_layer=32, n_embd=4096, n_head=32, n_head_kv=8, n_ff=14336"
write "$DRAFTER" "n_layer=28, n_embd=1024, n_head=16, n_head_kv=8, n_ff=3072"
# the same drafter cut to the 10 layers its default draft runs (scoring layer 28 // 3 = 9): the
# capture callback's cost in bench/gpu/draft_forward.py --plain
write /tmp/models/drafter-0.6b-10l$suffix.gguf "n_layer=10, n_embd=1024, n_head=16, n_head_kv=8, n_ff=3072"
echo "models ready in $(( $(date +%s) - start )) s: $(du -sh /tmp/models | cut -f1)"
