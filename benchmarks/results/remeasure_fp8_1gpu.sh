#!/usr/bin/env bash
# One GPU, the FP8 / loss / attention rows. PART=1: the attention kernels' GPU tests, the 1b
# step with the chunked loss against the materialised loss, and the FP8 GEMM table; PART=2:
# 1,000 steps of the 1b preset on the embedded corpus in bf16 and in FP8 (8 x 512 tokens a
# step; carry .wheels holding a tensorboardX wheel, which the device lacks), the attention
# kernels' GPU tests; PART=3: the FP8 GEMM
# table at 32k tokens; PART=4: the 3b step against the plain-JAX reference at 4 x 4096 (what
# fits an H100), then the 32k GEMM table in less time; PART=5: the MoE layer's kernel profile
# and the 32k GEMM table, in three minutes; PART=6: the MoE profile, the 3b step against the
# reference, the 32k GEMM table, in seven minutes; PART=7 (one H200): the 7b step in FP8, in
# bf16 and by the plain-JAX reference, each in its own process; PART=8: the Mosaic attention
# kernels' GPU test under a shifted causal diagonal, then PART=6; PART=10: the Mosaic kernels'
# GPU tests of their masks (segment ids, the shifted diagonal); PART=11: the GPU tests of the
# Mosaic kernels' general causal shifts, unequal lengths and pairs of segment ids, then the
# attention paths (backend="auto" against the Triton kernels); PART=12: the GPU test that no
# attention call reaches Triton, then the paths. Logs and
# JSON under $OUT, a short table last. PART=13: the MoE layer's profile in this tree and in the
# one .variants/moe_old.py patches in, then PART=11's GPU tests. PART=14 and 15: the attention
# kernels' GPU tests in two halves (the Mosaic paths dispatched and their masks, then what
# dispatch does not yet send them and the test that none reaches Triton), about nine minutes each.
#
#   OUT=/tmp/out PART=1 bash benchmarks/results/remeasure_fp8_1gpu.sh
set -u
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to the folder for logs and JSON}"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
nvidia-smi -L > "$OUT/device.txt"

attention_tests() {  # seconds, pytest -k expression: the attention kernels' GPU tests
  timeout "$1" python3 -c "import sys; sys.path.insert(0, 'benchmarks'); import _checkout, pytest; \
sys.exit(pytest.main(['-q', '-rA', '-m', 'gpu', '-p', 'no:cacheprovider', 'tests/test_attention.py', '-k', sys.argv[1]]))" \
      "$2" > "$OUT/gpu_tests.log" 2>&1
  echo "attention gpu tests ($2) exit $?"
}

if [ "${PART:-1}" = 1 ]; then
  attention_tests 150 test_gpu_kernels
  timeout 230 python3 benchmarks/train_mfu.py --preset 1b --steps 5 --warmup 2 \
      --engines shardflow,shardflow-plain-loss --out "$OUT/train_mfu_1b_loss.json" > "$OUT/train_mfu_1b_loss.log" 2>&1
  echo "train_mfu 1b chunked vs plain loss exit $?"
  timeout 190 python3 benchmarks/fp8.py gemms --iters 20 --out "$OUT/fp8_gemms.json" > "$OUT/fp8_gemms.log" 2>&1
  echo "fp8 gemms exit $?"
  tail -3 "$OUT/gpu_tests.log"; grep -A4 "^1b " "$OUT/train_mfu_1b_loss.log"; tail -50 "$OUT/fp8_gemms.log"
