"""INT8 from training to deployment: w8a8 PTQ per calibration method, QAT, mixed_int8 training, Qwix, ONNX.

On three example models (``jmp_train_examples.models``): the MLP and a small
ResNet (batch norm) on scikit-learn's 8x8 digits, and the demo's text
Transformer (one layer, width 64, 64 bytes of the standard library's source
per window), each trained in float32 (Adam, cosine decay), then:

* ``ptq_<method>``: post-training quantization with
  :func:`jmp_train.int8.quantize` (int8 weights, one scale per output
  channel; embedding tables one per row; activations with one static scale
  per tensor) calibrated by :func:`jmp_train.int8.calibrate` with each
  method on the same 4 training batches; ``best_ptq`` is the best of them;
* ``ptq_smoothquant``: the same with SmoothQuant (``smoothquant=0.5``: each
  dense product's activation divided per input channel by factors folded
  into its weight), calibrated by ``best_ptq``'s method (not one of
  ``best_ptq``'s candidates);
* ``qat``: ``"mixed_int8"`` fine-tuning of the float32 weights for 10% of the
  float run's steps (a tenth of its peak learning rate), then PTQ with the
  best method;
* ``qwix_<method>``: Qwix's static-range PTQ of the same model's weight
  products (int8 weights and activations, its ``absmax`` / ``minmax``
  calibration over the same batches), where Qwix installs;
* ``scratch_mixed_int8`` against ``scratch_mixed_bfloat16``: both policies'
  training from the same initial weights on the same batches (final
  validation metric and loss, median step time);
* sizes: the :func:`jmp_train.save_checkpoint` folder and the ONNX file
  (:func:`jmp_train.int8.export_onnx`) of the int8 model over those of the
  float32 one (the float32 ONNX file: the same graph with float weights and
  no quantize/dequantize pairs);
* onnxruntime (CPU, graph optimizations off) against our int8 inference:
  the share of test inputs with the same prediction; the inference time of
  both and of float32 (XLA, onnxruntime).

The metric is test accuracy (classifiers; differences in points) or
validation cross-entropy (Transformer; relative differences). Targets: best
PTQ within 0.5 points / 2%, QAT within 0.3 points / 0.5%, ours no worse than
Qwix's best, ``mixed_int8`` training's loss within 2% of ``mixed_bfloat16``'s
(MLP, Transformer), sizes at most 0.27x, onnxruntime agreement at least
99.9%. ``--quick``: the MLP only, a few steps.
"""

from __future__ import annotations

import functools
import pathlib
import statistics
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks import _harness
import jmp_train
import jmp_train.int8 as int8
from jmp_train_examples import data as data_lib
from jmp_train_examples import models

NAME = "int8"
COLUMNS = ("model", "variant", "metric", "value", "vs_float32", "target", "met", "note")
_CALIBRATION_BATCHES = 4
_METHODS = (("max", {}), ("percentile", {"percentile": 99.99}), ("entropy", {}), ("mse", {}))
_QWIX_METHODS = ("absmax", "minmax")
_SMOOTHQUANT_ALPHA = 0.5


class _Task:
  """A model, its data and how it is scored."""

  def __init__(self, name, model, train_batch, calib, test_x, test_y, classifier, steps, lr, state_keys=()):
    self.name, self.model, self.train_batch = name, model, train_batch
    self.calib, self.test_x, self.test_y = calib, test_x, test_y
    self.classifier, self.steps, self.lr, self.state_keys = classifier, steps, lr, state_keys

  def apply_fn(self, model_state):
    return lambda p, x: self.model.apply({"params": p, **model_state}, x)

  def score(self, outputs) -> float:
    outputs = np.asarray(outputs, np.float32)
    if self.classifier:
      return float(100.0 * np.mean(outputs.argmax(-1) == self.test_y))
    return float(optax.softmax_cross_entropy_with_integer_labels(outputs, self.test_y).mean())

  def loss(self, outputs) -> float:
    """The cross-entropy on the test (validation) set."""
    return float(optax.softmax_cross_entropy_with_integer_labels(jnp.asarray(outputs, jnp.float32), self.test_y).mean())

  def predictions(self, outputs) -> np.ndarray:
    return np.asarray(outputs).argmax(-1).ravel()


