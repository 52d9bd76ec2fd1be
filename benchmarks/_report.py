"""The benchmarks' stored results as Markdown: ``--summary`` and the generated report.

:func:`report` makes ``docs/benchmarks_report.md`` from the JSON files under
``benchmarks/results`` alone (no benchmark runs): headline figures
(:mod:`benchmarks._headlines`), then one section per benchmark with every
file's machine and tables. :func:`summary` prints one table per file.
"""

from __future__ import annotations

import ast
import functools
import json
import pathlib
from typing import Any, Iterator

from benchmarks import _headlines as _headlines_lib
from benchmarks._headlines import percent
from jmp_train.diagnostics import format_table

_HERE = pathlib.Path(__file__).resolve().parent
_ROOT = _HERE.parent
RESULTS_DIR = _HERE / "results"  # the same folder as ``_harness.RESULTS_DIR``
REPORT_PATH = _ROOT / "docs" / "benchmarks_report.md"
REPORT_COMMAND = "python -m benchmarks --report"


def module_facts(path: pathlib.Path) -> tuple[str, tuple[str, ...] | None]:
  """A module's docstring summary line and its ``COLUMNS``, read without importing it.

  Returns:
    ``(summary, columns)``: the first line of the docstring with reST
    literals as Markdown ones (``""`` without a docstring or a file), and the
    literal ``COLUMNS`` tuple (``None`` without one).
  """
  if not path.is_file():
    return "", None
  tree = ast.parse(path.read_text())
  doc = (ast.get_docstring(tree) or "").strip()
  line = doc.splitlines()[0].replace("``", "`") if doc else ""
  columns = None
  for node in tree.body:
    if (
      isinstance(node, ast.Assign)
      and len(node.targets) == 1
      and isinstance(node.targets[0], ast.Name)
      and node.targets[0].id == "COLUMNS"
    ):
      columns = tuple(ast.literal_eval(node.value))
  return line, columns


def _columns(name: str) -> tuple[str, ...] | None:
  return module_facts(_HERE / f"bench_{name}.py")[1]


def summary(results_dir: pathlib.Path | None = None) -> str:
  """The stored full-size results as markdown: one table per result file."""
  results_dir = pathlib.Path(results_dir or RESULTS_DIR)
  parts = []
  for path in sorted(results_dir.glob("*.json")):
    payload = json.loads(path.read_text())
    name = payload["benchmark"]
    if name.endswith("-quick"):
      continue
    m = payload["machine"]
    columns = _columns(name)
    if columns is not None and any("run" in r for r in payload["records"]):
      columns = (*columns, "run")  # records appended by later runs say which run
    parts.append(
      f"#### {name}\n\n{m['device_kind']} x{m['device_count']} ({m['backend']}, "
      f"{m.get('cpu_count')} CPU cores), jax {m['versions']['jax']}, {m['date']}\n\n"
      + format_table(payload["records"], columns)
    )
  return "\n\n".join(parts) if parts else f"(no results in {results_dir})"


_SPLIT_KEYS = ("part", "study", "kind")  # a column that names a table of its own
_LABEL_KEYS = ("run", "date", "skipped", "reason")
_SHORT_TEXT = 24  # longer text varying between rows stays out of the tables
# A folder of results that are not ``bench_*`` output: its section's title
# and the module whose docstring says what it measures.
_FOLDERS = {"demo": ("Demo (`jmp-train`)", _ROOT / "examples" / "jmp_train_examples" / "demo.py")}
_DEMO_SETTINGS = (
  "task",
  "steps",
  "batch",
  "seq_len",
  "d_model",
  "layers",
  "learning_rate",
  "momentum",
  "one_bit_scale",
  "seed",
)


def _plain(v: Any) -> Any:
  """A record value ready for a Markdown cell (``|`` escaped)."""
  return v.replace("|", "\\|") if isinstance(v, str) else v


def _sentence(text: str) -> str:
  return text if text.endswith((".", "!", "?")) else text + "."


def _key(v: Any) -> str:
  return json.dumps(v, sort_keys=True)


def _is_short_scalar(v: Any) -> bool:
  if isinstance(v, str):
    return len(v) <= _SHORT_TEXT
  return v is None or isinstance(v, (bool, int, float))


def _machine(m: dict[str, Any]) -> str:
  """The machine of a results file, in words, from its ``machine`` only."""
  kind, count = m.get("device_kind"), m.get("device_count", m.get("devices"))
  words = []
  if kind:
    words.append(f"{kind} x{count}" if count is not None else str(kind))
  elif count is not None:
    words.append(f"{count} device{'s' if count != 1 else ''}")
  details = [f"{m['backend']} backend"] if m.get("backend") else []
  if m.get("backend") == "cpu" and "xla_force_host_platform_device_count" in (m.get("xla_flags") or ""):
    details.append("simulated devices")
  if m.get("cpu_count"):
    details.append(f"{m['cpu_count']} CPU cores")
  if details:
    words.append(f"({', '.join(details)})")
  jax_version = (m.get("versions") or {}).get("jax", m.get("jax"))
  text = " ".join(words) + (f", jax {jax_version}" if jax_version else "")
  date = m.get("date")
  return f"{text}; {date}" if date else f"{text}; the file records no date"


