"""Every bad input is an sf.ShardingError that names the value, the spec and (where there is one)
the user's source line — never a raw TypeError / ZeroDivisionError / AttributeError from inside
shardflow, JAX or XLA. Inputs that are fine (empty arrays, linear solves, complex values) run and
agree with the unsharded function."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as PS

import shardflow as sf


@pytest.fixture(scope="module")
def mesh():
    return sf.make_mesh({"data": 2, "model": 4})


def double(x):
    return x * 2


X = np.ones((8, 12), np.float32)
ARG = r"argument args\[0\] float32\[8, 12\] of double \(test_errors.py:\d+\)"


def _agree(f, ref, *args, rtol=1e-5, atol=1e-5):
    for got, want in zip(jax.tree.leaves(f(*args)), jax.tree.leaves(ref(*args))):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=rtol, atol=atol)


# ------------------------------------------------------------------------------ every refusal names its value
# Each message names the value (its pytree path), the spec and the user's line — here the line
# of the table row whose call shardflow refused — in one paragraph.

PARAMS = {"w1": X, "w2": X}


def two(a, b):
    return a + b


def layer(params, x):
    return params["w1"] * params["w2"] + x


def pair(xs):
    return xs[0] + xs[1]


def twice(x):
    return x, x * 2


def w1(spec):
    """layer's in_specs with ``spec`` for params['w1']."""
    return {"w1": spec, "w2": PS()}, PS()