def _digits_tasks(quick: bool) -> list[_Task]:
  ds = data_lib.load_digits(seed=0)
  batch = 64

  def train_batch(i):
    idx = np.random.default_rng((0, i)).integers(0, len(ds.x_train), batch)
    return ds.x_train[idx], ds.y_train[idx]

  calib = [ds.x_train[j * batch : (j + 1) * batch] for j in range(_CALIBRATION_BATCHES)]
  width = 32 if quick else 128
  tasks = [
    _Task(
      "mlp",
      models.MLP(features=(width, width)),
      train_batch,
      calib,
      ds.x_test,
      ds.y_test,
      True,
      20 if quick else 600,
      3e-3,
    )
  ]
  if not quick:
    tasks.append(
      _Task(
        "resnet",
        models.ResNet(stage_features=(16, 32)),
        train_batch,
        calib,
        ds.x_test,
        ds.y_test,
        True,
        300,
        3e-3,
        ("batch_stats",),
      )
    )
  return tasks


def _text_task() -> _Task:
  corpus = data_lib.load_text_corpus(1_000_000)
  split = int(len(corpus) * 0.9)
  train, val = corpus[:split], corpus[split:]
  seq, batch = 64, 32

  def train_batch(i):
    return data_lib.text_windows(train, np.random.default_rng((0, i)), batch, seq)

  calib = [data_lib.text_windows(train, np.random.default_rng((1, j)), batch, seq)[0] for j in range(4)]
  vx, vy = data_lib.text_windows(val, np.random.default_rng((2, 0)), 4 * batch, seq)
  model = models.TransformerBlock(
    vocab_size=data_lib.TEXT_VOCAB_SIZE, d_model=64, num_heads=4, mlp_dim=256, max_len=seq
  )
  return _Task("transformer", model, train_batch, calib, vx, vy, False, 300, 3e-3)


def _loss(outputs, targets):
  return optax.softmax_cross_entropy_with_integer_labels(outputs, targets).mean()


def _train(task: _Task, policy: str, params, model_state, steps: int, schedule, first: int = 0, compiler_options=None):
  """``(params, model_state, losses, median step seconds)`` after ``steps`` steps of ``policy``.

  The step is compiled with ``compiler_options`` (``make_train_step``'s).
  """
  apply = functools.partial(task.model.apply, train=True) if task.state_keys else task.model.apply
  step = jmp_train.make_train_step(
    apply,
    _loss,
    optax.adam(schedule),
    policy=policy,
    model_policy="flax" if policy == "float32" else "autocast",
    eval_apply_fn=task.model.apply,
    compiler_options=compiler_options,
  )
  state = step.init(params, model_state=model_state or None)
  losses, times = [], []
  for i in range(steps):
    batch = tuple(jnp.asarray(a) for a in task.train_batch(first + i))
    start = time.perf_counter()
    state, metrics = step(state, batch)
    losses.append(float(metrics["loss"]))  # waits for the step
    times.append(time.perf_counter() - start)
  return state.params, dict(state.model_state or {}), np.array(losses), statistics.median(times[2:] or times)


