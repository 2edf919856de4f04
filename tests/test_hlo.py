"""shardflow.hlo on literal HLO text: every replica-group form XLA prints, the ring prices, and
collectives inside while loops weighted by their known_trip_count."""

import pytest

from shardflow import hlo


def one(line, num_devices=8):
    module = f"HloModule m, num_partitions={num_devices}\n\nENTRY %main (p: f32[8]) -> f32[8] {{\n  {line}\n}}\n"
    (c,) = hlo.collectives(module)
    return c


# Lines as XLA:CPU (jax 0.10.2) prints them for GSPMD and shard_map programs on 8 devices.
GROUP_FORMS = [
    (
        "%all-reduce.4 = (f32[8,32]{1,0}, f32[]) all-reduce(%ynn_fusion, %wrapped_reduce.1), channel_id=1, "
        "replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, to_apply=%add.clone",
        4,
    ),
    (
        "%all-reduce = f32[32]{0} all-reduce(%x), channel_id=1, replica_groups={{0,4},{1,5},{2,6},{3,7}}, "
        "use_global_device_ids=true, to_apply=%add",
        2,
    ),
    (
        "%all-gather = f32[8,64]{0,1} all-gather(%wrapped_copy), channel_id=1, replica_groups=[2,4]<=[8], "
        "dimensions={1}, use_global_device_ids=true",
        4,
    ),
    (
        "%all-reduce.1 = f32[64]{0} all-reduce(%x), channel_id=2, replica_groups=[4,2]<=[2,4]T(1,0), "
        "use_global_device_ids=true, to_apply=%add",
        2,
    ),
    (
        "%all-reduce.2 = f32[64]{0} all-reduce(%x), channel_id=2, replica_groups=[4,2]<=[2,2,2]T(0,2,1), "
        "use_global_device_ids=true, to_apply=%add",
        2,
    ),
    (
        "%all-gather.1 = f32[8,64]{0,1} all-gather(%c), channel_id=2, replica_groups=mesh['axis_0'=2,'axis_1'=4] "
        "{'axis_1'}, dimensions={1}, use_global_device_ids=true",
        4,
    ),
    (
        "ROOT %all-reduce.5 = (f32[32]{0}, f32[]) all-reduce(%a, %b), channel_id=2, "
        "replica_groups=mesh['axis_0'=2,'axis_1'=1,'axis_2'=4] {'axis_0'}, use_global_device_ids=true, "
        "to_apply=%region_0.0.clone",
        2,
    ),
    # mesh axes with a device order: the form the old parser read as groups of 1 (tp_sp's "2.3x")
    (
        "ROOT %all-reduce.5 = (f32[32]{0}, f32[]) all-reduce(%a, %b), channel_id=2, "
        "replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_0'}, "
        "use_global_device_ids=true, to_apply=%region_0.0.clone",
        4,
    ),
    (
        "%all-gather.3 = bf16[4,128,256]{2,1,0} all-gather(%p), channel_id=5, "
        "replica_groups=mesh['axis_0'=1,'axis_1'=4,'axis_2'=1,'axis_3'=2], device_ids=([2,4]T(1,0)) {'axis_1'}, "
        "dimensions={1}, use_global_device_ids=true",
        4,
    ),
    (
        "%all-reduce.7 = f32[16]{0} all-reduce(%x), channel_id=3, "
        "replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=1,'axis_3'=2], device_ids=([2,4]T(1,0)) {'axis_3'}, "
        "use_global_device_ids=true, to_apply=%add",
        2,
    ),
    (
        "%all-reduce.8 = f32[16]{0} all-reduce(%x), channel_id=3, replica_groups=mesh['a'=2,'b'=4] {'a','b'}, "
        "use_global_device_ids=true, to_apply=%add",
        8,
    ),
    (
        "%all-reduce.9 = f32[16]{0} all-reduce(%x), channel_id=3, replica_groups=mesh['a'=8] {'a':(1)2}, "
        "use_global_device_ids=true, to_apply=%add",
        2,
    ),
    (
        "%all-reduce.10 = f32[16]{0} all-reduce(%x), channel_id=3, replica_groups=mesh['a'=2,'b'=4] {}, "
        "use_global_device_ids=true, to_apply=%add",
        1,
    ),
    ("%all-reduce.11 = f32[16]{0} all-reduce(%x), channel_id=3, replica_groups={}, to_apply=%add", 8),
    (
        "%all-reduce.12 = f32[16]{0} all-reduce(%x), channel_id=3, replica_groups=maximal_mesh[device_id=0] {}, "
        "to_apply=%add",
        1,
    ),
]


@pytest.mark.parametrize("line,n", GROUP_FORMS)
def test_group_size(line, n):
    assert one(line).group_size == n