REFUSALS = [  # (id, the refused call, what its message must name besides the call's line)
    (
        "too-few-specs",
        lambda mesh: sf.parallelize(two, mesh=mesh, in_specs=(PS(),))(X, X),
        [f"in_specs {(PS(),)!r} do not match", "args of two (test_errors.py:", "no spec for args[1]"],
    ),
    (
        "missing-key",
        lambda mesh: sf.parallelize(layer, mesh=mesh, in_specs=({"w1": PS()}, PS()))(PARAMS, X),
        [f"in_specs[0] { ({'w1': PS()})!r}", "args[0] of layer", "no spec for args[0]['w2']"],
    ),
    (
        "extra-key",
        lambda mesh: sf.parallelize(layer, mesh=mesh, in_specs=(dict(w1=PS(), w2=PS(), w3=PS()), PS()))(PARAMS, X),
        ["in_specs[0] {", "in_specs[0]['w3'] matches no argument"],
    ),
    (
        "list-for-tuple",
        lambda mesh: sf.parallelize(pair, mesh=mesh, in_specs=([PS(), PS()],))((X, X)),
        [f"in_specs[0] {[PS(), PS()]!r}", "in_specs[0] is a list of 2, args[0] a tuple of 2"],
    ),
    (
        "out-specs-tree",
        lambda mesh: sf.parallelize(twice, mesh=mesh, in_specs=PS(), out_specs=(PS(), PS(), PS()))(X),
        [f"out_specs {(PS(), PS(), PS())!r}", "of twice (test_errors.py:", "out_specs[2] matches no output"],
    ),
    (
        "unclosed",
        lambda mesh: sf.parallelize(layer, mesh=mesh, in_specs=w1("S(3"))(PARAMS, X),
        ["in_specs[0]['w1'] for argument args[0]['w1'] float32[8, 12]", "'S(3'", "unbalanced parentheses"],
    ),
    (
        "unknown-sbp",
        lambda mesh: sf.parallelize(layer, mesh=mesh, in_specs=w1("Q, B"))(PARAMS, X),
        ["in_specs[0]['w1'] for argument args[0]['w1'] float32[8, 12]", "cannot read SBP 'Q' in spec 'Q, B'"],
    ),
    (
        "split-of-a-name",
        lambda mesh: sf.parallelize(layer, mesh=mesh, in_specs=w1("S(a), B"))(PARAMS, X),
        ["in_specs[0]['w1'] for argument args[0]['w1']", "'S(a), B'", "S takes the tensor dim to split, an int"],
    ),
    (
        "empty-entry",
        lambda mesh: sf.parallelize(layer, mesh=mesh, in_specs=w1("B,,B"))(PARAMS, X),
        ["in_specs[0]['w1'] for argument args[0]['w1']", "in spec 'B,,B': an empty entry"],
    ),
    (
        "unknown-axis",
        lambda mesh: sf.parallelize(layer, mesh=mesh, in_specs=w1(PS("tensor")))(PARAMS, X),
        ["in_specs[0]['w1'] for argument args[0]['w1']", f"unknown mesh axis 'tensor' in {PS('tensor')}"],
    ),
    (
        "out-spec-typo",
        lambda mesh: sf.parallelize(twice, mesh=mesh, in_specs=PS(), out_specs=(PS(), "S(1), Q"))(X),
        ["out_specs[1] for output 1 float32[8, 12] of twice", "cannot read SBP 'Q' in spec 'S(1), Q'"],
    ),
    (
        "split-past-rank",
        lambda mesh: sf.parallelize(layer, mesh=mesh, in_specs=w1("S(3), B"))(PARAMS, X),
        ["in_specs[0]['w1'] for argument args[0]['w1']", "S(3) on mesh axis 'data' under spec (S(3), B)", "rank 2"],
    ),
    ("partial-avg", lambda mesh: sf.P("avg"), ["P('avg')", "'sum', 'max' or 'min'"]),
    (
        "mesh-too-big",
        lambda mesh: sf.make_mesh({"data": 2, "model": 8}),
        [
            "make_mesh({'data': 2, 'model': 8}): needs 16 devices, 8 are available",
            "jax.config.update('jax_num_cpu_devices', 16)",
            "XLA_FLAGS=--xla_force_host_platform_device_count=16",
        ],
    ),
    (
        "mesh-axis-named-twice",
        lambda mesh: sf.parallelize(double, mesh=Mesh(mesh.devices, ("data", "data")), in_specs=PS("data"))(X),
        [
            "mesh= of double (test_errors.py:",
            "mesh axis 'data' is named 2 times in ('data', 'data')",
            "each mesh axis needs its own name",
        ],
    ),
    (
        "budget-unit",
        lambda mesh: sf.parallelize(double, mesh=mesh, in_specs=PS(), memory_budget="40 gigs"),
        ["memory_budget='40 gigs' of double (test_errors.py:", "'40GB'", "'40GiB'", "an int of bytes"],
    ),
    (
        "budget-type",
        lambda mesh: sf.parallelize(double, mesh=mesh, in_specs=PS(), memory_budget=[40]),
        ["memory_budget=[40] of double", "is a list", "an int of bytes"],
    ),
    (
        "budget-zero",
        lambda mesh: sf.parallelize(double, mesh=mesh, in_specs=PS(), memory_budget="0GB"),
        ["memory_budget='0GB' of double", "is 0 bytes", "a positive number of bytes"],
    ),
    (
        "budget-fraction",
        lambda mesh: sf.parallelize(double, mesh=mesh, in_specs=PS(), memory_budget=1.5),
        ["memory_budget=1.5 of double", "a whole number of bytes"],
    ),
    (
        "budget-of-plan",
        lambda mesh: sf.plan(double, X, in_specs=PS(), memory_budget="lots"),
        ["memory_budget='lots' of double", "an int of bytes"],
    ),
    (
        "pass-by-name",
        lambda mesh: sf.parallelize(double, mesh=mesh, in_specs=PS(), passes=["inline", "solver"]),
        [
            "passes[1] 'solver' of double (test_errors.py:",
            "no pass is named 'solver'",
            "'inline', 'cse', 'propagate', 'solve', 'boxing', 'unroll', 'lower'",
        ],
    ),
    (
        "pass-of-another-type",
        lambda mesh: sf.parallelize(double, mesh=mesh, in_specs=PS(), passes=[len]),
        ["passes[0] <built-in function len> of double", "neither a Pass nor a pass's name"],
    ),
    (
        "passes-that-do-not-box",
        lambda mesh: sf.parallelize(double, mesh=mesh, in_specs=PS(), passes=["inline", "solve"]),
        ["passes ('inline', 'solve') of double", "end without 'lowered'", "sf.passes.DEFAULT"],
    ),
    (
        "plan-on-no-axes",
        lambda mesh: sf.plan(double, X, in_specs=PS(), axes=()),
        ["sf.plan of double (test_errors.py:", "axes=() names no mesh axis", "axes=('data', 'model')"],
    ),
    (
        "plan-on-an-axis-named-twice",
        lambda mesh: sf.plan(double, X, in_specs=PS(), axes=("data", "data")),
        ["sf.plan of double", "mesh axis 'data' is named 2 times in axes=('data', 'data')"],
    ),
    (
        "plan-on-no-mesh-shapes",
        lambda mesh: sf.plan(double, X, in_specs=PS(), mesh_shapes=[]),
        ["sf.plan of double", "mesh_shapes=[] names no mesh shape"],
    ),
    (
        "alternatives-of-a-function",
        lambda mesh: sf.alternatives(double, X),
        [
            "sf.alternatives of double (test_errors.py:",
            "a function, not a parallelized step",
            "sf.alternatives(sf.parallelize(double, mesh=..., in_specs=...), *args)",
        ],
    ),
    (
        "alternatives-bad-pattern",
        lambda mesh: sf.alternatives(sf.parallelize(layer, mesh=mesh, in_specs=w1(PS())), PARAMS, X, only="args[0"),
        [
            "sf.alternatives of layer (test_errors.py:",
            "only='args[0' is not a regular expression",
            "unterminated character set",
            "args[0]['w1'], args[0]['w2'], args[1]",
        ],
    ),
    (
        "alternatives-matching-nothing",
        lambda mesh: sf.alternatives(sf.parallelize(layer, mesh=mesh, in_specs=w1(PS())), PARAMS, X, only="args[1]"),
        [
            "sf.alternatives of layer",
            "only='args[1]' matches no argument",
            "args[0]['w1'], args[0]['w2'], args[1]",
            "'[' opens a character class",
            "re.escape('args[1]')",
        ],
    ),
]


