#!/usr/bin/env bash
# One GPU, the MoE rows: every kernel variant timed in its own process (gemm and layer rows
# against dense; GPU_TESTS=1: the grouped-GEMM kernels' GPU tests first; MOE_STEP=1: then the
# moe-1b train step alone); PART=2: the moe-1b step against the MaxText-style reference and
# the FP8 GEMM table; PART=3: the 1b step in bf16, with the loss materialised, and in FP8;
# PART=4: the moe-1b step at batch 2 against the reference, then the 3b step in bf16 and FP8.
# Logs and JSON under $OUT, a short table last.
#
#   OUT=/tmp/out SHARDFLOW_COMMIT=$(git rev-parse HEAD) PART=1 bash benchmarks/results/remeasure_moe_1gpu.sh
set -u
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to the folder for logs and JSON}"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
nvidia-smi -L > "$OUT/device.txt"
if [ "${PART:-1}" = 1 ]; then
  if [ -n "${GPU_TESTS:-}" ]; then
    timeout 200 python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import _checkout, pytest; \
sys.exit(pytest.main(['-q', '-x', '-m', 'gpu', '-p', 'no:cacheprovider', 'tests/test_grouped_matmul.py']))" \
        > "$OUT/gpu_tests.log" 2>&1
    echo "gpu tests exit $?"
  fi
  # each variant in its own process and time limit: one slow compile does not cost the others
  for v in ${VARIANTS:-simple ws ws-n ws-wide simple/wgrad128}; do
    f=$(echo "$v" | tr / _)
    timeout "${VARIANT_S:-110}" python3 benchmarks/moe.py --shapes moe-1b --iters 5 --repeats 3 \
        --variants "$v" --out "$OUT/moe_$f.json" >> "$OUT/moe.log" 2>&1
    echo "moe.py $v exit $?" | tee -a "$OUT/moe.log"
  done
  if [ -n "${MOE_STEP:-}" ]; then
    timeout 170 python3 benchmarks/train_mfu.py --preset moe-1b --batch 4 --steps 5 --warmup 2 \
        --engines shardflow --out "$OUT/train_mfu_moe-1b.json" > "$OUT/train_mfu_moe-1b.log" 2>&1
    echo "train_mfu moe-1b exit $?"
    tail -4 "$OUT/train_mfu_moe-1b.log"
  fi
  grep -E "^(gemm|layer|moe.py)" "$OUT/moe.log"
elif [ "${PART}" = 2 ]; then
  timeout 300 python3 benchmarks/train_mfu.py --preset moe-1b --batch 4 --steps 5 --warmup 2 \
      --engines reference,shardflow --out "$OUT/train_mfu_moe-1b.json" > "$OUT/train_mfu_moe-1b.log" 2>&1
  echo "train_mfu moe-1b exit $?"
  timeout 200 python3 benchmarks/fp8.py gemms --out "$OUT/fp8_gemms.json" > "$OUT/fp8_gemms.log" 2>&1
  echo "fp8 gemms exit $?"
  tail -8 "$OUT/train_mfu_moe-1b.log"; tail -30 "$OUT/fp8_gemms.log"
elif [ "${PART}" = 4 ]; then
  timeout 330 python3 benchmarks/train_mfu.py --preset moe-1b --batch 2 --steps 3 --warmup 1 \
      --engines shardflow,reference --out "$OUT/train_mfu_moe-1b_b2.json" > "$OUT/train_mfu_moe-1b_b2.log" 2>&1
  echo "train_mfu moe-1b batch 2 exit $?"
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 timeout 250 python3 benchmarks/train_mfu.py --preset 3b --batch 4 --steps 3 --warmup 1 \
      --engines shardflow,shardflow-fp8 --out "$OUT/train_mfu_3b_fp8.json" > "$OUT/train_mfu_3b_fp8.log" 2>&1
  echo "train_mfu 3b fp8 exit $?"
  grep -E "^ +(shardflow|reference)|ratio|FAILED|^(moe-1b|3b) " "$OUT/train_mfu_moe-1b_b2.log" "$OUT/train_mfu_3b_fp8.log"
else
  timeout 560 python3 benchmarks/train_mfu.py --preset 1b --steps 5 --warmup 2 \
      --engines shardflow,shardflow-plain-loss,shardflow-fp8 --out "$OUT/train_mfu_1b.json" > "$OUT/train_mfu_1b.log" 2>&1
  echo "train_mfu 1b exit $?"
  tail -10 "$OUT/train_mfu_1b.log"
fi
cat "$OUT/device.txt"
