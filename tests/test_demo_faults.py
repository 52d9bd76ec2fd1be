"""Faults around ``jmp-train --num-processes 2 --checkpoint-dir D``, each with its fix.

* a worker that stops answering (SIGSTOP) ends the run within a minute,
  named in one line, its peer's native stack left out;
* a second run on the same checkpoint folder is refused at once (exit 2);
* workers end with their launcher (SIGKILL to it) and remove its folder;
* a row whose loss is not finite fails the run after everything is written;
* ``results.json`` is replaced whole or not at all;
* a resume under another ``--num-processes`` is refused.

The two multi-process runs (real ``jmp-train`` processes on 127.0.0.1, the
digits MLP, ``--quick``) overlap: the second starts while the first waits
for its stopped worker's heartbeats, and reads the programs the first
compiled from a compilation cache.
"""

from __future__ import annotations

import concurrent.futures
import errno
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import pytest


from helpers import processes
from jmp_train_examples import checkpoint_lock
from jmp_train_examples import cli
from jmp_train_examples import demo
from jmp_train_examples.processes import Finished, run_processes

ROOT = pathlib.Path(__file__).resolve().parents[1]

# What the survivor of a SIGSTOP printed (jax 0.11, abridged): its error, then
# the native stack of the abort.
_PEER_STOPPED_LOG = """\
E1128 04:04:18.075225   20770 coordination_service.cc:1549] Use error polling to propagate \
the following error to all tasks: UNAVAILABLE: The following tasks are unhealthy (stopped \
sending heartbeats):
1
The tasks have crashed. Check the task logs for an earlier error.
F1128 04:04:18.076409   20781 client.h:80] Terminating process because the JAX distributed \
service detected fatal errors. absl::Status: UNAVAILABLE: The following tasks are unhealthy \
(stopped sending heartbeats):
1
The tasks have crashed.
TimeoutError: Timed out while waiting for async_write_complete barrier.
*** Check failure stack trace: ***
    @     0x7f594dc40634  absl::lts_20260107::log_internal::LogMessage::SendToLog()
    @     0x7f5949d040ee  xla::CoordinationServiceAgent::SetError()
"""
# Process 1's output when process 0 (the coordinator's host) was stopped.
_COORDINATOR_STOPPED_LOG = """\
F1128 04:06:09.383788   22104 client.h:80] Terminating process because the JAX distributed \
service detected fatal errors. absl::Status: DEADLINE_EXCEEDED: Deadline Exceeded

RPC: /xla.coordination.CoordinationService/Heartbeat
*** Check failure stack trace: ***
    @     0x7f5949d040ee  xla::CoordinationServiceAgent::SetError()
"""


# --- the launcher, with small real processes ------------------------------------------


def test_a_stopped_process_is_killed_soon_after_its_peer_failed():
  started = time.monotonic()
  results = run_processes(
    [
      [sys.executable, "-c", "import sys, time; time.sleep(0.3); sys.exit(3)"],
      [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSTOP)"],
    ],
    os.environ,
    timeout=30,
    grace_s=1,
  )
  assert time.monotonic() - started < 10
  assert results == [(3, ""), (-signal.SIGKILL, "")]
  assert [r.ended for r in results] == [False, True]


def test_the_unresponsive_process_is_named_in_one_line_without_stack_frames(monkeypatch, capsys):
  for logs, named in (((_PEER_STOPPED_LOG, ""), 1), (("", _COORDINATOR_STOPPED_LOG), 0)):
    survivor = 1 - named
    results = [None, None]
    results[survivor] = Finished(-signal.SIGABRT, logs[survivor])
    results[named] = Finished(-signal.SIGKILL, "", ended=True)
    monkeypatch.setattr(demo, "run_processes", lambda commands, env, r=results, **kw: r)
    with pytest.raises(demo.DemoError) as e:
      demo._run_processes(demo.DemoSettings(num_processes=2), ["8dev-f32"], [])
    assert str(e.value) == (
      f"process {named} of 2 stopped responding (alive but not answering: process "
      f"{survivor} gave up on its heartbeats and stopped, it did not); the launcher "
      "killed it"
    )
    # One line per process, from its output.
    lines = {
      survivor: f"aborted (SIGABRT): jax.distributed lost its heartbeats from process {named}",
      named: "still running after another process had stopped: killed by the launcher",
    }
    assert capsys.readouterr().err.splitlines() == [f"process {pid} of 2: {lines[pid]}" for pid in range(2)]
  # A failure of its own is its error line, never a stack frame.
  assert demo._failure_line(_PEER_STOPPED_LOG) == (
    "TimeoutError: Timed out while waiting for async_write_complete barrier."
  )


# --- the checkpoint folder's lock -----------------------------------------------------


