"""Data: the embedded sets, the deterministic order, readers, the zarr store, synthetic data."""

from __future__ import annotations

import gzip
import pickle

import numpy as np
import pytest

from refdl.data import load_dataset
from refdl.data.order import epoch_permutation, global_batch_indices, worker_share, worker_slice
from refdl.data.readers import read_cifar_batch, read_idx, read_ptb, write_cifar_batch, write_idx
from refdl.data.store import ZarrDataset, write_zarr
from refdl.errors import DataError, UsageError


def test_digits_is_the_embedded_real_set(digits):
    info = digits.info
    assert (info.train_size, info.test_size, info.input_shape, info.num_classes) == (
        1437,
        360,
        (8, 8, 1),
        10,
    )
    assert digits.train_x.min() == 0.0 and digits.train_x.max() == 1.0
    assert set(np.unique(digits.test_y)) == set(range(10))
    # the split is fixed: the same on every load
    again = load_dataset("digits")
    np.testing.assert_array_equal(again.test_x, digits.test_x)


def test_pytext_char_and_word():
    ds = load_dataset("pytext")
    info = ds.info
    assert info.kind == "tokens" and info.input_shape == (20,)
    assert 80 < info.num_classes < 200 and info.train_size > 15_000
    np.testing.assert_array_equal(ds.train_x[0, 1:], ds.train_y[0, :-1])  # y is x shifted
    assert info.baselines["unigram_test_perplexity"] > 10
    words = load_dataset("pytext", options={"level": "word", "seq_len": "8"})
    assert words.info.vocab[0] == "<unk>" and words.info.input_shape == (8,)


def test_order_is_deterministic_and_covers_each_epoch():
    n, b = 50, 8
    steps = [global_batch_indices(3, t, b, n) for t in range(25)]  # 200 = 4 epochs
    again = [global_batch_indices(3, t, b, n) for t in range(25)]
    for a, c in zip(steps, again, strict=True):
        np.testing.assert_array_equal(a, c)
    stream = np.concatenate(steps)
    for e in range(4):  # each epoch is a permutation: every example exactly once
        np.testing.assert_array_equal(np.sort(stream[e * n : (e + 1) * n]), np.arange(n))
        np.testing.assert_array_equal(stream[e * n : (e + 1) * n], epoch_permutation(3, e, n))
    assert not np.array_equal(global_batch_indices(4, 0, b, n), steps[0])  # seed matters
    assert all(len(s) == b for s in steps)  # no short batch at an epoch boundary


def test_worker_shares_are_disjoint_and_cover_the_batch():
    idx = global_batch_indices(0, 7, 24, 1000)
    batch = {"x": idx * 10, "y": idx}
    shares = [worker_share(batch, w, 4) for w in range(4)]
    np.testing.assert_array_equal(np.concatenate([s["y"] for s in shares]), idx)
    assert len(set(np.concatenate([s["y"] for s in shares]))) == 24
    assert worker_slice(24, 2, 4) == slice(12, 18)
    with pytest.raises(UsageError, match="multiple of 5"):
        worker_slice(24, 0, 5)


