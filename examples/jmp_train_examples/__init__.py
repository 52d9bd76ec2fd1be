"""The examples beside the library: the ``jmp-train`` demo and its parts.

A package of its own (``examples/pyproject.toml``), installed from the
clone with ``pip install './examples[full]'`` (``make install`` does it);
jmp_train's wheel does not contain it.

* :mod:`jmp_train_examples.cli`: the ``jmp-train`` command (``python -m
  jmp_train_examples`` runs it too).
* :mod:`jmp_train_examples.demo`: runs the configurations it trains and
  compares (:mod:`~jmp_train_examples.demo_configs`), on its tasks
  (:mod:`~jmp_train_examples.demo_tasks`), one row at a time
  (:mod:`~jmp_train_examples.demo_training`);
  :mod:`jmp_train_examples.demo_plot` draws its figure.
* :mod:`jmp_train_examples.data`: small data sets that need no download (the
  Python standard library's source as a character corpus; scikit-learn's
  8x8 digits).
* :mod:`jmp_train_examples.models`: example Flax models (MLP, ResNet,
  Transformer: ``models.mlp``, ``models.resnet``, ``models.transformer``),
  each in linen and NNX with the same variables, and a GPT-style decoder
  from about 125M to 1.5B parameters (``models.gpt``, linen).
* :mod:`jmp_train_examples.half_weights`: the half-precision weight-update
  experiment behind the benchmarks and notebook 03 (its setups in
  :mod:`~jmp_train_examples.half_weights_setups`).
* :mod:`jmp_train_examples.processes`: starts the local processes of a
  ``jax.distributed`` job (the demo's ``--num-processes``, the multi-process
  benchmark, the tests' workers) and stops them together when one fails.
* :mod:`jmp_train_examples.checkpoint_lock`: one run at a time per
  ``--checkpoint-dir``; :mod:`jmp_train_examples.stopping`: SIGTERM as a
  safe stop.

The library (``jmp_train``, ``jmp_train.flax``, ``jmp_train.diagnostics``)
imports nothing from here; these modules use its public names.
"""