def _dead_pid() -> int:
  p = subprocess.Popen([sys.executable, "-c", ""])
  p.wait()
  return p.pid


def test_a_stale_lock_is_taken_over_and_one_from_another_host_is_not(tmp_path, capsys):
  lock = tmp_path / checkpoint_lock.LOCK_NAME
  pid = _dead_pid()
  lock.write_text(json.dumps({"pid": pid, "host": socket.gethostname()}))
  with checkpoint_lock.hold(tmp_path) as fd:
    assert checkpoint_lock.held_fd(tmp_path) == fd
    assert json.loads(lock.read_text())["pid"] == os.getpid()
  assert f"the run that held it (pid {pid} on host {socket.gethostname()}) is no longer running" in (
    capsys.readouterr().err
  )
  assert not lock.exists() and checkpoint_lock.held_fd(tmp_path) is None
  lock.write_text(json.dumps({"pid": 1, "host": "elsewhere"}))
  with pytest.raises(
    checkpoint_lock.CheckpointDirBusy,
    match=(f"locked by a run on another host .pid 1 on host elsewhere.*delete {lock}"),
  ):
    with checkpoint_lock.hold(tmp_path):
      pass


# --- results: failed rows, atomic writes ------------------------------------------------


def test_a_row_whose_loss_is_not_finite_fails_the_run_after_everything_is_written(tmp_path, capsys):
  pytest.importorskip("sklearn")
  code = cli.main(
    [
      "--quick",
      "--task",
      "digits",
      "--no-progress",
      "--no-plot",
      "--configs",
      "f16",
      "--lr",
      "1e8",
      "--steps",
      "2",
      "--out",
      str(tmp_path),
    ]
  )
  out, err = capsys.readouterr()
  assert code == 1, err
  (row,) = json.loads((tmp_path / "results.json").read_text())["rows"]
  assert row["failed"] == "loss is not finite"
  header, _, line = out.splitlines()[:3]
  assert header.rstrip(" |").endswith("failed") and "loss is not finite" in line
  assert err.splitlines()[-1].startswith(
    "jmp-train: error: configuration 'f16' failed: loss is not finite (train_loss nan"
  )


def test_results_json_is_replaced_whole_or_not_at_all(tmp_path, monkeypatch):
  path = tmp_path / "results.json"
  demo.write_atomic(path, '{"old": 1}\n')
  umask = os.umask(0o022)
  os.umask(umask)
  assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # as a plain open() would make it

  def full_disk(fd):
    raise OSError(errno.ENOSPC, "No space left on device")

  monkeypatch.setattr(os, "fsync", full_disk)
  with pytest.raises(
    demo.DemoError, match=(f"cannot write {path}: No space left on device; the previous file is unchanged")
  ):
    demo.write_atomic(path, '{"new": 2, "much": "' + "x" * 100_000 + '"}\n')
  assert path.read_text() == '{"old": 1}\n'
  assert os.listdir(tmp_path) == ["results.json"]


# --- two real --num-processes 2 runs --------------------------------------------------


def _alive(pid: int) -> bool:
  """Whether ``pid`` runs: a zombie whose threads have all ended does not."""
  try:
    status = dict(
      line.split(":", 1) for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line
    )
  except OSError:
    return False
  return not (status["State"].strip().startswith("Z") and int(status["Threads"]) <= 1)


def _wait_for_gone(pids, timeout: float) -> float | None:
  """Seconds until none of ``pids`` runs; ``None`` if some still run after ``timeout``."""
  start = time.monotonic()
  while any(_alive(pid) for pid in pids):
    if time.monotonic() - start > timeout:
      return None
    time.sleep(0.1)
  return time.monotonic() - start