def _schedule(task: _Task, steps: int, peak: float):
  return optax.warmup_cosine_decay_schedule(0.0, peak, max(1, steps // 10), max(2, steps), peak * 0.01)


def _record(task, variant, value, ref, **extra) -> dict[str, Any]:
  diff = value - ref if task.classifier else value / ref - 1.0
  return {
    "model": task.name,
    "variant": variant,
    "metric": "accuracy_%" if task.classifier else "val_loss",
    "value": value,
    "vs_float32": diff,
    **extra,
  }


def _drop(task: _Task, value: float, ref: float) -> float:
  """How much worse than float32: points of accuracy, or the relative rise of the loss."""
  return ref - value if task.classifier else value / ref - 1.0


def _folder_bytes(path: pathlib.Path) -> int:
  return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _checkpoint_bytes(params, model_state, tmp: pathlib.Path, name: str) -> int:
  state = jmp_train.TrainState(
    step=jnp.zeros((), jnp.int32), params=params, opt_state=None, model_state=model_state, rng=None
  )
  return _folder_bytes(jmp_train.save_checkpoint(tmp / name, state))


def _float_onnx(proto, path: pathlib.Path):
  """The int8 graph with float weights and no quantize/dequantize pairs (the float32 model)."""
  import onnx
  from onnx import numpy_helper

  model = onnx.ModelProto()
  model.CopyFrom(proto)
  graph = model.graph
  inits = {t.name: t for t in graph.initializer}
  rename: dict[str, str] = {}
  nodes = []
  for node in graph.node:
    ins = [rename.get(i, i) for i in node.input]
    if node.op_type == "QuantizeLinear":
      rename[node.output[0]] = ins[0]
      continue
    if node.op_type == "DequantizeLinear" and ins[0] in inits:  # an int8 weight
      codes = numpy_helper.to_array(inits[ins[0]]).astype(np.float32)
      scale = numpy_helper.to_array(inits[ins[1]]).astype(np.float32)
      axis = next((a.i for a in node.attribute if a.name == "axis"), 1)
      shape = [1] * codes.ndim
      shape[axis] = -1
      weight = numpy_helper.from_array(codes * scale.reshape(shape), node.output[0] + "_float")
      graph.initializer.append(weight)
      rename[node.output[0]] = weight.name
      continue
    if node.op_type == "DequantizeLinear":  # an activation's pair: the float value
      rename[node.output[0]] = ins[0]
      continue
    del node.input[:]
    node.input.extend(ins)
    nodes.append(node)
  del graph.node[:]
  graph.node.extend(nodes)
  used = {i for n in graph.node for i in n.input}
  keep = [t for t in graph.initializer if t.name in used]
  del graph.initializer[:]
  graph.initializer.extend(keep)
  onnx.checker.check_model(model)
  onnx.save(model, str(path))
  return model


def _ort_session(path: pathlib.Path):
  import onnxruntime as ort

  options = ort.SessionOptions()
  options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
  options.intra_op_num_threads = 2
  return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _qwix(task: _Task, params, model_state, method: str) -> tuple[float | None, str]:
  """Qwix's static-range int8 PTQ on the same model and calibration batches: (metric, note).

  Qwix's documented linen flow: a ``QtProvider`` model collects ``quant_stats`` over the
  calibration batches, then ``quantize_params`` turns them and the float weights into a
  ``PtqProvider`` model's parameters. Like ours, only weight products are quantized
  (``op_names``: Flax's ``Dense``/``DenseGeneral``/``Conv`` go through ``dot_general`` and
  ``conv_general_dilated``; its attention's two ``einsum`` products of activations stay in
  float, where Qwix's static ranges fail: ``QtProvider`` records an einsum's statistics for
  ``jnp.einsum``'s inner ``dot_general`` operands (there swapped and transposed) while
  ``PtqProvider`` expects them for the einsum's own operands (``ScopeParamShapeError``), and
  ``minmax`` would make both operands asymmetric, which Qwix refuses). The text model's activations are
  ``[batch, sequence, ...]``: both leading axes are batch axes (``act_batch_axes``), one
  static scale per tensor as ours, not one per sequence position. Calibration runs without
  ``jax.jit``, as in Qwix's documentation: its ``conv_general_qt`` writes ``quant_stats``
  inside a ``jax.custom_vjp`` function, which a ``jit`` without differentiation traces on
  its own, so the write leaks a tracer (``UnexpectedTracerError``).
  """
  try:
    import qwix
  except ImportError as e:
    return None, f"qwix not installed ({e}): pip install qwix"
  batch_axes = (0,) if task.classifier else (0, 1)
  try:
    rules = [
      qwix.QtRule(
        module_path=".*",
        op_names=("dot_general", "conv_general_dilated"),
        weight_qtype=jnp.int8,
        act_qtype=jnp.int8,
        act_static_scale=True,
        act_calibration_method=method,
        act_batch_axes=batch_axes,
      )
    ]
    example = jnp.asarray(task.calib[0])
    qt = qwix.quantize_model(task.model, qwix.QtProvider(rules))
    stats = jax.eval_shape(qt.init, jax.random.key(0), example).get("quant_stats", {})
    stats = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), stats)
    for x in task.calib:  # eagerly: see the docstring
      variables = {"params": params, **model_state, "quant_stats": stats}
      stats = qt.apply(variables, jnp.asarray(x), mutable=["quant_stats"])[1]["quant_stats"]
    ptq = qwix.quantize_model(task.model, qwix.PtqProvider(rules))
    abstract = jax.eval_shape(ptq.init, jax.random.key(0), example)
    qparams = qwix.quantize_params(params, abstract["params"], stats)
    out = jax.jit(lambda x: ptq.apply({"params": qparams, **model_state}, x))(jnp.asarray(task.test_x))
    sites = sum(path[-1].key == "count" for path, _ in jax.tree_util.tree_leaves_with_path(stats))
    if not sites:
      return None, f"qwix quantized no product of {task.name} (no dot_general/conv_general_dilated intercepted)"
    note = (
      f"qwix {getattr(qwix, '__version__', '')}: {sites} dot_general/conv weight products int8 (weights per channel, "
      f"activations one static scale per tensor, act_batch_axes {batch_axes}); activation-activation einsums float"
    )
    return task.score(out), note
  except Exception as e:  # Qwix's failure is a row, not a crash.
    return None, f"qwix failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"


