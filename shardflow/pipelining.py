"""Pipeline parallelism as one SPMD program: a schedule's table executed by a scan over steps.

Every device of the pipeline axis runs the same program. The executor groups the table's ticks
into steps (``schedules.steps``): in a step each stage runs at most one forward (F), one backward
for inputs (B) and one backward for weights (W), in the table's order; activations and their
gradients move to the neighbouring stage by ``ppermute`` between steps. At each step a device
looks up its actions (by its index on the axis) and runs them, each a loop of 0 or 1 trips,
which XLA updates in place, where a ``lax.switch`` would copy every buffer every step. The
pipelined loss owns its gradient: F on the last virtual stage also runs the head and the loss
and its backward, so a micro-batch's B can start while later micro-batches are still in their
forwards (1F1B and the zero-bubble schedules need that; autodiff through a pipelined forward
gives GPipe only).

``pipeline_executor.execute`` is the per-device program (call it inside ``shard_map`` over the
pipeline axis), running the tables ``pipeline_tables.step_tables`` builds from the schedule.
It returns the mean loss and every gradient; a loss seeded with another cotangent scales them
(the loss is a scalar, so its gradient is linear in the seed).

Lockstep. Devices meet at every step's ppermutes, so a step lasts as long as its slowest stage:
an unsplit schedule runs with each backward as B (inputs) then W (weights) at the stage's next
tick (``schedules.with_split_backward``; ``split_vjp`` cuts the traced backward so that B and W
share no equation, B keeping for W the values W reads, the stash). The published tables are
tight — nearly every tick a hop between stages, so a step per tick — and a tick that mixes a
forward on one stage with a backward that recomputes its forward on the next lasts as long as
the backward; ``1f1b-fused`` puts one F, one B and one W on every stage in each steady step, so
its steps are equal whatever the actions cost. The head runs on every device of the axis at
once, after the step's actions, sharded as its parameters are (a vocab split over the stages
shares its work out); and the hand-offs wait for every action of the step (an optimization
barrier), else XLA runs W after them and a device does two steps' work between two hand-offs.

Memory. What a schedule keeps is explicit: F stores its stage's residuals (the saved
activations, less the layer weights) in a slot that W frees, B the stash in one that W frees;
the layers' scans write and read them there row by row (``shardflow.slots``); slots are
assigned per stage by interval colouring of the table, so a stage holds as many as its schedule
keeps alive at once (GPipe m, 1F1B p - s on stage s, 1f1b-fused 2(p - s)). Inputs received from
a neighbour wait in slots the same way. The weight gradients are summed over micro-batches in
float32 (at least), each layer's added by the backward's scan as it makes it, and rounded to
the parameters' dtype once at the end.

Partial: interleaved / V layouts that keep the layers in device order between steps (today
the stacked layers are reordered each step, a collective explain shows) are not built yet; an
undifferentiated call still runs the backward. On one 4-GPU host 0.67-0.77x FSDP so far
(benchmarks/results/pipeline.md) with the published tables.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import mlir

from shardflow.conversion import Step
from shardflow.pipeline_executor import Bodies, aux_count, bodies_of, callables, execute, layer_outputs, sequential
from shardflow.pipeline_tables import step_tables
from shardflow.program import open_jaxpr, source_line
from shardflow.registry import Decision, defrule
from shardflow.schedules import Schedule, by_name
from shardflow.specs import B, Partial, ShardingError, Split, definition, describe, local_shape

# ------------------------------------------------------------------------------ the primitive
#
# sf_pipeline: operands (*stage leaves [p, v, ...], *head params, xs [m, ...], *args [m, ...]),
# results (loss, *d stage leaves, *d head params, d xs, *aux [p, v, ...]) — the head's loss, the
# whole gradient (the layers' loss terms included) and the layers' aux, as ``sequential``
# computes them. Its params hold the Bodies as single-device jaxprs, so shardflow
# shards them like any loop body (the rule below); bound outside parallelize it runs them in
# sequence.

pipeline_p = Primitive("sf_pipeline")
pipeline_p.multiple_results = True


def operand_groups(params, values):
    """(stage leaves, head leaves, xs, head args) of an sf_pipeline equation's operands (or of
    anything listed like them)."""
    ns, nh, na = params["counts"]
    return values[:ns], values[ns : ns + nh], values[ns + nh], values[ns + nh + 1 : ns + nh + 1 + na]


def _bodies_param(params) -> Bodies:
    return Bodies(*(params[name] for name in Bodies._fields))


def _uneven(layer_fn, counts, n_layers, table):
    """(device_order of a layer leaf, the ``active`` flag of each padded layer [p, v, width],
    layer_fn of {"layer", "active"} skipping inactive ones) for virtual stages of ``counts``
    layers each (in the model's order: stage s's chunk c runs ``table.virtual_stage(s, c)``),
    padded to the largest."""
    p, v = table.stages, table.chunks
    if len(counts) != p * v or sum(counts) != n_layers or min(counts) < 1:
        per = f"{p} stages" if v == 1 else f"{p} stages x {v} chunks (one per virtual stage, in the model's order)"
        raise ValueError(
            f"pipeline: layers_per_stage {list(counts)} must be {p * v} counts of at least 1, "
            f"for {per}, summing to the {n_layers} layers"
        )
    width, starts = max(counts), np.cumsum((0,) + counts[:-1])
    virtual = [[table.virtual_stage(s, c) for c in range(v)] for s in range(p)]
    index = np.array([[[starts[k] + min(j, counts[k] - 1) for j in range(width)] for k in row] for row in virtual])
    active = np.array([[[j < counts[k] for j in range(width)] for k in row] for row in virtual], np.float32)

    def device_order(leaf):  # [L, ...] -> [p, v, width, ...]
        return leaf[index]

    def masked(layer, h):
        def skipped():  # h passes on; a padding layer adds no loss term and no metrics
            _, loss, metrics = layer_outputs(jax.eval_shape(layer_fn, layer["layer"], h))
            if loss is None:
                return h
            zeros = lambda tree: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), tree)  # noqa: E731
            return h, zeros(loss), zeros(metrics)

        return lax.cond(layer["active"] > 0, lambda: layer_fn(layer["layer"], h), skipped)

    return device_order, jnp.asarray(active), masked


def _results(params, loss, d_stage, d_head, d_xs, aux) -> list:
    """The equation's results, in its order, from what the executor returns."""
    return [loss.astype(params["head"].out_avals[0].dtype), *d_stage, *d_head, d_xs, *aux]


