"""FP8 against bf16: the GEMM table that is to set models/fp8.py's size rule, and the loss check.

    python benchmarks/fp8.py gemms --out gemms.json          # GPU: bf16 vs FP8 per (M, N, K)
    python benchmarks/fp8.py gemms --quick                   # the same on a few small shapes (CPU check)
    python benchmarks/fp8.py convergence --out loss.json     # tiny preset, 300 steps, bf16 vs FP8
    python benchmarks/fp8.py convergence --steps 1000 --set model.preset=1b --set batch_size=8 \
        --set data.seq_len=1024 --set model.fp8_small_gemms=false --out loss_1b.json  # GPU: 1b

gemms: one linear layer's forward and backward (``y = x @ w``, then dx and dw from a fixed
output gradient), jitted, in bf16 and in FP8 (models.fp8.fp8_dot_general: the amax, scaling and
casts included, as a training step pays them), timed in the same run in interleaved rounds
(benchmarks/attention_timing.py). Shapes: every projection (K, N) of the presets 125m to 7b,
and a K x N grid, each at M tokens of 4096 and 32768 (a 1b step's micro-batch per GPU: 8 x
4096). The ratio is bf16 time / FP8 time (> 1: FP8 is faster); ``rule`` says what
models.fp8.runs_in_fp8 decides for the shape now (provisional: torchao's thresholds).

convergence: `shardflow train`'s default run (the tiny preset on the embedded standard-library
corpus, batch 16 x 128, AdamW, 8-way data parallel; on a CPU-only machine 8 simulated devices)
for 300 steps in bf16, then with ``model.fp8: true`` (and ``fp8_small_gemms``: every tiny
GEMM is below the size rule); the final loss is the mean of the last 20 steps' losses.
``--set key=value`` overrides the trainer's config as `shardflow train --set` does, in both
runs (``--set model.fp8_small_gemms=false`` leaves the small GEMMs to the size rule).
"""

from __future__ import annotations

import argparse
import tempfile

import _checkout  # noqa: F401
import _results

from shardflow.train import configure_host_platform

TOKENS = (4096, 32768)
GRID = (1024, 2048, 4096, 8192)
QUICK = [(256, 256, 256), (256, 1024, 1024)]  # (M, N, K)


def shapes(quick: bool, tokens=TOKENS) -> list[tuple[int, int, int]]:
    """(M, N, K) of every preset projection 125m..7b and of the K x N grid, each at ``tokens``."""
    from shardflow import models
    from shardflow.models import fp8

    if quick:
        return QUICK
    kn = {kn for name in ("125m", "350m", "1b", "3b", "7b") for kn in fp8.gemm_shapes(models.preset(name)).values()}
    kn |= {(k, n) for k in GRID for n in GRID}
    return [(m, n, k) for m in tokens for k, n in sorted(kn)]


def linear_step(dot):
    """(x, w, g) -> (y, dx, dw) of ``y = x @ w`` multiplied by ``dot`` (a dot_general)."""
    import jax
    import jax.numpy as jnp

    def step(x, w, g):
        y, vjp = jax.vjp(lambda x, w: jnp.einsum("mk,kn->mn", x, w, _dot_general=dot), x, w)
        return (y, *vjp(g))

    return jax.jit(step)


def gemms(quick: bool, iters: int, tokens=TOKENS) -> list[dict]:
    import jax
    import jax.numpy as jnp
    from attention_timing import interleaved_medians, time_samples

    from shardflow.models import fp8

    steps = {"bf16": linear_step(jax.lax.dot_general), "fp8": linear_step(fp8.fp8_dot_general)}
    rows = []
    print(f"{'M':>6} {'N':>6} {'K':>6}  {'bf16 ms':>9} {'fp8 ms':>9} {'bf16/fp8':>9}  rule")
    for m, n, k in shapes(quick, tokens):
        keys = jax.random.split(jax.random.key(0), 3)
        args = tuple(
            jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16)
            for key, shape in zip(keys, ((m, k), (k, n), (m, n)))
        )
        for step in steps.values():
            jax.block_until_ready(step(*args))  # compile
        samples = lambda fn, a: time_samples(fn, a, iters=iters)
        seconds = interleaved_medians({name: (step, args) for name, step in steps.items()}, samples)
        ratio = seconds["bf16"] / seconds["fp8"]
        rule = fp8.runs_in_fp8(m, n, k)
        print(
            f"{m:>6} {n:>6} {k:>6}  {1e3 * seconds['bf16']:9.3f} {1e3 * seconds['fp8']:9.3f} {ratio:9.3f}  "
            f"{'fp8' if rule else 'bf16'}"
        )
        rows.append(
            {
                "m": m,
                "n": n,
                "k": k,
                "bf16_s": seconds["bf16"],
                "fp8_s": seconds["fp8"],
                "ratio": ratio,
                "rule_fp8": rule,
            }
        )
    return rows


def convergence(steps: int, tail: int, overrides: list[str]) -> list[dict]:
    from shardflow import train
    from shardflow.train import config

    rows = []
    for name, flags in (("bf16", []), ("fp8", ["model.fp8=true", "model.fp8_small_gemms=true"])):
        with tempfile.TemporaryDirectory() as out:
            cfg = config.load(None, ["checkpoint.every=0", "eval_every=0", "log_every=1", *flags, *overrides], out=out)
            cfg.steps = steps
            losses = train.train(cfg, progress=False)["losses"]
        final = sum(losses[s] for s in sorted(losses)[-tail:]) / tail
        rows.append({"run": name, "final_loss": final, "first_loss": losses[min(losses)], "losses": losses})
        print(
            f"{name}: loss {losses[min(losses)]:.4f} at step {min(losses)}, mean of the last {tail} steps {final:.4f}"
        )
    bf16, fp8_loss = (r["final_loss"] for r in rows)
    print(f"fp8 / bf16 - 1: {fp8_loss / bf16 - 1:+.4%}")
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=("gemms", "convergence"))
    parser.add_argument("--quick", action="store_true", help="gemms: a few small shapes only")
    parser.add_argument("--iters", type=int, default=50, help="gemms: timed calls per contender and round")
    parser.add_argument(
        "--tokens", default=",".join(map(str, TOKENS)), help="gemms: the M of each shape, comma-separated"
    )
    parser.add_argument("--steps", type=int, default=300, help="convergence: training steps")
    parser.add_argument("--tail", type=int, default=20, help="convergence: the final loss's last steps")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="convergence: config override")
    parser.add_argument("--out", help="write the rows as JSON to this file")
    args = parser.parse_args(argv)
    configure_host_platform()
    import jax

    print(f"jax {jax.__version__}, {jax.device_count()} x {jax.devices()[0].device_kind}")
    tokens = tuple(int(m) for m in args.tokens.split(","))
    rows = (
        gemms(args.quick, args.iters, tokens) if args.what == "gemms" else convergence(args.steps, args.tail, args.set)
    )
    if args.out:
        _results.write_json(args.out, rows, what=args.what)
    return rows


if __name__ == "__main__":
    main()
