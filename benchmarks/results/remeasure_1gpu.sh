#!/usr/bin/env bash
# One GPU: the attention table, and the 1b and 3b train steps (shardflow against jax.jit, and
# shardflow with jax.jit's cuDNN attention), logs and JSON under $OUT, a short table printed
# last. 3b with remat "dots" at 8 x 4096 needs an H200's memory; PRESETS="1b" skips it.
#
#   OUT=/tmp/out SHARDFLOW_COMMIT=$(git rev-parse HEAD) bash benchmarks/results/remeasure_1gpu.sh
#
# Then: $OUT/attention.json -> benchmarks/results/attention/<date>_1x<gpu>.json and
# $OUT/train_mfu_<preset>.json -> benchmarks/results/train_mfu/<date>_1x<gpu>_<preset>.json.
set -u
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to the folder for logs and JSON}"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
nvidia-smi -L > "$OUT/device.txt"
timeout "${ATTENTION_TIMEOUT:-300}" python3 benchmarks/attention.py --iters 10 \
    --out "$OUT/attention.json" > "$OUT/attention.log" 2>&1
echo "attention.py exit $?"
for preset in ${PRESETS:-1b 3b}; do
  timeout "${TRAIN_TIMEOUT:-240}" python3 benchmarks/train_mfu.py --preset "$preset" --steps 5 \
      --warmup 2 --engines reference,shardflow,shardflow-cudnn \
      --out "$OUT/train_mfu_$preset.json" > "$OUT/train_mfu_$preset.log" 2>&1
  echo "train_mfu.py --preset $preset exit $?"
done
cat "$OUT/device.txt"
grep -A10 "^TFLOP/s" "$OUT/attention.log"
for preset in ${PRESETS:-1b 3b}; do grep -A7 "^$preset " "$OUT/train_mfu_$preset.log"; done
