r"""1-bit Adam and 1-bit momentum SGD: the momentum, not the gradient, is compressed.

Why not compress the gradients in front of the optimizer
--------------------------------------------------------
:func:`jmp_train.sign_compression` chained *before* an optimizer averages the
replicas' gradients with 1-bit error feedback. With the worker residual
``r`` (the server residual adds a second, similar term), the optimizer sees

.. math::
  \hat g_t = \bar g_t + r_{t-1} - r_t ,

the true average plus what the quantizer held back at the previous step,
minus what it holds back now: part of every gradient reaches the optimizer
one or more steps late.

* Adam's second moment is not linear in its input: the error enters ``v``
  squared and never leaves it (Tang et al., 2021).
* Momentum SGD is linear, and the residual is conserved exactly and stays
  bounded, yet it is the *delay* that hurts: at the learning rates where
  momentum SGD trains fastest, it runs beyond plain SGD's stability limit
  (the heavy ball is stable up to ``lr·λ < 2(1+m)``, plain SGD up to
  ``lr·λ < 2``) and a gradient applied a step late destabilises it. The
  delayed part is then integrated by the momentum for ``~1/(1-m)`` steps.

So the divergence is inherent to error feedback on gradients in front of
momentum, not a defect of the compressor. The evidence (digits MLP, 8
replicas, momentum 0.9; ``benchmarks/bench_one_bit_convergence.py``, study
``momentum_lr``): both residuals stay bounded at every learning rate,
diverging runs included; exact momentum SGD fed the *exact* average
gradient one step late fails at the learning rates where gradient
compression fails, while the undelayed one trains; at those learning
rates, dropping the second delay stage (the server residual) helps, though
it costs accuracy at small ones; and per-tensor RMS scales
(``scale="l2"``) hold back more than ``"column"`` and fail earlier.

Compressing the momentum (1-bit Adam)
-------------------------------------
Each replica updates the momentum with its *own* gradient and the momentum
goes through the 1-bit exchange; its average replaces the momentum on every
replica. With ``K`` replicas, local gradient :math:`g_j` and the compressed
average :math:`C(\cdot)` (worker + server error feedback):

.. math::
  m_j = \beta_1 m + (1-\beta_1) g_j, \qquad m \leftarrow C(m_1, \dots, m_K).

The error per step is not smaller than with gradient compression (the
momentum is the larger vector), but what the residual holds back is now
part of the momentum, a slowly varying average, so releasing it a step
late barely changes the trajectory; no gradient arrives late.

1-bit Adam (Tang et al., 2021; DeepSpeed's ``OnebitAdam``):

* **warm-up** (``count < warmup_steps``): exact Adam on the ``pmean`` of the
  gradients (a float all-reduce), ``v`` updated as usual;
* **after**: ``v`` is frozen; the update is
  :math:`-\eta_t\,(\mathrm{clip}_B(\hat m / (\sqrt{\hat v} + \epsilon)) + \lambda p)`
  with ``m`` from the compressed exchange (decoupled weight decay, AdamW).

With ``clip_step=True`` (the default; ``False`` is the paper's identity)
``clip_B`` clips each element to
:math:`B = \max((1-\beta_1)/\sqrt{1-\beta_2}, 1)`, the bound Kingma & Ba
give for an Adam step (Sec. 2.1: its size after a lone gradient spike).
Exact Adam, whose ``v`` follows the gradients, does not exceed it. A
frozen ``v`` can: where the gradients outgrow their warm-up size, or where
``v`` is tiny and ``m`` carries the 1-bit exchange's error, the step
``m/(sqrt(v)+eps)`` grows without a limit, and one such step can throw
the weights out of a minimum. The clip applies to every step after
warm-up, refreshes included: with a clip between refreshes only, ``m``
keeps the size of gradients the clipped steps did not follow, and the
first refresh, with a smaller ``v``, took the whole step at once
(``benchmarks/README.md``, ``one_bit_optimizers``).

For elements whose frozen ``v`` is zero (the weights of an input that is
always zero, an embedding row not seen during warm-up) a later gradient
would step by ``m/eps``: they keep ``m = 0`` (DeepSpeed asks the user for
such an ``exp_avg_mask``; here it comes from ``v``). Where ``v`` is tiny
but not zero, ``m/(sqrt(v)+eps)`` still amplifies the quantization error
of ``m``; ``exchange="preconditioned"`` exchanges ``m / d`` instead, with
the frozen preconditioner ``d = sqrt(v_hat) + eps`` (the same on every
replica, so the average is unchanged), and multiplies back: the 1-bit
scales and residuals are then those of the *update*. Each element of
``m / d`` is first clipped to ``±(1-β1^t)·max((1-β1)/sqrt(1-β2), 1)``,
the bound Kingma & Ba give for an Adam step (Sec. 2.1: its size after a
lone gradient spike): a stale ``v`` cannot make a larger step, and a few
elements with a tiny ``v`` cannot set the scales of the rest (without the
clip, one digits run with refreshes 250 steps apart diverged). The default,
``exchange="momentum"``, exchanges ``m`` itself, as in the paper; on the
digits benchmark it did at least as well.

Bias corrections follow ``optax.adamw``: :math:`\hat m = m/(1-\beta_1^t)`;
the frozen :math:`\hat v = v/(1-\beta_2^{W})` with ``W = warmup_steps``. Run
with ``warmup_steps`` past the last step, the optimizer is
``optax.adamw`` on the averaged gradients.

Refreshing the second moment (0/1 Adam)
---------------------------------------
A ``v`` frozen early is the size of the early, large gradients: as they
shrink, every later step is smaller than Adam's. 0/1 Adam (Lu et al., 2022)
updates ``v`` on a sparse set of steps instead. ``variance_refresh=k``
(default 0: frozen, no float all-reduce after warm-up) makes every
``k``-th step after warm-up an *exact* step: the gradients are averaged
with a float all-reduce (as in warm-up), ``m`` takes the exact average and
``v`` takes it for the ``k`` steps since the last refresh,

.. math::
  v \leftarrow \beta_2^k v + (1-\beta_2^k)\,\bar g^2,

what ``k`` Adam steps with that gradient would give (the bias correction
then counts the steps ``v`` stands for: ``W`` plus the steps up to the last
refresh). Elements whose ``v`` is 0 at the freeze stay still (a refresh
gives them a tiny ``v`` that would amplify the quantization error of
``m``). The residuals are left as they are on those steps. The other
steps are 1-bit; a step's bytes on the wire average
``(1/k)·float + (1-1/k)·1-bit``. Pair refreshes with ``clip_step=True`` or
``exchange="preconditioned"``: a refreshed ``v`` is smaller, and with
``exchange="momentum"`` alone the per-tensor quantization error of ``m`` is
divided by each element's own ``sqrt(v)``, without a bound.

Following the gradients' size with one float per tensor
--------------------------------------------------------
Most of what a frozen ``v`` costs is its *size*: on a task whose
gradients shrink tenfold after warm-up, every later step is held back by
the early gradients. ``rescale_variance=True`` (the default; ``False``
keeps the paper's frozen ``v``) keeps the frozen ``v`` as
the pattern across each tensor's elements and lets its size follow the
gradients. Each replica takes its gradient's mean square over each tensor
``ℓ``; their ``pmean`` (one float per tensor, all tensors in one
all-reduce) feeds a running average with Adam's own decay and bias
correction,

.. math::
  s_\ell \leftarrow \beta_2 s_\ell + (1-\beta_2)\,\frac{1}{K}\sum_j
  \operatorname{mean}(g_{j,\ell}^2),\qquad
  \hat v_\ell = \frac{v_\ell}{1-\beta_2^{W}}\cdot
  \frac{s_\ell / (1-\beta_2^{t})}{s_{\ell,f} / (1-\beta_2^{W})},

where :math:`s_{\ell,f}` is ``s`` at the last step that updated ``v`` (the
end of warm-up, or the last refresh; ``W`` counts the steps ``v`` stands
for). Where each tensor's squared gradients change by one factor over time,
this is exactly Adam's ``v``. ``s`` averages the replicas' local squares, so it
also counts the gradients' noise between replicas; its ratio cancels that
where the noise keeps its share. The replicas' ``s`` agree, as ``m`` and ``v`` do;
the bytes per step grow by four per tensor. Pair it with ``clip_step=True``:
without the clip, a ``v`` that follows shrinking gradients lets the
1-bit exchange's error of ``m`` through at full size (on the digits
benchmark, single runs without the clip ended 56–78% above Adam's loss).

1-bit momentum SGD does the same with the momentum (trace) of
``optax.sgd(learning_rate, momentum)``: ``m_j = μ m + g_j``, the update is
:math:`-\eta_t\, C(m_1..m_K)`; with ``nesterov=True`` it is
:math:`-\eta_t\,((1+\mu) m_{new} - \mu m_{old})`, which equals
``g + μ m_new`` when the exchange is exact.

The switch is a ``lax.cond`` on the step counter, identical on every replica:
after warm-up the compiled step runs no float all-reduce of gradient size
(check with :func:`jmp_train.collective_bytes`: the float all-reduce lives
only in the warm-up branch; with ``warmup_steps=0`` there is no branch).

State and replicas
------------------
``mu``/``nu`` (``trace``) are identical on every replica (replicated,
``P()`` under ``shard_map``); the residuals inside ``compression`` are per
replica (``P(axis_name)``): :func:`jmp_train.sign_compression_specs` gives
the specs of the whole state. The residuals survive checkpoints (unlike
DeepSpeed, which resets them on load); they depend on the replica count,
and ``update`` raises ``ValueError`` on a state made for another count.
The moments are kept in float32; updates come out in the gradients' dtypes.

References:
  Tang, Gan, Awan, Rajbhandari, Li, Lian, Liu, Zhang, He, "1-bit Adam:
  Communication Efficient Large-Scale Training with Adam's Convergence
  Speed", ICML 2021. https://arxiv.org/abs/2102.02888

  Karimireddy, Rebjock, Stich, Jaggi, "Error Feedback Fixes SignSGD and
  other Gradient Compression Schemes", ICML 2019.
  https://arxiv.org/abs/1901.09847
"""

from jmp_train._src.one_bit_adam import OneBitAdamState, one_bit_adam
from jmp_train._src.one_bit_momentum import OneBitMomentumState, one_bit_momentum

__all__ = [
    "OneBitAdamState",
    "OneBitMomentumState",
    "one_bit_adam",
    "one_bit_momentum",
]
