# On the CUDA machine, after `source bench/gpu/setup.sh`: the draft's profile (docs/pflash_gpu.md,
# "Where the draft's time goes") into $OUT: timing arms, then every kernel of 3 windows under ncu.
set -u
tiny=/tmp/models/drafter-tiny-10l.gguf
[ -f $tiny ] || python3 -c "import sys; from pflash_plugin.testing import write_tiny_llama as w; w(sys.argv[1], n_layer=10, n_embd=64, n_head=4, n_head_kv=2, n_ff=64, f16=True, n_ctx_train=262144)" $tiny
D10=/tmp/models/drafter-0.6b-10l.gguf
(cd bench/gpu && python3 draft_profile.py --model $D10 --tiny $tiny --layers 9 --tokens 65536 --reps 3 --out $OUT/draft_profile.json)
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
if [ -n "$ncu" ]; then
  (cd bench/gpu && timeout 240 $ncu --clock-control none --cache-control none --print-units base \
     --metrics gpu__time_duration.sum --csv --log-file /tmp/kernels.csv \
     python3 draft_profile.py --model $D10 --kernels_only > /tmp/ncu.log 2>&1; tail -5 /tmp/ncu.log
   python3 draft_profile.py --kernel_table /tmp/kernels.csv --out $OUT/draft_kernels.json | head -60)
else
  echo "no ncu on this machine"
fi
