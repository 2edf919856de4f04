"""explain's source column names the user's line — the innermost frame of the user's own code —
never a frame of optax, flax, JAX or shardflow, nor a placeholder; the library line that made the
value stands beside it, ``test_explain_source.py:30 (optax/_classification.py:400)``."""

import os
import types

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as PS

import shardflow as sf
from shardflow.specs import installed_file, is_user_file

HERE = os.path.basename(__file__)
LOGITS = np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32)
LABELS = np.arange(8) % 16

# optax's losses as a virtualenv holds them: JAX's own filter skips site-packages only where the
# stdlib directory contains it (pyenv, this machine), so there its files passed for user code.
VENV_OPTAX = "/home/user/venv/lib/python3.11/site-packages/optax/losses/_classification.py"
venv_optax = types.ModuleType("venv_optax_classification")
with open(optax.losses._classification.__file__) as f:
    exec(compile(f.read(), VENV_OPTAX, "exec"), venv_optax.__dict__)


@pytest.fixture(scope="module")
def mesh():
    return sf.make_mesh({"data": 2, "model": 4})


def line_of(fn, offset=1):
    """The line ``offset`` lines below ``fn``'s ``def``."""
    return f"{HERE}:{fn.__code__.co_firstlineno + offset}"


def optax_loss(logits, labels):
    return optax.losses.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def venv_optax_loss(logits, labels):
    return venv_optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


@pytest.mark.parametrize("loss", [optax_loss, venv_optax_loss], ids=["optax", "optax-in-a-venv"])
def test_cross_entropy_on_split_logits_names_the_callers_line(mesh, loss):
    f = sf.parallelize(loss, mesh=mesh, in_specs=(PS("data", "model"), PS("data")))
    plan = f.explain(LOGITS, LABELS)
    sources = [c.source for c in plan.collectives]
    assert sources and all(s.startswith(line_of(loss) + " ") or s == line_of(loss) for s in sources), plan
    # the logsumexp over the split vocabulary, as optax's line beside the user's
    assert any(s.startswith(f"{line_of(loss)} (optax/_classification.py:") for s in sources), plan
    assert f"{line_of(loss)} (optax/_classification.py:" in str(plan)


def test_flax_layers_are_attributed_to_the_users_line(mesh):
    layer = nnx.Linear(16, 32, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(layer)

    def apply(state, x):
        return nnx.merge(graphdef, state)(x).sum()

    f = sf.parallelize(jax.grad(apply), mesh=mesh, in_specs=(PS(), PS("data", "model")))
    values = f.explain(state, LOGITS).values
    products = [source for primitive, source, _, _ in values if primitive == "dot_general"]
    assert products and all(s.startswith(f"{line_of(apply)} (flax/linear.py:") for s in products), values


def test_a_line_of_plain_jax_stands_alone(mesh):
    def fn(x):
        return sf.constrain(x * 2, PS("model")).sum()

    values = sf.parallelize(fn, mesh=mesh, in_specs=PS("data")).explain(LOGITS).values
    assert {source for primitive, source, _, _ in values if primitive != "sf_box"} == {line_of(fn)}, values


def test_which_files_are_the_users():
    assert not is_user_file(VENV_OPTAX) and installed_file(VENV_OPTAX) == "optax/_classification.py"
    assert not is_user_file(optax.__file__) and not is_user_file(nnx.__file__)
    assert not is_user_file(jax.numpy.__file__) and installed_file(jax.numpy.__file__) is None
    assert not is_user_file(sf.api.__file__) and not is_user_file(sf.specs.__file__)
    assert is_user_file(__file__)
    # the trainer is code its user reads and edits, as in the tiny_model notebook's explain
    import shardflow.train.loop

    assert is_user_file(shardflow.train.loop.__file__)


def test_explain_says_when_a_weight_pinned_split_is_gathered_whole():
    """A weight split over 'model' by its spec, used by a matmul whose result is wanted whole
    over 'model': with many rows the plan gathers the weight (768 bytes) rather than the result,
    and explain names the argument, the layouts, the line and the bytes; with few rows it
    gathers the result and names nothing."""
    import jax.numpy as jnp
    from jax.sharding import Mesh

    m = Mesh(np.asarray(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    w = np.ones((16, 16), np.float32)

    def f(w, x):
        return jnp.tanh(x @ w)

    kw = dict(mesh=m, in_specs=(jax.P(None, "model"), jax.P("data")), out_specs=jax.P("data"))
    plan = sf.parallelize(f, **kw).explain(w, np.ones((512, 16), np.float32))
    ((name, src, dst, where, sent),) = plan.gathered
    assert (name, src, dst, sent) == ("args[0]", "(B, S(1))", "(B, B)", 768) and where.startswith(
        "test_explain_source.py:"
    )
    assert "gathered whole over an axis its spec splits: args[0] (B, S(1)) -> (B, B)" in str(plan)
    assert sf.parallelize(f, **kw).explain(w, np.ones((8, 16), np.float32)).gathered == []


def layer_loop_loss(ws, x):
    h = jax.lax.scan(lambda h, w: (jax.numpy.tanh(h @ w), None), x, ws)[0]
    return jax.numpy.mean(h**2)


WS, X = np.ones((3, 16, 16), np.float32) / 16, np.ones((8, 16), np.float32)


@pytest.mark.parametrize("wrap", [jax.value_and_grad, jax.grad, lambda f: f], ids=["value_and_grad", "grad", "plain"])
def test_a_layer_loop_under_value_and_grad_is_attributed_to_the_users_lines(mesh, wrap):
    """A conversion of a value the loop body takes (a layer's weight, the carry) names the line
    of the loop, as every other row names the line that made its value."""
    f = sf.parallelize(wrap(layer_loop_loss), mesh=mesh, in_specs=(PS(None, "model"), PS("data")))
    plan = f.explain(WS, X)
    mine = {line_of(layer_loop_loss), line_of(layer_loop_loss, 2)}
    assert plan.collectives and all(c.source in mine for c in plan.collectives), plan
    assert any(c.count == 3 for c in plan.collectives), plan  # a conversion inside the loop's body
    assert all(source in mine or source.startswith("args[") for _, source, _, _ in plan.values), plan.values


def test_a_function_wrapped_in_value_and_grad_is_named_at_its_own_line(mesh):
    f = sf.parallelize(jax.value_and_grad(layer_loop_loss), mesh=mesh, in_specs=(PS(None, "model"),))
    with pytest.raises(
        sf.ShardingError,
        match=rf"args of layer_loop_loss \({line_of(layer_loop_loss, 0)}\): "
        r"no spec for args\[1\]",
    ):
        f(WS, X)
