"""Tests for jaxlong.data: corpus, tokenizer, packing, determinism, resumability, sharding."""
import json

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxlong import data

TOK = data.ByteTokenizer()


def _same(a, b):
    return all(np.array_equal(a[k], b[k]) for k in ("inputs", "targets", "mask"))


def _tiny_tokens(n=200):
    return np.arange(n, dtype=np.int32) % 251


# --------------------------------------------------------------------------- corpus


def test_stdlib_corpus():
    toks = data.load_corpus(None, TOK, max_tokens=2_000_000)
    assert toks.dtype == np.int32 and toks.ndim == 1
    assert 100_000 < toks.size <= 2_000_000
    assert (toks == TOK.eod_id).sum() > 10
    assert toks.min() >= 0 and toks.max() < TOK.vocab_size
    text = TOK.decode(toks[:200_000])
    assert "def " in text and "import " in text
    # cached: second call returns the same object
    assert data.load_corpus(None, TOK, max_tokens=2_000_000) is toks


def test_stdlib_files_sorted_and_filtered():
    files = data.stdlib_files()
    assert len(files) > 100
    assert all(f.suffix == ".py" for f in files)
    assert not any(part in ("site-packages", "test", "tests") for f in files for part in f.parts[-4:-1])


def test_max_tokens_cap_exact():
    toks = data.load_corpus(None, TOK, max_tokens=12_345)
    assert toks.size == 12_345


# --------------------------------------------------------------------------- tokenizer


def test_tokenizer_roundtrip_unicode():
    s = "héllo wörld — 你好, мир 🚀\n\tdef f(): pass"
    ids = TOK.encode(s)
    assert ids.dtype == np.int32 and ids.max() < 256
    assert TOK.vocab_size == 257 and TOK.eod_id == 256
    assert TOK.decode(ids) == s
    assert TOK.decode(np.concatenate([ids, [TOK.eod_id]])) == s
    assert TOK.decode(ids[:-1][: len(s.encode()) - 3]) is not None  # cut mid-char: no raise


def test_get_tokenizer():
    assert isinstance(data.get_tokenizer("byte"), data.ByteTokenizer)
    with pytest.raises(ValueError, match="byte"):
        data.get_tokenizer("gpt2")


# --------------------------------------------------------------------------- packing


def test_packing_shift_and_range():
    toks = data.load_corpus(None, TOK, max_tokens=200_000)
    it = data.make_batch_iterator(toks, seq_len=64, global_batch=8, seed=0)
    for _ in range(3):
        b = next(it)
        assert b["inputs"].shape == b["targets"].shape == b["mask"].shape == (8, 64)
        assert b["inputs"].dtype == np.int32 and b["targets"].dtype == np.int32
        assert b["mask"].dtype == np.float32 and (b["mask"] == 1.0).all()
        np.testing.assert_array_equal(b["inputs"][:, 1:], b["targets"][:, :-1])
        assert b["inputs"].max() < TOK.vocab_size and b["targets"].max() < TOK.vocab_size


def test_packing_windows_cover_stream():
    toks = _tiny_tokens(101)
    it = data.make_batch_iterator(toks, seq_len=10, global_batch=10, seed=3)
    assert it.num_sequences == 10 and it.steps_per_epoch == 1
    b = next(it)
    # one epoch = every window once; every token after the first is a target exactly once
    order = np.argsort(b["inputs"][:, 0])
    np.testing.assert_array_equal(b["targets"][order].reshape(-1), toks[1:])


def test_corpus_too_small():
    with pytest.raises(ValueError, match="global_batch"):
        data.make_batch_iterator(_tiny_tokens(50), seq_len=16, global_batch=4, seed=0)


# --------------------------------------------------------------------------- determinism