def _wait_for_launcher(launcher: subprocess.Popen, since: float):
  """``(stderr, exit status, seconds since since)`` once ``launcher`` ends; ``("", None, None)`` after 90 s."""
  try:
    err = launcher.communicate(timeout=90)[1]
  except subprocess.TimeoutExpired:
    return "", None, None
  return err, launcher.returncode, time.monotonic() - since


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
  """Two ``--num-processes 2`` runs and their faults, the second while the first winds down.

  ``stopped``: a second run is started on its checkpoint folder, then its
  worker 1 is stopped (SIGSTOP). While its worker 0 waits out its
  heartbeat timeout, ``killed`` starts (reading the programs ``stopped``
  compiled from the cache) and its launcher is killed (SIGKILL) once it
  trains. Returns what was seen; every process started here ends.
  """
  if not os.path.isdir("/proc"):
    pytest.skip("finds the workers in /proc")
  cache = processes.demo_cache(tmp_path_factory)
  runs, seen = {}, {}

  def start(name, every):
    tmp = tmp_path_factory.mktemp(name)
    flags = ["--steps", "3000", "--checkpoint-dir", str(tmp / "ckpt"), "--checkpoint-every", every]
    runs[name] = (tmp, processes.start_demo(*flags, "--out", str(tmp / "out"), tmp=tmp, cache=cache))
    return processes.wait_for_training(runs[name][1], tmp / "ckpt")

  try:
    stopped_workers = start("stopped", "2")
    tmp, launcher = runs["stopped"]
    second = processes.start_demo("--checkpoint-dir", str(tmp / "ckpt"), "--out", str(tmp / "out2"), tmp=tmp)
    try:
      seen["second"] = (second.communicate(timeout=30)[1], second.returncode)
    except subprocess.TimeoutExpired:
      second.kill()
      seen["second"] = (second.communicate()[1], None)

    os.kill(stopped_workers[1], signal.SIGSTOP)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
      stopped = pool.submit(_wait_for_launcher, launcher, time.monotonic())
      killed_workers = start("killed", "5")
      seen["killed_folders"] = list((runs["killed"][0] / "tmp").glob("jmp_train_mp_*"))
      runs["killed"][1].kill()
      runs["killed"][1].wait()
      seen["killed_workers_gone_s"] = _wait_for_gone(killed_workers.values(), 40)
      seen["stopped"] = stopped.result()
    seen["stopped_workers_gone_s"] = _wait_for_gone(stopped_workers.values(), 5)
    yield runs, seen
  finally:
    for tmp, launcher in runs.values():
      for pid in [launcher.pid, *processes.worker_pids(str(tmp / "ckpt")).values()]:
        try:
          os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
          pass
      launcher.communicate()


@pytest.mark.slow
def test_workers_end_with_a_killed_launcher_and_remove_its_folder(faults, capsys):
  runs, seen = faults
  tmp, launcher = runs["killed"]
  (folder,) = seen["killed_folders"]
  assert folder.name.startswith(f"jmp_train_mp_{launcher.pid}_")
  assert seen["killed_workers_gone_s"] is not None, "workers outlived their launcher"
  assert not list((tmp / "tmp").glob("jmp_train_mp_*"))
  # The lock the launcher left is taken over by the next run, with a note.
  with checkpoint_lock.hold(tmp / "ckpt"):
    pass
  assert f"(pid {launcher.pid} on host {socket.gethostname()}" in capsys.readouterr().err


@pytest.mark.slow
def test_a_second_run_on_the_same_checkpoint_folder_is_refused_at_once(faults):
  runs, seen = faults
  tmp, launcher = runs["stopped"]
  err, code = seen["second"]
  assert code == 2, err[-3000:]
  since = err.split(", since ")[1].split(")")[0]
  assert err.strip() == (
    f"jmp-train: error: --checkpoint-dir {tmp / 'ckpt'} is in use by another jmp-train run "
    f"(pid {launcher.pid} on host {socket.gethostname()}, since {since}); wait for it to "
    "finish, or pass another --checkpoint-dir"
  )


@pytest.mark.slow
def test_a_stopped_worker_ends_the_run_within_a_minute_named_in_one_line(faults):
  runs, seen = faults
  tmp, _ = runs["stopped"]
  err, code, elapsed = seen["stopped"]
  assert code == 1, err[-3000:]
  assert elapsed < 60, elapsed
  lines = err.strip().splitlines()
  assert lines[-1] == (
    "jmp-train: error: process 1 of 2 stopped responding (alive but not answering: process 0 "
    "gave up on its heartbeats and stopped, it did not); the launcher killed it"
  ), err[-3000:]
  assert len(lines) <= 3 and not [line for line in lines if "@ 0x" in line], err[-3000:]
  assert seen["stopped_workers_gone_s"] is not None
  assert not list((tmp / "tmp").glob("jmp_train_mp_*"))
  assert not (tmp / "ckpt" / checkpoint_lock.LOCK_NAME).exists()


@pytest.mark.slow
def test_a_checkpoint_of_two_processes_is_not_resumed_by_one(faults, capsys):
  runs, _ = faults
  ckpt = runs["stopped"][0] / "ckpt"
  code = cli.main(
    [
      "--quick",
      "--task",
      "digits",
      "--no-progress",
      "--no-plot",
      "--configs",
      "8dev-f32",
      "--steps",
      "3000",
      "--checkpoint-dir",
      str(ckpt),
      "--out",
      str(runs["stopped"][0] / "out3"),
    ]
  )
  err = capsys.readouterr().err
  assert code == 1, err
  assert err.strip().splitlines()[-1] == (
    f"jmp-train: error: the checkpoint of '8dev-f32' in {ckpt / '8dev-f32'} was written by "
    "2 process(es) (--num-processes 2); this run has 1, and would not continue bit for bit "
    "(the cross-process sums add in another order); rerun with --num-processes 2, or pass "
    "another --checkpoint-dir."
  )