def _display(path: pathlib.Path) -> tuple[str, str | None]:
  """``(name shown, link from docs/)`` of a results file."""
  try:
    rel = path.resolve().relative_to(_ROOT).as_posix()
  except ValueError:
    return path.as_posix(), None
  return rel, f"../{rel}"


def _file_blocks(path: pathlib.Path, results_dir: pathlib.Path, machine: dict[str, Any]) -> list[str]:
  """A file's heading (no link: Sphinx takes none in a title), machine and link."""
  shown, link = _display(path)
  blocks = [f"### `{path.relative_to(results_dir).as_posix()}`", f"Machine: {_machine(machine)}."]
  if link:
    blocks.append(f"File: [`{shown}`]({link}).")
  return blocks


def _record_tables(records: list[dict[str, Any]], columns: tuple[str, ...] | None) -> Iterator[str]:
  """Markdown blocks: one table per value of a splitting column and per run.

  Columns: ``columns`` (those some record of the table has), then every
  other short scalar field that varies within the table; a run's label and
  a single date go above its table.
  """
  records = [{k: _plain(v) for k, v in r.items()} for r in records]
  base = list(columns) if columns else list(dict.fromkeys(k for r in records for k in r))
  split = [k for k in _SPLIT_KEYS if k in base and len({_key(r.get(k)) for r in records}) > 1]
  groups: dict[tuple[str, ...], list[dict[str, Any]]] = {}
  for r in records:
    groups.setdefault(tuple(_key(r.get(k)) for k in split), []).append(r)
  for split_key, members in groups.items():
    if split:
      yield "#### " + ", ".join(f"{k} `{json.loads(v)}`" for k, v in zip(split, split_key))
    runs: dict[str, list[dict[str, Any]]] = {}
    for r in members:
      runs.setdefault(_key(r.get("run")), []).append(r)
    for run_key, rows in runs.items():
      run = json.loads(run_key)
      dates = sorted({str(r["date"]) for r in rows if "date" in r})
      notes = []
      if run is not None:
        notes.append(_sentence(f"Run: {run}"))
      if len(dates) == 1 and all("date" in r for r in rows):
        notes.append(f"Date: {dates[0]}.")
      shown = [c for c in base if c not in split and any(c in r for r in rows)]
      if len(dates) > 1 or (dates and not all("date" in r for r in rows)):
        shown.append("date")
      for k in dict.fromkeys(k for r in rows for k in r):
        if k in shown or k in split or k in _LABEL_KEYS:
          continue
        values = [r.get(k) for r in rows]
        if all(_is_short_scalar(v) for v in values) and len({_key(v) for v in values}) > 1:
          shown.append(k)
      if notes:
        yield " ".join(notes)
      yield format_table(rows, shown)


def _benchmark_section(path: pathlib.Path, payload: dict[str, Any], results_dir: pathlib.Path) -> list[str]:
  records = payload["records"]
  blocks = _file_blocks(path, results_dir, payload["machine"])
  if len(records) == 1 and records[0].get("skipped") is True:
    blocks.append(f"Skipped there: {records[0].get('reason')}")
  else:
    blocks.extend(_record_tables(records, _columns(payload["benchmark"])))
  return blocks


def _folder_file_section(path: pathlib.Path, payload: dict[str, Any], results_dir: pathlib.Path) -> list[str]:
  blocks = _file_blocks(path, results_dir, payload["machine"])
  if "rows" in payload:  # a ``jmp-train`` results.json
    settings = payload.get("settings", {})
    said = [f"{k} {settings[k]}" for k in _DEMO_SETTINGS if k in settings]
    timing = payload.get("timing", {})
    if "wall_s" in timing:
      said.append(f"{timing['wall_s']:.0f} s wall")
    if said:
      blocks.append("Settings: " + ", ".join(said) + ".")
    columns = list(payload.get("columns") or payload["rows"][0])
    columns += [c for c in ("devices", "backend") if c not in columns and any(c in r for r in payload["rows"])]
    rows = [{k: _plain(v) for k, v in r.items()} for r in payload["rows"]]
    blocks.append(format_table(rows, columns, formats={"val_loss_gap": percent(1)}))
    blocks.append(
      "`val_loss_gap`: the validation loss relative to the row's `reference` "
      "(`f32`, or `8dev-f32` for the 8-device rows)."
    )
  else:
    for key in ("what", "source"):
      if payload.get(key):
        blocks.append(_sentence(f"{key.capitalize()}: {payload[key]}"))
    blocks.extend(_record_tables(payload["records"], None))
  return blocks


