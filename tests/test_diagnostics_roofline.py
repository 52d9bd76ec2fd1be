"""The roofline: chip peaks, each operation's bound and time, formats compared, the data-parallel exchange."""

import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import roofline as jax_roofline

import jmp_train
from jmp_train.diagnostics import CHIPS
from jmp_train.diagnostics import Chip
from jmp_train.diagnostics import ExchangeReport
from jmp_train.diagnostics import ExchangeRow
from jmp_train.diagnostics import FormatComparison
from jmp_train.diagnostics import FormatRow
from jmp_train.diagnostics import RooflineReport
from jmp_train.diagnostics import RooflineRow
from jmp_train.diagnostics import chip_peaks
from jmp_train.diagnostics import collective_bytes
from jmp_train.diagnostics import data_parallel_exchange
from jmp_train.diagnostics import roofline
from jmp_train.diagnostics import roofline_compare

F16, BF16, F32 = jnp.float16, jnp.bfloat16, jnp.float32
CURRENT = jmp_train.Fp8Recipe(scaling="current")
DIMS = (((1,), (0,)), ((), ()))


def sds(*shape, dtype=F32):
  return jax.ShapeDtypeStruct(shape, dtype)


# --------------------------------------------------------------------------
# The chip table.


def test_table_holds_the_chips_with_dense_datasheet_peaks():
  for name in ("H100 SXM", "H200", "A100", "B200", "L4", "TPU v5e", "V100"):
    assert name in CHIPS
  h100, h200, a100 = CHIPS["H100 SXM"], CHIPS["H200"], CHIPS["A100"]
  assert h100.peak("bfloat16") == 989.4e12 and h100.peak("fp8") == h100.peak("int8") == 1978.9e12
  assert h200.peak("bfloat16") == h100.peak("bfloat16") and h200.hbm_bytes_per_s == 4.8e12
  # The ridge points the roofline's anchors give: H200 206 / 412, H100 295 / 591, A100 ~155 / 310.
  assert round(h200.ridge("bfloat16")) == 206 and round(h200.ridge("int8")) == 412
  assert round(h100.ridge("bfloat16")) == 295 and round(h100.ridge("int8")) == 591
  assert 150 < a100.ridge("bfloat16") < 157 and 300 < a100.ridge("int8") < 315
  assert CHIPS["V100"].peak("float16") == 125e12 and CHIPS["V100"].hbm_bytes_per_s == 900e9
  # No TF32 on a V100: a float32 product runs at the float32 peak.
  assert CHIPS["V100"].peak("tf32") == CHIPS["V100"].peak("float32") == 15.7e12


@pytest.mark.parametrize(
  "given, name",
  [
    ("h100", "H100 SXM"),
    ("NVIDIA H100 80GB HBM3", "H100 SXM"),
    ("NVIDIA H100 PCIe", "H100 PCIe"),
    ("NVIDIA A100-SXM4-40GB", "A100 40GB"),
    ("tpu_v5e", "TPU v5e"),
    ("TPU v5 lite", "TPU v5e"),
  ],
)
def test_chip_peaks_matches_names_and_device_kinds(given, name):
  assert chip_peaks(given).name == name


def test_unknown_chip_lists_the_known_ones_and_how_to_add_one():
  with pytest.raises(ValueError, match=r"Unknown chip 'X1'.*H100 SXM.*TPU v5e.*'cpu'.*Chip\("):
    chip_peaks("X1")
  mine = Chip("X1", peaks={"bfloat16": 100e12}, hbm_bytes_per_s=1e12)
  assert chip_peaks(mine) is mine and mine.ridge("bfloat16") == 100
  with pytest.raises(ValueError, match="unknown formats.*'fp4'"):
    Chip("X2", peaks={"fp4": 1e15}, hbm_bytes_per_s=1e12)


def test_a_format_without_a_peak_says_so():
  with pytest.raises(ValueError, match="A100 has no FP8 Tensor Cores.*Chips with one:.*H100 SXM"):
    CHIPS["A100"].peak("fp8")


# --------------------------------------------------------------------------
# The lecture's worked example, and the bound labels.


def _layer(x, w):
  return jax.nn.relu(x @ w)


