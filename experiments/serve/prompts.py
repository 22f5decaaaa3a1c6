"""Prompts: read from files (one prompt a file, its bytes the tokens) and padded into one batch
with a token mask (host only, no JAX)."""

from __future__ import annotations

import dataclasses
import pathlib

import numpy as np

from experiments.lab.training import data
from experiments.lab.training.workdir import RunError


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One prompt: the file it came from and its tokens (int32 [n], n >= 1)."""

    path: pathlib.Path
    tokens: np.ndarray


def read_prompts(spec: str, max_seq_len: int) -> list[Prompt]:
    """The prompts of ``spec`` (a file, folder or glob; `data.corpus_files`), in file order.

    Raises:
      RunError: one line naming the value: nothing matches, a file is empty or unreadable, or a
        prompt has more tokens than the model's positions (``max_seq_len``).
    """
    try:
        files = data.corpus_files(spec)
    except ValueError as err:
        raise RunError(f"--prompts={spec}: {err}") from None
    out = []
    for path in files:
        try:
            raw = path.read_bytes()
        except OSError as err:
            raise RunError(f"cannot read prompt file {path}: {err.strerror or err}") from None
        if not raw:
            raise RunError(f"prompt file {path} is empty")
        if len(raw) > max_seq_len:
            raise RunError(
                f"prompt file {path} has {len(raw)} tokens, more than the model's "
                f"max_seq_len={max_seq_len}"
            )
        out.append(Prompt(path, np.frombuffer(raw, np.uint8).astype(np.int32)))
    return out


def pad_batch(
    prompts: list[Prompt], rows_multiple: int, length: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The prompts as one batch, padded at the end of each row (causal attention never reads
    later positions) and with rows of padding up to a multiple of ``rows_multiple`` (the devices
    the batch is split over).

    Args:
      prompts: n >= 1 prompts.
      rows_multiple: B is the least multiple of it >= n.
      length: T (default: the longest prompt); at least the longest prompt.

    Returns:
      tokens int32 [B, T] (0 at padding), token_mask bool [B, T] (True at a prompt's tokens) and
      lengths int32 [B] (0 for the rows of padding).
    """
    longest = max(len(p.tokens) for p in prompts)
    T = longest if length is None else length
    if T < longest:
        raise ValueError(f"pad_batch: length {T} is shorter than the longest prompt ({longest})")
    B = -(-len(prompts) // rows_multiple) * rows_multiple
    tokens = np.zeros((B, T), np.int32)
    lengths = np.zeros((B,), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p.tokens)] = p.tokens
        lengths[i] = len(p.tokens)
    mask = np.arange(T)[None, :] < lengths[:, None]
    return tokens, mask, lengths


def as_text(tokens) -> str:
    """Byte tokens as text (undecodable bytes replaced)."""
    return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")
