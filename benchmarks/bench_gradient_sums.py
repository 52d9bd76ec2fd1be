"""Whether the backend sums half-precision gradients over the batch in float32.

Under a mixed policy the backward pass sums per-token contributions into
each parameter's gradient: a matmul for a ``Dense`` kernel, a reduction
(the transpose of a broadcast) for its bias, a scatter-add for an embedding
table. A sum run in float16 or bfloat16 keeps few bits once it holds
thousands of same-signed terms. For ``N`` tokens per step (one batch each)
it compares each gradient with the float32 sum of the same cotangents
rounded to the compute dtype (so that only the summation differs):

* ``dense/kernel``, ``dense/bias``: ``nn.Dense(64)`` under
  ``apply_policy``;
* ``embed``: ``nn.Embed(64, 64)`` under ``apply_policy`` (float32 lookups);
* ``flax_embed_half``: Flax's own ``nn.Embed(64, 64, dtype=half)``, which
  gathers, and so sums, in the half dtype: the contrast.

``rel_err`` is ``||g - g32|| / ||g32||``; a sum in float32 rounded once to
the result's dtype stays near that dtype's half ulp (``2**-11`` float16,
``2**-8`` bfloat16) for the bias and kernel of a float32 parameter, 0 for a
float32 table. The cotangents are same-signed on average (mean 0.3,
standard deviation 1), as a frequent token's or a bias's are. Run it on
each backend: XLA:CPU and XLA:GPU choose their accumulators themselves.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import jmp_train
import jmp_train.flax

NAME = "gradient_sums"
COLUMNS = ("policy", "tokens_per_step", "gradient", "rel_err")
FEATURES = 64


def _relative_errors(policy: str, n: int) -> dict[str, float]:
  half = jmp_train.get_policy(policy).compute_dtype
  keys = jax.random.split(jax.random.key(n), 3)
  x = jax.random.normal(keys[0], (n, FEATURES))
  ids = jax.random.randint(keys[1], (n,), 0, FEATURES)
  cotangent = (0.3 + jax.random.normal(keys[2], (n, FEATURES))) / n
  rounded = cotangent.astype(half).astype(jnp.float32)
  grad = jax.jit(
    jax.grad(lambda p, model, inputs, ct: jnp.sum(model.apply({"params": p}, inputs).astype(jnp.float32) * ct)),
    static_argnums=1,
  )
  out = {}
  for name, model, reference, inputs in [
    ("dense", jmp_train.flax.apply_policy(nn.Dense(FEATURES), policy), nn.Dense(FEATURES), x),
    ("embed", jmp_train.flax.apply_policy(nn.Embed(FEATURES, FEATURES), policy), nn.Embed(FEATURES, FEATURES), ids),
    ("flax_embed_half", nn.Embed(FEATURES, FEATURES, dtype=half), nn.Embed(FEATURES, FEATURES), ids),
  ]:
    params = reference.init(jax.random.key(0), inputs)["params"]
    exact = jax.device_get(grad(params, reference, inputs, rounded))
    got = jax.device_get(grad(params, model, inputs, cotangent))
    for leaf in exact:
      a, b = (np.asarray(t[leaf], np.float64) for t in (got, exact))
      label = name if leaf == "embedding" else f"{name}/{leaf}"
      out[label] = float(np.linalg.norm(a - b) / np.linalg.norm(b))
  return out


def run(quick: bool) -> list[dict[str, Any]]:
  tokens = (64,) if quick else (2048, 16384, 131072, 1048576)
  records = []
  for policy in ("mixed_float16", "mixed_bfloat16"):
    for n in tokens:
      for gradient, err in _relative_errors(policy, n).items():
        records.append({"policy": policy, "tokens_per_step": n, "gradient": gradient, "rel_err": err})
  return records
