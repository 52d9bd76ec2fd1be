"""Tests for jmp_train._src.diagnostics.hlo and the wire format of sign_compression."""

from __future__ import annotations


import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jmp_train import sign_compression, sign_compression_specs
from jmp_train.diagnostics import collective_bytes, collective_ops
from jmp_train.diagnostics import conditional_branches

AXIS = "i"

HANDWRITTEN = """
HloModule m

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main.1_spmd (p0: f32[1,1024], p1: u8[4,16]) -> f32[1,1024] {
  %p0 = f32[1,1024]{1,0} parameter(0)
  %p1 = u8[4,16]{1,0} parameter(1)
  %sl.0 = u8[1,16]{1,0} slice(%p1), slice={[0:1], [0:16]}
  %sl.1 = u8[1,16]{1,0} slice(%p1), slice={[1:2], [0:16]}
  %sl.2 = u8[1,16]{1,0} slice(%p1), slice={[2:3], [0:16]}
  %sl.3 = u8[1,16]{1,0} slice(%p1), slice={[3:4], [0:16]}
  %all-to-all = (u8[1,16]{1,0}, u8[1,16]{1,0}, u8[1,16]{1,0}, u8[1,16]{1,0}, /*index=4*/u8[1,16]{1,0}) all-to-all(%sl.0, %sl.1, %sl.2, %sl.3), channel_id=1, replica_groups={{0,1,2,3}}
  %ag = bf16[4,8]{1,0} all-gather-start(bf16[1,8]{1,0} %x), replica_groups=[1,4]<=[4], dimensions={0}
  %agd = bf16[4,8]{1,0} all-gather-done(%ag)
  ROOT %all_reduce = f32[1,1024]{1,0} all-reduce(%p0), channel_id=2, replica_groups={{0,1},{2,3}}, to_apply=%add
}
"""


def test_parses_handwritten_module():
  ops = {op.name: op for op in collective_ops(HANDWRITTEN)}
  assert set(ops) == {"all-to-all", "ag", "all_reduce"}
  a2a, ag, ar = ops["all-to-all"], ops["ag"], ops["all_reduce"]
  assert a2a.kind == "all-to-all" and a2a.dtypes == ("u8",)
  assert a2a.operand_bytes == 64 and a2a.group_size == 4 and a2a.wire_bytes == 48
  # An inline operand type is read as is; the async start is reported under
  # its base kind (and the -done is not counted again).
  assert ag.kind == "all-gather" and ag.group_size == 4 and ag.dtypes == ("bf16",)
  assert ag.operand_bytes == 16 and ag.wire_bytes == 3 * 16
  assert ar.kind == "all-reduce" and ar.operand_bytes == 4096 and ar.group_size == 2
  assert ar.wire_bytes == 4096 and ar.computation == "main.1_spmd"
  counts = collective_bytes(HANDWRITTEN)
  assert counts["all-to-all"] == 64 and counts["all-to-all:u8"] == 64
  assert counts["all-reduce:f32"] == 4096 and counts["total"] == 64 + 4096 + 16
  assert collective_bytes(HANDWRITTEN, wire=True)["all-reduce"] == 4096


# As newer XLA prints it (jax 0.11 on a GPU machine, 4 simulated CPU devices).
MESH_AXES = """
ENTRY %main.0_spmd (param.1: f32[1024]) -> f32[1024] {
  %param.1 = f32[1024]{0} parameter(0)
  ROOT %psum.7 = f32[1024]{0} all-reduce(%param.1), channel_id=1, replica_groups=mesh['b'=4] {'b'}, use_global_device_ids=true, to_apply=%region_0.0, metadata={op_name="jit(<lambda>)/shard_map/psum" stack_frame_id=7}
  %all_gather.7 = f32[4,1024]{1,0} all-gather(%param.1), channel_id=2, replica_groups=mesh['b'=4,'m'=2] {'m'}, dimensions={0}
  %a2a = f32[1024]{0} all-to-all(%param.1), channel_id=3, replica_groups=mesh['b'=4,'m'=2] {'b','m'}
  %sub = f32[1024]{0} all-reduce(%param.1), channel_id=4, replica_groups=mesh['b'=4] {'b':(1)2}, to_apply=%region_0.0
}
"""


