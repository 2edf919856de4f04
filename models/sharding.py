"""Logical-axis annotation of model parameters, and rules tables that map them to a mesh.

A model names what each parameter dimension *is* ("embed", "heads", "mlp", "vocab", ...);
a rules table, one per parallelism strategy, says which mesh axis (if any) splits that kind of
dimension. Changing strategy is changing the table, never the model.

Two ways to annotate a parameter; the per-variable one wins where both are given:

1. The class decorator ``@logical_axes(wq=("embed", "heads", "head_dim"), ...)``: keys are
   parameter paths relative to the decorated module ("wq", or "proj.kernel" for a parameter of
   a sub-module).
2. Flax's own metadata, ``nnx.with_partitioning(init, ("embed", "mlp"))`` (stored by flax as
   the variable's ``out_sharding``).

Parameters of layers stacked for a scan over depth carry one extra leading dimension; it is
given the logical axis "layers" automatically.

Activations are annotated inside the model with ``constrain(x, ("batch", "seq", None))``: a
no-op unless a trainer has set :func:`activation_sharding`, so the same model runs unchanged
on one device, under ``jax.jit`` shardings, or under ``shardflow.parallelize``.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Mapping, Sequence

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

LogicalAxes = tuple  # one logical name (or None) per dimension
Rules = Mapping[str, "str | tuple[str, ...] | None"]

STACKED_AXIS = "layers"


def logical_axes(**axes_by_param: Sequence[str | None]):
    """Class decorator naming the logical axis of each dimension of the module's parameters."""

    def decorate(cls):
        inherited = dict(getattr(cls, "__logical_axes__", {}))
        inherited.update({name: tuple(axes) for name, axes in axes_by_param.items()})
        cls.__logical_axes__ = inherited
        return cls

    return decorate


# Strategy presets. Mesh axes: "data" (batch / FSDP shards), "model" (tensor parallel) and
# "pipe" (pipeline stages: the stacked layers' depth dim). Logical axes absent from a table are
# replicated.
_TP = {"heads": "model", "kv_heads": "model", "mlp": "model", "vocab": "model"}
# The pipeline's head (final norm, output projection, loss) runs on every stage at once, so its
# vocab dim goes over the stages too: each computes 1/p of the logits instead of the last stage
# all of them (at 1b the head is a fifth of the weights: whole on one stage, every tick waits).
_PP = {STACKED_AXIS: "pipe", "vocab": "pipe"}
LOGICAL_AXIS_RULES: dict[str, dict[str, str | tuple[str, ...] | None]] = {
    "dp": {"batch": "data"},
    "fsdp": {"batch": "data", "embed": "data"},
    "tp": {"batch": "data", **_TP},
    # Sequence parallelism: the residual stream between blocks (norms, dropout-free adds) is
    # split along the sequence over the same axis that splits heads / mlp inside the blocks.
    "tp_sp": {"batch": "data", "seq": "model", **_TP},
    "2d": {"batch": "data", "embed": "data", **_TP},
    # Context parallelism: the sequence split over "context" everywhere (the residual stream,
    # q / k / v); attention then runs as the model's `context` says (ring / all_gather).
    "cp": {"batch": "data", "seq": "context"},
    # Context x tensor parallelism: the sequence over "context", heads / mlp / vocab over "model".
    "cp_tp": {"batch": "data", "seq": "context", **_TP},
    # Pipeline parallelism (the loss run by sf.pipeline; the trainer's `pipeline` config):
    # stage s holds layers [s L/p, (s+1) L/p). The other strategies take the pipe axis as well
    # when a pipeline is configured (with_pipeline); these name the meshes without a data axis.
    "pp": dict(_PP),
    "pp_dp": {"batch": "data", **_PP},
    "pp_tp": {**_TP, **_PP, "vocab": ("pipe", "model")},
    # Expert parallelism (mixture-of-experts models): the experts over "expert", which splits the
    # batch too outside the experts (the tokens reach their experts by an all-to-all over it);
    # with the experts' weights also FSDP-split over "data", or their hidden dim over "model".
    "ep": {"batch": ("data", "expert"), "expert": "expert"},
    "ep_fsdp": {"batch": ("data", "expert"), "expert": "expert", "embed": "data"},
    "ep_tp": {"batch": ("data", "expert"), "expert": "expert", **_TP},
}