def test_ring_prices():
    ar = one("%ar = f32[8,32]{1,0} all-reduce(%x), replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=%add")
    assert (ar.kind, ar.result_bytes, ar.bytes) == ("all_reduce", 1024, 2 * 3 * 1024 // 4)
    ag = one("%ag = f32[8,64]{0,1} all-gather(%c), replica_groups=[2,4]<=[8], dimensions={1}")
    assert (ag.kind, ag.operand_bytes, ag.bytes) == ("all_gather", 512, 3 * 2048 // 4)
    rs = one(
        "%rs = bf16[4,16]{1,0} reduce-scatter(%c), replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}, to_apply=%add"
    )
    assert (rs.kind, rs.operand_bytes, rs.bytes) == ("reduce_scatter", 256, 128)
    a2a = one(
        "%a2a = (f32[2,8]{1,0}, f32[2,8]{1,0}, f32[2,8]{1,0}, f32[2,8]{1,0}) all-to-all(%a, %b, %c, %d), "
        "channel_id=4, replica_groups=mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_0'}"
    )
    assert (a2a.kind, a2a.group_size, a2a.bytes) == ("all_to_all", 4, 3 * 256 // 4)
    cp = one(
        "%cp = f32[4,64]{1,0} collective-permute(%x), channel_id=6, "
        "source_target_pairs={{0,0},{4,1},{1,4},{5,5},{2,2},{6,3},{3,6},{7,7}}"
    )
    assert (cp.kind, cp.bytes) == ("ppermute", 1024)
    same = one("%cp = f32[4,64]{1,0} collective-permute(%x), source_target_pairs={{0,0},{1,1}}")
    assert same.bytes == 0


def test_scalar_tuple_and_async_forms():
    c = one("%all-reduce = (f32[32]{0}, f32[]) all-reduce(%a, %b), replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%r")
    assert c.result_bytes == 132 and c.bytes == round(2 * 7 / 8 * 132)
    start = one(
        "%ags = (f32[2,64]{1,0}, f32[8,64]{1,0}) all-gather-start(%x), replica_groups=[2,4]<=[8], dimensions={0}"
    )
    assert (start.result_bytes, start.bytes) == (2048, 1536)
    ars = one("%ars = f32[64]{0} all-reduce-start(%x), replica_groups=[4,2]<=[8], to_apply=%add")
    assert ars.bytes == 256
    # the -done halves and non-collectives that mention one are not counted
    module = (
        "HloModule m, num_partitions=8\n\nENTRY %main () -> f32[8] {\n"
        "  %ard = f32[64]{0} all-reduce-done(%ars)\n"
        "  %f = f32[8,32]{1,0} fusion(%all-reduce.4), kind=kLoop, calls=%fused\n"
        "  %g = f32[8,32]{1,0} get-tuple-element(%all-reduce.4), index=0, "
        'metadata={op_name="jit(f)/all-reduce(x)"}\n}\n'
    )
    assert hlo.collectives(module) == []


LOOPS = """HloModule jit_h, is_scheduled=true, entry_computation_layout={(f32[8,64]{1,0})->f32[8,64]{1,0}}, num_partitions=8

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %add = f32[] add(%x, %y)
}

%inner_body (p: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %p = (s32[], f32[8,16]{1,0}) parameter(0)
  %all-reduce.1 = f32[8,16]{1,0} all-reduce(%v), channel_id=3, replica_groups=[2,4]<=[8], to_apply=%add
  ROOT %t = (s32[], f32[8,16]{1,0}) tuple(%i, %all-reduce.1)
}

%inner_cond (p: (s32[], f32[8,16])) -> pred[] {
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%outer_body (param: (s32[], f32[8,16]{1,0}, f32[64,16]{1,0})) -> (s32[], f32[8,16]{1,0}, f32[64,16]{1,0}) {
  %param = (s32[], f32[8,16]{1,0}, f32[64,16]{1,0}) parameter(0)
  %all-gather = f32[8,64]{0,1} all-gather(%wrapped_copy), channel_id=1, replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, dimensions={1}, use_global_device_ids=true
  %while.1 = (s32[], f32[8,16]{1,0}) while(%tuple.2), condition=%inner_cond, body=%inner_body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %tuple = (s32[], f32[8,16]{1,0}, f32[64,16]{1,0}) tuple(%i, %x, %w)
}

%outer_cond (param: (s32[], f32[8,16]{1,0}, f32[64,16]{1,0})) -> pred[] {
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%unknown_body (p: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %cp = f32[8,16]{1,0} collective-permute(%v), channel_id=7, source_target_pairs={{0,1},{1,0}}
  ROOT %t = (s32[], f32[8,16]{1,0}) tuple(%i, %cp)
}

%called (x: f32[8,64]) -> f32[8,64] {
  %ag2 = f32[8,64]{1,0} all-gather(%x), channel_id=9, replica_groups={{0,1},{2,3},{4,5},{6,7}}, dimensions={0}
  ROOT %r = f32[8,64]{1,0} copy(%ag2)
}

ENTRY %main.10_spmd (param: f32[8,64]) -> f32[8,64] {
  %while.3 = (s32[], f32[8,16]{1,0}, f32[64,16]{1,0}) while(%tuple.7), condition=%outer_cond, body=%outer_body, metadata={op_name="jit(h)/while"}, backend_config={"dynamic_variables":[],"known_induction_variable":{"tuple_index":"0"},"known_init_step":{"init":"0","step":"1"},"known_trip_count":{"n":"5"}}
  %while.4 = (s32[], f32[8,16]{1,0}) while(%tuple.8), condition=%inner_cond, body=%unknown_body
  %call = f32[8,64]{1,0} call(%param), to_apply=%called
  ROOT %all-gather.1 = f32[8,64]{0,1} all-gather(%wrapped_copy.2), channel_id=2, replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, dimensions={1}, use_global_device_ids=true
}
"""


def test_loops_weighted_by_trip_count():
    cs = {c.computation: c for c in hlo.collectives(LOOPS)}
    assert set(cs) == {"outer_body", "inner_body", "unknown_body", "called", "main.10_spmd"}
    assert cs["outer_body"].count == 5
    assert cs["inner_body"].count == 15  # nested: 5 x 3
    assert cs["unknown_body"].count == 1 and not cs["unknown_body"].trip_count_known
    assert cs["called"].count == 1 and cs["main.10_spmd"].count == 1
    assert all(c.trip_count_known for k, c in cs.items() if k != "unknown_body")
    static = sum(c.bytes for c in cs.values())
    weighted = sum(c.bytes * c.count for c in cs.values())
    assert hlo.total_bytes(LOOPS) == static
    assert hlo.total_bytes(LOOPS, weighted=True) == weighted
    assert weighted - static == 4 * cs["outer_body"].bytes + 14 * cs["inner_body"].bytes
    assert hlo.summary(LOOPS)["all_reduce"] == (1, 15 * cs["inner_body"].bytes)


def test_compiled_module_end_to_end():
    """A real compiled scan: the while loop's collective counted once per iteration."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as PS

    import shardflow as sf

    mesh = sf.make_mesh({"data": 2, "model": 4})

    def h(x, w):
        return jax.lax.scan(lambda c, _: (jnp.tanh(c @ w), None), x, None, length=5)[0]

    x, w = jnp.ones((16, 64)), jnp.ones((64, 64))
    ins = (NamedSharding(mesh, PS("data", None)), NamedSharding(mesh, PS(None, "model")))
    text = jax.jit(h, in_shardings=ins, out_shardings=ins[0]).lower(x, w).compile().as_text()
    cs = hlo.collectives(text)
    assert cs and all(c.group_size == 4 for c in cs)
    assert max(c.count for c in cs) == 5
    assert hlo.total_bytes(text, weighted=True) > hlo.total_bytes(text)


def test_collectives_of_one_kind_and_devices_that_depend_on_none_of_each_other_share_a_level():
    """Levels: an all-gather that reads an earlier one's result (through other instructions)
    is one level up; independent ones of one kind and devices share a level, and all but the
    first of a level run combined; other devices or another kind start their own."""
    groups = "replica_groups={{0,1,2,3},{4,5,6,7}}"
    module = f"""HloModule m, num_partitions=8

ENTRY %main (p: f32[8], q: f32[8]) -> f32[32] {{
  %p = f32[8]{{0}} parameter(0)
  %q = f32[8]{{0}} parameter(1)
  %ag.0 = f32[32]{{0}} all-gather(%p), channel_id=1, {groups}, dimensions={{0}}
  %ag.1 = f32[32]{{0}} all-gather(%q), channel_id=2, {groups}, dimensions={{0}}
  %ag.2 = f32[32]{{0}} all-gather(%q), channel_id=3, replica_groups={{{{0,4}},{{1,5}},{{2,6}},{{3,7}}}}, dimensions={{0}}
  %sum = f32[8]{{0}} add(%p, %q)
  %ar = f32[8]{{0}} all-reduce(%sum), channel_id=4, {groups}, to_apply=%add
  %x = f32[32]{{0}} add(%ag.0, %ag.1)
  %s = f32[8]{{0}} slice(%x), slice={{[0:8]}}
  ROOT %ag.3 = f32[32]{{0}} all-gather(%s), channel_id=5, {groups}, dimensions={{0}}
}}
"""
    cs = hlo.collectives(module)
    assert [(c.kind, c.level) for c in cs] == [
        ("all_gather", 1),
        ("all_gather", 1),
        ("all_gather", 1),
        ("all_reduce", 1),
        ("all_gather", 2),
    ]
    assert hlo.combined(cs) == [False, True, False, False, False]
