"""The byte corpus and its reproducible batches."""

import sysconfig
from pathlib import Path

import pytest
import torch

from reference import data as data_module
from reference.data import (
    ByteCorpus,
    corpus,
    decode,
    encode,
    get_batch,
    split,
    stdlib_source_files,
    synthetic_batch,
)

SMALL = 100_000  # bytes: enough for every check, cheap to read


def test_corpus_is_nonempty_bytes_from_the_stdlib():
    data = corpus(SMALL)
    assert data.dtype == torch.uint8 and data.dim() == 1
    assert len(data) == SMALL  # the stdlib holds far more than 100 kB of source
    text = decode(data)
    assert "def " in text and "import " in text
    # It starts with the first file in sorted order, byte for byte.
    first = stdlib_source_files()[0].read_bytes()
    assert bytes(data[: len(first)].tolist()) == first[:SMALL]


def test_corpus_files_are_sorted_and_skip_tests_and_site_packages():
    root = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_source_files()
    assert files, "the standard library has .py files"
    rel = [f.relative_to(root).as_posix() for f in files]
    assert rel == sorted(rel)
    for r in rel:
        parts = r.split("/")[:-1]
        assert not {"site-packages", "dist-packages", "test", "tests", "idle_test"} & set(parts), r
        assert r.endswith(".py")
    # Ordinary packages are kept.
    assert any(r.startswith("json/") for r in rel)


def test_corpus_is_deterministic_and_returns_copies():
    a = corpus(SMALL)
    data_module._corpus_bytes.cache_clear()  # read the files again
    b = corpus(SMALL)
    assert torch.equal(a, b)
    a[0] = 0  # callers own their copy
    assert torch.equal(corpus(SMALL), b)


def test_corpus_rejects_bad_sizes():
    with pytest.raises(ValueError, match="max_bytes"):
        corpus(0)


def test_split_is_the_last_tenth():
    data = corpus(SMALL)
    train, val = split(data)
    assert len(train) == 90_000 and len(val) == 10_000
    assert torch.equal(torch.cat([train, val]), data)
    bundle = ByteCorpus.load(SMALL)
    assert torch.equal(bundle.train, train) and torch.equal(bundle.val, val)
    with pytest.raises(ValueError, match="val_fraction"):
        split(data, 1.0)


def test_batches_are_shifted_windows_of_the_data():
    data = corpus(SMALL)
    x, y = get_batch(data, batch_size=8, block_size=16, step=3, seed=1)
    assert x.shape == y.shape == (8, 16)
    assert x.dtype == y.dtype == torch.int64
    assert 0 <= int(x.min()) and int(x.max()) < 256
    assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one


def test_batch_rows_are_consecutive_windows():
    # In the data 0, 1, ..., 255, 0, 1, ... every window of consecutive bytes
    # counts up by one (mod 256) from its first byte.
    data = (torch.arange(5000) % 256).to(torch.uint8)
    x, y = get_batch(data, batch_size=16, block_size=32, step=0)
    counting = (x[:, :1] + torch.arange(32)) % 256  # (B, T)
    assert torch.equal(x, counting)
    assert torch.equal(y, (x + 1) % 256)
    assert len(set(x[:, 0].tolist())) > 1  # rows start at different offsets


def test_batches_depend_only_on_seed_and_step():
    data = corpus(SMALL)
    torch.manual_seed(0)
    a = get_batch(data, 4, 16, step=5, seed=2)
    state = torch.get_rng_state()
    torch.manual_seed(999)  # the global RNG plays no part
    torch.rand(10)
    b = get_batch(data, 4, 16, step=5, seed=2)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    torch.manual_seed(0)
    get_batch(data, 4, 16, step=5, seed=2)
    assert torch.equal(torch.get_rng_state(), state)  # nor is it consumed
    assert not torch.equal(get_batch(data, 4, 16, step=6, seed=2)[0], a[0])
    assert not torch.equal(get_batch(data, 4, 16, step=5, seed=3)[0], a[0])


def test_get_batch_errors():
    with pytest.raises(ValueError, match="block_size=16"):
        get_batch(torch.zeros(16, dtype=torch.uint8), 2, 16, step=0)
    with pytest.raises(ValueError, match="step"):
        get_batch(corpus(SMALL), 2, 16, step=-1)
    with pytest.raises(ValueError, match="1-D"):
        get_batch(torch.zeros(4, 40, dtype=torch.uint8), 2, 16, step=0)


def test_smallest_data_that_fits_a_window():
    data = torch.arange(17, dtype=torch.uint8)
    x, y = get_batch(data, 3, 16, step=0)
    assert torch.equal(x[0], torch.arange(16)) and torch.equal(y[0], torch.arange(1, 17))


def test_synthetic_batch():
    x, y = synthetic_batch(4, 8, vocab_size=50, seed=1)
    assert x.shape == y.shape == (4, 8) and x.dtype == torch.int64
    assert 0 <= int(x.min()) and int(x.max()) < 50
    assert torch.equal(x[:, 1:], y[:, :-1])
    x2, y2 = synthetic_batch(4, 8, vocab_size=50, seed=1)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(synthetic_batch(4, 8, vocab_size=50, seed=2)[0], x)


def test_encode_decode_round_trip():
    text = "def f(x):\n    return x  # naïve\n"
    tokens = encode(text)
    assert tokens.dtype == torch.int64 and int(tokens.max()) < 256
    assert decode(tokens) == text
    assert decode(tokens.view(1, -1)) == text
    assert decode([0xFF]) == "\ufffd"  # a lone byte that is not UTF-8
