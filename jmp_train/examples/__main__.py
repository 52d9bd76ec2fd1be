"""``python -m jmp_train.examples``: the ``jmp-train`` demo."""

import sys

from jmp_train.examples.cli import main

if __name__ == "__main__":
  sys.exit(main())
