#!/usr/bin/env bash
# One GPU, the MoE rows: the grouped-GEMM kernels' GPU tests, every kernel variant checked and
# timed (gemm and layer rows against dense), then (PART=2) the moe-1b step against the
# MaxText-style reference and the 1b step with the fused loss against the materialised one.
# Logs and JSON under $OUT, a short table last.
#
#   OUT=/tmp/out SHARDFLOW_COMMIT=$(git rev-parse HEAD) PART=1 bash benchmarks/results/remeasure_moe_1gpu.sh
set -u
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to the folder for logs and JSON}"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
nvidia-smi -L > "$OUT/device.txt"
if [ "${PART:-1}" = 1 ]; then
  timeout 200 python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import _checkout, pytest; \
sys.exit(pytest.main(['-q', '-x', '-m', 'gpu', '-p', 'no:cacheprovider', 'tests/test_grouped_matmul.py']))" \
      > "$OUT/gpu_tests.log" 2>&1
  echo "gpu tests exit $?"
  timeout 330 python3 benchmarks/moe.py --check --shapes moe-1b,moe-8x1b --iters 5 --repeats 3 \
      --variants "${VARIANTS:-simple,simple/wgrad128,ws,ws-n,ws-wide}" --out "$OUT/moe.json" > "$OUT/moe.log" 2>&1
  echo "moe.py exit $?"
  tail -3 "$OUT/gpu_tests.log"
  tail -40 "$OUT/moe.log"
else
  timeout 280 python3 benchmarks/train_mfu.py --preset moe-1b --batch 4 --steps 5 --warmup 2 \
      --engines reference,shardflow --out "$OUT/train_mfu_moe-1b.json" > "$OUT/train_mfu_moe-1b.log" 2>&1
  echo "train_mfu moe-1b exit $?"
  timeout 280 python3 benchmarks/train_mfu.py --preset 1b --steps 5 --warmup 2 \
      --engines shardflow,shardflow-plain-loss --out "$OUT/train_mfu_1b_loss.json" > "$OUT/train_mfu_1b_loss.log" 2>&1
  echo "train_mfu 1b loss exit $?"
  tail -8 "$OUT/train_mfu_moe-1b.log" "$OUT/train_mfu_1b_loss.log"
fi
cat "$OUT/device.txt"
