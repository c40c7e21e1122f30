# On the CUDA machine, after `source bench/gpu/setup.sh`: the draft's profile
# (docs/pflash_draft_profile.md) into $OUT/draft_profile.json: the timing arms of draft_profile.py,
# then the draft and the plain arms traced with CUPTI (cupti_trace.c; Nsight Systems is not there).
set -u
tiny=/tmp/models/drafter-tiny-10l.gguf  # 10 layers, 64-wide heads (what CUDA's flash attention takes), little arithmetic
[ -f $tiny ] || python3 -c "import sys; from pflash_plugin.testing import write_tiny_llama as w; w(sys.argv[1], n_layer=10, n_embd=256, n_head=4, n_head_kv=2, n_ff=64, f16=True, n_ctx_train=262144)" $tiny
bash bench/gpu/cupti_build.sh || exit 1
(cd bench/gpu && python3 draft_profile.py --model /tmp/models/drafter-0.6b-10l.gguf --tiny $tiny --layers 9 \
   --tokens 65536 --reps 3 --trace /tmp/cupti_trace.so --out $OUT/draft_profile.json)