@pytest.mark.parametrize("refused, fragments", [case[1:] for case in REFUSALS], ids=[case[0] for case in REFUSALS])
def test_every_refusal_names_the_value_the_spec_and_the_line(mesh, refused, fragments):
    with pytest.raises(sf.ShardingError) as refusal:
        refused(mesh)
    message = str(refusal.value)
    assert message.startswith(f"test_errors.py:{refused.__code__.co_firstlineno}: "), message
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    assert "\n" not in message, message


def test_a_refusal_pickles_as_it_reads():
    import pickle

    error = sf.ShardingError("spec 7 is not a sharding spec")
    assert str(error).startswith("test_errors.py:") and str(error).endswith(": spec 7 is not a sharding spec")
    assert str(pickle.loads(pickle.dumps(error))) == str(error)


@pytest.mark.slow
def test_a_cpu_machine_gets_its_devices_as_the_refusal_says():
    """On one CPU device the README's mesh is refused with the way out, and the way out works."""
    import subprocess
    import sys

    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    mesh = "import shardflow as sf; print(sf.make_mesh({'data': 2, 'model': 4}).devices.shape)"
    refused = subprocess.run([sys.executable, "-c", mesh], env=env, capture_output=True, text=True)
    assert "needs 8 devices, 1 is available" in refused.stderr and "jax_num_cpu_devices', 8)" in refused.stderr
    advised = f"import jax; jax.config.update('jax_num_cpu_devices', 8); {mesh}"
    done = subprocess.run([sys.executable, "-c", advised], env=env, capture_output=True, text=True)
    assert done.stdout.strip() == "(2, 4)", done.stderr


# ------------------------------------------------------------------------------ specs of other types


