"""Implementation of jmp_train. The public surface is ``jmp_train``."""