def _sequential_impl(*values, **params):
    stage, head, xs, args = operand_groups(params, list(values))
    return _results(params, *sequential(callables(_bodies_param(params)), params["table"], stage, head, xs, args))


def _abstract_eval(*avals, **params):
    stage, head, xs, _ = operand_groups(params, list(avals))
    loss, forward = params["head"].out_avals[0], params["forward"]
    lead = stage[0].shape[:2]  # [p, v]
    aux = [
        jax.core.ShapedArray(lead + a.shape, jnp.promote_types(a.dtype, jnp.float32))
        for a in forward.out_avals[1 : 1 + aux_count(_bodies_param(params))]
    ]
    return [loss, *stage, *head, xs, *aux]


pipeline_p.def_impl(lambda *values, **params: jax.jit(lambda *v: _sequential_impl(*v, **params))(*values))
pipeline_p.def_abstract_eval(_abstract_eval)
mlir.register_lowering(pipeline_p, mlir.lower_fun(_sequential_impl, multiple_results=True))


def _is_float_scalar(a) -> bool:
    return isinstance(a, jax.ShapeDtypeStruct) and a.shape == () and jnp.issubdtype(a.dtype, jnp.floating)


def _check_layer_and_head(layer_fn, head, layers, x, head_params, head_args, m: int):
    """One layer's metrics (abstract; None where it returns h alone), or a ShardingError naming
    ``layer_fn`` or ``head`` unless one layer maps a micro-batch's activations to their own
    shape and dtype (the stages hand them on), with a float scalar loss term where it returns
    one, and the head makes a float scalar of them (the loss the schedule differentiates)."""

    def one_micro_batch(a):
        return jax.ShapeDtypeStruct((a.shape[0] // m,) + tuple(a.shape[1:]), a.dtype)

    h = one_micro_batch(x)
    one_layer = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), layers)
    out = jax.eval_shape(layer_fn, one_layer, h)
    got, loss, metrics = layer_outputs(out)
    if jax.tree.structure(got) != jax.tree.structure(h) or (got.shape, got.dtype) != (h.shape, h.dtype):
        raise ShardingError(
            f"sf.pipeline: layer_fn {definition(layer_fn)} must map a micro-batch's activations "
            f"h {describe(h)} to the same shape and dtype, or return (h, loss term, metrics); "
            f"it returns {_described(out)}: each stage hands its output to the next as the next one's h"
        )
    if out is not got and not _is_float_scalar(loss):
        raise ShardingError(
            f"sf.pipeline: layer_fn {definition(layer_fn)} returns (h, loss term, metrics) with a "
            f"loss term {_described(loss)}; it must be a float scalar (added to the micro-batch's loss)"
        )
    loss = jax.eval_shape(head, head_params, h, jax.tree.map(one_micro_batch, head_args))
    if not _is_float_scalar(loss):
        raise ShardingError(
            f"sf.pipeline: head {definition(head)} must return a micro-batch's loss, a float "
            f"scalar; it returns {_described(loss)} (y {describe(h)}): the schedule "
            "differentiates the mean of the micro-batches' losses"
        )
    return metrics


