"""Byte-level text corpus for the MoE language-model training run (pure NumPy, host only).

The corpus is a flat ``uint8`` array: the bytes of a list of files, concatenated in order with a
``\\n`` between files. Tokens are the byte values (vocabulary size 256).

* :func:`corpus_files` -- which files: by default the ``.py`` sources of the Python standard
  library (real text on every machine with Python, no download), else the user's ``--data``
  (a file, a directory or a glob pattern). Always in a deterministic, sorted order.
* :func:`load_corpus` -- reads those files lazily, in order, up to ``max_bytes``.
* :func:`split_corpus` -- the held-out eval slice is the *last* ``eval_fraction`` of the bytes.
* :func:`train_batch` -- batch ``step`` as a pure function of ``step``: batches stream through the
  corpus in file order (so the routing really changes over time: tests, docs, C-like code...), and
  a resumed run sees exactly the same batches as an uninterrupted one.
* :func:`eval_batches` -- fixed, non-overlapping windows from the start of the eval slice.

Every batch is int32 ``[batch_size, seq_len + 1]``: the model reads ``batch[:, :-1]`` and predicts
``batch[:, 1:]``.

None of this imports JAX.
"""

from __future__ import annotations

import glob
import math
import os
import pathlib
import sysconfig

import numpy as np

from ultraep_jax.tools import check_int

__all__ = [
    "EXCLUDED_DIRS",
    "VOCAB_SIZE",
    "corpus_files",
    "default_corpus_root",
    "eval_batches",
    "load_corpus",
    "split_corpus",
    "train_batch",
]

#: Byte-level tokens.
VOCAB_SIZE = 256
#: Directory names skipped (with everything below them) when walking the standard library.
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
_GLOB_CHARS = frozenset("*?[")


# --------------------------------------------------------------------------------------------
# Argument checks
# --------------------------------------------------------------------------------------------


def _check_tokens(name: str, data, min_len: int) -> np.ndarray:
    data = np.asarray(data)
    if data.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {data.shape}")
    if data.size < min_len:
        raise ValueError(f"{name} holds {data.size} bytes, fewer than one sequence ({min_len})")
    return data


# --------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------


def default_corpus_root() -> pathlib.Path:
    """The Python standard library directory (``sysconfig.get_paths()["stdlib"]``)."""
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def _walk_files(root: pathlib.Path, suffix: str | None, excluded=frozenset()) -> list[pathlib.Path]:
    """Regular files under ``root`` (symlinked dirs not followed), sorted by relative POSIX path.

    Directories named in ``excluded`` are pruned with everything below them; with ``suffix`` only
    file names ending in it are kept.
    """
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in excluded]
        for name in filenames:
            if suffix is not None and not name.endswith(suffix):
                continue
            path = pathlib.Path(dirpath, name)
            if path.is_file():
                found.append(path)
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def corpus_files(data: str | None) -> list[pathlib.Path]:
    """The corpus files, in corpus order.

    Args:
      data: None for the default corpus: the ``.py`` files of the Python standard library, without
        the ``site-packages`` / ``dist-packages`` / ``__pycache__`` subtrees, sorted by path
        relative to the stdlib root (the same list on every machine with the same Python). A
        string is a file, a directory (every regular file below it, recursively, sorted by
        relative path) or a glob pattern (``**`` allowed; the matching regular files, sorted).
        ``~`` is expanded.

    Returns:
      A non-empty list of paths.

    Raises:
      ValueError: one line naming ``data`` when it does not exist or matches no file.
    """
    if data is None:
        root = default_corpus_root()
        files = _walk_files(root, ".py", EXCLUDED_DIRS)
        if not files:
            raise ValueError(f"no .py files found in the Python standard library at {str(root)!r}")
        return files
    if not isinstance(data, (str, os.PathLike)):
        raise TypeError(f"data must be a path string or None, got {type(data).__name__}")
    text = os.path.expanduser(os.fspath(data))
    if not text:
        raise ValueError("data path is empty")
    path = pathlib.Path(text)
    if path.is_file():
        return [path]
    if path.is_dir():
        files = _walk_files(path, None)
        if not files:
            raise ValueError(f"data directory {str(data)!r} contains no files")
        return files
    if _GLOB_CHARS.intersection(text):
        files = sorted(
            pathlib.Path(p) for p in glob.glob(text, recursive=True) if os.path.isfile(p)
        )
        if not files:
            raise ValueError(f"data pattern {str(data)!r} matches no files")
        return files
    raise ValueError(f"data path {str(data)!r} does not exist")