def test_determinism():
    toks = _tiny_tokens(2000)
    kw = dict(seq_len=16, global_batch=4)
    it = data.make_batch_iterator(toks, seed=1, **kw)
    a = [next(it) for _ in range(5)]
    it = data.make_batch_iterator(toks, seed=1, **kw)
    b = [next(it) for _ in range(5)]
    it = data.make_batch_iterator(toks, seed=2, **kw)
    c = [next(it) for _ in range(5)]
    assert all(_same(x, y) for x, y in zip(a, b))
    assert not all(_same(x, y) for x, y in zip(a, c))


def test_resume_across_epoch_boundary():
    toks = _tiny_tokens(200)  # 199 // 16 = 12 sequences -> 3 steps/epoch at batch 4
    kw = dict(seq_len=16, global_batch=4, seed=7)
    it = data.make_batch_iterator(toks, **kw)
    assert it.steps_per_epoch == 3
    full = [next(it) for _ in range(10)]
    # epochs differ in order
    assert not _same(full[0], full[3])
    for k in (0, 1, 2, 3, 5, 7):  # 2 -> 3 and 5 -> 6 cross epoch boundaries
        r = data.make_batch_iterator(toks, start_step=k, **kw)
        for j in range(3):
            assert _same(next(r), full[k + j]), (k, j)
        assert r.step == k + 3


# --------------------------------------------------------------------------- user corpora


def test_txt_and_jsonl_corpora(tmp_path):
    (tmp_path / "a.txt").write_text("hello wörld", encoding="utf-8")
    rows = [{"text": "first doc"}, {"text": "second — doc"}]
    (tmp_path / "b.jsonl").write_text(
        "\n".join(json.dumps(r) for r in rows) + "\n\n", encoding="utf-8")

    t = data.load_corpus(tmp_path / "a.txt", TOK)
    assert TOK.decode(t) == "hello wörld" and t[-1] == TOK.eod_id

    j = data.load_corpus(str(tmp_path / "b.jsonl"), TOK)
    assert (j == TOK.eod_id).sum() == 2
    assert TOK.decode(j) == "first docsecond — doc"

    d = data.load_corpus(tmp_path, TOK)  # directory: sorted a.txt then b.jsonl
    np.testing.assert_array_equal(d, np.concatenate([t, j]))


@pytest.mark.parametrize("name", ["missing.txt", "corpus.csv"])
def test_bad_path(tmp_path, name):
    p = tmp_path / name
    if name.endswith(".csv"):
        p.write_text("x")
    with pytest.raises(ValueError, match="data.path") as e:
        data.load_corpus(p, TOK)
    assert str(p) in str(e.value) and ".jsonl" in str(e.value)


def test_bad_jsonl_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(ValueError, match="data.path.*:2"):
        data.load_corpus(p, TOK, cache=False)


# --------------------------------------------------------------------------- sharding


def test_put_on_mesh():
    assert jax.device_count() == 8
    mesh = jax.make_mesh((1, 2, 4), ("data", "fsdp", "context"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 3)
    sharding = NamedSharding(mesh, P(("data", "fsdp"), "context"))
    toks = _tiny_tokens(2000)
    batch = next(data.make_batch_iterator(toks, seq_len=32, global_batch=4, seed=0))
    out = data.put_on_mesh(batch, sharding)
    assert set(out) == set(batch)
    for k, v in out.items():
        assert isinstance(v, jax.Array)
        assert v.sharding == sharding
        assert v.shape == batch[k].shape and v.dtype == batch[k].dtype
        assert len(v.addressable_shards) == 8
        for s in v.addressable_shards:
            assert s.data.shape == (2, 8)
            np.testing.assert_array_equal(np.asarray(s.data), batch[k][s.index])
        np.testing.assert_array_equal(np.asarray(v), batch[k])


def test_put_on_mesh_indivisible():
    mesh = jax.make_mesh((1, 2, 4), ("data", "fsdp", "context"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 3)
    sharding = NamedSharding(mesh, P(("data", "fsdp"), "context"))
    with pytest.raises(ValueError, match="inputs"):
        data.put_on_mesh({"inputs": np.zeros((3, 8), np.int32)}, sharding)