def _described(tree) -> str:
    leaves = jax.tree.leaves(tree)
    if len(leaves) == 1 and jax.tree.structure(tree).num_leaves == 1 and not isinstance(tree, (tuple, list, dict)):
        return describe(leaves[0])
    return str(jax.tree.map(describe, tree)).replace("'", "")


def _even(n_layers, table):
    """device_order of a layer leaf for ``table``'s virtual stages of equal layer counts."""
    p, v = table.stages, table.chunks
    if n_layers % (p * v):
        raise ValueError(
            f"pipeline: {n_layers} layers do not split into {p} stages x {v} chunks; "
            f"give layers_per_stage for an uneven split"
        )
    per_chunk = n_layers // (p * v)
    order = np.array([[table.virtual_stage(s, c) for c in range(v)] for s in range(p)])

    def device_order(leaf):  # [L, ...] -> [p, v, L / (p v), ...]
        blocks = leaf.reshape((p * v, per_chunk) + leaf.shape[1:])
        if (order.reshape(-1) == np.arange(p * v)).all():
            return blocks.reshape((p, v) + blocks.shape[1:])
        return blocks[order]

    return device_order


def _model_order(device_order, active, n_layers):
    """[p, v, width, ...] -> [L, ...]: each layer's entry of a per-slot value, in the model's
    order (padding slots left out)."""
    layer_at = np.asarray(device_order(np.arange(n_layers))).reshape(-1)
    present = np.ones(layer_at.shape, bool) if active is None else np.asarray(active).reshape(-1) > 0
    slot = np.array([np.flatnonzero((layer_at == layer) & present)[0] for layer in range(n_layers)])
    return lambda a: a.reshape((-1,) + a.shape[3:])[slot]


