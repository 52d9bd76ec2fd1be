"""Step time of dynamic loss scaling: ``loss_scaled(adamw)`` against its peers.

One model, five ways to write the same jitted AdamW train step:

* ``adamw``: no loss scaling (the baseline);
* ``jmp_train``: :func:`jmp_train.loss_scaled` around ``optax.adamw`` with a
  :class:`jmp_train.DynamicLossScale`, gradients from
  :func:`jmp_train.scaled_value_and_grad`, the scale read from the optimizer
  state with :func:`jmp_train.get_loss_scale`;
* ``jmp_train_select``: the same with ``skip_mode="select"`` (``jnp.where``
  over new and old inner state instead of ``lax.cond``);
* ``jmp``: ``jmp.DynamicLossScale`` by hand (scale the loss, unscale,
  ``jmp.all_finite``, ``adjust``, ``jmp.select_tree`` over the new and old
  parameters and optimizer state), as in jmp's README (left out where
  ``jmp``, the ``bench`` extra, is not installed);
* ``flax``: ``flax.training.dynamic_scale.DynamicScale.value_and_grad`` and
  a ``jnp.where`` over the new and old parameters and optimizer state, as in
  Flax's examples;
* ``optax``: ``optax.apply_if_finite(adamw)`` for the skipping; optax has no
  loss scale, so the step multiplies the loss by a fixed 2**15 and the
  gradients by 2**-15 by hand;
* ``skip_floor``: not a peer but a reference: the least any correct
  skip-on-overflow step written with optax's ``update``/``apply_updates``
  can do, with no loss scale at all: one finiteness test of the gradients
  (:func:`jmp_train.all_finite`) and a ``lax.cond`` around
  ``adamw.update``. Its cost over ``adamw`` is the one extra read of the
  gradients that deciding to skip needs before anything is written (the
  test cannot fuse into the update it guards) and the ``cond`` boundary
  (the updates are written out of it and read back by ``apply_updates``).

The model is a float32 MLP 64-1024-1024-10 (1.1M parameters) on batches of
128, 512 and 1,024 real images from :func:`jmp_train_examples.data.load_digits`
(on a GPU also 64-4096-4096-4096-10, 33.9M parameters, on batches of 1,024
and 8,192, the digits repeated)
(float32 on every backend, so the figures compare loss-scaling overhead
only, not half-precision arithmetic). The overhead is a fixed cost per
parameter (a few memory passes over the gradients), so its share of the
step shrinks as the batch, and with it the forward and backward work,
grows. Each step takes and returns the whole training state (parameters and
optimizer state donated), as in a training loop; all steps see finite
gradients, which is the case that costs time (a skipped step does less
work).

Two parts are timed: ``step`` (forward, backward and update; the target:
``jmp_train`` at most 1% over ``skip_floor`` queued on a GPU, and no slower
than any peer) and
``update`` (the optimizer update alone on fixed gradients, where the
overhead is not diluted by the forward and backward passes). Figures are
interleaved medians (candidates timed round-robin); ``ratio_to_adamw`` and
``ratio_to_jmp_train`` are ratios of those medians in the same process.
``min_ms`` and ``min_ratio_to_adamw`` are the fastest call of each and their
ratio: on a shared machine the minimum is the least disturbed estimate of
what a step costs, the median what it costs under the load at the time
(``load_average``: the machine's 1-minute load average around the timing,
the larger of before and after).
On a GPU, ``queued_ms`` is a third figure: the time per call when 10 calls
are queued before one wait (median of ``repeats // 10`` round-robin rounds),
as a training loop runs with JAX's asynchronous dispatch; there the host's
per-call work overlaps the device's, which the one-call-one-wait figures
add to every step. ``queued_ratio_to_adamw`` is its ratio; on CPU both are
``None``.
Two parts are counted, not timed (``hlo_step`` and ``hlo_update``, on the
1.1M-parameter MLP at batch 128, every backend, ``quick`` too): what the
compiled step does on finite gradients, read from the optimized HLO by
:func:`finite_step_profile`: ``array_kernels`` (launched instructions that
read or write an array: passes over gradient-, parameter- and state-sized
buffers), ``scalar_kernels`` (launches on scalars only) and
``array_bytes`` (what the array kernels read and write). Kernel counts are
the backend's (XLA:CPU's here) and fusion differs between backends, but an
extra pass over the gradients shows up on each. ``jmp`` is not counted
(see :func:`compiled_profiles`).
``quick=True`` times the ``step`` part only, on the 1.1M-parameter MLP at
batch 128 with few repeats, and counts ``flax`` and ``optax`` only (a smoke
test; its ratios mean little; the steps compiled for the counts are
reused).
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import statistics
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_train
from benchmarks import _harness
from jmp_train_examples.data import load_digits

NAME = "loss_scaling"
COLUMNS = (
  "part",
  "variant",
  "params",
  "batch",
  "median_ms",
  "ratio_to_adamw",
  "ratio_to_jmp_train",
  "min_ms",
  "min_ratio_to_adamw",
  "queued_ms",
  "queued_ratio_to_adamw",
  "repeats",
  "array_kernels",
  "scalar_kernels",
  "array_bytes",
)
_QUEUED_STEPS = 10  # calls queued before one wait, on a GPU
VARIANTS = ("adamw", "jmp_train", "jmp_train_select", "jmp", "flax", "optax", "skip_floor")
_STATIC_SCALE = 2.0**15


def _variants() -> tuple[str, ...]:
  """:data:`VARIANTS`, without ``jmp`` where it is not installed."""
  if importlib.util.find_spec("jmp") is None:
    return tuple(v for v in VARIANTS if v != "jmp")
  return VARIANTS


def _init_mlp(sizes: tuple[int, ...], seed: int = 0) -> dict[str, jax.Array]:
  rng = np.random.default_rng(seed)
  params = {}
  for i, (m, n) in enumerate(zip(sizes[:-1], sizes[1:])):
    params[f"w{i}"] = jnp.asarray(rng.normal(0, 1 / np.sqrt(m), (m, n)), jnp.float32)
    params[f"b{i}"] = jnp.zeros((n,), jnp.float32)
  return params


def _loss(params: dict[str, jax.Array], x: jax.Array, y: jax.Array):
  n = len(params) // 2
  h = x
  for i in range(n):
    h = h @ params[f"w{i}"] + params[f"b{i}"]
    if i < n - 1:
      h = jax.nn.relu(h)
  return optax.softmax_cross_entropy_with_integer_labels(h, y).mean()


def _steps(lr: float = 1e-3) -> dict[str, tuple[Callable[..., Any], Any]]:
  """Each variant: (step(carry, x, y) -> carry, init(params) -> carry)."""
  adamw = optax.adamw(lr)
  steps = {}

  def bare(carry, x, y):
    params, opt_state = carry
    _, grads = jax.value_and_grad(_loss)(params, x, y)
    updates, opt_state = adamw.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  steps["adamw"] = (bare, lambda p: (p, adamw.init(p)))

  grad_fn = jmp_train.scaled_value_and_grad(_loss)

  def ours(skip_mode):
    tx = jmp_train.loss_scaled(adamw, jmp_train.DynamicLossScale(), skip_mode=skip_mode)

    def step(carry, x, y):
      params, opt_state = carry
      _, grads = grad_fn(jmp_train.get_loss_scale(opt_state), params, x, y)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state

    return step, lambda p: (p, tx.init(p))

  steps["jmp_train"] = ours("cond")
  steps["jmp_train_select"] = ours("select")

  if "jmp" in _variants():
    steps["jmp"] = _jmp_step(adamw)
  steps["flax"] = _flax_step(adamw)

  guarded = optax.apply_if_finite(adamw, max_consecutive_errors=10**9)

  def with_optax(carry, x, y):
    params, opt_state = carry
    grads = jax.grad(lambda p: _loss(p, x, y) * _STATIC_SCALE)(params)
    grads = jax.tree.map(lambda g: g * (1.0 / _STATIC_SCALE), grads)
    updates, opt_state = guarded.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  steps["optax"] = (with_optax, lambda p: (p, guarded.init(p)))

  def floor(carry, x, y):
    params, opt_state = carry
    grads = jax.grad(_loss)(params, x, y)
    return _skip_floor_apply(adamw, (params, opt_state), grads)

  steps["skip_floor"] = (floor, lambda p: (p, adamw.init(p)))
  return steps


def _jmp_step(adamw):
  """jmp's DynamicLossScale by hand, as in jmp's README."""
  import jmp

  def with_jmp(carry, x, y):
    params, opt_state, loss_scale = carry
    grads = jax.grad(lambda p: loss_scale.scale(_loss(p, x, y)))(params)
    grads = loss_scale.unscale(grads)
    finite = jmp.all_finite(grads)
    loss_scale = loss_scale.adjust(finite)
    updates, new_opt_state = adamw.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    params, opt_state = jmp.select_tree(finite, (new_params, new_opt_state), (params, opt_state))
    return params, opt_state, loss_scale

  return (
    with_jmp,
    lambda p: (p, adamw.init(p), jmp.DynamicLossScale(jnp.asarray(2.0**15, jnp.float32))),
  )


def _flax_step(adamw):
  """Flax's DynamicScale.value_and_grad and a jnp.where, as in its examples."""
  from flax.training.dynamic_scale import DynamicScale

  def with_flax(carry, x, y):
    params, opt_state, dynamic_scale = carry
    dynamic_scale, is_finite, _, grads = dynamic_scale.value_and_grad(_loss)(params, x, y)
    updates, new_opt_state = adamw.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    select = lambda new, old: jax.tree.map(lambda a, b: jnp.where(is_finite, a, b), new, old)
    return (select(new_params, params), select(new_opt_state, opt_state), dynamic_scale)

  return (with_flax, lambda p: (p, adamw.init(p), DynamicScale()))


