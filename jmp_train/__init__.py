"""jmp_train: mixed-precision training and 1-bit data parallelism for JAX.

The public surface, re-exported from ``jmp_train._src``. Flax glue lives in
``jmp_train.flax``; diagnostics in ``jmp_train.diagnostics``.
"""

__version__ = "0.1.0"

# --- dtype policies (issue 2) ---
from jmp_train._src.policy import Policy
from jmp_train._src.policy import cast_floating
from jmp_train._src.policy import get_policy
from jmp_train._src.policy import half_dtype

# --- loss scaling (issue 3) ---

# --- half-precision weight updates (issue 4) ---

# --- 1-bit SGD with error feedback (issue 5) ---

# --- train-step builder (issue 7) ---

__all__ = (
    "Policy",
    "cast_floating",
    "get_policy",
    "half_dtype",
)