def _load(results_dir: pathlib.Path) -> dict[str, tuple[pathlib.Path, dict[str, Any]]]:
  """``relative name -> (path, payload)`` of every full-size results file."""
  found = {}
  for path in sorted(results_dir.rglob("*.json")):
    payload = json.loads(path.read_text())
    if not isinstance(payload, dict) or "machine" not in payload:
      continue
    if str(payload.get("benchmark", "")).endswith("-quick"):
      continue
    found[path.relative_to(results_dir).as_posix()] = (path, payload)
  return found


def _where(loaded, name: str) -> str:
  path, payload = loaded[name]
  link = _display(path)[1]
  m = payload["machine"]
  device = m.get("device_kind") or f"{m.get('backend', '?')} backend"
  return f"[`{name}`]({link}) ({device})" if link else f"`{name}` ({device})"


def _headlines(loaded) -> list[str]:
  """The headline blocks: the demo's table, then one row per figure of every file."""
  where = functools.partial(_where, loaded)
  demo = {n: payload for n, (_, payload) in loaded.items() if n.split("/")[0].startswith("demo-")}
  blocks = _headlines_lib.demo_table(demo, where)
  rows = []
  found = _headlines_lib.demo_bytes(demo)
  if found:
    name, (figure, value) = found
    rows.append({"figure": figure, "value": value, "source": where(name)})
  for name, (_, payload) in loaded.items():
    if "/" not in name:
      for figure, value in _headlines_lib.figures(payload["benchmark"], payload):
        rows.append({"figure": figure, "value": value, "source": where(name)})
  if rows:
    blocks += ["### Other figures", format_table(rows, ["figure", "value", "source"])]
  return blocks


def report(results_dir: pathlib.Path | None = None) -> str:
  """The benchmarks report: headlines, then every stored result, as Markdown.

  Made only from the JSON files under ``results_dir`` (default
  ``benchmarks/results``, subfolders included) and the benchmark modules'
  docstrings; the same files always give the same text. Each file's table
  names the machine and the date its ``machine`` records (none where it
  records none); ``--quick`` results are left out.

  Args:
    results_dir: the results folder.

  Returns:
    The page, ending in one newline.
  """
  results_dir = pathlib.Path(results_dir or RESULTS_DIR)
  loaded = _load(results_dir)
  blocks = [
    "# Benchmark results",
    f"<!-- Generated by `{REPORT_COMMAND}` from benchmarks/results/. Do not edit by hand: run the command again. -->",
    f"Generated by `{REPORT_COMMAND}` from the JSON files in `benchmarks/results/`; "
    "do not edit by hand. How the figures are taken and how to run the benchmarks: "
    "`benchmarks/README.md` in the repository. Compare figures within one table: "
    "ratios were taken within one run, and timings from different runs or machines are "
    "not comparable.",
  ]
  headlines = _headlines(loaded)
  if headlines:
    blocks += ["## Headlines", *headlines]

  sections: dict[str, list[str]] = {}
  titles: dict[str, str] = {}
  for name, (path, payload) in loaded.items():
    folder = name.split("/")[0] if "/" in name else None
    if folder is None:
      key = payload["benchmark"]
      titles[key] = f"`{key}`"
      doc = module_facts(_HERE / f"bench_{key}.py")[0]
      sections.setdefault(key, [f"{doc}" if doc else "", f"Module: `benchmarks/bench_{key}.py`."])
      sections[key] += _benchmark_section(path, payload, results_dir)
    else:
      key = folder.split("-")[0]
      title, module = _FOLDERS.get(key, (f"`{folder}`", None))
      titles[key] = title
      doc = module_facts(module)[0] if module else ""
      sections.setdefault(key, [doc] if doc else [])
      sections[key] += _folder_file_section(path, payload, results_dir)
  if sections:
    blocks.append("Sections: " + ", ".join(f"[{titles[k]}](#{_anchor(titles[k])})" for k in sorted(sections)) + ".")
  for key in sorted(sections):
    blocks.append(f"## {titles[key]}")
    blocks += [b for b in sections[key] if b]
  if not loaded:
    blocks.append(f"(no results in {results_dir})")
  return "\n\n".join(blocks) + "\n"


def _anchor(title: str) -> str:
  """GitHub's anchor of a heading."""
  text = "".join(c for c in title.lower() if c.isalnum() or c in " -_")
  return text.replace(" ", "-")


def write_report(path: pathlib.Path | None = None, results_dir: pathlib.Path | None = None) -> pathlib.Path:
  """Writes :func:`report` to ``path`` (default ``docs/benchmarks_report.md``)."""
  path = pathlib.Path(path or REPORT_PATH)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(report(results_dir))
  return path