def _skip_floor_apply(adamw, carry, grads):
  """``adamw`` under ``lax.cond`` on one finiteness test: the reference."""
  params, opt_state = carry
  updates, opt_state = jax.lax.cond(
    jmp_train.all_finite(grads),
    lambda g, s, p: adamw.update(g, s, p),
    lambda g, s, p: (jax.tree.map(jnp.zeros_like, g), s),
    grads,
    opt_state,
    params,
  )
  return optax.apply_updates(params, updates), opt_state


def _update_only(step_name: str, lr: float = 1e-3):
  """The optimizer update alone (on given scaled gradients) per variant."""
  adamw = optax.adamw(lr)
  if step_name == "adamw":
    return (lambda c, g: _apply(adamw, c, g), lambda p: (p, adamw.init(p)))
  if step_name in ("jmp_train", "jmp_train_select"):
    tx = jmp_train.loss_scaled(
      adamw, jmp_train.DynamicLossScale(), skip_mode="select" if step_name == "jmp_train_select" else "cond"
    )
    return (lambda c, g: _apply(tx, c, g), lambda p: (p, tx.init(p)))
  if step_name == "jmp":
    import jmp

    def upd(carry, grads):
      params, opt_state, loss_scale = carry
      grads = loss_scale.unscale(grads)
      finite = jmp.all_finite(grads)
      loss_scale = loss_scale.adjust(finite)
      new = _apply(adamw, (params, opt_state), grads)
      return (*jmp.select_tree(finite, new, (params, opt_state)), loss_scale)

    return upd, lambda p: (p, adamw.init(p), jmp.DynamicLossScale(jnp.asarray(2.0**15, jnp.float32)))
  if step_name == "flax":
    from flax.training.dynamic_scale import DynamicScale

    def upd(carry, grads):
      # DynamicScale.value_and_grad fuses its unscale and finiteness check
      # into the gradient call; here the same operations, written out.
      params, opt_state, ds = carry
      grads = jax.tree.map(lambda g: g / ds.scale, grads)
      finite = jnp.array(True)
      for g in jax.tree.leaves(grads):
        finite &= jnp.all(jnp.isfinite(g))
      new_params, new_opt = _apply(adamw, (params, opt_state), grads)
      sel = lambda a, b: jax.tree.map(lambda x, y: jnp.where(finite, x, y), a, b)
      return sel(new_params, params), sel(new_opt, opt_state), ds

    return upd, lambda p: (p, adamw.init(p), DynamicScale())
  if step_name == "skip_floor":
    return (lambda c, g: _skip_floor_apply(adamw, c, g), lambda p: (p, adamw.init(p)))
  guarded = optax.apply_if_finite(adamw, max_consecutive_errors=10**9)

  def upd(carry, grads):
    grads = jax.tree.map(lambda g: g * (1.0 / _STATIC_SCALE), grads)
    return _apply(guarded, carry, grads)

  return upd, lambda p: (p, guarded.init(p))


