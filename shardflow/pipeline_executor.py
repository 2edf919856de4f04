"""The pipeline executor: the stage and head bodies traced once (``bodies_of``), what every
schedule computes run in sequence (``sequential``), and the per-device program that runs a
schedule's step tables in lockstep (``execute``: a scan over steps; see ``shardflow.pipelining``
for the design)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import jaxpr_as_fun

from shardflow import slots
from shardflow.pipeline_tables import placements, step_tables
from shardflow.schedules import Schedule
from shardflow.slots import at, put
from shardflow.split_vjp import split_vjp


class Bodies(NamedTuple):
    """A virtual stage and the head as functions of flat lists of arrays (one device's view).

    forward(chunk, x) -> (y, aux, stored): ``aux`` what the chunk's layers return beside their
    output, each stacked over the chunk's layers (their loss terms first, then their metrics;
    empty where a layer returns its output alone); ``stored`` the residuals B and W need, less
    those that are the chunk's own parameters (passed again rather than kept per micro-batch).
    backward(chunk, stored, dy) -> (d chunk, dx), the layers' loss terms seeded with one, and
    the same work cut in two
    (``split_vjp``): backward_x(chunk, stored, dy) -> (dx, stash) and
    backward_w(chunk, stored, stash) -> d chunk, the stash being what W reads of B's values
    (the cotangents of the weights' matmuls).
    head(head_params, y, args) -> (loss, d head_params, dy).
    """

    forward: Callable
    backward: Callable
    backward_x: Callable
    backward_w: Callable
    head: Callable


def layer_outputs(out):
    """(h, loss term, metrics) of what ``sf.pipeline``'s ``layer_fn`` returns: ``h`` alone, or
    ``(h, loss, metrics)`` — a float scalar added to the micro-batch's loss (differentiated)
    and a pytree of arrays returned per layer (not differentiated)."""
    if isinstance(out, tuple) and len(out) == 3:
        return out
    return out, None, None


def bodies_of(layer_fn, head_fn, chunk, x, head_params, args) -> Bodies:
    """The Bodies on one device as ClosedJaxprs, for ``layer_fn(layer, h)`` (see
    ``layer_outputs``) scanned over a chunk of stacked layers and
    ``head_fn(head_params, y, args) -> loss``, traced at the given (abstract) values."""
    chunk_leaves, chunk_tree = jax.tree.flatten(chunk)
    head_leaves, head_tree = jax.tree.flatten(head_params)
    arg_leaves, arg_tree = jax.tree.flatten(args)
    n = len(chunk_leaves)

    def stage(leaves, x):  # ((y, the layers' loss terms), their metrics)
        def one(h, layer):
            h, loss, metrics = layer_outputs(layer_fn(layer, h))
            return h, (loss, metrics)

        y, (losses, metrics) = lax.scan(one, x, jax.tree.unflatten(chunk_tree, leaves))
        return (y, losses), metrics

    pullback = {}

    def full_forward(leaves, x):
        (y, losses), vjp, metrics = jax.vjp(stage, leaves, x, has_aux=True)
        residuals, pullback["tree"] = jax.tree.flatten(vjp)
        aux = pullback["aux"] = jax.tree.leaves((losses, metrics))
        return y, aux, residuals

    traced = jax.make_jaxpr(full_forward)(chunk_leaves, x)
    n_aux = len(pullback["aux"])
    inputs = traced.jaxpr.invars[:n]
    y, *outs = traced.jaxpr.outvars
    aux, residuals = outs[:n_aux], outs[n_aux:]
    # Where each residual comes from: a chunk parameter (its index) or the stored list (-1).
    from_chunk = tuple(inputs.index(v) if v in inputs else -1 for v in residuals)
    # forward: the traced jaxpr less the residuals that are chunk parameters (no new trace).
    forward = traced.replace(
        jaxpr=traced.jaxpr.replace(outvars=[y, *aux] + [r for r, i in zip(residuals, from_chunk) if i < 0])
    )
    y, *outs = (jax.ShapeDtypeStruct(a.shape, a.dtype) for a in forward.out_avals)
    losses, stored = outs[: min(n_aux, 1)], outs[n_aux:]

    def pullback_of(leaves, stored):
        stored = iter(stored)
        residuals = [leaves[i] if i >= 0 else next(stored) for i in from_chunk]
        return jax.tree.unflatten(pullback["tree"], residuals)

    def backward(leaves, stored, dy):
        seed = [jnp.ones(a.shape, a.dtype) for a in losses]  # d loss / d (each layer's loss term)
        d_leaves, dx = pullback_of(leaves, stored)((dy, seed[0] if seed else None))
        return list(d_leaves), dx

    def head(hp, y, a):
        loss, (dh, dy) = jax.value_and_grad(
            lambda hp, y: head_fn(jax.tree.unflatten(head_tree, hp), y, jax.tree.unflatten(arg_tree, a)), argnums=(0, 1)
        )(hp, y)
        return loss, list(dh), dy

    backward_jaxpr = jax.make_jaxpr(backward)(chunk_leaves, stored, y)
    split = split_vjp(backward_jaxpr, shared=n + len(stored), weights=n)
    jaxprs = Bodies(
        forward=forward,
        backward=backward_jaxpr,
        backward_x=split.b,
        backward_w=split.w,
        head=jax.make_jaxpr(head)(head_leaves, y, arg_leaves),
    )
    if jax.tree.structure(y) != jax.tree.structure(x) or y.shape != jnp.shape(x) or y.dtype != jnp.result_type(x):
        raise ValueError(
            f"pipeline: a layer must map its input to the same shape and dtype; "
            f"{jnp.result_type(x)}{list(jnp.shape(x))} became {y.dtype}{list(y.shape)}"
        )
    return jaxprs


def callables(jaxprs: Bodies, run=jaxpr_as_fun) -> Bodies:
    """Bodies calling each ClosedJaxpr through ``run`` (e.g. a rule's local lowering), in and
    out as the flat lists ``execute`` passes."""

    def flat(jaxpr, split):
        fn = run(jaxpr)
        return lambda *groups: split(list(fn(*[x for g in groups for x in (g if isinstance(g, list) else [g])])))

    f, b, bx, bw, h = jaxprs
    n_dp, a = len(b.out_avals) - 1, 1 + aux_count(jaxprs)
    return Bodies(
        forward=flat(f, lambda o: (o[0], o[1:a], o[a:])),
        backward=flat(b, lambda o: (o[:n_dp], o[n_dp])),
        backward_x=flat(bx, lambda o: (o[0], o[1:])),
        backward_w=flat(bw, lambda o: o),
        head=flat(h, lambda o: (o[0], o[1:-1], o[-1])),
    )


def aux_count(jaxprs: Bodies) -> int:
    """How many of forward's results after y are the layers' aux (the rest are stored): backward
    reads the chunk, the stored values and dy where forward reads the chunk and x."""
    n_stored = len(jaxprs.backward.in_avals) - len(jaxprs.forward.in_avals)
    return len(jaxprs.forward.out_avals) - 1 - n_stored


def sequential(bodies: Bodies, table: Schedule, stage, head_params, xs, args):
    """What every schedule computes, one micro-batch and one virtual stage after another on one
    device: (head loss, d stage, d head_params, d xs, aux), each a flat list (stage leaves and
    aux [p, v, ...]; aux the mean over micro-batches, in float32 at least)."""
    where = placements(table)
    m, n_virtual = table.microbatches, table.stages * table.chunks

    def chunk(k):
        return [x[where[k]] for x in stage]

    d_chunk, d_hp, aux0 = _gradient_shapes(bodies, chunk(0), xs[0], head_params, [a[0] for a in args])
    d_stage = [jnp.zeros(x.shape[:2] + g.shape, _summed(g.dtype)) for x, g in zip(stage, d_chunk)]
    d_head = [jnp.zeros(g.shape, _summed(g.dtype)) for g in d_hp]
    aux = [jnp.zeros(stage[0].shape[:2] + a.shape, _summed(a.dtype)) for a in aux0]
    loss, d_xs = jnp.zeros((), jnp.float32), []

    for i in range(m):
        h, stored = xs[i], []
        for k in range(n_virtual):
            h, out, st = bodies.forward(chunk(k), h)
            aux = [a.at[where[k]].add(o.astype(a.dtype)) for a, o in zip(aux, out)]
            stored.append(st)
        l, dh, dy = bodies.head(head_params, h, [a[i] for a in args])
        loss, d_head = loss + l, [a + b.astype(a.dtype) for a, b in zip(d_head, dh)]
        for k in reversed(range(n_virtual)):
            dc, dy = bodies.backward(chunk(k), stored[k], dy)
            d_stage = [d.at[where[k]].add(g.astype(d.dtype)) for d, g in zip(d_stage, dc)]
        d_xs.append(dy)
    return (
        loss / m,
        [(d / m).astype(g.dtype) for d, g in zip(d_stage, d_chunk)],
        [(d / m).astype(g.dtype) for d, g in zip(d_head, d_hp)],
        jnp.stack(d_xs) / m,
        [a / m for a in aux],
    )


def _summed(dtype):
    """The dtype gradients and aux are summed over micro-batches in: at least float32 (bf16
    gradients summed 16 times in bf16 would round 16 times; they are rounded once, at the end)."""
    return jnp.promote_types(dtype, jnp.float32)


def _flat(out) -> list:
    first, *groups = out
    return [first, *(x for group in groups for x in group)]


def _gradient_shapes(bodies: Bodies, chunk, x, head_params, args):
    """(a chunk's gradient, the head params' gradient, a chunk's aux) as the bodies make them:
    sharded bodies may make them in other blocks than the parameters' (a replicated bias's
    gradient split with the activations)."""
    y, aux, stored = jax.eval_shape(bodies.forward, chunk, x)
    return (
        jax.eval_shape(bodies.backward, chunk, stored, y)[0],
        jax.eval_shape(bodies.head, list(head_params), y, args)[1],
        aux,
    )


def execute(bodies: Bodies, table: Schedule, stage, head_params, xs, args, *, axis: str):
    """The pipelined loss and its gradients on this device (inside ``shard_map`` over ``axis``):
    ``sequential``'s results, each device holding its own [1, v, ...] block of the stage leaves,
    of their gradients and of the aux, the rest whole on every device."""
    run = _Lockstep(bodies, table, stage, head_params, xs, args, axis)
    carry, _ = lax.scan(run.step, run.initial_carry(), jnp.arange(run.step_tables.steps))
    return run.results(carry)


def _like(avals) -> list:
    return [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]


def _buffers(n, like, spare=0) -> list:
    return [jnp.zeros((max(n, 1) + spare,) + tuple(a.shape), a.dtype) for a in like]


def _when(pred, fn, c, keys):
    """``c`` with its entries ``keys`` replaced by ``fn`` of them where ``pred``. A loop of 0
    or 1 trips, not a conditional: XLA updates a loop's state in place, where a conditional
    copies every buffer its branches pass through — all of them, every step."""
    part = {k: c[k] for k in keys}
    _, part = lax.while_loop(
        lambda s: s[0] < pred.astype(jnp.int32), lambda s: (s[0] + 1, fn(s[1])), (jnp.int32(0), part)
    )
    return dict(c, **part)


def _chunk_sums(d_stage, k):
    """Chunk k's gradient sums, as slots.run adds to them."""
    return {r: (slots.Rows(d[k]), None) for r, d in enumerate(d_stage)}


def _with_chunk_sums(d_stage, k, new):
    """``d_stage`` with chunk k's sums replaced by ``new`` (slots.run's results)."""
    return [[list(n) if j == k else d_j for j, d_j in enumerate(d)] for d, n in zip(d_stage, new)]


class _Lockstep:
    """``execute`` on one device: the step's actions as local jaxprs, the state the scan over
    steps carries, one step (the actions its tables give this device, then the hand-offs to the
    neighbouring stages) and the results."""

    def __init__(self, bodies: Bodies, table: Schedule, stage, head_params, xs, args, axis: str):
        self.bodies, self.head_params, self.xs, self.args, self.axis = bodies, head_params, xs, args, axis
        self.step_tables = step_tables(table)
        self.p, self.m, self.v = table.stages, table.microbatches, table.chunks
        self.me = lax.axis_index(axis)
        self.last_stage, _ = placements(table)[self.p * self.v - 1]
        self.first_stage, self.first_chunk = placements(table)[0]
        mine = [x[0] for x in stage]  # [v, ...] this device's chunks
        # Each chunk's layers split once, before the loop over steps, so that each layer's weights,
        # and its gradients' float32 sums, are arrays of their own (slots.Rows): sliced from a
        # stack inside the loop, XLA:GPU copies them for every micro-batch. So an action runs in one
        # loop of 0 or 1 trips per chunk, each with its chunk's arrays.
        self.layers = [[slots.Rows(x[k, l] for l in range(x.shape[1])) for x in mine] for k in range(self.v)]
        self.x0 = xs[0]
        stacked0 = [x[0] for x in mine]
        self.d_chunk, self.d_hp, self.aux0 = _gradient_shapes(
            bodies, stacked0, self.x0, head_params, [a[0] for a in args]
        )
        self.n = len(mine)
        self._trace_actions(_like(stacked0))
        self.tables = {name: jnp.asarray(tab) for name, tab in self.step_tables.tables.items()}
        self.heads = jnp.asarray(self.step_tables.heads)
        p = self.p
        self.shifts = (("next", [(j, (j + 1) % p) for j in range(p)]), ("prev", [(j, (j - 1) % p) for j in range(p)]))

    def _trace_actions(self, chunk0):
        """The actions as local jaxprs, which slots.run evaluates with the residuals and the stash
        written into and read from their slots by the layers' scans themselves. Only the backward
        the table runs is traced: split (B, then W at another step) and / or whole (B and W of a
        micro-batch in one step)."""
        bodies, n, x0, tables = self.bodies, self.n, self.x0, self.step_tables.tables
        self.f_jaxpr = jax.make_jaxpr(lambda *a: _flat(bodies.forward(list(a[:n]), a[n])))(*chunk0, x0)
        self.n_aux = len(self.aux0)
        self.stored0 = _like(self.f_jaxpr.out_avals[1 + self.n_aux :])
        n_stored = self.n_stored = len(self.stored0)
        self.stash0 = []
        self.whole_b = bool(tables["bw_whole"].any())
        self.split_b = bool(((tables["b_chunk"] >= 0) & (tables["bw_whole"] == 0)).any())
        if self.split_b:
            self.bx_jaxpr = jax.make_jaxpr(lambda *a: _flat(bodies.backward_x(list(a[:n]), list(a[n:-1]), a[-1])))(
                *chunk0, *self.stored0, x0
            )
            self.stash0 = _like(self.bx_jaxpr.out_avals[1:])
            self.bw_jaxpr = jax.make_jaxpr(
                lambda *a: bodies.backward_w(list(a[:n]), list(a[n : n + n_stored]), list(a[n + n_stored :]))
            )(*chunk0, *self.stored0, *self.stash0)
        if self.whole_b:
            self.b_jaxpr = jax.make_jaxpr(
                lambda *a: (lambda d, dx: [*d, dx])(*bodies.backward(list(a[:n]), list(a[n:-1]), a[-1]))
            )(*chunk0, *self.stored0, x0)
        self.n_stash = len(self.stash0)

    def initial_carry(self) -> dict:
        pl, x0 = self.step_tables, self.x0
        return dict(
            stored=_buffers(pl.n_resid, self.stored0),
            stash=_buffers(pl.n_stash, self.stash0) if self.split_b else [],
            in_f=_buffers(pl.n_in_f, [x0], spare=1)[0],  # the last slot takes writes to nowhere
            in_b=_buffers(pl.n_in_b, [x0], spare=1)[0],
            d_stage=[
                [[jnp.zeros(g.shape[1:], _summed(g.dtype)) for _ in range(g.shape[0])] for _ in range(self.v)]
                for g in self.d_chunk
            ],  # [leaf][chunk][layer]
            d_head=[jnp.zeros(g.shape, _summed(g.dtype)) for g in self.d_hp],
            aux=[jnp.zeros((self.v,) + a.shape, _summed(a.dtype)) for a in self.aux0],
            d_xs=_buffers(self.m, [x0], spare=1)[0],
            loss=jnp.zeros((), jnp.float32),
            out_f=jnp.zeros_like(x0),  # what this step's F and B send on (read only where sent)
            out_b=jnp.zeros_like(x0),
        )

    def is_first(self, k):
        return (self.me == self.first_stage) & (k == self.first_chunk)

    def forward(self, k, row, c):
        i = row["f_mb"]
        x = jnp.where(self.is_first(k), at(self.xs, i), at(c["in_f"], row["f_in"]))
        a = 1 + self.n_aux
        y, *outs = slots.run(
            self.f_jaxpr, self.layers[k] + [x], writes={a + r: (b, row["f_resid"]) for r, b in enumerate(c["stored"])}
        )
        aux = [s.at[k].add(o.astype(s.dtype)) for s, o in zip(c["aux"], outs)]
        return dict(stored=outs[a - 1 :], out_f=y, aux=aux)

    def head(self, row, c):  # on every device: y from the last stage; dy to it
        y = lax.psum(jnp.where(self.me == self.last_stage, c["out_f"], jnp.zeros_like(c["out_f"])), self.axis)
        i = self.tables["f_mb"][row["t"], self.last_stage]
        loss, dh, dy = self.bodies.head(list(self.head_params), y, [at(a, i) for a in self.args])
        return dict(
            loss=c["loss"] + loss,
            d_head=[a + b.astype(a.dtype) for a, b in zip(c["d_head"], dh)],
            in_b=put(c["in_b"], row["f_head"], dy),
        )

    def backward(self, k, row, c):
        i, n = row["b_mb"], self.n
        dy = at(c["in_b"], row["b_in"])
        dx, *stash = slots.run(
            self.bx_jaxpr,
            self.layers[k] + [None] * self.n_stored + [dy],
            reads={n + r: (b, row["b_resid"]) for r, b in enumerate(c["stored"])},
            writes={1 + s: (b, row["b_stash"]) for s, b in enumerate(c["stash"])},
        )
        return dict(stash=stash, d_xs=put(c["d_xs"], jnp.where(self.is_first(k), i, -1), dx), out_b=dx)

    def whole_backward(self, k, row, c):  # B and W of one micro-batch in one step: nothing stashed
        i, n = row["b_mb"], self.n
        *d_stage, dx = slots.run(
            self.b_jaxpr,
            self.layers[k] + [None] * self.n_stored + [at(c["in_b"], row["b_in"])],
            reads={n + r: (b, row["b_resid"]) for r, b in enumerate(c["stored"])},
            adds=_chunk_sums(c["d_stage"], k),
        )
        return dict(
            d_stage=_with_chunk_sums(c["d_stage"], k, d_stage),
            d_xs=put(c["d_xs"], jnp.where(self.is_first(k), i, -1), dx),
            out_b=dx,
        )

    def weights(self, k, j, row, c):  # the step's j-th W
        n, n_stored = self.n, self.n_stored
        reads = {n + r: (b, row["w_resid"][j]) for r, b in enumerate(c["stored"])}
        reads.update({n + n_stored + s: (b, row["w_stash"][j]) for s, b in enumerate(c["stash"])})
        sums = slots.run(
            self.bw_jaxpr,
            self.layers[k] + [None] * (n_stored + self.n_stash),
            reads=reads,
            adds=_chunk_sums(c["d_stage"], k),
        )
        return dict(d_stage=_with_chunk_sums(c["d_stage"], k, sums))

    def step(self, c, t):
        row = dict({name: tab[t, self.me] for name, tab in self.tables.items()}, t=t)
        c = self._run_actions(c, row, t)
        return self._hand_off(c, row, t), None

    def _run_actions(self, c, row, t):
        """This device's actions of step ``t``: at most one F, one B, W_SLOTS W's, each kind's
        loops one per chunk, of which one runs; then the head."""
        read = lambda fn, *key: lambda part: fn(*key, row, dict(c, **part))  # the other entries as they are now
        for k in range(self.v):
            c = _when(row["f_chunk"] == k, read(self.forward, k), c, ("stored", "out_f", "aux"))
        for k in range(self.v):
            if self.split_b:
                c = _when(
                    (row["b_chunk"] == k) & (row["bw_whole"] < 1),
                    read(self.backward, k),
                    c,
                    ("stash", "d_xs", "out_b"),
                )
            if self.whole_b:
                c = _when(
                    (row["b_chunk"] == k) & (row["bw_whole"] > 0),
                    read(self.whole_backward, k),
                    c,
                    ("d_stage", "d_xs", "out_b"),
                )
        for j in range(self.step_tables.w_slots):
            for k in range(self.v * self.split_b):
                c = _when(row["w_chunk"][j] == k, read(self.weights, k, j), c, ("d_stage",))
        # The head last: every device waits in its collectives for the last stage's forward,
        # so a device's own actions before it run alongside that forward, after it they would not
        # (a step as long as two). Its dy is read at a later step.
        return _when(self.heads[t], read(self.head), c, ("loss", "d_head", "in_b"))

    def _hand_off(self, c, row, t):
        """What this step's F and B made, sent on to the neighbouring stages' inboxes."""
        # The hand-offs wait for W too: XLA would otherwise run W, which nothing sent depends
        # on, after them, and a device would do this step's W and the next step's work
        # between two hand-offs — a step as long as two on one device (seen on H200).
        out_f, out_b, d_stage = lax.optimization_barrier((c["out_f"], c["out_b"], c["d_stage"]))
        # A hand-off to itself (the turn of a V) goes straight into this stage's inbox.
        c = dict(
            c, d_stage=d_stage, in_f=put(c["in_f"], row["f_self"], out_f), in_b=put(c["in_b"], row["b_self"], out_b)
        )
        for kind, out in (("f", out_f), ("b", out_b)):
            for col, (direction, perm) in enumerate(self.shifts):
                if f"{kind}_{direction}" in self.step_tables.directions:
                    inbox = f"in_{kind}"
                    slot = self.tables[f"recv_{kind}"][t + 1, self.me, col]
                    c = dict(c, **{inbox: put(c[inbox], slot, lax.ppermute(out, self.axis, perm))})
        return c

    def results(self, c):
        m = self.m
        loss = c["loss"] / m
        d_head = [(g / m).astype(like.dtype) for g, like in zip(c["d_head"], self.d_hp)]
        d_xs = lax.psum(c["d_xs"][:m], self.axis) / m
        d_stage = [
            (jnp.stack([jnp.stack(rows) for rows in g]) / m).astype(like.dtype)[None]
            for g, like in zip(c["d_stage"], self.d_chunk)
        ]
        return loss, d_stage, d_head, d_xs, [(a / m)[None] for a in c["aux"]]