def test_the_worked_example():
  """4096 outputs from 1024 inputs at batch 512 in float16 on a V100, then the ReLU."""
  report = roofline(_layer, sds(512, 1024, dtype=F16), sds(1024, 4096, dtype=F16), chip="V100", backward=False)
  assert isinstance(report, RooflineReport) and all(isinstance(r, RooflineRow) for r in report.rows)
  dot, relu = report.rows
  assert dot.op == "dot_general" and dot.format == "float16" and dot.product and dot.tensor_core
  assert dot.flops == 2 * 512 * 1024 * 4096  # 4.3 GFLOP
  assert dot.bytes == 2 * (512 * 1024 + 1024 * 4096 + 512 * 4096)  # 13.6 MB
  assert dot.intensity == pytest.approx(315.08, abs=0.01)
  assert dot.t_math_s == pytest.approx(dot.flops / 125e12) and dot.t_mem_s == pytest.approx(dot.bytes / 900e9)
  assert dot.bound == "math"
  assert relu.op == "max" and relu.bound == "memory" and not relu.product
  assert relu.intensity == pytest.approx(0.25, rel=1e-4) and relu.bytes == pytest.approx(2 * 2 * 512 * 4096, abs=2)
  assert report.ridge_points == {"float16": pytest.approx(125e12 / 900e9)}
  assert report.time_s == pytest.approx(dot.t_math_s + relu.t_mem_s)
  assert report.tensor_core_share == pytest.approx(dot.t_math_s / report.time_s)
  text = str(report)
  assert "dot_general" in text and "memory" in text and "V100: predicted" in text


def test_bound_labels_follow_the_ridge_point():
  # Batch 8 against a 4096x4096 weight: intensity ~8 FLOP/B, far below H100's 295.
  small = roofline(jnp.dot, sds(8, 4096, dtype=BF16), sds(4096, 4096, dtype=BF16), chip="H100", backward=False)
  large = roofline(jnp.dot, sds(8192, 4096, dtype=BF16), sds(4096, 4096, dtype=BF16), chip="H100", backward=False)
  assert [r.bound for r in small.rows] == ["memory"] and [r.bound for r in large.rows] == ["math"]
  assert small.rows[0].intensity < CHIPS["H100 SXM"].ridge("bfloat16") < large.rows[0].intensity
  # float32 operands at the default precision run on TF32; at "highest" on float32.
  f32 = roofline(jnp.dot, sds(256, 256), sds(256, 256), chip="H100", backward=False).rows[0]
  with jax.default_matmul_precision("highest"):
    highest = roofline(jnp.dot, sds(256, 256), sds(256, 256), chip="H100", backward=False).rows[0]
  assert (f32.format, highest.format) == ("tf32", "float32") and not highest.tensor_core


def test_counts_are_jax_rooflines_and_fusion_saves_the_intermediates():
  def chain(x):
    return jnp.exp(x) * 2.0 + x

  x = sds(1024, 1024)
  unfused = roofline(chain, x, chip="H100", backward=False, fuse=False)
  _, total = jax_roofline.roofline(chain)(x)
  assert [r.op for r in unfused.rows] == ["exp", "mul", "add"]
  assert unfused.flops == total.unfused_flops and unfused.bytes == total.unfused_hbm_bytes
  fused = roofline(chain, x, chip="H100", backward=False)
  (row,) = fused.rows
  assert row.op == "fusion(exp+mul+add)" and row.flops == unfused.flops
  assert row.bytes == 2 * 4 * 1024 * 1024  # x read once, the result written once
  assert fused.time_s < unfused.time_s and row.bound == "memory"


def test_backward_adds_the_gradient_products():
  loss = lambda w, x: jnp.sum(_layer(x, w) ** 2)  # noqa: E731
  w, x = sds(1024, 4096, dtype=BF16), sds(512, 1024, dtype=BF16)
  forward = roofline(loss, w, x, chip="H200", backward=False)
  both = roofline(loss, w, x, chip="H200")
  products = [r for r in both.rows if r.product]
  assert [r.phase for r in products] == ["forward", "backward", "backward"]
  assert all(r.flops == 2 * 512 * 1024 * 4096 for r in products)
  assert both.time_s > 2.5 * sum(r.time_s for r in forward.rows if r.product)


def test_quantize_work_of_fp8_products_is_counted():
  def fp8(x, w):
    return jmp_train.fp8_dot_general(x, w, DIMS, meta=None, recipe=CURRENT)

  report = roofline(fp8, sds(4096, 4096, dtype=BF16), sds(4096, 4096, dtype=BF16), chip="H100", backward=False)
  (product,) = [r for r in report.rows if r.product]
  assert product.format == "fp8" and product.peak_flops_per_s == 1978.9e12
  assert any(r.quantize for r in report.rows) and 0 < report.quantize_share < 1
  with pytest.raises(ValueError, match="A100 has no FP8 Tensor Cores"):
    roofline(fp8, sds(64, 64, dtype=BF16), sds(64, 64, dtype=BF16), chip="A100", backward=False)