def _apply(tx, carry, grads):
  params, opt_state = carry
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state


def _runner(step, carry, *args, compiler_options=None):
  """A zero-argument callable running one donated step on a held carry."""
  jitted = jax.jit(step, donate_argnums=0, compiler_options=compiler_options)
  holder = [carry]

  def run():
    holder[0] = jitted(holder[0], *args)
    return holder[0]

  return run


def _queued_times(fns: dict[str, Callable[[], Any]], *, steps: int, rounds: int) -> dict[str, list[float]]:
  """Seconds per call with ``steps`` calls queued before one wait.

  A training loop on a GPU does not wait for each step: JAX dispatches the
  next step while the device runs the last one, so the host's per-call work
  (flattening the state, launching) overlaps the device's. Waiting after
  every call, as ``_harness.interleaved_seconds`` does, adds that host work to
  each step. Candidates are timed round-robin, ``rounds`` times.
  """
  times: dict[str, list[float]] = {name: [] for name in fns}
  for _ in range(rounds):
    for name, fn in fns.items():
      start = time.perf_counter()
      for _ in range(steps):
        out = fn()
      _harness.block(out)
      times[name].append((time.perf_counter() - start) / steps)
  return times


def _load_average() -> float | None:
  """The 1-minute load average, where the platform has one."""
  getloadavg = getattr(os, "getloadavg", None)
  return getloadavg()[0] if getloadavg is not None else None