@pytest.mark.parametrize("spec", [0, 1.5, object()], ids=["int", "float", "object"])
def test_in_spec_of_another_type(mesh, spec):
    f = sf.parallelize(double, mesh=mesh, in_specs=spec)
    with pytest.raises(
        sf.ShardingError,
        match=ARG + r": spec .* \((int|float|object)\) is not a sharding spec; "
        r"a spec is one SBP per mesh axis \('data', 'model'\), "
        r"e\.g\. \(sf\.S\(0\), sf\.B\)",
    ):
        f(X)


def test_in_spec_of_another_type_in_a_tree(mesh):
    f = sf.parallelize(lambda x, y: x + y, mesh=mesh, in_specs=(PS("data"), 7))
    with pytest.raises(
        sf.ShardingError,
        match=r"argument args\[1\] float32\[8, 12\] of <lambda> "
        r"\(test_errors.py:\d+\): spec 7 \(int\) is not a sharding spec",
    ):
        f(X, X)


@pytest.mark.parametrize("spec", [3, 2.0, object()], ids=["int", "float", "object"])
def test_out_spec_of_another_type(mesh, spec):
    f = sf.parallelize(double, mesh=mesh, in_specs=PS("data"), out_specs=spec)
    with pytest.raises(
        sf.ShardingError,
        match=r"output 0 float32\[8, 12\] of double \(test_errors.py:\d+\): "
        r"spec .* is not a sharding spec",
    ):
        f(X)


@pytest.mark.parametrize("spec", [3, 1.5, object()], ids=["int", "float", "object"])
def test_constraint_of_another_type_names_the_line(mesh, spec):
    def fn(x):
        return sf.constrain(x * 3, spec) + 1

    f = sf.parallelize(fn, mesh=mesh, in_specs=PS("data"))
    with pytest.raises(
        sf.ShardingError,
        match=r"constrain\w* of float32\[8, 12\] at test_errors.py:\d+: "
        r"spec .* is not a sharding spec",
    ):
        f(X)


def test_tuple_of_non_sbp_entries_says_what_a_spec_is(mesh):
    f = sf.parallelize(lambda x: sf.constrain(x, (0, None)), mesh=mesh, in_specs=PS())
    with pytest.raises(
        sf.ShardingError,
        match=r"constrain\w* of float32\[8, 12\] at test_errors.py:\d+: spec "
        r"\(0, None\) is neither SBP .* a spec is one SBP",
    ):
        f(X)


def test_unreadable_string_names_the_value(mesh):
    with pytest.raises(sf.ShardingError, match=ARG + r": cannot read SBP 'S\(x\)' in spec 'S\(x\), B'"):
        sf.parallelize(double, mesh=mesh, in_specs="S(x), B")(X)
    # a mesh axis name where an SBP string goes: the PartitionSpec was meant
    with pytest.raises(
        sf.ShardingError,
        match=ARG + r": cannot read SBP 'data'.*did you mean "
        r"PartitionSpec\('data'\)\?",
    ):
        sf.parallelize(double, mesh=mesh, in_specs="data")(X)


@pytest.mark.parametrize("dim", ["0", 1.0, None, True])
def test_split_of_a_non_int_dim(dim):
    with pytest.raises(sf.ShardingError, match=r"S\(.*\): S takes the tensor dim to split, an int"):
        sf.S(dim)


def test_split_of_a_numpy_int_is_an_int(mesh):
    assert sf.S(np.int64(1)) == sf.S(1) and type(sf.S(np.int32(1)).dim) is int
    assert sf.to_sbp((sf.S(np.int64(0)), sf.B), mesh, 2) == (sf.S(0), sf.B)


# ------------------------------------------------------------------------------ meshes