def with_pipeline(rules: Rules, axis: str = "pipe") -> dict:
    """``rules`` with the stacked layers' depth dim on mesh axis ``axis`` (the pipeline's
    stages) and the vocab dim over it as well, outermost (the head runs on every stage); a
    ValueError where the table already puts the layers elsewhere."""
    rules = dict(rules)
    current = rules.get(STACKED_AXIS)
    if current not in (None, axis):
        raise ValueError(
            f"the rules put the stacked layers ({STACKED_AXIS!r}) on {current!r}, "
            f"but the pipeline's stages are mesh axis {axis!r}"
        )
    rules[STACKED_AXIS] = axis
    vocab = mesh_axes_of(rules.get("vocab"))
    if axis not in vocab:
        rules["vocab"] = (axis, *vocab) if vocab else axis
    return rules


def get_rules(strategy_or_rules: str | Rules) -> dict:
    if isinstance(strategy_or_rules, str):
        if strategy_or_rules not in LOGICAL_AXIS_RULES:
            raise ValueError(
                f"unknown strategy {strategy_or_rules!r}; choose one of {sorted(LOGICAL_AXIS_RULES)} "
                "or give an explicit rules table"
            )
        return dict(LOGICAL_AXIS_RULES[strategy_or_rules])
    return dict(strategy_or_rules)


# The weights' dims tensor parallelism splits: the mesh axes they map to, and no batch or FSDP
# axis, are where the planners move activations rather than weights (Megatron's layout).
TENSOR_PARALLEL_NAMES = ("heads", "kv_heads", "mlp")


def tensor_parallel_axes(rules: Rules) -> tuple[str, ...]:
    """The mesh axes over which ``rules`` split the weights as tensor parallelism does (heads,
    MLP hidden), and not the batch or the embedding (data / FSDP axes): ``parallelize``'s
    ``stationary`` axes for a model trained under ``rules``."""
    tensor = {a for name in TENSOR_PARALLEL_NAMES for a in mesh_axes_of(rules.get(name))}
    other = {a for name in ("batch", "embed") for a in mesh_axes_of(rules.get(name))}
    return tuple(sorted(tensor - other))


def mesh_axes_of(rule) -> tuple[str, ...]:
    if rule is None:
        return ()
    return (rule,) if isinstance(rule, str) else tuple(rule)


def check_rules(rules: Rules, mesh_axis_names: Sequence[str]) -> None:
    """Every mesh axis a rule names must exist in the mesh."""
    for logical, rule in rules.items():
        for axis in mesh_axes_of(rule):
            if axis not in mesh_axis_names:
                raise ValueError(
                    f"rule {logical!r} -> {rule!r} names mesh axis {axis!r}, which the mesh "
                    f"{tuple(mesh_axis_names)} does not have"
                )


# Logical axes the models name on activations only (their parameters name the others).
ACTIVATION_AXES = ("batch", "seq")


def model_logical_axes(model: nnx.Module) -> list[str]:
    """Every logical axis a rules table can split for ``model``: its parameters' and the
    activations' (sorted)."""
    axes_tree, _ = param_logical_axes(model)
    names = {name for axes in jax.tree.leaves(axes_tree, is_leaf=_is_axes) for name in axes}
    return sorted((names - {None}) | set(ACTIVATION_AXES))


def check_logical_names(rules: Rules, model_axes: Sequence[str]) -> None:
    """Every logical axis a rule names must be one the model has: a misspelt name would leave
    the dimension it meant replicated."""
    for logical in rules:
        if logical not in model_axes:
            raise ValueError(
                f"the rules table names logical axis {logical!r}, which the model does "
                f"not have; its logical axes: {', '.join(model_axes)}"
            )