def _plans(quick: bool, on_gpu: bool):
  """(MLP sizes, [(part, batch, repeats), ...]) pairs to time.

  On a GPU the 1.1M-parameter MLP is launch-bound (each step is a few dozen
  tiny kernels), so a 34M-parameter MLP is timed too: there the extra passes
  over the gradients cost memory bandwidth, as in a real model.
  """
  if quick:  # the counted shapes: the timed step reuses their compilation
    return [((64, 1024, 1024, 10), [("step", 128, 5)])]
  plans = [((64, 1024, 1024, 10), [("step", 128, 300), ("update", 128, 300), ("step", 512, 120), ("step", 1024, 60)])]
  if on_gpu:
    plans.append(((64, 4096, 4096, 4096, 10), [("step", 1024, 200), ("update", 1024, 200), ("step", 8192, 100)]))
  return plans


def run(quick: bool) -> list[dict[str, Any]]:
  warmup = 1 if quick else 10
  data = load_digits()
  # One set of step functions for the counted and the timed parts: a step
  # timed on the counted shapes is not compiled again.
  steps = _steps()
  # --quick counts flax and optax only: each counted update is one more
  # compile, and tests/test_loss_scaling_steps.py counts adamw, jmp_train
  # and skip_floor.
  options = _harness.compile_options(quick)
  records = compiled_profiles(
    steps=steps, compiler_options=options, **({"variants": ("flax", "optax")} if quick else {})
  )
  for sizes, plan in _plans(quick, jax.default_backend() == "gpu"):
    records += _run_plan(sizes, plan, data, warmup, steps, options)
  return records


def kernel_records(quick: bool = False) -> list[dict[str, Any]]:
  """The counted parts (``hlo_step``, ``hlo_update``) and the 1.1M-parameter step at batch 128, on this backend.

  The GPU probe's share of this benchmark: the kernel counts from the
  backend's own compiler and the one timed case where ``loss_scaled``'s
  overhead shows most (queued on a GPU). ``quick``: 5 timed rounds.
  """
  steps = _steps()
  records = compiled_profiles(steps=steps)
  repeats = 5 if quick else 300
  return records + _run_plan((64, 1024, 1024, 10), [("step", 128, repeats)], load_digits(), 1 if quick else 10, steps)