def test_arguments_that_cannot_be_traced_raise():
  with pytest.raises(ValueError, match=r"args\[1\] is a str.*functools.partial"):
    roofline(lambda x, mode: x, sds(4), "fast", chip="H100")
  with pytest.raises(ValueError, match="could not trace fn.*Python control flow"):
    roofline(lambda x: x if x.sum() > 0 else -x, jnp.ones(4), chip="H100", backward=False)
  with pytest.raises(TypeError, match="needs a callable"):
    roofline("not a function", sds(4), chip="H100")


def test_plot_draws_a_point_per_product():
  matplotlib = pytest.importorskip("matplotlib")
  matplotlib.use("Agg")
  report = roofline(_layer, sds(512, 1024, dtype=F16), sds(1024, 4096, dtype=F16), chip="V100", backward=False)
  ax = report.plot()
  assert ax.get_xscale() == "log" and len(ax.collections) == 2  # products, other operations
  assert ax.collections[0].get_offsets().shape == (1, 2)


# --------------------------------------------------------------------------
# Formats compared.


def _bf16(x, w):
  return jax.lax.dot_general(x, w, DIMS)


def _fp8(x, w):
  return jmp_train.fp8_dot_general(x, w, DIMS, meta=None, recipe=CURRENT)


def test_compare_says_fp8_pays_on_large_products():
  x, w = sds(8192, 8192, dtype=BF16), sds(8192, 8192, dtype=BF16)
  comparison = roofline_compare(_bf16, x, w, policies=(("bfloat16", _bf16), ("fp8", _fp8)), chip="H100 SXM")
  assert isinstance(comparison, FormatComparison) and all(isinstance(r, FormatRow) for r in comparison.rows)
  bf16, fp8 = comparison.rows
  assert bf16.formats == ("bfloat16",) and fp8.formats == ("fp8",)
  assert fp8.speedup > 1.05 and fp8.quantize_share > 0
  assert comparison.verdict == f"fp8 pays here: {fp8.speedup:.2f}x over bfloat16"
  assert "fp8 pays here" in str(comparison)


def test_compare_says_a_memory_bound_step_saves_little():
  # Batch 16: the products are memory-bound, quantizing costs more than FP8's math saves.
  x, w = sds(16, 4096, dtype=BF16), sds(4096, 4096, dtype=BF16)
  comparison = roofline_compare(_bf16, x, w, policies=(("bfloat16", _bf16), ("fp8", _fp8)), chip="H100 SXM")
  assert comparison.rows[1].speedup < 1.05
  assert comparison.verdict.startswith("memory-bound (")
  assert "a narrower format saves at most" in comparison.verdict and "fp8 gives" in comparison.verdict


def test_compare_applies_policies_through_autocast():
  x, w = sds(4096, 4096), sds(4096, 4096)
  comparison = roofline_compare(
    lambda w, x: x @ w, w, x, policies=("float32", "mixed_bfloat16"), chip="H100 SXM", backward=False
  )
  f32, bf16 = comparison.rows
  assert f32.formats == ("tf32",) and bf16.formats == ("bfloat16",) and f32.speedup == 1.0
  # The casts autocast adds are counted: less than the products' 2x.
  assert 1.05 < bf16.speedup < 2.0
  assert comparison.verdict == f"mixed_bfloat16 pays here: {bf16.speedup:.2f}x over float32"
  with pytest.raises(ValueError, match="at least one policy"):
    roofline_compare(jnp.dot, x, w, policies=(), chip="H100")


# --------------------------------------------------------------------------
# The data-parallel exchange and the balance point.


def test_exchange_bytes_and_times_follow_the_alpha_beta_model():
  grads = {"w": sds(1024, 1024), "b": sds(1024)}
  n, k, link, alpha = 1024 * 1024 + 1024, 16, 100e9 / 8, 10e-6
  report = data_parallel_exchange(grads, replicas=k, link_bytes_per_s=link, latency_s=alpha, compute_s=0.02)
  assert isinstance(report, ExchangeReport) and all(isinstance(r, ExchangeRow) for r in report.rows)
  f32, bf16, one_bit = (report.row(f) for f in ("float32", "bfloat16", "1-bit"))
  assert f32.bytes_per_replica == pytest.approx(2 * (k - 1) / k * 4 * n)
  assert bf16.bytes_per_replica == pytest.approx(f32.bytes_per_replica / 2)
  assert one_bit.bytes_per_replica == jmp_train.sign_compression_wire_bytes(list(grads.values()), k)
  assert f32.t_comm_s == pytest.approx(2 * (k - 1) * alpha + f32.bytes_per_replica / link)
  assert f32.t_calc_s == pytest.approx(0.02 / k) and f32.step_s == pytest.approx(f32.t_calc_s + f32.t_comm_s)
  assert f32.balance_replicas < bf16.balance_replicas < one_bit.balance_replicas


