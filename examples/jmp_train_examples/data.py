"""Real data that is on every machine without a download.

* :func:`load_text_corpus`: the Python standard library's own source code,
  as bytes, for character-level language models; :func:`text_windows` and
  :func:`char_lm_batches` cut it into ``(inputs, targets)`` windows.
* :func:`load_digits`: the 8x8 handwritten digits that ship inside
  scikit-learn (1,797 images; optional dependency).
"""

from __future__ import annotations

import pathlib
import sysconfig
from typing import Iterator, NamedTuple

import numpy as np

__all__ = [
  "Dataset",
  "load_text_corpus",
  "load_digits",
  "text_windows",
  "char_lm_batches",
  "TEXT_VOCAB_SIZE",
]

# Byte-level vocabulary: fixed, and a multiple of 8 for Tensor Cores.
TEXT_VOCAB_SIZE = 256

# Fixed, version-stable stdlib modules so the corpus is deterministic.
_CORPUS_MODULES = (
  "argparse.py",
  "ast.py",
  "base64.py",
  "bisect.py",
  "calendar.py",
  "collections/__init__.py",
  "configparser.py",
  "contextlib.py",
  "copy.py",
  "csv.py",
  "dataclasses.py",
  "datetime.py",
  "decimal.py",
  "difflib.py",
  "enum.py",
  "fractions.py",
  "functools.py",
  "glob.py",
  "gzip.py",
  "heapq.py",
  "inspect.py",
  "json/decoder.py",
  "json/encoder.py",
  "logging/__init__.py",
  "pathlib.py",
  "pickle.py",
  "pprint.py",
  "random.py",
  "shutil.py",
  "statistics.py",
  "string.py",
  "subprocess.py",
  "tarfile.py",
  "textwrap.py",
  "threading.py",
  "typing.py",
  "zipfile.py",
)


class Dataset(NamedTuple):
  """A train/test split of arrays."""

  x_train: np.ndarray
  y_train: np.ndarray
  x_test: np.ndarray
  y_test: np.ndarray


def load_text_corpus(max_bytes: int | None = 2_000_000) -> np.ndarray:
  """Returns the standard library's source as a ``uint8`` array of bytes.

  Args:
    max_bytes: keep at most this many bytes (``None``: all of it).

  Returns:
    A 1-D ``uint8`` array; tokens are bytes (vocabulary 256).

  Raises:
    ValueError: if ``max_bytes`` is not positive or no source is found.
  """
  if max_bytes is not None and max_bytes <= 0:
    raise ValueError(f"max_bytes must be positive or None, got {max_bytes}.")
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  chunks, total = [], 0
  for name in _CORPUS_MODULES:
    path = root / name
    if not path.is_file():
      # Modules turned into packages across Python versions (pathlib in 3.13).
      path = root / name.replace(".py", "") / "__init__.py"
      if not path.is_file():
        continue
    data = path.read_bytes()
    chunks.append(data)
    total += len(data)
    if max_bytes is not None and total >= max_bytes:
      break
  if not chunks:
    raise ValueError(f"No standard-library source found under {root}.")
  corpus = np.frombuffer(b"".join(chunks), dtype=np.uint8)
  return corpus[:max_bytes] if max_bytes is not None else corpus


def text_windows(corpus: np.ndarray, rng: np.random.Generator, n: int, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
  """``n`` windows of ``corpus`` at random positions, targets shifted by 1.

  The ``n`` start positions come from one ``rng.integers`` call: generators
  seeded alike cut the same windows.

  Args:
    corpus: 1-D integer array of tokens, longer than ``seq_len + 1``.
    rng: the generator the start positions are drawn from.
    n: windows to cut.
    seq_len: tokens per window.

  Returns:
    ``(inputs, targets)``: ``int32`` arrays of shape ``(n, seq_len)``.

  Examples:
    >>> corpus = np.arange(100, dtype=np.uint8)
    >>> x, y = text_windows(corpus, np.random.default_rng(0), 4, 8)
    >>> x.shape, bool((y[:, :-1] == x[:, 1:]).all())
    ((4, 8), True)
  """
  starts = rng.integers(0, len(corpus) - seq_len - 1, size=n)
  window = corpus[starts[:, None] + np.arange(seq_len + 1)].astype(np.int32)
  return window[:, :-1], window[:, 1:]


def char_lm_batches(
  corpus: np.ndarray, batch_size: int, seq_len: int, seed: int = 0
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
  """Yields ``(inputs, targets)`` windows of ``corpus``, targets shifted by 1.

  Args:
    corpus: 1-D integer array of tokens.
    batch_size: windows per batch.
    seq_len: tokens per window.
    seed: seed of the window positions (deterministic stream).

  Yields:
    ``int32`` arrays of shape ``(batch_size, seq_len)``.
  """
  if corpus.ndim != 1 or len(corpus) <= seq_len + 1:
    raise ValueError(f"corpus must be 1-D and longer than seq_len + 1 = {seq_len + 1}, got shape {corpus.shape}.")
  rng = np.random.default_rng(seed)
  while True:
    yield text_windows(corpus, rng, batch_size, seq_len)


def load_digits(test_fraction: float = 0.2, seed: int = 0) -> Dataset:
  """The 8x8 digits shipped with scikit-learn, as float32 in [0, 1].

  Args:
    test_fraction: share of the 1,797 images held out for testing.
    seed: seed of the (stratification-free) shuffle.

  Returns:
    A :class:`Dataset` with ``x`` of shape ``(n, 64)`` float32 and ``y``
    int32 labels in 0..9.

  Raises:
    ImportError: with an install hint, if scikit-learn is missing.
  """
  try:
    from sklearn import datasets
  except ImportError as e:
    raise ImportError("load_digits needs scikit-learn: pip install 'jmp_train_examples[full]'") from e
  if not 0.0 < test_fraction < 1.0:
    raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}.")
  digits = datasets.load_digits()
  x = (digits.data / 16.0).astype(np.float32)
  y = digits.target.astype(np.int32)
  order = np.random.default_rng(seed).permutation(len(x))
  x, y = x[order], y[order]
  n_test = int(round(len(x) * test_fraction))
  return Dataset(x[n_test:], y[n_test:], x[:n_test], y[:n_test])