@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_idx_round_trip_and_mnist_folder(tmp_path, suffix):
    rng = np.random.default_rng(0)
    imgs = rng.integers(0, 256, (20, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, 20).astype(np.uint8)
    write_idx(tmp_path / f"a{suffix}", imgs)
    np.testing.assert_array_equal(read_idx(tmp_path / f"a{suffix}"), imgs)
    f32 = rng.standard_normal((3, 4)).astype(np.float32)
    write_idx(tmp_path / "f", f32)
    np.testing.assert_array_equal(read_idx(tmp_path / "f"), f32)
    for prefix, n in (("train", 20), ("t10k", 8)):
        write_idx(tmp_path / f"{prefix}-images-idx3-ubyte{suffix}", imgs[:n])
        write_idx(tmp_path / f"{prefix}-labels-idx1-ubyte{suffix}", labels[:n])
    ds = load_dataset("mnist", str(tmp_path))
    assert ds.info.input_shape == (28, 28, 1) and ds.info.train_size == 20
    np.testing.assert_allclose(ds.train_x[..., 0], imgs / 255.0, rtol=1e-6)
    np.testing.assert_array_equal(ds.test_y, labels[:8])


def test_idx_malformed_files_name_the_file(tmp_path):
    bad = tmp_path / "bad"
    bad.write_bytes(b"\x01\x02\x03\x04")
    with pytest.raises(DataError, match=f"{bad}: not an IDX file"):
        read_idx(bad)
    short = tmp_path / "short"
    write_idx(short, np.zeros((4, 5), np.uint8))
    short.write_bytes(short.read_bytes()[:-3])
    with pytest.raises(DataError, match="body has 17 bytes"):
        read_idx(short)
    with pytest.raises(DataError, match="train-images-idx3-ubyte: missing"):
        load_dataset("mnist", str(tmp_path))
    with pytest.raises(DataError, match="not a readable directory"):
        load_dataset("fashion_mnist", str(tmp_path / "nope"))


def test_cifar_batches_round_trip(tmp_path):
    rng = np.random.default_rng(1)
    for name, n in (("data_batch_1", 6), ("data_batch_2", 4), ("test_batch", 3)):
        write_cifar_batch(
            tmp_path / name, rng.integers(0, 256, (n, 32, 32, 3), np.uint8), rng.integers(0, 10, n)
        )
    imgs, labels = read_cifar_batch(tmp_path / "data_batch_1")
    assert imgs.shape == (6, 32, 32, 3) and labels.shape == (6,)
    # the on-disk layout is channel-major rows of 3072 bytes
    with open(tmp_path / "data_batch_1", "rb") as f:
        raw = pickle.load(f, encoding="bytes")[b"data"]
    np.testing.assert_array_equal(raw[0, :1024].reshape(32, 32), imgs[0, :, :, 0])
    ds = load_dataset("cifar10", str(tmp_path))
    assert (ds.info.train_size, ds.info.test_size) == (10, 3)
    (tmp_path / "test_batch").write_bytes(b"garbage")
    with pytest.raises(DataError, match="test_batch: not a CIFAR python batch"):
        load_dataset("cifar10", str(tmp_path))


def test_ptb_reader(tmp_path):
    (tmp_path / "ptb.train.txt").write_text(" the cat sat \n the dog <unk> \n")
    (tmp_path / "ptb.test.txt").write_text(" the bird sat \n")
    assert read_ptb(tmp_path / "ptb.train.txt") == [
        "the",
        "cat",
        "sat",
        "<eos>",
        "the",
        "dog",
        "<unk>",
        "<eos>",
    ]
    ds = load_dataset("ptb", str(tmp_path), {"seq_len": "3"})
    vocab = ds.info.vocab
    assert vocab[0] == "<eos>" or vocab[0] == "the"  # most frequent first
    unk = vocab.index("<unk>")
    assert ds.test_x[0].tolist() == [vocab.index("the"), unk, vocab.index("sat")]  # bird -> <unk>
    with pytest.raises(DataError, match=r"ptb\.test\.txt"):
        (tmp_path / "ptb.test.txt").unlink()
        load_dataset("ptb", str(tmp_path))


def test_zarr_store_round_trip_and_random_access(tmp_path, digits):
    write_zarr(digits, tmp_path / "d.zarr", chunk=100)
    z = load_dataset("zarr", str(tmp_path / "d.zarr"))
    assert isinstance(z, ZarrDataset) and z.info == digits.info
    idx = global_batch_indices(0, 3, 64, digits.info.train_size)
    a, b = z.train_batch(idx), digits.train_batch(idx)
    np.testing.assert_array_equal(a["x"], b["x"])
    np.testing.assert_array_equal(a["y"], b["y"])
    share = worker_share({"i": idx}, 1, 4)["i"]  # a worker reads only its share
    np.testing.assert_array_equal(z.train_batch(share)["y"], digits.train_y[share])
    tz = np.concatenate([t["x"] for t in z.test_batches(100)])
    np.testing.assert_array_equal(tz, digits.test_x)
    with pytest.raises(DataError, match=r"info\.json: missing"):
        load_dataset("zarr", str(tmp_path))


def test_data_convert_cli(tmp_path):
    from refdl.data.__main__ import main

    assert main(["convert", "--dataset", "digits", "--out", str(tmp_path / "z")]) == 0
    assert load_dataset("zarr", str(tmp_path / "z")).info.train_size == 1437
    assert main(["convert", "--dataset", "mnist", "--out", str(tmp_path / "m")]) == 2


def test_synthetic_is_reproducible_per_index():
    ds = load_dataset("synthetic", options={"shape": "cifar", "size": "100"})
    a = ds.train_batch(np.array([5, 7]))
    b = ds.train_batch(np.array([7, 5]))
    np.testing.assert_array_equal(a["x"][0], b["x"][1])
    assert a["x"].shape == (2, 32, 32, 3)
    tok = load_dataset("synthetic", options={"shape": "tokens", "seq_len": "16"})
    t = tok.train_batch(np.arange(2))
    np.testing.assert_array_equal(t["x"][:, 1:], t["y"][:, :-1])
    with pytest.raises(
        UsageError, match="shape='svhn': must be one of mnist, cifar, imagenet, tokens"
    ):
        load_dataset("synthetic", options={"shape": "svhn"})


def test_gz_digits_source_is_readable():
    from refdl.data.embedded import _digits_file

    with gzip.open(_digits_file(), "rt") as f:
        assert len(f.readline().split(",")) == 65
