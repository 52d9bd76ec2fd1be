"""Runs README.md's quick start against an installed jmp_train (`make wheel-check`).

Usage: ``python -I .ci/quickstart_check.py README.md``, with the Python of an
environment where the wheel is installed, from a folder outside the
repository. The first ```python block under the "## Quick start" heading is
run as written; the script then checks that ``jmp_train`` was imported from
that environment's site-packages (not from a checkout) and that the step
reported its metrics.
"""

import math
import re
import sys
import sysconfig
from pathlib import Path


def quick_start(readme: str) -> str:
  """The first ```python block under the "## Quick start" heading."""
  match = re.search(r"^## Quick start\n(.*?)(?=^## |\Z)", readme, re.S | re.M)
  if not match:
    raise SystemExit("README.md has no '## Quick start' section.")
  block = re.search(r"^```python\n(.*?)^```", match.group(1), re.S | re.M)
  if not block:
    raise SystemExit("README.md's quick start has no ```python block.")
  return block.group(1)


def main(argv: list[str]) -> int:
  if len(argv) != 2:
    raise SystemExit(__doc__)
  code = quick_start(Path(argv[1]).read_text())
  namespace = {"__name__": "__quickstart__"}
  exec(compile(code, "README.md (quick start)", "exec"), namespace)

  import jmp_train  # the quick start imported it already

  site = Path(sysconfig.get_paths()["purelib"]).resolve()
  where = Path(jmp_train.__file__).resolve()
  if site not in where.parents:
    raise SystemExit(f"jmp_train was imported from {where}, not from this environment's {site}.")
  metrics = {k: float(v) for k, v in namespace["metrics"].items()}
  if not {"loss", "loss_scale", "skipped_steps", "grad_norm"} <= set(metrics):
    raise SystemExit(f"The quick start's metrics lack a key: {sorted(metrics)}.")
  if not math.isfinite(metrics["loss"]):
    raise SystemExit(f"The quick start's loss is not finite: {metrics['loss']}.")
  print(f"quick start OK: jmp_train {jmp_train.__version__} from {where.parent}")
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