def test_balance_point_equates_compute_and_communication():
  grads = [sds(4096, 4096)]
  n, link, alpha, t1, fixed = 4096 * 4096, 10e9 / 8, 20e-6, 2.0, 0.01
  report = data_parallel_exchange(
    grads, replicas=8, link_bytes_per_s=link, latency_s=alpha, compute_s=t1, fixed_s=fixed, formats=("float32",)
  )
  k_hat = report.row("float32").balance_replicas
  comm = 2 * (k_hat - 1) * alpha + 2 * (k_hat - 1) / k_hat * 4 * n / link
  assert fixed + t1 / k_hat == pytest.approx(comm, rel=1e-6)
  assert 5 < k_hat < 50
  # Compute that never falls to the exchange's time has no balance point.
  never = data_parallel_exchange(grads, replicas=2, link_bytes_per_s=1e15, latency_s=0.0, fixed_s=1.0)
  assert math.isinf(never.row("float32").balance_replicas)
  overlapped = data_parallel_exchange(grads, replicas=8, link_bytes_per_s=link, compute_s=t1, overlap=True)
  row = overlapped.row("float32")
  assert row.step_s == max(row.t_calc_s, row.t_comm_s)
  with pytest.raises(ValueError, match="Unknown exchange formats.*'int4'"):
    data_parallel_exchange(grads, replicas=8, link_bytes_per_s=link, formats=("int4",))


def test_exchange_reads_a_compiled_steps_collectives():
  f = jax.pmap(lambda g: jax.lax.pmean(g, "i"), axis_name="i")
  k = jax.local_device_count()
  compiled = f.lower(jnp.zeros((k, 4096), F32)).compile()
  report = data_parallel_exchange([sds(4096)], replicas=k, link_bytes_per_s=1e9, compiled=compiled)
  row = report.row("compiled")
  assert row.bytes_per_replica == collective_bytes(compiled, wire=True)["total"] > 0
  assert row.messages == 2 * (k - 1) and "compiled" in str(report)


# --------------------------------------------------------------------------
# On this machine's CPU: measured peaks, and predictions against timings.


@pytest.fixture(scope="module")
def cpu():
  return chip_peaks("cpu")


def test_cpu_peaks_are_measured(cpu):
  assert cpu.name == "cpu" and cpu.peak("float32") > 1e9 and cpu.hbm_bytes_per_s > 1e8
  assert chip_peaks("cpu") is cpu  # once per process


def test_on_the_cpu_a_large_matmul_is_math_bound_and_an_elementwise_chain_memory_bound(cpu):
  matmul = roofline(jnp.dot, sds(1024, 1024), sds(1024, 1024), chip=cpu, backward=False)
  chain = roofline(lambda x: jnp.tanh(x) * 2.0 + 1.0, sds(1 << 20), chip=cpu, backward=False)
  assert [r.bound for r in matmul.rows] == ["math"]
  assert [r.bound for r in chain.rows] == ["memory"]


def _best(fn, *args, repeats=5):
  jax.block_until_ready(fn(*args))
  best = math.inf
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    best = min(best, time.perf_counter() - start)
  return best


def test_on_the_cpu_predicted_step_times_rank_as_measured(cpu):
  def loss(params, x):
    h = jnp.tanh(x @ params[0])
    return jnp.mean((h @ params[1]) ** 2)

  predicted, measured = [], []
  for width in (128, 512, 2048):  # 16x the FLOPs from one to the next
    rng = np.random.default_rng(0)
    params = [jnp.asarray(rng.normal(size=s), F32) / 30 for s in ((512, width), (width, 512))]
    x = jnp.asarray(rng.normal(size=(256, 512)), F32)
    predicted.append(roofline(loss, params, x, chip=cpu).time_s)
    measured.append(_best(jax.jit(jax.grad(loss)), params, x))
  assert np.argsort(predicted).tolist() == np.argsort(measured).tolist() == [0, 1, 2]


def test_a_prng_key_in_the_program_counts_its_key_data():
  def noisy(key, x):
    return jax.random.normal(key, x.shape) * x

  report = roofline(noisy, jax.random.key(0), jnp.ones(4), chip="H100", backward=True)
  assert report.time_s > 0 and all(np.isfinite(r.bytes) for r in report.rows)