def load_corpus(files, max_bytes: int | None) -> np.ndarray:
    """Concatenates ``files`` in order (``\\n`` between files), reading at most ``max_bytes``.

    Files are opened one at a time and reading stops as soon as ``max_bytes`` bytes are held, so
    loading a prefix of a large corpus is fast. Empty files are skipped (no separator for them).

    Args:
      files: paths, in corpus order.
      max_bytes: cap on the corpus size (>= 1), or None for everything.

    Returns:
      uint8 ``[n]``: the first ``min(max_bytes, total)`` bytes of the full concatenation.

    Raises:
      ValueError: the files hold no bytes, or one cannot be read.
    """
    if max_bytes is not None:
        max_bytes = check_int("max_bytes", max_bytes, 1)
    chunks: list[bytes] = []
    total = 0
    for path in files:
        if max_bytes is not None and total >= max_bytes:
            break
        sep = 1 if chunks else 0
        # Read at least one byte: an empty file adds no separator.
        want = -1 if max_bytes is None else max(max_bytes - total - sep, 1)
        try:
            with open(path, "rb") as f:
                chunk = f.read(want)
        except OSError as e:
            raise ValueError(f"cannot read corpus file {str(path)!r}: {e.strerror or e}") from None
        if not chunk:
            continue
        if sep:
            chunks.append(b"\n")
        chunks.append(chunk)
        total += sep + len(chunk)
    if not chunks:
        raise ValueError("the corpus is empty (the data files hold no bytes)")
    corpus = np.frombuffer(b"".join(chunks), dtype=np.uint8)[:max_bytes]
    return corpus.copy()


def split_corpus(
    corpus: np.ndarray, eval_fraction: float, seq_len: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Splits off the held-out slice: the LAST ``eval_fraction`` of the bytes.

    Args:
      corpus: uint8 ``[n]``.
      eval_fraction: in ``(0, 1)``.
      seq_len: if given, both parts must hold at least one sequence (``seq_len + 1`` bytes) and
        the eval part is grown to one sequence when the fraction gives less.

    Returns:
      ``(train, eval)``: views ``corpus[:n - k]`` and ``corpus[n - k:]`` with
      ``k = max(ceil(eval_fraction * n), seq_len + 1 or 1)``; disjoint, together all of ``corpus``.
    """
    corpus = np.asarray(corpus)
    if corpus.ndim != 1:
        raise ValueError(f"corpus must be 1-D, got shape {corpus.shape}")
    eval_fraction = float(eval_fraction)
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
    min_len = 1 if seq_len is None else check_int("seq_len", seq_len, 1) + 1
    n = corpus.size
    n_eval = max(math.ceil(eval_fraction * n), min_len)
    if n - n_eval < min_len:
        raise ValueError(
            f"corpus of {n} bytes is too small to split off {n_eval} eval bytes and keep "
            f"{min_len} training bytes"
        )
    return corpus[: n - n_eval], corpus[n - n_eval :]


# --------------------------------------------------------------------------------------------
# Batches
# --------------------------------------------------------------------------------------------


def train_batch(train: np.ndarray, step: int, batch_size: int, seq_len: int) -> np.ndarray:
    """Training batch number ``step`` (a pure function of its arguments).

    Row ``i`` is the window of ``seq_len + 1`` bytes starting at byte
    ``(step * batch_size + i) * seq_len`` of ``train``, indices taken modulo ``len(train)``
    (wrapping around the end). Consecutive windows, within a batch and across steps, overlap by
    one byte, so the batches stream through the corpus in order and every byte is a target once
    per pass.

    Args:
      train: uint8 ``[n]`` with ``n >= seq_len + 1``.
      step: >= 0.
      batch_size, seq_len: >= 1.

    Returns:
      int32 ``[batch_size, seq_len + 1]``.
    """
    step = check_int("step", step, 0)
    batch_size = check_int("batch_size", batch_size, 1)
    seq_len = check_int("seq_len", seq_len, 1)
    train = _check_tokens("train", train, seq_len + 1)
    n = train.size
    start = (step * batch_size * seq_len) % n  # Python ints: no overflow for any step.
    rows = np.arange(batch_size, dtype=np.int64)[:, None] * seq_len
    cols = np.arange(seq_len + 1, dtype=np.int64)[None, :]
    return train[(start + rows + cols) % n].astype(np.int32)


def eval_batches(
    eval: np.ndarray, batch_size: int, seq_len: int, max_batches: int
) -> list[np.ndarray]:
    """Fixed eval batches covering the held-out slice from its start.

    Window ``w`` is ``eval[w * (seq_len + 1) : (w + 1) * (seq_len + 1)]`` (non-overlapping);
    batch ``b`` holds windows ``b * batch_size .. (b + 1) * batch_size - 1``. Only full batches
    are returned (so every batch has the same shape), at most ``max_batches`` of them; when the
    slice holds fewer than ``batch_size`` windows, the single batch reuses windows from the start
    (window index modulo the number of windows).

    Args:
      eval: uint8 ``[n]`` with ``n >= seq_len + 1``.
      batch_size, seq_len: >= 1.
      max_batches: >= 0.

    Returns:
      ``min(max_batches, max(1, windows // batch_size))`` int32 arrays
      ``[batch_size, seq_len + 1]``.
    """
    batch_size = check_int("batch_size", batch_size, 1)
    seq_len = check_int("seq_len", seq_len, 1)
    max_batches = check_int("max_batches", max_batches, 0)
    eval = _check_tokens("eval", eval, seq_len + 1)
    width = seq_len + 1
    num_windows = eval.size // width
    num_batches = min(max_batches, max(1, num_windows // batch_size))
    windows = eval[: num_windows * width].reshape(num_windows, width)
    batches = []
    for b in range(num_batches):
        idx = np.arange(b * batch_size, (b + 1) * batch_size) % num_windows
        batches.append(windows[idx].astype(np.int32))
    return batches
