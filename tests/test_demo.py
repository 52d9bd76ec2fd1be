"""Tests for the ``jmp-train`` demo (examples/jmp_train_examples/cli.py, examples/jmp_train_examples/demo.py)."""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

from helpers import processes
from helpers.fill import fill
from jmp_train_examples import cli
from jmp_train_examples import demo
from jmp_train_examples import demo_configs

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _env():
  # A fresh process: the CLI must set up its 8 devices itself.
  env = processes.worker_env()
  env["JAX_PLATFORMS"] = "cpu"
  return env


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
  """``jmp-train --quick --task digits``, every configuration, once per module.

  The default rows and the DiLoCo ones (asked for by name). The digits MLP
  compiles in a fraction of the Transformer's time; the text task runs in
  ``test_quick_text_demo`` (one configuration).
  """
  out = tmp_path_factory.mktemp("demo")
  done = subprocess.run(
    [
      sys.executable,
      "-m",
      "jmp_train_examples",
      "--quick",
      "--task",
      "digits",
      "--no-progress",
      "--configs",
      ",".join(demo_configs.CONFIGS),
      "--steps",
      "24",
      "--out",
      str(out),
    ],
    cwd=ROOT,
    env=_env(),
    capture_output=True,
    text=True,
    timeout=600,
    check=False,
  )
  return out, done


