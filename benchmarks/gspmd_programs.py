"""Programs made of code shardflow did not write, for comparing shardflow with XLA GSPMD.

Every program is built by importing an installed library — flax (NNX and Linen layers), optax
(optimizers, schedules, clipping, losses) — or is plain jnp/lax in the manner of JAX's own pjit
and shard_map tests. Nothing here is pasted library source.

    from gspmd_programs import CASES, MESH_SHAPE
    for case in CASES:
        fn, args, in_specs, out_specs = case.build()   # a single-device program and its specs

Strategies, on the mesh {data: 2, model: 4} (8 devices):
  dp    batch split over every device (data × model), parameters replicated
  fsdp  as dp, and every parameter (and its optimizer state) split on its largest dim that
        8 divides, over data × model (ZeRO-3)
  tp    Megatron: column-parallel then row-parallel layers, heads, vocab or experts over
        'model'; batch over 'data'
  2d    tp, and each parameter's largest remaining dim split over 'data' (fsdp × tp, as the
        trainer's "2d")
  ep    (the MoE layer) experts over 'model', tokens over 'data'
Programs of single ops read "dp" as their leading dim over every device, "tp" as the dim of
interest over 'model', and "2d" as both at once (data × model).

The programs live by family: gspmd_models.py (flax), gspmd_optax.py (optax), gspmd_ops.py (a
MoE layer and single ops), on the specs of gspmd_specs.py; this file is the table of cases and
how a case runs.

``Case.xfail`` names the rows shardflow fails today, and why; tests/test_gspmd_programs.py runs
every row and expects exactly those to fail (strictly: a fixed one flags).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
from collections.abc import Callable

if "jax" not in sys.modules:  # 8 simulated CPU devices, when this module is the first to import jax
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from gspmd_models import program_cnn, program_lm, program_lstm, program_resnet, program_vit  # noqa: E402
from gspmd_ops import (  # noqa: E402
    case_dynamic_slice,
    case_moe,
    case_pad,
    case_reductions,
    case_scan,
    case_scatter_add,
    case_top_k,
    case_user_shard_map,
)
from gspmd_optax import case_ce_integer, case_ce_onehot, program_optimizer  # noqa: E402
from gspmd_specs import MESH_SHAPE, STRATEGIES, mesh  # noqa: E402, F401  (MESH_SHAPE: the scripts' mesh)
from jax.sharding import PartitionSpec as PS  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Case:
    program: str
    strategy: str
    build: Callable = dataclasses.field(repr=False)  # () -> (fn, args, in_specs, out_specs)
    xfail: str | None = None  # why shardflow fails this row today

    @property
    def name(self) -> str:
        return f"{self.program}-{self.strategy}"


# ------------------------------------------------------------------------------ running a case


def shardings(specs):
    """NamedShardings of a PartitionSpec tree on the mesh (None stays None)."""
    from jax.sharding import NamedSharding

    return jax.tree.map(lambda s: NamedSharding(mesh(), s), specs, is_leaf=lambda x: isinstance(x, PS))


def reference(fn, args):
    """fn on one device: jax.jit without shardings."""
    return jax.device_get(jax.jit(fn)(*args))


TIE_BREAK = 1e4  # "solver-bytes": how much cheaper than modelled the local work is priced


def parallelized(fn, in_specs, out_specs, planner="greedy"):
    """sf.parallelize on the suite's mesh; ``planner``: "greedy" (passes.propagate), "solver"
    (passes.solve, modelled time) or "solver-bytes" (passes.solve, modelled time without the
    collectives' latency)."""
    import shardflow as sf

    passes = sf.passes.DEFAULT if planner == "greedy" else sf.passes.SOLVER
    # Without the per-collective latency the collectives cost their bytes over bandwidth: the
    # table's measure. The local work is priced at 1/TIE_BREAK of its modelled time: among
    # plans moving the same bytes the one doing the least work (a scatter run on a device's
    # block rather than whole, then sliced), where priced in full a plan would move more
    # bytes to read and write less memory.
    modelled = sf.LinkModel()
    links = (
        sf.LinkModel(
            alpha=0.0, flops=modelled.flops * TIE_BREAK, memory_bandwidth=modelled.memory_bandwidth * TIE_BREAK
        )
        if planner == "solver-bytes"
        else None
    )
    return sf.parallelize(fn, mesh=mesh(), in_specs=in_specs, out_specs=out_specs, passes=passes, links=links)


def gspmd(fn, in_specs, out_specs):
    """The same program partitioned by XLA GSPMD: jax.jit with NamedShardings of the same specs."""
    kwargs = {} if out_specs is None else {"out_shardings": shardings(out_specs)}
    return jax.jit(fn, in_shardings=shardings(tuple(in_specs)), **kwargs)


def flops(compiled) -> float | None:
    """Per-device flops of a compiled program by XLA's cost analysis (a while loop's body
    counted once, whatever its trip count), or None where the backend gives none — or gives
    -1, its "cannot cost this" (XLA:CPU for the TopK custom call: the whole analysis -1)."""
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else None
    flops = float(cost["flops"]) if cost and "flops" in cost else None
    return None if flops is None or flops < 0 else flops


def run_shardflow(fn, args, in_specs, out_specs, planner="greedy"):
    """(plan, the compiled executable, the outputs' leaves) of fn under shardflow, compiled
    once: the executable of ``lower(...).compile()`` runs the step."""
    step = parallelized(fn, in_specs, out_specs, planner)
    plan = step.explain(*args)
    compiled = step.lower(*args).compile()
    try:  # the lowered program takes the arguments' leaves and returns the outputs' leaves
        out = compiled(*jax.tree.leaves(args))
    except (TypeError, ValueError):
        out = step(*args)
    return plan, compiled, jax.tree.leaves(jax.device_get(out))


def max_rel_error(got, want, floor=1e-6) -> float:
    """max over output leaves of max|got - want| / max(max|want|, floor); integer leaves compared
    as floats. The floor keeps a leaf that is zero in exact arithmetic (rounding noise) from
    reading as a 100 % error."""
    got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
    if len(got_leaves) != len(want_leaves):
        raise ValueError(f"{len(got_leaves)} outputs, expected {len(want_leaves)}")
    err = 0.0
    for g, w in zip(got_leaves, want_leaves):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        if g.shape != w.shape:
            raise ValueError(f"output shape {g.shape}, expected {w.shape}")
        scale = max(float(np.max(np.abs(w))) if w.size else 0.0, floor)
        err = max(err, float(np.max(np.abs(g - w))) / scale if w.size else 0.0)
    return err


# ------------------------------------------------------------------------------ the table

# {(program, strategy): why shardflow fails the row today}. None on 2026-11-26: the last one,
# user_shard_map-dp (KeyError: 'subfuns' at 2faff88), passes since the core v2 skeleton (9e073c5).
XFAIL: dict = {}


def _from_program(program: Callable, strategy: str):
    p = program()
    in_specs, out_specs = p.specs(strategy)
    return p.fn, p.args, in_specs, out_specs


def _cases():
    out = []

    def add(program, builder, strategies, cached=False):
        for s in strategies:
            build = functools.partial(_from_program, builder, s) if cached else functools.partial(builder, s)
            out.append(Case(program, s, build, XFAIL.get((program, s))))

    add("cnn", program_cnn, STRATEGIES, cached=True)
    add("resnet", program_resnet, STRATEGIES, cached=True)
    add("vit", program_vit, STRATEGIES, cached=True)
    add("lm", program_lm, STRATEGIES, cached=True)
    add("lstm", program_lstm, ("dp", "fsdp", "tp"), cached=True)
    for name in ("adamw", "adafactor", "lion", "lamb", "muon"):
        add(f"mlp_{name}", functools.partial(program_optimizer, name), STRATEGIES, cached=True)
    add("ce_integer", case_ce_integer, ("dp", "tp", "2d"))
    add("ce_onehot", case_ce_onehot, ("dp", "tp", "2d"))
    add("moe", case_moe, ("dp", "ep", "2d"))
    for program, builder in (
        ("reductions", case_reductions),
        ("pad", case_pad),
        ("dynamic_slice", case_dynamic_slice),
        ("scan", case_scan),
        ("top_k", case_top_k),
        ("scatter_add", case_scatter_add),
    ):
        add(program, builder, ("dp", "tp", "2d"))
    add("user_shard_map", case_user_shard_map, ("dp",))
    return out


CASES = _cases()
