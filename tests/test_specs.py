"""SBP <-> PartitionSpec, and every refusal a user can meet, with what it must name."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as PS

import shardflow as sf
from shardflow.specs import parse_sbp_string


@pytest.fixture(scope="module")
def mesh():
    return sf.make_mesh({"data": 2, "model": 4})


def test_sbp_forms_agree(mesh):
    assert sf.to_sbp("S(0), B", mesh) == (sf.S(0), sf.B)
    assert sf.to_sbp((sf.S(1), sf.P), mesh) == (sf.S(1), sf.P)
    assert sf.to_sbp("B, P(max)", mesh) == (sf.B, sf.P("max"))
    assert sf.to_sbp(PS("data", "model"), mesh, 2) == (sf.S(0), sf.S(1))
    assert sf.to_sbp(PS(("data", "model")), mesh, 2) == (sf.S(0), sf.S(0))
    assert sf.to_sbp(PS(None, "data", unreduced={"model"}), mesh, 2) == (sf.S(1), sf.P)
    assert sf.to_sbp(None, mesh) == (sf.B, sf.B)
    assert parse_sbp_string("S(2),P") == (sf.S(2), sf.P)


def test_an_sbp_atom_is_one_object_per_value_immutable_and_pickles_to_itself():
    """The planners key their tables by NdSbp tuples, hashed and compared by identity: every
    way of making an atom gives the one object, and nothing can change it."""
    import copy
    import pickle

    assert sf.S(np.int64(1)) is sf.S(1) is sf.to_sbp("S(1)", sf.make_mesh({"data": 8}))[0]
    assert sf.P is sf.P("sum") and sf.P("max") is sf.P("max") is not sf.P and sf.B is type(sf.B)()
    for atom in (sf.S(2), sf.B, sf.P, sf.P("min")):
        assert pickle.loads(pickle.dumps(atom)) is atom and copy.deepcopy(atom) is atom
        assert {atom: 1}[copy.copy(atom)] == 1
    assert (sf.S(0), sf.B) == (sf.S(0), sf.B) and sf.S(0) != sf.S(1) and sf.S(0) != sf.B
    with pytest.raises(AttributeError, match="immutable"):
        sf.S(0).dim = 1
    with pytest.raises(sf.ShardingError, match=r"S\(True\): S takes the tensor dim to split, an int"):
        sf.S(True)
    with pytest.raises(sf.ShardingError, match="'sum', 'max' or 'min'"):
        sf.P("mean")


@pytest.mark.parametrize(
    "sbp",
    [
        (sf.S(0), sf.B),
        (sf.B, sf.S(1)),
        (sf.S(1), sf.S(0)),
        (sf.S(0), sf.S(0)),
        (sf.B, sf.B),
        (sf.P, sf.S(0)),
        (sf.B, sf.P),
    ],
)
def test_partition_spec_round_trip(mesh, sbp):
    assert sf.to_sbp(sf.to_partition_spec(sbp, mesh, 2), mesh, 2) == sbp


def test_make_mesh_refuses_too_many_devices():
    with pytest.raises(sf.ShardingError, match="needs 16 devices"):
        sf.make_mesh({"data": 16})


# ------------------------------------------------------------------------------ bad input


def double(x):
    return x * 2


def run(mesh, in_specs, *args, fn=double, out_specs=None):
    return sf.parallelize(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)(*args)


X = np.ones((8, 12), np.float32)


def test_unknown_mesh_axis(mesh):
    with pytest.raises(
        sf.ShardingError, match=r"float32\[8, 12\] of double \(test_specs.py:\d+\): unknown mesh axis 'tensor'"
    ):
        run(mesh, PS("tensor"), X)


def test_partition_spec_longer_than_rank(mesh):
    with pytest.raises(sf.ShardingError, match=r"float32\[8, 12\].*longer than the tensor's rank 2"):
        run(mesh, PS("data", None, "model"), X)


def test_split_dim_out_of_range(mesh):
    with pytest.raises(sf.ShardingError, match=r"float32\[8, 12\].*S\(2\) on mesh axis 'data'.*rank 2"):
        run(mesh, "S(2), B", X)


def test_mesh_axis_used_twice(mesh):
    with pytest.raises(sf.ShardingError, match=r"float32\[8, 12\].*'data' is used twice"):
        run(mesh, PS("data", "data"), X)


def test_indivisible_dimension_is_never_replicated(mesh):
    with pytest.raises(
        sf.ShardingError,
        match=r"float32\[6, 12\] at double \(test_specs.py:\d+\): dim 0 of size 6 is not divisible by 4",
    ):
        run(mesh, PS("model"), np.ones((6, 12), np.float32))


def test_indivisible_output_spec(mesh):
    with pytest.raises(sf.ShardingError, match=r"output 0 float32\[8, 12\].*dim 1 of size 12.*8"):
        run(mesh, PS(), X, out_specs=PS(None, ("data", "model")))


def test_sbp_with_wrong_number_of_axes(mesh):
    with pytest.raises(sf.ShardingError, match=r"float32\[8, 12\].*has 1 entries but mesh axes"):
        run(mesh, "S(0)", X)


def test_in_specs_not_matching_argument_tree(mesh):
    with pytest.raises(sf.ShardingError, match="in_specs .* do not match"):
        run(mesh, (PS("data"), PS("data")), X, fn=double)


def test_conflicting_constraints_name_both_lines(mesh):
    def fn(x):
        y = sf.constrain(x, PS("data"))
        z = sf.constrain(x, PS(None, "model"))
        return y + z

    with pytest.raises(
        sf.ShardingError, match=r"conflicting constraints on float32\[8, 12\].*test_specs.py:\d+.*test_specs.py:\d+"
    ):
        run(mesh, PS(), X, fn=fn)


def test_bad_constraint_names_the_source_line(mesh):
    def fn(x):
        return sf.constrain(x * 3, PS("model")) + 1

    with pytest.raises(sf.ShardingError, match=r"float32\[6, 12\] at test_specs.py:\d+.*not divisible by 4"):
        run(mesh, PS(), np.ones((6, 12), np.float32), fn=fn)


def test_partial_inputs_are_refused(mesh):
    with pytest.raises(sf.ShardingError, match=r"float32\[8, 12\].*has P"):
        run(mesh, "P, B", X)


def test_constrain_is_the_identity_outside_parallelize():
    x = jnp.arange(6.0)
    np.testing.assert_array_equal(sf.constrain(x, PS("data")), x)
    np.testing.assert_array_equal(jax.jit(lambda x: sf.constrain(x, "S(0)") * 2)(x), x * 2)
    g = jax.grad(lambda x: jnp.sum(sf.constrain(x, PS("data")) ** 2))(x)
    np.testing.assert_allclose(g, 2 * x)


def test_decorator_form_and_inputs_of_any_sharding(mesh):
    @sf.parallelize(mesh=mesh, in_specs=PS("data", "model"))
    def f(x):
        return jnp.tanh(x) @ x.T

    x = jnp.asarray(np.random.default_rng(0).standard_normal((8, 12)), jnp.float32)
    x_sharded = jax.device_put(x, jax.sharding.NamedSharding(mesh, PS("model")))
    out = f(x_sharded)
    np.testing.assert_allclose(np.asarray(out), np.tanh(x) @ x.T, rtol=1e-5, atol=1e-5)
    assert out.sharding.mesh == mesh


def test_donated_arguments_are_consumed(mesh):
    x = jax.device_put(np.ones((8, 12), np.float32), jax.sharding.NamedSharding(mesh, PS("data")))
    f = sf.parallelize(lambda x: x * 2, mesh=mesh, in_specs=PS("data"), out_specs=PS("data"), donate_argnums=0)
    np.testing.assert_array_equal(np.asarray(f(x)), 2 * np.ones((8, 12)))
    assert x.is_deleted()


@pytest.mark.slow
def test_typed_prng_keys_pass_whole_or_split(mesh):
    """jax.random.key arrays (an extended dtype) as arguments and results, whole or split."""
    x = jnp.arange(64.0).reshape(8, 8)
    noisy = lambda a, key: a + jax.random.normal(key, a.shape)
    f = sf.parallelize(noisy, mesh=mesh, in_specs=(PS("data"), PS()), out_specs=PS("data"))
    key = jax.random.key(0)
    np.testing.assert_allclose(np.asarray(f(x, key)), np.asarray(noisy(x, key)), rtol=1e-6)

    per_row = lambda keys, a: jax.vmap(noisy)(a, keys)
    keys = jax.random.split(jax.random.key(1), 8)
    g = sf.parallelize(per_row, mesh=mesh, in_specs=(PS("data"), PS("data")), out_specs=PS("data"))
    np.testing.assert_allclose(np.asarray(g(keys, x)), np.asarray(per_row(keys, x)), rtol=1e-6)

    split = sf.parallelize(lambda key: jax.random.split(key, 4), mesh=mesh, in_specs=PS(), out_specs=PS())
    assert np.array_equal(jax.random.key_data(split(key)), jax.random.key_data(jax.random.split(key, 4)))
    gather = sf.parallelize(lambda keys: keys, mesh=mesh, in_specs=PS("data"), out_specs=PS())
    assert np.array_equal(jax.random.key_data(gather(keys)), jax.random.key_data(keys))
    assert "key<fry>[8]" in str(gather.explain(keys))


def test_jits_closing_over_constants_inside_loops_branches_and_remat(mesh):
    """A jit whose body closes over a constant array, called inside a scan, a while loop, a cond
    and a remat inside a scan, and differentiated: its consts are hoisted to the loop body."""
    table = np.linspace(0.5, 1.5, 8).astype(np.float32)

    @jax.jit
    def scale_rows(r):
        return jnp.sin(r) * table

    def f(a, pred):
        y, _ = jax.lax.scan(lambda c, r: (c + scale_rows(r), None), jnp.zeros(8), a)
        w = jax.lax.while_loop(
            lambda c: c[1] < 2, lambda c: (scale_rows(c[0]), c[1] + 1), (jax.lax.stop_gradient(y), 0)
        )[0]  # no reverse-mode through while
        y = y + w
        y = jax.lax.cond(pred, scale_rows, lambda r: r, y)
        remat = jax.checkpoint(lambda c, r: (scale_rows(c * r), None))
        z, _ = jax.lax.scan(remat, y, a)
        return z

    loss = lambda a, pred: jnp.sum(f(a, pred) ** 2)
    a = jnp.asarray(np.random.default_rng(0).standard_normal((8, 8)), jnp.float32)
    g = sf.parallelize(
        jax.value_and_grad(loss), mesh=mesh, in_specs=(PS(None, "model"), PS()), out_specs=(PS(), PS(None, "model"))
    )
    for pred in (True, False):
        value, grad = g(a, pred)
        ref_value, ref_grad = jax.jit(jax.value_and_grad(loss))(a, pred)
        np.testing.assert_allclose(float(value), float(ref_value), rtol=1e-5)
        # the scans lowered unrolled round in another order than jit's rolled ones (gradients
        # up to 2.5, 3e-6 apart in float32; in float64 2e-16 apart)
        np.testing.assert_allclose(np.asarray(grad), np.asarray(ref_grad), rtol=1e-5, atol=1e-5)


def test_keyword_arguments_are_refused_with_the_way_out(mesh):
    def f(x, scale=2.0):
        return x * scale

    g = sf.parallelize(f, mesh=mesh, in_specs=(PS("data"),), out_specs=PS("data"))
    with pytest.raises(
        TypeError,
        match=r"f \(test_specs.py:\d+\) was called with keyword "
        r"arguments \['scale'\].*functools.partial",
    ):
        g(jnp.ones((8, 4)), scale=3.0)


def test_spec_of_another_type_is_refused_by_every_entry_point(mesh):
    with pytest.raises(
        sf.ShardingError,
        match=r"weights: spec 3 \(int\) is not a sharding spec; a spec is one SBP "
        r"per mesh axis \('data', 'model'\), e\.g\. \(sf\.S\(0\), sf\.B\) or "
        r"'S\(0\), B', a PartitionSpec such as PartitionSpec\('data'\), or None",
    ):
        sf.to_sbp(3, mesh, 2, what="weights")
    with pytest.raises(sf.ShardingError, match=r"value: spec 1\.5 \(float\) is not a sharding spec"):
        sf.to_partition_spec(1.5, mesh)
    with pytest.raises(
        sf.ShardingError, match=r"value: cannot read SBP 'model'.*did you mean PartitionSpec\('model'\)"
    ):
        sf.to_sbp("model", mesh)
