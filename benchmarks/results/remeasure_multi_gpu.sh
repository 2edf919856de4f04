#!/usr/bin/env bash
# Several GPUs of one host (2 or 4), the rows that wait for them; logs and JSON under $OUT, a
# short table last. Each PART fits one 10-minute device call.
#
#   PART=hetero: emulated heterogeneity — the second half of the GPUs slowed by a calibrated,
#                predicated extra load; the planner's split against the even one, measured and
#                predicted (benchmarks/hetero_emulated.py).
#   PART=moe:    expert parallelism over every GPU: the dropless layer against the EP=1 dense
#                equivalent, and jax.jit on the same shardings (benchmarks/moe.py's ep rows).
#   PART=unroll: the 1b step under fsdp and 2d, shardflow with its layer loops rolled where they
#                communicate (today's default) and unrolled apart, against jax.jit
#                (benchmarks/scaling.py --engines shardflow,shardflow-unrolled,jit).
#
#   OUT=/tmp/out PART=hetero bash benchmarks/results/remeasure_multi_gpu.sh
set -u
cd "$(dirname "$0")/../.."
: "${OUT:?set OUT to the folder for logs and JSON}"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
nvidia-smi -L > "$OUT/device.txt"
case "${PART:-hetero}" in
  hetero)
    timeout 560 python3 benchmarks/hetero_emulated.py --preset 1b --steps 5 --warmup 2 \
        --out "$OUT/hetero_emulated.json" > "$OUT/hetero_emulated.log" 2>&1
    echo "hetero_emulated exit $?"
    tail -8 "$OUT/hetero_emulated.log"
    ;;
  moe)
    timeout 560 python3 benchmarks/moe.py --shapes moe-1b,moe-8x1b --iters 5 --repeats 3 \
        --out "$OUT/moe_ep.json" > "$OUT/moe_ep.log" 2>&1
    echo "moe.py exit $?"
    grep -E "^(ep=|layer|gemm)" "$OUT/moe_ep.log"
    ;;
  unroll)
    timeout 560 python3 benchmarks/scaling.py --preset 1b --strategies fsdp,2d \
        --engines shardflow,shardflow-unrolled,jit --steps 5 --warmup 2 \
        --out "$OUT/scaling_unroll.json" > "$OUT/scaling_unroll.log" 2>&1
    echo "scaling.py exit $?"
    tail -12 "$OUT/scaling_unroll.log"
    ;;
esac
cat "$OUT/device.txt"