def spec_for(axes: LogicalAxes, rules: Rules) -> PartitionSpec:
    """PartitionSpec for a tensor whose dims have the given logical names.

    A mesh axis may split only one dimension of a tensor; a later dimension that maps to an
    axis already used stays replicated along it.
    """
    used: set[str] = set()
    entries = []
    for name in axes:
        mesh_axes = tuple(a for a in mesh_axes_of(rules.get(name)) if a not in used)
        used.update(mesh_axes)
        entries.append(None if not mesh_axes else mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
    return PartitionSpec(*entries)


def _set_nested(tree: dict, path: tuple, value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def param_logical_axes(model: nnx.Module) -> tuple[dict, list[str]]:
    """Logical axes of every nnx.Variable (parameters, and state such as an MoE router bias), as
    a nested dict shaped like ``nnx.to_pure_dict``.

    Returns (axes tree, paths of parameters nobody annotated — those are replicated).
    Works on abstract models from ``nnx.eval_shape`` as well as real ones.
    """
    modules: dict[tuple, nnx.Module] = {}
    params: list[tuple[tuple, nnx.Variable]] = []
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Module):
            modules[tuple(path)] = node
        elif isinstance(node, nnx.Variable):  # parameters and state the trainer carries with them
            params.append((tuple(path), node))

    tree: dict = {}
    unannotated: list[str] = []
    for path, var in params:
        ndim = len(var.shape)
        axes = var.get_metadata().get("out_sharding")
        if not axes:
            axes = None
            for cut in range(len(path) - 1, -1, -1):  # nearest annotated ancestor first
                table = getattr(type(modules.get(path[:cut])), "__logical_axes__", {})
                key = ".".join(str(p) for p in path[cut:])
                if key in table:
                    axes = table[key]
                    break
        if axes is None:
            unannotated.append("/".join(map(str, path)))
            axes = (None,) * ndim
        axes = tuple(axes)
        if len(axes) == ndim - 1:
            axes = (STACKED_AXIS,) + axes
        if len(axes) != ndim:
            raise ValueError(
                f"parameter {'/'.join(map(str, path))} has shape {tuple(var.shape)} but its "
                f"logical axes {axes} name {len(axes)} dimensions"
            )
        _set_nested(tree, path, axes)
    return tree, unannotated


def _is_axes(x) -> bool:
    return isinstance(x, tuple)


def param_specs(model: nnx.Module, rules: Rules, mesh: jax.sharding.Mesh | None = None) -> dict:
    """PartitionSpec per parameter (nested dict like ``nnx.to_pure_dict``).

    With a mesh, also checks that every split dimension divides evenly, raising a ValueError
    that names the parameter — before anything is compiled.
    """
    axes_tree, _ = param_logical_axes(model)
    specs = jax.tree.map(lambda axes: spec_for(axes, rules), axes_tree, is_leaf=_is_axes)
    if mesh is not None:
        shapes = {p: v.shape for p, v in nnx.iter_graph(model) if isinstance(v, nnx.Variable)}
        for path, shape in shapes.items():
            spec = _get_nested(specs, tuple(path))
            check_spec_divides("parameter " + "/".join(map(str, path)), shape, spec, mesh)
    return specs


def _get_nested(tree, path):
    for key in path:
        tree = tree[key]
    return tree


def check_spec_divides(what: str, shape, spec: PartitionSpec, mesh: jax.sharding.Mesh) -> None:
    for dim, (size, entry) in enumerate(zip(shape, spec)):
        axes = mesh_axes_of(entry)
        ways = math.prod(mesh.shape[a] for a in axes)
        if size % ways:
            raise ValueError(
                f"{what}: dimension {dim} (size {size}) is split over mesh axes {axes} "
                f"({ways} ways), which does not divide it"
            )


# --- activation constraints ------------------------------------------------------------

_ACTIVATIONS: contextvars.ContextVar = contextvars.ContextVar("shardflow_activation_sharding", default=None)


@contextlib.contextmanager
def activation_sharding(rules: Rules, pin: Callable[[jax.Array, PartitionSpec], jax.Array]):
    """While active, ``constrain(x, axes)`` calls ``pin(x, spec_for(axes, rules))``.

    ``pin`` is ``shardflow.constrain`` under the shardflow engine, or a
    ``with_sharding_constraint`` on a NamedSharding under plain jit. It must be active while
    the step function is *traced*.
    """
    token = _ACTIVATIONS.set((dict(rules), pin))
    try:
        yield
    finally:
        _ACTIVATIONS.reset(token)


def jit_pin(mesh: jax.sharding.Mesh):
    def pin(x, spec):
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    return pin


def active_mesh_axes(logical: str) -> tuple[str, ...] | None:
    """The mesh axes that the rules set by :func:`activation_sharding` put logical axis
    ``logical`` on (() where none); None where no rules are set."""
    active = _ACTIVATIONS.get()
    return None if active is None else mesh_axes_of(active[0].get(logical))


def constrain(x: jax.Array, axes: LogicalAxes) -> jax.Array:
    active = _ACTIVATIONS.get()
    if active is None:
        return x
    rules, pin = active
    spec = spec_for(axes, rules)
    if all(entry is None for entry in spec):
        return x
    return pin(x, spec)