elif [ "${PART}" = 2 ]; then
  [ -d .wheels ] && python3 -m pip install -q --no-deps .wheels/*.whl > "$OUT/pip.log" 2>&1
  timeout 280 python3 benchmarks/fp8.py convergence --steps 1000 --tail 50 --set model.preset=1b \
      --set batch_size=8 --set data.seq_len=512 --set model.fp8_small_gemms=false \
      --out "$OUT/fp8_convergence_1b.json" > "$OUT/fp8_convergence_1b.log" 2>&1
  echo "fp8 convergence 1b exit $?"
  attention_tests 260 test_gpu_kernels
  grep -E "^(bf16|fp8)" "$OUT/fp8_convergence_1b.log"
  grep -E "PASSED|FAILED|passed|failed" "$OUT/gpu_tests.log" | tail -20
elif [ "${PART}" = 5 ]; then
  timeout 70 python3 benchmarks/moe.py --profile --shapes moe-1b --iters 5 --variants ws-wide \
      --out "$OUT/moe_profile.json" > "$OUT/moe_profile.log" 2>&1
  echo "moe profile exit $?"
  timeout 110 python3 benchmarks/fp8.py gemms --iters 10 --tokens 32768 --out "$OUT/fp8_gemms_32k.json" \
      > "$OUT/fp8_gemms_32k.log" 2>&1
  echo "fp8 gemms 32k exit $?"
  grep -A14 "^profile" "$OUT/moe_profile.log"; tail -26 "$OUT/fp8_gemms_32k.log"
elif [ "${PART}" = 11 ]; then
  attention_tests 330 "beyond_what_dispatch"
  grep -E "PASSED|FAILED|passed|failed|Error" "$OUT/gpu_tests.log" | tail -12
  if [ -f .variants/old_mgpu.py ]; then  # the Mosaic backward before against now (carry .variants)
    timeout 90 python3 benchmarks/attention.py --bwd --causal yes --iters 10 \
        --variants old=.variants/old_mgpu.py new=kernels/flash_attention_mgpu.py > "$OUT/bwd_variants.log" 2>&1
    echo "backward variants exit $?"
    grep -E "^\|" "$OUT/bwd_variants.log"
  fi
  timeout 160 python3 benchmarks/attention.py --paths --iters 5 --rounds 3 --warmup 1 --out "$OUT/attention_paths.json" \
      > "$OUT/attention_paths.log" 2>&1
  echo "attention paths exit $?"
  grep -E "^\||failed" "$OUT/attention_paths.log"
elif [ "${PART}" = 12 ]; then
  attention_tests 200 "reaches_triton"
  grep -E "PASSED|FAILED|passed|failed|Error" "$OUT/gpu_tests.log" | tail -6
  timeout 360 python3 benchmarks/attention.py --paths --iters 5 --rounds 3 --warmup 1 --out "$OUT/attention_paths.json" \
      > "$OUT/attention_paths.log" 2>&1
  echo "attention paths exit $?"
  grep -E "^\||failed" "$OUT/attention_paths.log"
elif [ "${PART}" = 13 ]; then  # the MoE layer's profile, this tree against .variants' (carry .variants)
  for tree in new old; do
    script=benchmarks/moe.py; [ "$tree" = old ] && script=.variants/moe_old.py
    timeout 100 python3 "$script" --profile --shapes moe-1b --iters 5 --variants ws-wide \
        --out "$OUT/moe_profile_$tree.json" > "$OUT/moe_profile_$tree.log" 2>&1
    echo "moe profile ($tree) exit $?"
    grep -A14 "^profile" "$OUT/moe_profile_$tree.log"
  done
  attention_tests 300 "beyond_what_dispatch"
  grep -E "PASSED|FAILED|passed|failed|Error" "$OUT/gpu_tests.log" | tail -12
elif [ "${PART}" = 14 ]; then  # the Mosaic kernels' GPU tests on the paths dispatch sends them, first half
  attention_tests 560 "(test_gpu_kernels and 512 and (128 or 48)) or stacked_layers or mosaic_masks"
  grep -E "PASSED|FAILED|passed|failed|Error" "$OUT/gpu_tests.log" | tail -14
elif [ "${PART}" = 15 ]; then  # second half: what dispatch does not yet send them, and that none reaches Triton
  attention_tests 560 "beyond_what_dispatch or reaches_triton"
  grep -E "PASSED|FAILED|passed|failed|Error" "$OUT/gpu_tests.log" | tail -16
elif [ "${PART}" = 10 ]; then
  attention_tests 280 mosaic_masks
  grep -E "PASSED|FAILED|passed|failed|Error" "$OUT/gpu_tests.log" | tail -12
elif [ "${PART}" = 8 ]; then
  attention_tests 120 "shifted_diagonal or 128-512-True or 96-512-True"
  grep -E "PASSED|FAILED|passed|failed" "$OUT/gpu_tests.log" | tail -8
  PART=6 bash "$0"
  exit
elif [ "${PART}" = 6 ]; then
  timeout 70 python3 benchmarks/moe.py --profile --shapes moe-1b --iters 5 --variants ws-wide \
      --out "$OUT/moe_profile.json" > "$OUT/moe_profile.log" 2>&1
  echo "moe profile exit $?"
  grep -A14 "^profile" "$OUT/moe_profile.log"
  PART=4 bash "$0"
  exit
elif [ "${PART}" = 7 ]; then  # one H200: the 7b does not fit 80 GB
  for engine in shardflow-fp8 shardflow reference; do
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 timeout 180 python3 benchmarks/train_mfu.py --preset 7b --steps 3 --warmup 1 \
        --engines $engine --out "$OUT/train_mfu_7b_$engine.json" > "$OUT/train_mfu_7b_$engine.log" 2>&1
    echo "train_mfu 7b $engine exit $?"
    grep -A3 "^7b " "$OUT/train_mfu_7b_$engine.log"
  done
elif [ "${PART}" = 4 ]; then
  XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 timeout 200 python3 benchmarks/train_mfu.py --preset 3b --batch 4 --steps 3 \
      --warmup 1 --engines reference,shardflow --out "$OUT/train_mfu_3b.json" > "$OUT/train_mfu_3b.log" 2>&1
  echo "train_mfu 3b vs reference exit $?"
  timeout 120 python3 benchmarks/fp8.py gemms --iters 10 --tokens 32768 --out "$OUT/fp8_gemms_32k.json" \
      > "$OUT/fp8_gemms_32k.log" 2>&1
  echo "fp8 gemms 32k exit $?"
  grep -A5 "^3b " "$OUT/train_mfu_3b.log"; tail -30 "$OUT/fp8_gemms_32k.log"
else
  timeout 250 python3 benchmarks/fp8.py gemms --iters 20 --tokens 32768 --out "$OUT/fp8_gemms_32k.json" \
      > "$OUT/fp8_gemms_32k.log" 2>&1
  echo "fp8 gemms 32k exit $?"
  tail -30 "$OUT/fp8_gemms_32k.log"
fi
cat "$OUT/device.txt"
