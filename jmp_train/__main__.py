"""``python -m jmp_train``: the ``jmp-train`` demo (:mod:`jmp_train.examples`)."""

import sys

from jmp_train.examples.cli import main

if __name__ == "__main__":
  sys.exit(main())