def test_parses_replica_groups_named_by_mesh_axes():
  ops = {op.name: op for op in collective_ops(MESH_AXES)}
  assert {name: op.group_size for name, op in ops.items()} == {"psum.7": 4, "all_gather.7": 2, "a2a": 8, "sub": 2}
  assert ops["psum.7"].wire_bytes == 2 * 3 / 4 * 4096
  assert collective_bytes(MESH_AXES, wire=True)["all-gather"] == 4096


@pytest.mark.parametrize("groups", ["mesh['b'=4] {'x'}", "<unknown>"])
def test_unreadable_replica_groups_raise_instead_of_counting_nothing(groups):
  text = f"  %ar = f32[8]{{0}} all-reduce(f32[8]{{0}} %p), replica_groups={groups}, to_apply=%add"
  with pytest.raises(ValueError, match="cannot read the replica groups"):
    collective_ops(text)


def test_rejects_non_hlo():
  with pytest.raises(ValueError, match="as_text"):
    collective_bytes(42)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_pmean_bytes(dtype):
  k, n = 4, 1000
  f = jax.pmap(lambda x: jax.lax.pmean(x, AXIS), axis_name=AXIS, devices=jax.devices()[:k])
  compiled = f.lower(jnp.zeros((k, n), dtype)).compile()
  (op,) = collective_ops(compiled)
  # XLA:CPU promotes a bfloat16 all-reduce to float32 (a convert moved across
  # the collective): the parser must report what really crosses devices.
  wire_dtype = op.dtypes[0]
  assert wire_dtype == "f32" or (dtype == jnp.bfloat16 and wire_dtype == "bf16")
  nbytes = {"f32": 4, "bf16": 2}[wire_dtype]
  counts = collective_bytes(compiled)
  assert counts["all-reduce"] == n * nbytes == counts["total"] == counts[f"all-reduce:{wire_dtype}"]
  assert collective_bytes(compiled, wire=True)["all-reduce"] == round(2 * (k - 1) / k * n * nbytes)


D = 128
N = D * D + D  # a DxD kernel and its bias


def _tree():
  return {"b": jnp.zeros((D,)), "w": jnp.zeros((D, D))}


def _compiled_pmap(k, **kwargs):
  # Compiled from shapes only: nothing is initialized or run.
  tx = sign_compression(AXIS, **kwargs)
  params = jax.tree.map(lambda x: jax.ShapeDtypeStruct((k,) + x.shape, x.dtype), _tree())
  devices = jax.devices()[:k]
  state = jax.eval_shape(jax.pmap(tx.init, axis_name=AXIS, devices=devices), params)
  update = jax.pmap(tx.update, axis_name=AXIS, devices=devices)
  return update.lower(params, state).compile()