def _run_plan(sizes, plan, data, warmup, steps, compiler_options=None) -> list[dict[str, Any]]:
  params = _init_mlp(sizes)
  n_params = sum(int(p.size) for p in jax.tree.leaves(params))
  copy = lambda: jax.tree.map(jnp.copy, params)

  records = []
  for part, batch, repeats in plan:
    # Batches larger than the training set repeat it (timing only).
    reps = -(-batch // len(data.x_train))
    x = jnp.asarray(np.tile(data.x_train, (reps, 1))[:batch], jnp.float32)
    y = jnp.asarray(np.tile(data.y_train, reps)[:batch], jnp.int32)
    candidates = {}
    if part == "step":
      for name, (step, init) in steps.items():
        candidates[name] = _runner(step, init(copy()), x, y, compiler_options=compiler_options)
    else:
      grads = jax.tree.map(lambda g: g * _STATIC_SCALE, jax.grad(_loss)(params, x, y))
      for name in _variants():
        upd, init = _update_only(name)
        candidates[name] = _runner(upd, init(copy()), grads, compiler_options=compiler_options)
    load_before = _load_average()
    times = _harness.interleaved_seconds(candidates, warmup=warmup, repeats=repeats)
    queued = None
    if jax.default_backend() == "gpu" and repeats > 5:
      queued = _queued_times(candidates, steps=_QUEUED_STEPS, rounds=max(5, repeats // 10))
      queued = {k: statistics.median(v) for k, v in queued.items()}
    load_after = _load_average()
    medians = {k: statistics.median(v) for k, v in times.items()}
    mins = {k: min(v) for k, v in times.items()}
    for name in _variants():
      records.append(
        {
          "part": part,
          "variant": name,
          "params": n_params,
          "batch": batch,
          "median_ms": medians[name] * 1e3,
          "ratio_to_adamw": medians[name] / medians["adamw"],
          "ratio_to_jmp_train": medians[name] / medians["jmp_train"],
          "min_ms": mins[name] * 1e3,
          "min_ratio_to_adamw": mins[name] / mins["adamw"],
          "queued_ms": None if queued is None else queued[name] * 1e3,
          "queued_ratio_to_adamw": (None if queued is None else queued[name] / queued["adamw"]),
          "repeats": repeats,
          # 1-minute load average of the machine around the timing.
          "load_average": (None if load_before is None else round(max(load_before, load_after), 2)),
        }
      )
    if part == "step":
      # The loss-scaled run really ran with its scale and never skipped.
      state = candidates["jmp_train"]()[1]
      metrics = jmp_train.loss_scale_metrics(state)
      assert int(metrics["total_notfinite"]) == 0, metrics
      assert float(metrics["loss_scale"]) == 2.0**15, metrics
  return records


# ---------------------------------------------------------------------------
# What the compiled step launches and moves (backend-independent structure).
# ---------------------------------------------------------------------------

_DTYPE_BYTES = {
  "pred": 1,
  "s8": 1,
  "u8": 1,
  "s16": 2,
  "u16": 2,
  "f16": 2,
  "bf16": 2,
  "s32": 4,
  "u32": 4,
  "f32": 4,
  "s64": 8,
  "u64": 8,
  "f64": 8,
}
_ARRAY_RE = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_HEADER_RE = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTR_RE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([a-z][a-z\-]*)\((.*)$")
# Instructions that launch nothing: they name, bundle or unbundle buffers.
_NOT_LAUNCHED = frozenset(
  {"parameter", "get-tuple-element", "tuple", "constant", "bitcast", "after-all", "opt-barrier"}
)


def _hlo_arrays(type_text: str) -> list[tuple[str, int]]:
  """``(dtype, elements)`` of every array in an HLO type."""
  out = []
  for dtype, dims in _ARRAY_RE.findall(type_text):
    if dtype in _DTYPE_BYTES:
      out.append((dtype, math.prod(int(d) for d in dims.split(",") if d)))
  return out


def _hlo_computations(text: str):
  """``({name: [(instr, type, opcode, rest), ...]}, entry name)``."""
  computations, entry, current = {}, None, None
  for line in text.splitlines():
    if not line.startswith(" ") and line.rstrip().endswith("{"):
      match = _HEADER_RE.match(line)
      if match:
        current = match.group(2)
        computations[current] = []
        entry = current if match.group(1) else entry
      continue
    match = _INSTR_RE.match(line) if current else None
    if match:
      computations[current].append(match.groups())
  return computations, entry


def finite_step_profile(hlo_text: str) -> dict[str, int]:
  """What a finite step launches and moves, read from compiled HLO.

  Walks the entry computation and, for every ``conditional``, its last
  branch (``lax.cond(pred, true_fun, false_fun)`` compiles to branches
  ``{false_fun, true_fun}``, so the last is the step on finite gradients),
  recursively. Every other instruction there launches work: a fusion, a
  copy, a custom call. It counts:

  * ``array_kernels``: launched instructions reading or writing an array of
    more than one element (passes over parameter-, gradient- or
    state-sized buffers);
  * ``scalar_kernels``: launched instructions on scalars only (the scale
    bookkeeping, counters);
  * ``array_bytes``: bytes read and written by the array kernels (each
    operand and result counted once per instruction).
  """
  computations, entry = _hlo_computations(hlo_text)
  profile = {"array_kernels": 0, "scalar_kernels": 0, "array_bytes": 0}

  def walk(name):
    types = {instr: t for instr, t, _, _ in computations[name]}
    for _, result_type, opcode, rest in computations[name]:
      if opcode == "conditional":
        branches = re.search(r"branch_computations=\{([^}]*)\}", rest)
        last = (
          branches.group(1).split(",")[-1] if branches else re.search(r"true_computation=%?([\w.\-]+)", rest).group(1)
        )
        walk(last.strip().lstrip("%"))
        continue
      if opcode in _NOT_LAUNCHED:
        continue
      operands = re.findall(r"%([\w.\-]+)", rest.split(")")[0])
      arrays = _hlo_arrays(result_type) + [a for o in operands for a in _hlo_arrays(types.get(o, ""))]
      if any(n > 1 for _, n in arrays):
        profile["array_kernels"] += 1
        profile["array_bytes"] += sum(_DTYPE_BYTES[d] * n for d, n in arrays)
      else:
        profile["scalar_kernels"] += 1

  walk(entry)
  return profile


def compiled_profiles(
  sizes: tuple[int, ...] = (64, 1024, 1024, 10),
  batch: int = 128,
  variants: tuple[str, ...] = tuple(v for v in VARIANTS if v != "jmp"),
  steps: dict[str, tuple[Callable[..., Any], Any]] | None = None,
  compiler_options: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
  """:func:`finite_step_profile` of each variant's step and update.

  The steps are compiled as the timing compiles them (donated carry), on
  zeros of the timed shapes; nothing is run. ``jmp`` is left out: its loss
  scale validates its leaves when JAX rebuilds it, which fails on the
  placeholders of ``jax.jit(...).lower``. ``steps``: the step functions
  (:func:`_steps` by default); pass the timed ones, and the options they
  are compiled with (``compiler_options``), to share their compilations.
  """
  params = _init_mlp(sizes)
  x = jnp.zeros((batch, sizes[0]), jnp.float32)
  y = jnp.zeros((batch,), jnp.int32)
  grads = jax.tree.map(jnp.zeros_like, params)
  steps = _steps() if steps is None else steps
  records = []
  for name in variants:
    for part in ("step", "update"):
      if part == "step":
        fn, init = steps[name]
        args = (x, y)
      else:
        fn, init = _update_only(name)
        args = (grads,)
      jitted = jax.jit(fn, donate_argnums=0, compiler_options=compiler_options)
      compiled = jitted.lower(init(params), *args).compile()
      records.append(
        {
          "part": f"hlo_{part}",
          "variant": name,
          "params": sum(int(p.size) for p in jax.tree.leaves(params)),
          "batch": batch,
          **finite_step_profile(compiled.as_text()),
        }
      )
  return records
