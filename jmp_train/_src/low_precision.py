"""Half-precision weight updates without a float32 master copy.

In float16 (11 significant bits) or bfloat16 (8 bits) the sum ``w + u``
rounds back to ``w`` whenever ``|u|`` is below half a unit in the last place
of ``w`` (``|u| < |w|·2^-11`` in float16, ``|u| < |w|·2^-8`` in bfloat16):
small learning-rate steps vanish. Mixed-precision training therefore keeps a
float32 master copy of every weight (4 extra bytes per parameter). This
module offers three optax pieces that keep the weights in half precision and
still move them as a float32 update would:

* :func:`modified_momentum_sgd`: the momentum accumulates gradients, not
  learning-rate-scaled steps (Naruse, NVIDIA, "Training DL models fast and
  accurately with Volta Tensor Cores", 2017), so the buffer stays
  representable and the applied step is ``1/(1-m)`` times larger than a
  plain SGD step.
* :func:`kahan_compensation`: a per-parameter buffer holds what rounding
  dropped and adds it back at the next step (compensated summation).
* :func:`stochastic_rounding`: rounds the new weight up or down at random
  with probability proportional to the distance, so it is right on average.

Each lives in its own module (:mod:`jmp_train._src.modified_momentum`,
:mod:`jmp_train._src.kahan_compensation`,
:mod:`jmp_train._src.stochastic_rounding`); this module gathers them.
The last two are placed last in an ``optax.chain`` after any optimizer and
need ``params``; they rewrite the updates so that ``optax.apply_updates``
(which computes ``(p + u).astype(p.dtype)``) lands exactly on the chosen
half-precision value.
"""

from jmp_train._src.kahan_compensation import KahanCompensationState
from jmp_train._src.kahan_compensation import kahan_compensation
from jmp_train._src.modified_momentum import ModifiedMomentumState
from jmp_train._src.modified_momentum import modified_momentum_sgd
from jmp_train._src.stochastic_rounding import StochasticRoundingState
from jmp_train._src.stochastic_rounding import stochastic_rounding

__all__ = [
    "KahanCompensationState",
    "ModifiedMomentumState",
    "StochasticRoundingState",
    "kahan_compensation",
    "modified_momentum_sgd",
    "stochastic_rounding",
]