def test_quick_demo_writes_table_json_and_png(quick_run):
  out, done = quick_run
  assert done.returncode == 0, done.stderr[-3000:]
  payload = json.loads((out / "results.json").read_text())
  rows = {r["config"]: r for r in payload["rows"]}
  assert list(rows) == [
    "f32",
    "f16",
    "f16-dls",
    "bf16",
    "f16w-sgd",
    "f16w-mmsgd",
    "8dev-f32",
    "8dev-1bit-noef",
    "8dev-1bit",
    "8dev-diloco",
    "8dev-diloco-1bit",
  ]
  for name, row in rows.items():
    for column in payload["columns"]:
      assert column in row, (name, column)
    assert np.isfinite(row["train_loss"]) and np.isfinite(row["steps_per_s"]), name
    assert 0.0 <= row["underflow_f16"] <= 1.0
    assert len(payload["curves"][name]["loss"]) == payload["settings"]["steps"]
    assert len(payload["curves"][name]["loss_scale"]) == payload["settings"]["steps"]
  # Each row's gap is relative to its comparison's reference.
  assert rows["f32"]["val_loss_gap"] == rows["8dev-f32"]["val_loss_gap"] == 0.0
  assert rows["f16"]["val_loss_gap"] == pytest.approx(rows["f16"]["val_loss"] / rows["f32"]["val_loss"] - 1)
  assert rows["8dev-1bit"]["val_loss_gap"] == pytest.approx(
    rows["8dev-1bit"]["val_loss"] / rows["8dev-f32"]["val_loss"] - 1
  )
  assert set(payload["comparisons"]) == {"loss scaling", "weight updates", "compression"}
  assert payload["timing"]["wall_s"] > 0 and payload["timing"]["cpu_s"] > 0
  # The printed table has one line per configuration plus header and rule.
  table = [line for line in done.stdout.splitlines() if line.startswith("|")]
  assert len(table) == 2 + len(rows)
  assert (out / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  # Something was learned (chance: ln 10 = 2.30).
  assert rows["f32"]["train_loss"] < np.log(10) - 0.3
  assert rows["f32"]["val_acc"] > 0.3


def test_quick_text_demo_in_process_without_matplotlib(tmp_path, capsys, monkeypatch):
  """The default task, one configuration, through main() in this process.

  Without matplotlib (``pip install jmp_train`` alone) the table and
  results.json are written, the output says how to get the figure, and the
  exit status is 0.
  """
  monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
  assert cli.main(["--quick", "--configs", "f16-dls", "--no-progress", "--out", str(tmp_path)]) == 0
  out = capsys.readouterr().out
  assert "| f16-dls" in out and "pip install 'jmp_train[plot]'" in out
  assert not (tmp_path / "results.png").exists()
  (row,) = json.loads((tmp_path / "results.json").read_text())["rows"]
  # Something was learned from the stdlib source (uniform over bytes: ln 256).
  assert row["train_loss"] < np.log(256) - 1.0 and row["loss_scale"] >= 1.0


def test_quick_demo_figures_make_sense(quick_run):
  out, _ = quick_run
  rows = {r["config"]: r for r in json.loads((out / "results.json").read_text())["rows"]}
  # Loss scaling lives only where it was asked for.
  assert rows["f32"]["loss_scale"] == rows["f16"]["loss_scale"] == 1.0
  assert rows["f16-dls"]["loss_scale"] >= 1.0
  # float16 weights halve the bytes of parameters and optimizer state.
  assert rows["f16w-mmsgd"]["state_bytes"] < 0.6 * rows["f32"]["state_bytes"]
  # Single-device steps move nothing; 1-bit moves far fewer bytes than float32.
  assert rows["f32"]["wire_bytes_per_step"] == 0
  assert 0 < rows["8dev-1bit"]["wire_bytes_per_step"] < 0.5 * rows["8dev-f32"]["wire_bytes_per_step"]
  assert 0 < rows["8dev-1bit-noef"]["wire_bytes_per_step"] < 0.5 * rows["8dev-f32"]["wire_bytes_per_step"]
  # The 8-device rows run f32's momentum SGD (the same state bytes); 1-bit
  # SGD with error feedback adds its residuals.
  assert rows["8dev-f32"]["devices"] == rows["8dev-1bit"]["devices"] == 8
  assert rows["8dev-f32"]["state_bytes"] == rows["f32"]["state_bytes"]
  assert rows["8dev-1bit"]["state_bytes"] > rows["8dev-f32"]["state_bytes"]
  # DiLoCo exchanges once every DILOCO_SYNC_EVERY steps (24 steps: three
  # synchronisations, the last at the end), 1-bit DiLoCo a 32nd of that;
  # both keep the synchronised weights besides.
  f32, diloco, diloco_1bit = (rows[n] for n in ("8dev-f32", "8dev-diloco", "8dev-diloco-1bit"))
  every = demo_configs.DILOCO_SYNC_EVERY
  assert 0.9 / every < diloco["wire_bytes_per_step"] / f32["wire_bytes_per_step"] < 1.2 / every
  assert 0 < diloco_1bit["wire_bytes_per_step"] < 0.1 * diloco["wire_bytes_per_step"]
  assert diloco["state_bytes"] > f32["state_bytes"]
  for row in (diloco, diloco_1bit):
    assert np.isfinite(row["val_loss"]) and row["train_loss"] < np.log(10), row


@pytest.mark.parametrize(
  "argv, fragment",
  [
    (["--steps", "0"], "--steps: expected a positive integer, got 0"),
    (["--batch", "12"], "--batch 12 must be a multiple of 8"),
    (["--configs", "f32,f99"], "unknown configuration(s) 'f99'"),
    (["--configs", "f32,f32"], "lists a configuration twice"),
    (["--num-processes", "3"], "must divide 8: 1, 2, 4 or 8"),
    (["--task", "mnist"], "invalid choice: 'mnist'"),
    (["--d-model", "24"], "--d-model 24 must be a multiple of 16"),
    (["--lr", "-1"], "--lr: expected a positive number"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--seed", "-1"], "--seed: expected a non-negative integer, got -1"),
    (["--final-lr", "2"], "--final-lr: expected a number in (0, 1]"),
  ],
)
def test_bad_flags_one_line_and_exit_2(capsys, argv, fragment):
  assert cli.main(argv) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and err.startswith("jmp-train: error:"), err
  assert fragment in err
  assert "Traceback" not in err


def test_missing_sklearn_one_line_and_exit_1(capsys, monkeypatch):
  monkeypatch.setitem(sys.modules, "sklearn", None)  # makes `import sklearn` fail
  assert cli.main(["--task", "digits", "--no-plot"]) == 1
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "pip install 'jmp_train_examples[full]'" in err, err


def test_digits_batch_larger_than_the_held_out_images_one_line_and_exit_1(capsys):
  pytest.importorskip("sklearn")
  assert cli.main(["--task", "digits", "--batch", "1024", "--no-plot"]) == 1
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "--batch 1024 is more than the 359 held-out" in err, err
  assert "use --batch 352 or less" in err and "Traceback" not in err


def test_text_sequence_longer_than_the_validation_text_one_line_and_exit_1(capsys):
  assert cli.main(["--seq-len", "10000000", "--no-plot"]) == 1
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and "--seq-len 10000000 does not fit in the" in err, err
  assert "Traceback" not in err


def test_out_that_cannot_be_written_fails_before_training(tmp_path, capsys):
  a_file = tmp_path / "a_file"
  a_file.write_text("")
  for out, fragment in ((a_file, "exists and is not a folder"), (a_file / "sub", "cannot write there")):
    assert cli.main(["--quick", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--out {out}: {fragment}" in err, err
    assert "Traceback" not in err


def test_out_is_created(tmp_path):
  out = tmp_path / "new" / "folder"
  cli._check_output_dir(str(out))
  assert out.is_dir() and not list(out.iterdir())


def test_help_is_plain_text_and_needs_no_jax():
  """The CLI module answers --help without importing JAX, in plain text."""
  code = (
    "import importlib.util, sys\n"
    f"spec = importlib.util.spec_from_file_location('cli', {str(ROOT / 'examples/jmp_train_examples/cli.py')!r})\n"
    "cli = importlib.util.module_from_spec(spec); spec.loader.exec_module(cli)\n"
    "try:\n  cli.main(['--help'])\nexcept SystemExit as e:\n  assert e.code == 0\n"
    "print('JAX IMPORTED' if 'jax' in sys.modules else 'NO JAX')\n"
  )
  done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
  assert done.stdout.strip().endswith("NO JAX"), done.stdout
  text = done.stdout
  assert "usage: jmp-train" in text and "--out" in text
  for markup in ("``", ":func:", ":mod:", ":class:"):
    assert markup not in text, markup


def test_demo_uses_the_public_api():
  """The example modules import jmp_train's public names, not jmp_train._src."""
  import ast

  for path in sorted((ROOT / "examples" / "jmp_train_examples").glob("*.py")):
    name = path.name
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
      if isinstance(node, ast.ImportFrom) and node.module:
        assert not node.module.startswith("jmp_train._src"), (name, node.module)
      if isinstance(node, ast.Import):
        for alias in node.names:
          assert not alias.name.startswith("jmp_train._src"), (name, alias.name)


def test_schedule_warms_up_and_decays_to_the_final_rate():
  from jmp_train_examples import demo

  s = demo.DemoSettings(steps=100, learning_rate=0.2, warmup_fraction=0.1, final_lr_fraction=0.01)
  lr = np.asarray([float(demo.learning_rate_schedule(s)(i)) for i in range(101)])
  assert lr[0] == 0.0 and lr.argmax() == 10 and lr.max() == pytest.approx(0.2)
  assert np.all(np.diff(lr[10:]) <= 0)
  assert lr[100] == pytest.approx(0.002)


def test_gpt2_init_draws_small_weights_and_scales_residual_projections():
  import jax
  from jmp_train_examples import demo, models

  model = models.TransformerBlock(d_model=64, num_layers=4)
  # The model's parameter shapes, filled by NumPy (an eager init compiles each op).
  params = fill(jax.eval_shape(model.init, jax.random.PRNGKey(0), np.zeros((1, 8), np.int32))["params"])
  new = demo.gpt2_init(params, jax.random.PRNGKey(1), num_layers=4)
  assert np.std(new["head"]["kernel"]) == pytest.approx(0.02, rel=0.05)
  assert np.std(new["embed"]["embedding"]) == pytest.approx(0.02, rel=0.05)
  for i in range(4):
    layer = new[f"layer{i}"]
    assert np.std(layer["mlp_in"]["kernel"]) == pytest.approx(0.02, rel=0.05)
    assert np.std(layer["mlp_out"]["kernel"]) == pytest.approx(0.02 / np.sqrt(8), rel=0.05)
    assert np.std(layer["attn"]["out"]["kernel"]) == pytest.approx(0.02 / np.sqrt(8), rel=0.1)
    np.testing.assert_array_equal(layer["ln1"]["scale"], params[f"layer{i}"]["ln1"]["scale"])
    np.testing.assert_array_equal(layer["mlp_in"]["bias"], params[f"layer{i}"]["mlp_in"]["bias"])


def test_bad_init_names_the_valid_ones():
  from jmp_train_examples import demo_tasks

  s = demo_tasks.DemoSettings(task="text", init="xavier", steps=1)
  task = demo_tasks.TASKS["text"](s)
  with pytest.raises(ValueError, match="'flax', 'gpt2'"):
    demo_tasks.init_params(task, s)


def test_one_bit_scale_and_init_flags_reach_the_settings():
  parser = cli.build_parser()
  args = parser.parse_args(["--one-bit-scale", "column", "--init", "gpt2"])
  settings = cli._settings(args, parser.config_names)
  assert settings["one_bit_scale"] == "column" and settings["init"] == "gpt2"
  default = cli._settings(parser.parse_args([]), parser.config_names)
  assert default["one_bit_scale"] == "l1" and default["init"] == "flax"
  # The DiLoCo rows run when asked for by name.
  assert default["configs"] == demo_configs.DEFAULT_CONFIGS == demo_configs.DemoSettings().configs
  assert set(demo_configs.CONFIGS) - set(default["configs"]) == {"8dev-diloco", "8dev-diloco-1bit"}
  assert tuple(demo_configs.CONFIGS) == parser.config_names


def test_console_script_is_declared_by_the_examples_not_the_library():
  assert 'jmp-train = "jmp_train_examples.cli:main"' in (ROOT / "examples" / "pyproject.toml").read_text()
  assert "jmp-train" not in (ROOT / "pyproject.toml").read_text().split("[project.optional-dependencies]")[0]
  assert "[project.scripts]" not in (ROOT / "pyproject.toml").read_text()


def test_two_processes_run_the_data_parallel_configs(tmp_path, capsys):
  """``--num-processes 2``: 1-bit SGD over 2 worker processes x 4 devices (gloo)."""
  status = cli.main(
    [
      "--quick",
      "--task",
      "digits",
      "--no-progress",
      "--no-plot",
      "--steps",
      "4",
      "--configs",
      "8dev-1bit",
      "--num-processes",
      "2",
      "--out",
      str(tmp_path),
    ]
  )
  assert status == 0, capsys.readouterr().err
  (row,) = json.loads((tmp_path / "results.json").read_text())["rows"]
  assert row["config"] == "8dev-1bit" and row["processes"] == 2 and row["devices"] == 8
  assert np.isfinite(row["train_loss"]) and row["wire_bytes_per_step"] > 0


def _readme_quick_start() -> str:
  text = (ROOT / "README.md").read_text()
  section = text.split("## Quick start", 1)[1]
  return section.split("```python\n", 1)[1].split("```", 1)[0]


def test_readme_has_the_sections_a_newcomer_needs():
  text = (ROOT / "README.md").read_text()
  for heading in (
    "## Installation",
    "## Quick start",
    "## What's inside",
    "## The demo",
    "## Headline results",
    "## Two commands",
    "## Data parallelism",
    "## Layout",
    "## Citing",
  ):
    assert heading in text, heading
  assert "make test" in text and "make demo" in text
  assert "jax.block_until_ready" in text  # the CPU data-parallelism note
  # A front page: read in five minutes, no dates (history is in CHANGELOG.md).
  assert len(text.splitlines()) <= 200
  assert not re.search(r"\b20[0-9]{2}-[0-9]{2}-[0-9]{2}\b", text)
  for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
    assert f"notebooks/{notebook.name}" in text, notebook.name
  for guide in sorted((ROOT / "docs" / "guides").glob("*.md")):
    assert f"docs/guides/{guide.name}" in text, guide.name


def test_readme_quick_start_runs_as_written(capsys):
  code = _readme_quick_start()
  assert len(code.strip().splitlines()) <= 15
  namespace = {"__name__": "__readme__"}
  exec(compile(code, "README.md", "exec"), namespace)
  assert "'loss_scale'" in capsys.readouterr().out
  metrics = {k: float(v) for k, v in namespace["metrics"].items()}
  assert set(metrics) == {"loss", "loss_scale", "skipped_steps", "consecutive_skipped_steps", "grad_norm"}
  # Each skipped (overflowing) step halved the scale from its 2**15 start.
  assert metrics["loss_scale"] * 2 ** metrics["skipped_steps"] == 2.0**15
  assert np.isfinite(metrics["loss"]) and metrics["skipped_steps"] < 3


def test_a_failed_worker_process_reports_its_error_line(tmp_path, capsys, monkeypatch):
  # A process that aborts prints a native stack after its error: the
  # message names the error, not the last stack frame.
  script = (
    "print('starting'); print('F1124 00:00:00.1 x.cc:1] Check failed: peer lost'); "
    "print('*** Check failure stack trace: ***'); "
    "print('    @     0x7f893cf58ba3  PyObject_Vectorcall'); raise SystemExit(1)"
  )
  popen = subprocess.Popen
  monkeypatch.setattr(subprocess, "Popen", lambda cmd, **kw: popen([sys.executable, "-c", script], **kw))
  status = cli.main(
    [
      "--quick",
      "--task",
      "digits",
      "--no-progress",
      "--no-plot",
      "--steps",
      "2",
      "--configs",
      "8dev-1bit",
      "--num-processes",
      "2",
      "--out",
      str(tmp_path),
    ]
  )
  err = capsys.readouterr().err
  assert status != 0
  assert "process 0 of 2 failed: F1124 00:00:00.1 x.cc:1] Check failed: peer lost" in err, err
  assert "PyObject_Vectorcall" not in err


@pytest.mark.parametrize(
  "log, line",
  [
    ('Traceback (most recent call last):\n  File "x.py", line 1\nValueError: bad size\n', "ValueError: bad size"),
    (
      "terminate called after throwing an instance of 'gloo::IoException'\n"
      "  what():  Connection closed by peer\n*** SIGABRT received ***\n",
      "what():  Connection closed by peer",
    ),
    ("step 1\nstep 2\n", "step 2"),
    ("", "(no output)"),
  ],
)
def test_failure_line_prefers_the_last_error_line(log, line):
  assert demo._failure_line(log) == line


def test_worker_processes_keep_every_xla_flag_but_the_device_count():
  # Each worker sets its own device count; a GPU flag or a collective
  # timeout set by the user must reach it.
  flags = (
    "--xla_gpu_ftz=true --xla_force_host_platform_device_count=8 "
    "--xla_cpu_collective_call_terminate_timeout_seconds=600"
  )
  kept = demo._worker_xla_flags(flags)
  assert kept.split() == ["--xla_gpu_ftz=true", "--xla_cpu_collective_call_terminate_timeout_seconds=600"]
  assert demo._worker_xla_flags("") == ""
