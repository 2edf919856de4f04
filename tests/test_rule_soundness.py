"""Per-rule soundness: for every signature of every rule, the equation run on local
blocks equals the equation run whole — the way JAX tests its batching rules against vmap.

A catalog (tests/soundness_cases.py) holds small jnp/lax functions, one or more per primitive
with signatures. For each entry the equation of its primitive is taken out of the traced jaxpr
and run alone (tests/soundness_harness.py): once whole (``jaxpr_as_fun`` under ``jax.jit``, the
reference), and once as a one-equation Program whose equation carries a forced Decision (one
signature per mesh axis), through ``boxing`` and ``lower``. Every operand starts as the
signature needs it; a P operand is fed as random per-device parts (a stacked input split over
the partial axes, one squeeze equation ahead), so a signature that is not linear in a partial
operand shows; P outputs are reduced by the boxing (P -> B all-reduce), so a wrong partial
shows as a wrong sum.

``test_catalog_covers_every_rule`` fails when a primitive with a ``signatures`` function has no
catalog entry: a new rule needs a soundness case in the catalog (or an explicit exclusion with
a reason).
"""

from __future__ import annotations

import os

import pytest
from fast_tier import examples
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from soundness_cases import CATALOG, EXCLUDED, Case
from soundness_harness import check, mesh, sig_repr, traced, valid

import shardflow.attention  # noqa: F401  (registers the attention primitives' rule)
import shardflow.rules  # noqa: F401  (registers every rule)
from shardflow import registry

EXAMPLES = int(os.environ.get("SHARDFLOW_SOUNDNESS_EXAMPLES", "3"))  # per signature, 1 axis
EXAMPLES_2D = int(os.environ.get("SHARDFLOW_SOUNDNESS_EXAMPLES_2D", "2"))  # per case, 2x2 mesh
SETTINGS = dict(
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.differing_executors],
)


def _xfails(c: Case) -> dict:
    return dict(c.xfail)


def _signature_params():
    params = []
    for c in CATALOG:
        _, sigs = traced(c)
        for i, sig in enumerate(sigs):
            reason = _xfails(c).get(sig_repr(sig))
            marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
            params.append(pytest.param(c, i, id=f"{c.name}:{sig_repr(sig)}", marks=marks))
    return params


def test_catalog_covers_every_rule():
    """Every primitive whose rule has signatures has a case (or an exclusion with a reason);
    every case's equation has signatures, and every xfail names one of them."""
    covered = {c.prim for c in CATALOG}
    missing = sorted(
        p.name
        for p, rule in registry.RULES.items()
        if rule.signatures is not None and p not in covered and p.name not in EXCLUDED
    )
    assert not missing, f"rules without a soundness case in tests/soundness_cases.py: {missing}"
    names = [c.name for c in CATALOG]
    assert len(set(names)) == len(names), "case names are test ids: make them unique"
    for c in CATALOG:
        eqn, sigs = traced(c)
        assert sigs, f"{c.name}: {eqn.primitive.name} has no signature here (no rule registered?)"
        assert set(_xfails(c)) <= {sig_repr(s) for s in sigs}, f"{c.name}: stale xfail {c.xfail}"
    stale = sorted(set(EXCLUDED) - {p.name for p, rule in registry.RULES.items() if rule.signatures is not None})
    assert not stale, f"exclusions of primitives without signatures: {stale}"


@pytest.mark.parametrize("c, i", _signature_params())
@settings(max_examples=examples(EXAMPLES), **SETTINGS)
@given(n=st.sampled_from([2, 4]), seed=st.integers(0, 2**32 - 1))
@example(n=4, seed=1)
def test_signature_is_sound(c, i, n, seed):
    """One signature on a mesh {"x": n}: blocks computed locally equal the whole result."""
    eqn, sigs = traced(c)
    assert valid(c, eqn, (sigs[i],), mesh((2,))), f"{c.name}: pick shapes that {sig_repr(sigs[i])} splits"
    assume(valid(c, eqn, (sigs[i],), mesh((n,))))
    check(c, (i,), (n,), seed)


def _two_axis_params():
    params = []
    for c in CATALOG:
        eqn, sigs = traced(c)
        sound = [i for i, s in enumerate(sigs) if sig_repr(s) not in _xfails(c)]
        if sound:
            params.append(pytest.param(c, id=c.name))
    return params


@pytest.mark.parametrize("c", _two_axis_params())
@settings(max_examples=examples(EXAMPLES_2D), **SETTINGS)
@given(data=st.data())
def test_two_signatures_on_a_2x2_mesh_are_sound(c, data):
    """One signature per axis of {"x": 2, "y": 2}, drawn among the pairs that fit together (the
    known-unsound signatures left out): the nd Decision propagation would make."""
    eqn, sigs = traced(c)
    m = mesh((2, 2))
    sound = [i for i, s in enumerate(sigs) if sig_repr(s) not in _xfails(c)]
    pairs = [(a, b) for a in sound for b in sound if valid(c, eqn, (sigs[a], sigs[b]), m)]
    assert pairs
    a, b = data.draw(st.sampled_from(pairs), label="signatures")
    check(c, (a, b), (2, 2), data.draw(st.integers(0, 2**32 - 1), label="seed"))


@pytest.mark.parametrize("c", [c for c in CATALOG if c.name.startswith("attention")], ids=lambda c: c.name)
def test_attention_admits_a_ring_beside_a_query_split_exactly_where_it_is_sound(c):
    """A ring on one axis and the queries alone split on the other: the rule admits the pair
    where the result is the global one (no mask), and refuses it under a causal mask or segment
    ids, where the ring's block masks would be wrong."""
    eqn, sigs = traced(c)
    names = [s.name for s in sigs]
    if not {"ring", "query_seq"} <= set(names):
        pytest.skip("the case offers no ring beside a query split")
    a, b = names.index("ring"), names.index("query_seq")
    for pair in ((a, b), (b, a)):
        if valid(c, eqn, (sigs[pair[0]], sigs[pair[1]]), mesh((2, 2))):
            check(c, pair, (2, 2), 0)
        else:
            with pytest.raises(AssertionError):
                check(c, pair, (2, 2), 0)