@pytest.mark.parametrize(
    "axes, message",
    [
        ({"data": 0}, r"make_mesh\(\{'data': 0\}\): mesh axis 'data' has size 0; a mesh axis size is a positive int"),
        ({"data": -2}, r"mesh axis 'data' has size -2; a mesh axis size is a positive int"),
        ({"data": 2.5}, r"mesh axis 'data' has size 2\.5; a mesh axis size is a positive int"),
        ({"data": 2.0}, r"mesh axis 'data' has size 2\.0; a mesh axis size is a positive int"),
        ({"data": "2"}, r"mesh axis 'data' has size '2'; a mesh axis size is a positive int"),
        ({"data": True}, r"mesh axis 'data' has size True"),
        ({}, r"make_mesh\(\{\}\): a mesh needs at least one axis, e.g. sf\.make_mesh\(\{'data': 2, 'model': 4\}\)"),
        ({0: 2}, r"make_mesh\(\{0: 2\}\): mesh axis name 0 is not a non-empty string"),
        ({"": 2}, r"mesh axis name '' is not a non-empty string"),
        ([("data", 2), ("data", 2)], r"mesh axis 'data' is named 2 times; each mesh axis needs its own name"),
        ("data", r"make_mesh\('data'\): expected a dict of mesh axis name -> size"),
        (8, r"make_mesh\(8\): expected a dict of mesh axis name -> size"),
    ],
    ids=[
        "zero",
        "negative",
        "float",
        "float-int",
        "str",
        "bool",
        "empty",
        "int-name",
        "empty-name",
        "duplicate",
        "str-axes",
        "int-axes",
    ],
)
def test_make_mesh_refuses(axes, message):
    with pytest.raises(sf.ShardingError, match=message):
        sf.make_mesh(axes)


def test_make_mesh_takes_pairs_and_numpy_sizes():
    mesh = sf.make_mesh([("data", 2), ("model", np.int64(4))])
    assert mesh.axis_names == ("data", "model") and mesh.devices.shape == (2, 4)


def test_make_mesh_of_a_mesh(mesh):
    with pytest.raises(sf.ShardingError, match=r"already a Mesh; pass it to sf\.parallelize\(mesh=\.\.\.\) as it is"):
        sf.make_mesh(mesh)


def test_dict_as_mesh_says_to_call_make_mesh():
    with pytest.raises(
        sf.ShardingError,
        match=r"mesh=\{'data': 2\} of double \(test_errors.py:\d+\) is a dict, "
        r"not a jax\.sharding\.Mesh; make one with "
        r"sf\.make_mesh\(\{'data': 2\}\)",
    ):
        sf.parallelize(double, mesh={"data": 2}, in_specs=PS("data"))(X)
    with pytest.raises(sf.ShardingError, match=r"mesh=\{'data': 2\} of f \(test_errors.py:\d+\) is a dict"):

        @sf.parallelize(mesh={"data": 2}, in_specs=PS("data"))
        def f(x):
            return x


@pytest.mark.parametrize("bad", ["data", None, ("data", 2), "devices"], ids=["str", "None", "tuple", "devices"])
def test_non_mesh_as_mesh(bad):
    bad = jax.devices()[:2] if bad == "devices" else bad
    with pytest.raises(
        sf.ShardingError,
        match=r"mesh=.* of double \(test_errors.py:\d+\) is a \w+, not a "
        r"jax\.sharding\.Mesh; make one with sf\.make_mesh\(",
    ):
        sf.parallelize(double, mesh=bad, in_specs=PS())(X)


def test_a_mesh_with_an_empty_axis():
    empty = Mesh(np.array(jax.devices()[:0]).reshape(0), ("data",))
    with pytest.raises(sf.ShardingError, match=r"mesh= of double \(test_errors.py:\d+\): mesh axis 'data' has size 0"):
        sf.parallelize(double, mesh=empty, in_specs=PS())(X)


# ------------------------------------------------------------------------------ complex values

COMPLEX = (np.arange(32).reshape(8, 4) + 1j * np.arange(32)[::-1].reshape(8, 4)).astype(np.complex64)


def complex_max(x):
    return jnp.max(x, axis=0)


