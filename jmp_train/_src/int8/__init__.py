"""INT8 as a format of the narrow products: the recipe and the products.

* ``recipe``: :class:`~jmp_train.int8.Int8Recipe` (no JAX import: policies read it).
* ``products``: INT8's format of the narrow products and the public products.

Calibration, quantized models and their export, which run a model under
:func:`~jmp_train.autocast`, are the ``deployment`` package's.
"""
