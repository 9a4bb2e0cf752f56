"""Byte-level training data that every machine already has, and reproducible batches.

The corpus is the Python standard library's own ``.py`` source read as bytes (the vocabulary is
the 256 byte values; nothing is downloaded), files in sorted path order without ``site-packages``
and tests: the same Python version gives the same corpus on every machine. A batch depends on
``(seed, step)`` alone, so every process that asks for step ``s`` gets the same global batch,
whatever it did before; data-parallel ranks take their slices of it.
"""

from __future__ import annotations

import functools
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import numpy as np
import torch

__all__ = ["DEFAULT_MAX_BYTES", "stdlib_source_files", "corpus", "split", "ByteCorpus", "get_batch",
           "synthetic_batch", "encode", "decode"]

DEFAULT_MAX_BYTES = 2_000_000

# Directories whose files stay out of the corpus: installed third-party
# packages (they differ between machines) and test suites (large, repetitive).
_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})


def stdlib_source_files() -> list[Path]:
    """The standard library's ``.py`` files that make up the corpus, in corpus order."""
    root = sysconfig.get_paths()["stdlib"]
    relative = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Pruned in place: os.walk never descends into them (site-packages can dwarf the stdlib).
        dirnames[:] = [d for d in dirnames if d not in _SKIPPED_DIRS]
        rel_dir = Path(dirpath).relative_to(root)
        relative += [(rel_dir / f).as_posix() for f in filenames if f.endswith(".py")]
    # Sorted relative to the stdlib root, so the order does not depend on where Python lives.
    return [Path(root, rel) for rel in sorted(relative)]


@functools.lru_cache(maxsize=4)
def _corpus_bytes(max_bytes: int) -> bytes:
    chunks, total = [], 0
    for path in stdlib_source_files():
        if total >= max_bytes:
            break
        chunk = path.read_bytes()
        chunks.append(chunk)
        total += len(chunk)
    if total == 0:
        raise RuntimeError(f"no .py source found under {sysconfig.get_paths()['stdlib']!r}; "
                           "this Python keeps its standard library elsewhere (zipped?)")
    return b"".join(chunks)[:max_bytes]


def corpus(max_bytes: int = DEFAULT_MAX_BYTES) -> torch.Tensor:
    """The corpus as a 1-D ``torch.uint8`` tensor of at most ``max_bytes`` bytes (read once, copied)."""
    if not isinstance(max_bytes, int) or max_bytes <= 0:
        raise ValueError(f"max_bytes must be a positive int, got {max_bytes!r}")
    raw = _corpus_bytes(max_bytes)
    return torch.from_numpy(np.frombuffer(raw, dtype=np.uint8).copy())


def split(data: torch.Tensor, val_fraction: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, val): the last ``val_fraction`` of ``data`` is the validation part."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
    n_train = int(len(data) * (1.0 - val_fraction))
    return data[:n_train], data[n_train:]


@dataclass
class ByteCorpus:
    """The corpus split into its train and validation parts (1-D uint8 tensors)."""

    train: torch.Tensor
    val: torch.Tensor

    @classmethod
    def load(cls, max_bytes: int = DEFAULT_MAX_BYTES, val_fraction: float = 0.1) -> "ByteCorpus":
        return cls(*split(corpus(max_bytes), val_fraction))


def _rng(seed: int, step: int) -> np.random.Generator:
    # numpy's SeedSequence mixes (seed, step) into the full 128-bit PCG64 state, so distinct
    # pairs give distinct streams (a torch CPU generator keeps 32 bits of a combined seed).
    for name, value in (("seed", seed), ("step", step)):
        if not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return np.random.default_rng([int(seed), int(step)])


def _check_sizes(batch_size: int, block_size: int) -> None:
    if batch_size <= 0 or block_size <= 0:
        raise ValueError(f"batch_size={batch_size} and block_size={block_size} must be positive")


def get_batch(data: torch.Tensor, batch_size: int, block_size: int, step: int, seed: int = 0,
              device: Optional[Union[str, torch.device]] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch number ``step``: x, y int64 (batch_size, block_size), each row a window of ``data`` at
    an offset drawn from ``(seed, step)``, y the next bytes: y[b, t] = x[b, t + 1] in ``data``."""
    if data.dim() != 1:
        raise ValueError(f"data must be 1-D, got shape {tuple(data.shape)}")
    _check_sizes(batch_size, block_size)
    n_windows = len(data) - block_size  # offsets 0 .. len - block_size - 1 leave room for y
    if n_windows <= 0:
        raise ValueError(f"data holds {len(data)} tokens: too few for block_size={block_size} "
                         f"(needs at least block_size + 1)")
    offsets = torch.from_numpy(_rng(seed, step).integers(0, n_windows, size=batch_size, dtype=np.int64))  # (B,)
    index = offsets[:, None] + torch.arange(block_size + 1)  # (B, T + 1)
    windows = data[index].to(torch.int64)  # (B, T + 1)
    x = windows[:, :-1].contiguous()  # (B, T)
    y = windows[:, 1:].contiguous()  # (B, T)
    if device is not None:
        x, y = x.to(device), y.to(device)
    return x, y


def synthetic_batch(batch_size: int, block_size: int, vocab_size: int = 256, seed: int = 0,
                    step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniformly random tokens for tests: x, y int64 (batch_size, block_size), y = x shifted by one."""
    tokens = torch.from_numpy(
        _rng(seed, step).integers(0, vocab_size, size=(batch_size, block_size + 1), dtype=np.int64)
    )  # (B, T + 1)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


PAD = 0  # the NUL byte: what a padded position's input holds (its target is -100)


def padded_documents(data: torch.Tensor, batch_size: int, block_size: int, step: int,
                     seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch number ``step`` of documents padded to ``block_size``: x, y int64 (batch_size, block_size).

    Row b is a document of L_b + 1 tokens of ``data`` (L_b uniform in 1 .. block_size, its offset
    random, both from ``(seed, step)``): x[b, :L_b] its first L_b tokens, y[b, :L_b] its last L_b,
    then x holds `PAD` and y -100, the target that counts for nothing (`reference.loss`). Rows
    count different numbers of tokens, as padded documents or masked prompts do."""
    if data.dim() != 1 or len(data) <= block_size:
        raise ValueError(f"data must be 1-D with more than block_size={block_size} tokens, "
                         f"got shape {tuple(data.shape)}")
    _check_sizes(batch_size, block_size)
    rng = _rng(seed, step)
    lengths = rng.integers(1, block_size + 1, size=batch_size)  # (B,): counted tokens per row
    offsets = rng.integers(0, len(data) - block_size, size=batch_size)
    x = torch.full((batch_size, block_size), PAD, dtype=torch.int64)
    y = torch.full((batch_size, block_size), -100, dtype=torch.int64)
    for b, (n, o) in enumerate(zip(lengths.tolist(), offsets.tolist())):
        x[b, :n] = data[o: o + n]
        y[b, :n] = data[o + 1: o + n + 1]
    return x, y


def encode(text: str) -> torch.Tensor:
    """UTF-8 bytes of ``text`` as int64 token ids (T,)."""
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.int64)


def decode(tokens: Union[torch.Tensor, list]) -> str:
    """Token ids (any shape is flattened) back to text; bytes that are not valid UTF-8 become U+FFFD."""
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.reshape(-1).tolist()
    return bytes(tokens).decode("utf-8", errors="replace")