def pipeline(
    layer_fn,
    layers,
    x,
    *,
    head,
    head_params,
    head_args=(),
    stages: int,
    microbatches: int,
    schedule="1f1b",
    chunks: int | None = None,
    layers_per_stage=None,
    axis: str = "pipe",
):
    """``mean_i head(head_params, layers applied to micro-batch i of x, head_args of i)``.

    ``layers`` is a pytree of stacked layer parameters (leading dim: the number of layers),
    ``layer_fn(layer, h) -> h`` one layer; ``x`` and each leaf of ``head_args`` are split into
    ``microbatches`` along dim 0, strided (micro-batch i holds rows i, i + m, ...: a batch split
    over a data axis leaves every micro-batch split the same way, without moving a row). In
    ``sf.parallelize`` on a mesh with ``axis`` of ``stages`` devices, the layers are split over
    it in blocks and the schedule runs; elsewhere the same numbers come from one device running
    the micro-batches in turn. Differentiating the result gives the schedule's gradients
    (computed with the loss; the loss must be the output that is differentiated — its gradient
    is linear in the seed). Partial: called without differentiating (an evaluation), it still
    runs the backward and drops it.

    A layer may also return ``(h, loss_term, metrics)`` (an MoE layer's balance loss and its
    routing statistics): ``loss_term``, a float scalar, is added to its micro-batch's loss and
    differentiated with it in the layer's own backward (the stage that runs the layer); the
    result is then ``(loss, metrics)``, ``metrics`` stacked over the layers in the model's
    order and averaged over the micro-batches, in float32 at least, under ``stop_gradient``
    (a term to differentiate belongs in ``loss_term``).

    ``layers_per_stage`` (e.g. [5, 4, 4, 3]) splits the layers unevenly: every stage holds as
    many as the largest, the padding ones skipped by a ``lax.cond`` (predication: the stage's
    program is the same on every device, its work is not). With v chunks per stage it has a
    count per virtual stage, p * v of them in the model's order.
    """
    leaves, layer_tree = jax.tree.flatten(layers)
    n_layers = {x.shape[0] for x in leaves}
    if len(n_layers) != 1:
        raise ValueError(f"pipeline: the stacked layers' leading dims differ: {sorted(n_layers)}")
    (n_layers,) = n_layers
    table = schedule if isinstance(schedule, Schedule) else by_name(schedule, stages, microbatches, chunks)
    m = table.microbatches
    if x.shape[0] % m:
        raise ValueError(f"pipeline: a batch of {x.shape[0]} does not split into {m} micro-batches")
    metrics = _check_layer_and_head(layer_fn, head, layers, x, head_params, head_args, m)
    if layers_per_stage is not None:
        device_order, active, layer_fn = _uneven(layer_fn, tuple(layers_per_stage), n_layers, table)
        stage_tree = {"layer": jax.tree.map(device_order, layers), "active": active}
    else:
        device_order, active = _even(n_layers, table), None
        stage_tree = jax.tree.map(device_order, layers)

    def micro(a):  # micro-batch i: rows i, i + m, i + 2m, ... (a batch split stays split)
        return a.reshape((a.shape[0] // m, m) + a.shape[1:]).swapaxes(0, 1)

    stage, layer_tree = jax.tree.flatten(stage_tree)
    head_leaves = jax.tree.leaves(head_params)
    xs = micro(x)
    arg_leaves, arg_tree = jax.tree.flatten(jax.tree.map(micro, head_args))
    jaxprs = bodies_of(
        layer_fn,
        head,
        jax.tree.unflatten(layer_tree, [jax.ShapeDtypeStruct(a.shape[2:], a.dtype) for a in stage]),
        jax.ShapeDtypeStruct(xs.shape[1:], xs.dtype),
        head_params,
        jax.tree.unflatten(arg_tree, [jax.ShapeDtypeStruct(a.shape[1:], a.dtype) for a in arg_leaves]),
    )
    params = dict(jaxprs._asdict(), table=table, axis=axis, counts=(len(stage), len(head_leaves), len(arg_leaves)))

    def bind(stage, head_leaves, xs, arg_leaves):
        """((the loss, the layers' aux), (d stage, d head, d xs)); the loss with the layers'
        loss terms, each the mean over the micro-batches."""
        outs = pipeline_p.bind(*stage, *head_leaves, xs, *arg_leaves, **params)
        ns, nh = len(stage), len(head_leaves)
        loss, aux = outs[0], outs[2 + ns + nh :]
        if aux:
            loss = loss + jnp.sum(aux[0]).astype(loss.dtype)
        return (loss, aux), (outs[1 : 1 + ns], outs[1 + ns : 1 + ns + nh], outs[1 + ns + nh])

    @jax.custom_vjp
    def loss(stage, head_leaves, xs, arg_leaves):
        return bind(stage, head_leaves, xs, arg_leaves)[0]

    def loss_bwd(grads, g):  # head_args (targets, masks) get no gradient; aux under stop_gradient
        d_stage, d_head, d_xs = grads
        g = g[0]
        scale = lambda ds: [d * g.astype(d.dtype) for d in ds]  # noqa: E731
        return scale(d_stage), scale(d_head), d_xs * g.astype(d_xs.dtype), [None] * len(arg_leaves)

    loss.defvjp(bind, loss_bwd)
    value, aux = loss(stage, head_leaves, xs, arg_leaves)
    if metrics is None:
        return value
    in_model_order = _model_order(device_order, active, n_layers)
    aux = [in_model_order(lax.stop_gradient(a)) for a in aux[1:]]
    return value, jax.tree.unflatten(jax.tree.structure(metrics), aux)


# ------------------------------------------------------------------------------ the rule
#
# On the pipeline axis the stage leaves are split by stage (dim 0) and everything else is whole;
# the bodies run whole on it (a device runs its own stages). On the other axes the bodies are
# sharded like a loop body, from the operands' NdSbps with the stacking dims (p, v for the
# stage leaves, m for xs and args) unsplit: an activation leaves a stage (forward, dx, the
# head's dy) as it entered, residuals go from forward to backward as forward made them, and the
# gradients come out as backward made them (partial where the batch is split).


def _inner(sbp, ax, lead):
    """The NdSbp inside the bodies of an operand with ``lead`` stacking dims."""
    return tuple(B if i == ax else (Split(s.dim - lead) if isinstance(s, Split) else s) for i, s in enumerate(sbp))


def outer_sbp(sbp, ax, lead, on_axis):
    """The NdSbp outside the bodies of a value that is ``sbp`` inside them, with ``lead``
    stacking dims in front and ``on_axis`` on the pipeline axis (``ax``)."""
    return tuple(
        on_axis if i == ax else (Split(s.dim + lead) if isinstance(s, Split) else s) for i, s in enumerate(sbp)
    )


def _operand(sbp, ax, lead, on_axis):
    """What the operand must be: ``on_axis`` on the pipeline axis; elsewhere as it is, except
    that stacking dims are not split and nothing is partial."""
    return tuple(
        on_axis if i == ax else (B if isinstance(s, Partial) or (isinstance(s, Split) and s.dim < lead) else s)
        for i, s in enumerate(sbp)
    )


def pipeline_axis(eqn, mesh) -> int | None:
    """The index of the pipeline's mesh axis, None where the mesh has none (the stages then
    run in turn); a ShardingError where the stages do not fit it."""
    table, axis, names = eqn.params["table"], eqn.params["axis"], tuple(mesh.axis_names)
    ax = names.index(axis) if axis in names else None
    if ax is None and table.stages > 1:
        raise ShardingError(
            f"{source_line(eqn)}: sf.pipeline over {table.stages} stages on axis {axis!r}, which "
            f"the mesh {dict(zip(names, mesh.devices.shape))} lacks"
        )
    if ax is not None and mesh.devices.shape[ax] != table.stages:
        raise ShardingError(
            f"{source_line(eqn)}: sf.pipeline over {table.stages} stages on mesh axis {axis!r} of "
            f"{mesh.devices.shape[ax]} devices"
        )
    return ax


def _propagate(prop, eqn):
    params, src = eqn.params, source_line(eqn)
    ax = pipeline_axis(eqn, prop.mesh)
    stage, head, xs, args = operand_groups(params, [prop.of(a) for a in eqn.invars])
    # Over an axis that splits the micro-batches (data parallel) a stage's weights enter whole:
    # gathered once a step and their gradients reduced once (ZeRO), where split (FSDP) the
    # bodies would gather them again for every micro-batch. Over the others (tensor parallel)
    # they stay as they are.
    data_axes = {i for i, s in enumerate(xs) if i != ax and s == Split(1)}
    whole_over_data = lambda sbp: tuple(B if i in data_axes else t for i, t in enumerate(sbp))
    stage = [whole_over_data(_operand(s, ax, 2, Split(0))) for s in stage]
    # The head runs on every device of the axis at once, split as its parameters are (a vocab
    # split over the stages shares the head's work out); replicated parameters run it whole.
    head = [
        whole_over_data(_operand(s, ax, 0, s[ax] if ax is not None and isinstance(s[ax], Split) else B)) for s in head
    ]
    xs = _operand(xs, ax, 1, B)
    args = [_operand(s, ax, 1, B) for s in args]
    chunk = [_inner(s, ax, 2) for s in stage]
    x = _inner(xs, ax, 1)

    def run(name, in_sbp):
        if ax is None or name == "head":
            return prop.run_body(open_jaxpr(params[name]), in_sbp, src)
        with prop.holding(ax):
            return prop.run_body(open_jaxpr(params[name]), in_sbp, src)

    n_aux = aux_count(_bodies_param(params))
    forward, (_, *outs) = run("forward", chunk + [x])
    aux, stored = outs[:n_aux], outs[n_aux:]
    head_body, (loss, *d_head_and_dy) = run("head", head + [x] + [_inner(s, ax, 1) for s in args])
    on_axis = lambda sbp, entry=B: sbp if ax is None else tuple(entry if i == ax else s for i, s in enumerate(sbp))
    loss = on_axis(loss)
    d_head = [on_axis(d, h[ax] if ax is not None else B) for d, h in zip(d_head_and_dy[:-1], head)]
    backward, outs = run("backward", chunk + stored + [x])
    d_chunk = outs[:-1]
    backward_x, (_, *stash) = run("backward_x", chunk + stored + [x])
    backward_w, _ = run("backward_w", chunk + stored + stash)
    wanted = dict(
        forward=(x, *aux, *stored),
        head=(loss, *d_head, x),
        backward=(*d_chunk, x),
        backward_x=(x, *stash),
        backward_w=tuple(d_chunk),
    )
    outs = (
        [loss]
        + [outer_sbp(s, ax, 2, Split(0)) for s in d_chunk]
        + d_head
        + [outer_sbp(x, ax, 1, B)]
        + [outer_sbp(s, ax, 2, Split(0)) for s in aux]
    )
    decision = Decision(
        tuple(stage + head + [xs] + args), tuple(outs), bodies=tuple((name, wanted[name]) for name in Bodies._fields)
    )
    rebody = lambda old, new: old.replace(jaxpr=new)
    return prop.decide(
        eqn,
        decision,
        src,
        forward=rebody(params["forward"], forward),
        head=rebody(params["head"], head_body),
        backward=rebody(params["backward"], backward),
        backward_x=rebody(params["backward_x"], backward_x),
        backward_w=rebody(params["backward_w"], backward_w),
    )


def body_runs(table: Schedule, staged: bool) -> dict:
    """How many times each body runs on a device in a step (averaged over the stages where
    they differ): forward and a backward per micro-batch and chunk, the head per micro-batch;
    the backward whole where the micro-batch's W runs in its B's step
    (``StepTables.tables["bw_whole"]``) or the stages run in turn (not ``staged``), else as
    backward_x and backward_w."""
    trips = table.microbatches * table.chunks
    whole = trips
    if staged:
        tabs = step_tables(table).tables
        whole = int(((tabs["b_chunk"] >= 0) & (tabs["bw_whole"] > 0)).sum()) / table.stages
        whole = int(whole) if whole == int(whole) else whole
    return dict(
        forward=trips, head=table.microbatches, backward=whole, backward_x=trips - whole, backward_w=trips - whole
    )


def _lower(local, eqn, ins):
    params = eqn.params
    bodies = callables(_bodies_param(params), run=local.body_fn)
    stage, head, xs, args = operand_groups(params, list(ins))
    if params["axis"] not in local.names:  # one stage: the micro-batches in turn
        return _results(params, *sequential(bodies, params["table"], stage, head, xs, args))
    return _results(params, *execute(bodies, params["table"], stage, head, xs, args, axis=params["axis"]))


def _comm(eqn, ins, sigs, mesh):
    """Per step, one ppermute of an activation-sized block per kind (F, B) and direction the table
    sends it; per micro-batch, the last stage's output summed onto every device for the head
    (whose own collectives explain lists in its body); at the end, d xs summed over the stages."""
    params = eqn.params
    table, axis = params["table"], params["axis"]
    if axis not in mesh.axis_names or table.stages == 1:
        return []
    ax = mesh.axis_names.index(axis)
    _, _, xs, _ = operand_groups(params, list(eqn.invars))
    _, _, xs_sbp, _ = operand_groups(params, list(ins))
    x = jax.core.ShapedArray(xs.aval.shape[1:], xs.aval.dtype)
    n = mesh.devices.shape[ax]

    def all_reduce(aval, sbp):
        return Step(
            "all_reduce",
            (axis,),
            value=aval,
            bytes=int(2 * (n - 1) / n * math.prod(local_shape(aval.shape, sbp, mesh)) * aval.dtype.itemsize),
        )

    block = math.prod(local_shape(x.shape, _inner(xs_sbp, ax, 1), mesh)) * x.dtype.itemsize
    pl = step_tables(table)
    return (
        [Step("ppermute", (axis,), bytes=block, value=x)] * (pl.steps * len(pl.directions))
        + [all_reduce(x, _inner(xs_sbp, ax, 1))] * table.microbatches
        + [all_reduce(xs.aval, xs_sbp)]
    )


def _solve(builder, eqn, scale):
    from shardflow.pipeline_solve import solve_pipeline  # the solver's side, loaded when a pipeline is solved

    return solve_pipeline(builder, eqn, scale)


defrule(
    pipeline_p,
    propagate=_propagate,
    solve=_solve,
    lower=_lower,
    comm=_comm,
    comm_reason="passes activations and gradients between stages, gives the head the last stage's output, sums d xs",
    trips=lambda eqn, body, mesh: body_runs(eqn.params["table"], pipeline_axis(eqn, mesh) is not None)[body],
)
