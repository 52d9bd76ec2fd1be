"""The per-mode wrappers of a train step: one device, ``pmap``, ``shard_map``.

Each takes the per-replica ``train(state, batch)``, ``evaluate(state,
batch)`` and optimizer ``init(params)`` and returns their compiled forms.
In the ``pmap`` and ``shard_map`` modes every state leaf has a leading
replica axis; inside ``shard_map`` that axis has size 1 and is squeezed
(:func:`first`) before the per-replica function and restored
(:func:`expand`) after it, so that an optimizer state made by ``init`` inside
the mapped axis may differ between replicas.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

__all__ = [
  "FP8_GPU_COMPILER_OPTIONS",
  "check_compiler_options",
  "default_compiler_options",
  "compile_single",
  "compile_pmap",
  "compile_shard_map",
  "expand",
  "first",
  "waits_for_each_step",
  "waiting",
]


def first(tree):
  return jax.tree.map(lambda x: x[0], tree)


def expand(tree):
  return jax.tree.map(lambda x: x[None], tree)


# XLA options an FP8 step is compiled with on GPUs. XLA autotunes each FP8
# GEMM over cuBLAS and generated Triton kernels; without Triton's candidates
# the first call of an FP8 train step takes seconds instead of minutes, and
# the steps run on cuBLAS's FP8 GEMMs (benchmarks/bench_fp8_first_call.py).
FP8_GPU_COMPILER_OPTIONS = {"xla_gpu_enable_triton_gemm": False}


def default_compiler_options(policy, platform: str) -> dict[str, Any]:
  """The XLA options a step of ``policy`` is compiled with on ``platform``."""
  if policy.fp8 is not None and platform == "gpu":
    return dict(FP8_GPU_COMPILER_OPTIONS)
  return {}


def check_compiler_options(options: Any) -> dict[str, Any] | None:
  """``options`` as a dict (``None`` stays ``None``: the default)."""
  if options is None:
    return None
  if not isinstance(options, Mapping) or not all(isinstance(k, str) for k in options):
    raise TypeError(
      "compiler_options must be None (the default options) or a mapping from XLA option "
      "names to values, e.g. {'xla_gpu_enable_triton_gemm': False}, got "
      f"{type(options).__name__}: {options!r}."
    )
  return dict(options)


def compile_single(train, evaluate, init, donate, compiler_options=None):
  donate_argnums = (0,) if donate else ()
  options = compiler_options or None
  return (
    jax.jit(train, donate_argnums=donate_argnums, compiler_options=options),
    jax.jit(evaluate, compiler_options=options),
    jax.jit(init),
  )


def compile_pmap(train, evaluate, init, donate, axis_name):
  pmapped_train = jax.pmap(train, axis_name=axis_name, donate_argnums=(0,) if donate else ())
  pmapped_eval = jax.pmap(evaluate, axis_name=axis_name)

  # The metrics are equal on every device (pmean/pmax): return one copy so
  # that every mode returns scalars.
  def step_fn(state, batch):
    new_state, metrics = pmapped_train(state, batch)
    return new_state, first(metrics)

  step_fn.lower = pmapped_train.lower
  eval_fn = lambda state, batch: first(pmapped_eval(state, batch))
  return step_fn, eval_fn, jax.pmap(init, axis_name=axis_name)


def compile_shard_map(train, evaluate, init, donate, axis_name, mesh, compiler_options=None):
  # Every state leaf carries a leading replica axis (size 1 inside the map).
  def sharded_train(state, batch):
    new_state, metrics = train(first(state), batch)
    return expand(new_state), metrics

  spec = P(axis_name)
  step_fn = jax.jit(
    jax.shard_map(sharded_train, mesh=mesh, in_specs=(spec, spec), out_specs=(spec, P())),
    donate_argnums=(0,) if donate else (),
    compiler_options=compiler_options or None,
  )
  eval_fn = jax.jit(
    jax.shard_map(lambda s, b: evaluate(first(s), b), mesh=mesh, in_specs=(spec, spec), out_specs=P()),
    compiler_options=compiler_options or None,
  )
  init_fn = jax.jit(jax.shard_map(lambda p: expand(init(first(p))), mesh=mesh, in_specs=spec, out_specs=spec))
  return step_fn, eval_fn, init_fn


def waits_for_each_step(mode: str, devices) -> bool:
  """Whether a step must finish before the next is queued.

  XLA:CPU runs the collectives of every queued program on one shared thread
  pool, and each all-reduce waits until all of its devices' threads have
  arrived. With several CPU devices and steps queued faster than they run,
  the threads can all be taken by later steps' participants while an
  earlier all-reduce still waits for one of its own: the rendezvous times
  out ("Expected N threads ... only N-1 arrived") and the process aborts,
  or it hangs. GPUs and TPUs queue collectives in streams and do not wait.
  """
  devices = list(devices)
  return mode != "single" and len(devices) > 1 and any(d.platform == "cpu" for d in devices)


def waiting(step_fn):
  """``step_fn`` that returns only once its outputs are computed."""

  def step(state, batch):
    return jax.block_until_ready(step_fn(state, batch))

  step.lower = step_fn.lower
  return step