def _targets(task: _Task) -> dict[str, float]:
  return {"ptq": 0.5, "qat": 0.3} if task.classifier else {"ptq": 0.02, "qat": 0.005}


def _run_task(task: _Task, quick: bool, tmp: pathlib.Path) -> list[dict[str, Any]]:
  records: list[dict[str, Any]] = []
  x0 = jnp.asarray(task.train_batch(0)[0])
  variables = jax.jit(task.model.init)(jax.random.key(0), x0)
  init_params = variables["params"]
  init_state = {k: variables[k] for k in task.state_keys}
  steps = task.steps
  options = _harness.compile_options(quick)
  params, model_state, losses, f32_step = _train(
    task, "float32", init_params, init_state, steps, _schedule(task, steps, task.lr), compiler_options=options
  )
  apply_fn = task.apply_fn(model_state)
  test_x = jnp.asarray(task.test_x)
  float_fn = jax.jit(apply_fn)
  ref = task.score(float_fn(params, test_x))
  records.append(_record(task, "float32", ref, ref, steps=steps, final_train_loss=float(losses[-5:].mean())))
  tol = _targets(task)

  # PTQ, each calibration method.
  ptq: dict[str, tuple[float, Any]] = {}
  for method, kw in _METHODS[::3] if quick else _METHODS:
    start = time.perf_counter()
    cal = int8.calibrate(apply_fn, params, task.calib, method, **kw)
    model = int8.quantize(apply_fn, params, cal)
    value = task.score(model(test_x))
    ptq[method] = (value, model)
    records.append(_record(task, f"ptq_{method}", value, ref, seconds=time.perf_counter() - start))
  best = max(ptq, key=lambda m: -_drop(task, ptq[m][0], ref))
  best_value, qmodel = ptq[best]
  records.append(
    _record(
      task,
      "best_ptq",
      best_value,
      ref,
      target=f"drop <= {tol['ptq']:g}",
      met=_drop(task, best_value, ref) <= tol["ptq"],
      note=best,
    )
  )

  # SmoothQuant with the best method.
  start = time.perf_counter()
  sq_cal = int8.calibrate(apply_fn, params, task.calib, best, smoothquant=_SMOOTHQUANT_ALPHA, **dict(_METHODS)[best])
  sq_value = task.score(int8.quantize(apply_fn, params, sq_cal)(test_x))
  records.append(
    _record(
      task,
      "ptq_smoothquant",
      sq_value,
      ref,
      seconds=time.perf_counter() - start,
      note=f"alpha {_SMOOTHQUANT_ALPHA:g}, {best} calibration; {len(sq_cal.smoothing)} of "
      f"{len(sq_cal.scales)} products smoothed",
    )
  )

  # QAT: mixed_int8 fine-tuning for 10% of the float run's steps.
  qat_steps = max(2, steps // 10)
  qat_params, qat_state, _, _ = _train(
    task,
    "mixed_int8",
    params,
    model_state,
    qat_steps,
    optax.constant_schedule(task.lr * 0.1),
    first=steps,
    compiler_options=options,
  )
  qat_fn = task.apply_fn(qat_state)
  kw = dict(_METHODS)[best]
  qat_model = int8.quantize(qat_fn, qat_params, int8.calibrate(qat_fn, qat_params, task.calib, best, **kw))
  qat_value = task.score(qat_model(test_x))
  records.append(
    _record(
      task,
      "qat",
      qat_value,
      ref,
      steps=qat_steps,
      target=f"drop <= {tol['qat']:g}",
      met=_drop(task, qat_value, ref) <= tol["qat"],
      note=f"then ptq_{best}",
    )
  )

  # Qwix, same model, data and calibration batches.
  qwix_values = []
  for method in _QWIX_METHODS[:1] if quick else _QWIX_METHODS:
    value, note = _qwix(task, params, model_state, method)
    if value is None:
      records.append({"model": task.name, "variant": f"qwix_{method}", "skipped": True, "note": note})
    else:
      qwix_values.append(value)
      records.append(_record(task, f"qwix_{method}", value, ref, note=note))
  if qwix_values:
    qwix_best = max(qwix_values, key=lambda v: -_drop(task, v, ref))
    ours = min(_drop(task, best_value, ref), _drop(task, qat_value, ref))
    records.append(
      _record(
        task,
        "ours_vs_qwix_best",
        qwix_best,
        ref,
        target="ours' drop <= qwix's best drop",
        met=bool(_drop(task, best_value, ref) <= _drop(task, qwix_best, ref) + 1e-9),
        note=f"best ptq drop {_drop(task, best_value, ref):.4g}, qat {ours:.4g}, "
        f"qwix best {_drop(task, qwix_best, ref):.4g}",
      )
    )

  # mixed_int8 from scratch against mixed_bfloat16.
  scratch = {}
  scratch_steps = steps
  for policy in () if quick else ("mixed_bfloat16", "mixed_int8"):
    p, s, run_losses, step_s = _train(
      task, policy, init_params, init_state, scratch_steps, _schedule(task, scratch_steps, task.lr)
    )
    out = jax.jit(task.apply_fn(s))(p, test_x)
    scratch[policy] = (task.score(out), task.loss(out), step_s)
  if scratch:
    (bv, bl, bs), (iv, il, is_) = scratch["mixed_bfloat16"], scratch["mixed_int8"]
    records.append(_record(task, "scratch_mixed_bfloat16", bv, ref, test_loss=bl, step_ms=1e3 * bs))
    rel = il / bl - 1.0
    targeted = task.name != "resnet"
    records.append(
      _record(
        task,
        "scratch_mixed_int8",
        iv,
        ref,
        test_loss=il,
        step_ms=1e3 * is_,
        loss_vs_bf16=rel,
        step_vs_bf16=is_ / bs,
        target="test loss within 2% of mixed_bfloat16's" if targeted else None,
        met=abs(rel) <= 0.02 if targeted else None,
        note=f"test loss {rel:+.2%} vs mixed_bfloat16's; step {is_ / bs:.2f}x its time "
        f"(float32 step {1e3 * f32_step:.2f} ms)",
      )
    )

  # Sizes: checkpoint and ONNX.
  f32_ckpt = _checkpoint_bytes(params, model_state, tmp, f"{task.name}_f32")
  q_tree = {"params": qmodel.params, "activation_scales": qmodel.scales}
  q_ckpt = _checkpoint_bytes(q_tree, model_state, tmp, f"{task.name}_int8")
  records.append(
    {
      "model": task.name,
      "variant": "checkpoint_bytes",
      "metric": "bytes",
      "value": q_ckpt,
      "float32_bytes": f32_ckpt,
      "vs_float32": q_ckpt / f32_ckpt,
      "target": "<= 0.27",
      "met": q_ckpt / f32_ckpt <= 0.27,
      "note": "save_checkpoint folders (orbax files, checksums)",
    }
  )
  param_bytes = _harness.tree_bytes(params)
  q_bytes = _harness.tree_bytes(q_tree)
  records.append(
    {
      "model": task.name,
      "variant": "weight_bytes",
      "metric": "bytes",
      "value": q_bytes,
      "float32_bytes": param_bytes,
      "vs_float32": q_bytes / param_bytes,
      "note": "the arrays alone (int8 codes, float32 scales, biases)",
    }
  )
  try:
    proto = int8.export_onnx(qmodel, test_x, tmp / f"{task.name}_int8.onnx")
  except ValueError as e:
    records.append(
      {"model": task.name, "variant": "onnx", "skipped": True, "note": f"not exported: {str(e).splitlines()[0][:200]}"}
    )
    proto = None
  if proto is not None:
    _float_onnx(proto, tmp / f"{task.name}_f32.onnx")
    q_onnx = (tmp / f"{task.name}_int8.onnx").stat().st_size
    f_onnx = (tmp / f"{task.name}_f32.onnx").stat().st_size
    records.append(
      {
        "model": task.name,
        "variant": "onnx_bytes",
        "metric": "bytes",
        "value": q_onnx,
        "float32_bytes": f_onnx,
        "vs_float32": q_onnx / f_onnx,
        "target": "<= 0.27",
        "met": q_onnx / f_onnx <= 0.27,
      }
    )
    s_int8, s_f32 = _ort_session(tmp / f"{task.name}_int8.onnx"), _ort_session(tmp / f"{task.name}_f32.onnx")
    feed = {"input": np.asarray(test_x)}
    ort_out = s_int8.run(None, feed)[0]
    ours = np.asarray(qmodel(test_x))
    agree = float(np.mean(task.predictions(ort_out) == task.predictions(ours)))
    records.append(
      {
        "model": task.name,
        "variant": "onnxruntime_agreement",
        "metric": "share",
        "value": agree,
        "target": ">= 0.999",
        "met": agree >= 0.999,
        "max_abs_diff": float(np.abs(ort_out - ours).max()),
        "note": f"{task.predictions(ours).size} test predictions, ORT_DISABLE_ALL",
      }
    )
    fns = {
      "float32_xla": lambda: float_fn(params, test_x),
      "int8_ours_xla": lambda: qmodel(test_x),
      "int8_onnxruntime": lambda: s_int8.run(None, feed),
      "float32_onnxruntime": lambda: s_f32.run(None, feed),
    }
  else:
    fns = {"float32_xla": lambda: float_fn(params, test_x), "int8_ours_xla": lambda: qmodel(test_x)}
  times = _harness.interleaved_median_seconds(fns, warmup=2, repeats=3 if quick else 20)
  for name, t in times.items():
    records.append(
      {
        "model": task.name,
        "variant": f"inference_{name}",
        "metric": "ms",
        "value": 1e3 * t,
        "vs_float32": t / times["float32_xla"],
        "note": f"input {tuple(test_x.shape)}",
      }
    )
  return records


def run(quick: bool) -> list[dict[str, Any]]:
  try:
    tasks = _digits_tasks(quick)
  except ImportError as e:
    return _harness.skipped(str(e))
  if not quick:
    tasks.append(_text_task())
  records = []
  with tempfile.TemporaryDirectory() as tmp:
    for task in tasks:
      start = time.perf_counter()
      rows = _run_task(task, quick, pathlib.Path(tmp))
      for r in rows:
        r.setdefault("target", None)
        r.setdefault("met", None)
      records.extend(rows)
      print(f"  ({task.name}: {time.perf_counter() - start:.0f} s)", flush=True)
  return records