# K = 8 with column scales is covered by the benchmark (bench_compression).
@pytest.mark.parametrize("k, scale", [(3, "column"), (8, "l1")])
def test_wire_carries_packed_bits_only(k, scale):
  n = N
  n_pad = -(-n // (8 * k)) * 8 * k
  segments = D + 1 if scale == "column" else 2
  max_local = -(-segments // k) + 2
  ops = collective_ops(_compiled_pmap(k, scale=scale))
  # One all-to-all and one all-gather, both uint8: no f32 or pred collective.
  assert sorted(op.kind for op in ops) == ["all-gather", "all-to-all"]
  assert all(op.dtypes == ("u8",) for op in ops), ops
  size = {op.kind: op.operand_bytes for op in ops}
  # The bits (the whole packed buffer to the owners, each owner's chunk
  # back), each chunk followed by the (hi, lo) pairs of its pieces: 8 bytes
  # per pair, at most max_local pairs per chunk.
  pair_bytes = size["all-gather"] - n_pad // 8 // k
  assert 0 < pair_bytes <= max_local * 8
  assert size["all-to-all"] == n_pad // 8 + k * pair_bytes
  if scale == "l1" and k == 8:
    # Against a float32 ring all-reduce of the same gradient: < 1/28 of its bytes.
    ours = sum(op.wire_bytes for op in ops)
    f32_allreduce = 2 * (k - 1) / k * 4 * n
    assert ours < f32_allreduce / 28


def test_warmup_float_all_reduce_only_in_its_branch():
  text = _compiled_pmap(4, warmup_steps=3).as_text()
  ops = collective_ops(text)
  float_reduce = [op for op in ops if op.kind == "all-reduce"]
  assert float_reduce and all(op.dtypes == ("f32",) for op in float_reduce)
  names = conditional_branches(text)
  assert names, "expected a conditional"
  # The float all-reduce and the packed collectives sit in different branches,
  # never in the entry computation: after warm-up no float all-reduce runs.
  assert {op.computation for op in float_reduce} <= names
  packed = [op for op in ops if op.dtypes == ("u8",)]
  assert packed and {op.computation for op in packed} <= names
  assert not {op.computation for op in packed} & {op.computation for op in float_reduce}
  # Each collective says which branch it runs in, by name, not by XLA's region names.
  assert all("/warmup/" in op.scope for op in float_reduce), [op.scope for op in float_reduce]
  assert all("/one_bit/" in op.scope for op in packed), [op.scope for op in packed]


def test_shard_map_program_wire_format():
  k = 4
  tx = sign_compression(AXIS)
  mesh = jax.make_mesh((k,), (AXIS,), devices=jax.devices()[:k])
  params = _tree()
  shapes = jax.eval_shape(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=P()), params)
  specs = sign_compression_specs(shapes, AXIS)

  # Compiled from shapes only: nothing is initialized or run.
  def placed(spec, shapes):
    sharding = NamedSharding(mesh, spec)
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), shapes)

  state = jax.tree.map(
    placed,
    specs,
    jax.eval_shape(jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs)), params),
    is_leaf=lambda x: isinstance(x, P),
  )
  grads = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct((k,) + x.shape, x.dtype, sharding=NamedSharding(mesh, P(AXIS))), params
  )
  step = jax.jit(
    jax.shard_map(
      lambda g, s: tx.update(jax.tree.map(lambda x: x[0], g), s),
      mesh=mesh,
      in_specs=(P(AXIS), specs),
      out_specs=(P(), specs),
    )
  )
  counts = collective_bytes(step.lower(grads, state).compile())
  n_pad = -(-N // (8 * k)) * 8 * k
  assert counts["all-reduce"] == 0
  # The packed bits, each chunk followed by the (hi, lo) pairs of the
  # segments overlapping it (8 bytes each); nothing else crosses.
  max_local = -(-(D + 1) // k) + 2
  pair_bytes = counts["all-gather:u8"] - n_pad // 8 // k
  assert 0 < pair_bytes <= max_local * 8
  assert counts["all-to-all:u8"] == n_pad // 8 + k * pair_bytes
  assert counts["all-to-all:u8"] + counts["all-gather:u8"] == counts["total"]


def test_conditional_branches_names_both_spellings():
  text = (
    "%c = f32[] conditional(%p, %a, %b), true_computation=%t.1, false_computation=%f.2\n"
    "%d = f32[] conditional(%i, %a), branch_computations={%b0, %b1.3}\n"
  )
  assert conditional_branches(text) == {"t.1", "f.2", "b0", "b1.3"}
  assert conditional_branches("ENTRY %main () -> f32[] {}") == set()
