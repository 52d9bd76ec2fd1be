"""``python -m jmp_train_examples``: the ``jmp-train`` demo."""

import sys

from jmp_train_examples.cli import main

if __name__ == "__main__":
  sys.exit(main())