def test_complex_max_on_a_split_dim(mesh):
    """reduce_max offers no S(d) -> P(max) for complex values: XLA has no complex max all-reduce."""
    _agree(sf.parallelize(complex_max, mesh=mesh, in_specs=PS("data")), complex_max, COMPLEX)
    _agree(sf.parallelize(complex_max, mesh=mesh, in_specs=PS("data"), out_specs=PS("model")), complex_max, COMPLEX)


def test_partial_max_of_a_complex_value_is_refused(mesh):
    def fn(x):
        return sf.constrain(x, "B, P(max)") * 1

    with pytest.raises(
        sf.ShardingError,
        match=r"complex64\[8, 4\] at test_errors.py:\d+: P\(max\) on mesh axis "
        r"'model' under spec \(B, P\(max\)\); XLA has no max all-reduce of "
        r"complex values",
    ):
        sf.parallelize(fn, mesh=mesh, in_specs=PS())(COMPLEX)
    # a real value may be P(max)
    _agree(sf.parallelize(fn, mesh=mesh, in_specs=PS()), lambda x: x, COMPLEX.real.copy())


# ------------------------------------------------------------------------------ values shardflow must run
# Shapes and ops whose plans meet an empty dim or a primitive without a rule: each runs and
# agrees with the unsharded function.

EMPTY = [  # no collective meets the empty dim
    (lambda x: x @ x.T, PS("data"), (0, 4)),
    (lambda x: x.sum(0), PS("data"), (0, 4)),
    (lambda x: x * 2, PS(), (0, 8)),
]
EMPTY_GATHERED = [  # an all_gather of a 0-size dim: XLA's verifier refuses it
    (lambda x: x.T @ x, PS("data"), (0, 4)),
    (lambda x: x.reshape(-1), PS("data"), (0, 4)),
    (lambda x: x + 1, PS("data", "model"), (0, 0)),
    (lambda x: x.sum(), PS(None, "model"), (8, 0)),
]


@pytest.mark.parametrize("case", range(len(EMPTY)))
def test_empty_arrays_on_a_split_dim(mesh, case):
    fn, spec, shape = EMPTY[case]
    _agree(sf.parallelize(fn, mesh=mesh, in_specs=spec), fn, np.ones(shape, np.float32))


@pytest.mark.parametrize("case", range(len(EMPTY_GATHERED)))
def test_empty_arrays_gathered(mesh, case):
    fn, spec, shape = EMPTY_GATHERED[case]
    _agree(sf.parallelize(fn, mesh=mesh, in_specs=spec), fn, np.ones(shape, np.float32))


A = (np.eye(4) * 3 + 0.1 * np.arange(16).reshape(4, 4)).astype(np.float32)
A8 = np.stack([A + i for i in range(8)]) + np.eye(4, dtype=np.float32) * 8


@pytest.mark.slow
@pytest.mark.parametrize("name", ["solve", "solve-split", "inv", "slogdet-grad", "slogdet-grad-split"])
def test_linear_solves_run_whole(mesh, name):
    slogdet = lambda x: jnp.sum(jnp.linalg.slogdet(x)[1])
    fn, specs, args = {
        "solve": (jnp.linalg.solve, (PS(), PS()), (A, A[:, 0])),
        "solve-split": (jnp.linalg.solve, (PS("data"), PS("data")), (A8, A8[:, :, :2])),
        "inv": (jnp.linalg.inv, PS(), (A,)),
        "slogdet-grad": (jax.value_and_grad(slogdet), PS(), (A,)),
        "slogdet-grad-split": (jax.value_and_grad(slogdet), PS("data"), (A8,)),
    }[name]
    _agree(sf.parallelize(fn, mesh=mesh, in_specs=specs), jax.jit(fn), *args, rtol=1e-4, atol=1e-4)


def test_slogdet_runs(mesh):
    slogdet = lambda x: jnp.linalg.slogdet(x)
    _agree(sf.parallelize(slogdet, mesh=mesh, in_specs=PS()), slogdet, A)
    _agree(sf.parallelize(slogdet, mesh=mesh, in_specs=PS("data")), slogdet, A8)
