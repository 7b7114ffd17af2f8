"""Tests for jaxlong.data: sources and their errors, tokenizers (byte and Hugging Face), packed batches, resume
of the Grain iterator, per-process sharding, placement on the mesh."""
import json

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from helpers import ring_mesh

from jaxlong import data
from jaxlong.data.pipeline import token_limit
from jaxlong.core.batch import natural_order, put_batch


BYTE = data.ByteTokenizer()
KEYS = ("inputs", "targets", "positions", "segment_ids", "mask")


def _jsonl(tmp_path, lengths, name="c.jsonl", seed=0, field="text"):
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta"]
    docs = [" ".join(rng.choice(words, size=n)) for n in lengths]
    path = tmp_path / name
    path.write_text("".join(json.dumps({field: d}) + "\n" for d in docs), encoding="utf-8")
    return path, docs


def _batches(path, n, *, seq_len=64, global_batch=2, seed=0, tok=BYTE, **kw):
    ds = data.make_dataset(data.DocumentSource(path), tok, seq_len=seq_len, global_batch=global_batch,
                           options=data.PipelineOptions(seed=seed, **kw))
    it = iter(ds)
    return [next(it) for _ in range(n)], it


def _same(a, b):
    return all(np.array_equal(a[k], b[k]) for k in KEYS)


# --------------------------------------------------------------------------- sources


def test_stdlib_source():
    src = data.DocumentSource(None)
    assert len(src) > 100 and len(src) == len(data.stdlib_files())
    text = "".join(src[i] for i in range(20))
    assert "def " in text or "import " in text


def test_txt_dir_and_jsonl_with_text_field(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "b.txt").write_text("second file")
    (tmp_path / "d" / "a.txt").write_text("first file")
    (tmp_path / "d" / "skip.bin").write_bytes(b"\x00\x01")  # not a corpus suffix: ignored
    src = data.DocumentSource(tmp_path / "d")
    assert [src[0], src[1]] == ["first file", "second file"]
    path, docs = _jsonl(tmp_path, [3, 4, 5], field="body")
    src = data.DocumentSource(path, text_field="body")
    assert [src[i] for i in range(3)] == docs
    with pytest.raises(ValueError, match=r"c.jsonl:1 .*'text' field"):
        data.DocumentSource(path)  # the default field is missing


@pytest.mark.parametrize("case", ["missing", "suffix", "empty_dir", "empty_file", "nul", "undecodable",
                                  "bad_json", "no_field"])
def test_bad_corpora_name_the_file(tmp_path, case):
    f = tmp_path / "x.txt"
    if case == "missing":
        f, match = tmp_path / "missing.txt", "missing.txt.*does not exist"
    elif case == "suffix":
        f = tmp_path / "x.csv"
        f.write_text("a,b")
        match = "x.csv.*unsupported extension"
    elif case == "empty_dir":
        f = tmp_path / "empty"
        f.mkdir()
        match = "without .txt/.jsonl"
    elif case == "empty_file":
        f.write_text("")
        match = "x.txt.*corpus is empty"
    elif case == "nul":
        f.write_bytes(b"hello\x00world")
        match = "x.txt is not a text file .*NUL"
    elif case == "undecodable":
        f.write_bytes(bytes(range(128, 256)) * 10)
        match = "x.txt is not a text file"
    elif case == "bad_json":
        f = tmp_path / "x.jsonl"
        f.write_text('{"text": "ok"}\n\n{"text": oops}\n')
        match = r"x.jsonl:3 is not valid JSON"
    else:
        f = tmp_path / "x.jsonl"
        f.write_text('{"text": "ok"}\n{"body": "no text"}\n')
        match = r"x.jsonl:2 must be a JSON object with a string 'text' field"
    with pytest.raises(ValueError, match=match):
        data.DocumentSource(f)


# --------------------------------------------------------------------------- tokenizers


def test_byte_tokenizer_roundtrip_unicode():
    s = "héllo wörld — 你好, мир 🚀\n\tdef f(): pass"
    ids = BYTE.encode(s)
    assert ids.dtype == np.int32 and ids.max() < 256
    assert BYTE.vocab_size == 257 and BYTE.eos_id == BYTE.bos_id == 256
    assert BYTE.decode(np.concatenate([ids, [BYTE.eos_id]])) == s
    assert BYTE.decode(ids[:-3]) is not None  # cut mid-character: no raise
    tokens = data.document_tokens("ab", BYTE)
    np.testing.assert_array_equal(tokens, [256, 97, 98, 256])


@pytest.fixture(scope="module")
def hf_tokenizer_dir(tmp_path_factory):
    """A BPE tokenizer trained on the fly (nothing downloaded), saved as tokenizer.json + tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    d = tmp_path_factory.mktemp("tok")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"])
    corpus = [data.DocumentSource(None)[i][:2000] for i in range(30)]
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>"}}))
    return d


def test_hf_tokenizer(hf_tokenizer_dir):
    tok = data.get_tokenizer(str(hf_tokenizer_dir / "tokenizer.json"))
    assert isinstance(tok, data.HFTokenizer)
    assert tok.vocab_size <= 300 and (tok.bos_id, tok.eos_id) == (1, 2)
    ids = tok.encode("def main():\n    return 0\n")
    assert ids.dtype == np.int32 and ids.size > 0 and ids.max() < tok.vocab_size
    assert tok.decode(ids) == "def main():\n    return 0\n"
    tokens = data.document_tokens("x = 1", tok)
    assert tokens[0] == 1 and tokens[-1] == 2 and (tokens[1:-1] > 2).all()
    data.check_vocab(tok, 300)
    with pytest.raises(ValueError, match=r"model.vocab_size=128 is smaller .*tokenizer.json"):
        data.check_vocab(tok, 128)


def test_hf_tokenizer_errors(tmp_path, hf_tokenizer_dir):
    with pytest.raises(ValueError, match="nope/tokenizer.json.*no such file"):
        data.get_tokenizer(str(tmp_path / "nope" / "tokenizer.json"))
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not a tokenizer")
    with pytest.raises(ValueError, match="tokenizer.json.* cannot be read as a Hugging Face tokenizer"):
        data.get_tokenizer(str(bad))
    no_eos = tmp_path / "noeos"
    no_eos.mkdir()
    (no_eos / "tokenizer.json").write_text((hf_tokenizer_dir / "tokenizer.json").read_text())
    (no_eos / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<missing>"}))
    with pytest.raises(ValueError, match="'<missing>' .* not in its vocabulary"):
        data.get_tokenizer(str(no_eos / "tokenizer.json"))
    with pytest.raises(ValueError, match="gpt2"):
        data.get_tokenizer("gpt2")


def test_hf_tokenizer_batches(tmp_path, hf_tokenizer_dir):
    tok = data.get_tokenizer(str(hf_tokenizer_dir / "tokenizer.json"))
    path, _ = _jsonl(tmp_path, [5, 9, 3, 12, 7, 4] * 4)
    (b,), _ = _batches(path, 1, tok=tok)
    valid = b["segment_ids"] > 0
    assert b["inputs"][valid].max() < tok.vocab_size
    starts = valid & (b["positions"] == 0)
    assert (b["inputs"][starts] == tok.bos_id).all()


# --------------------------------------------------------------------------- packed batches


def test_documents_packing_layout(tmp_path):
    path, docs = _jsonl(tmp_path, [2, 5, 3, 8, 1, 4, 6, 2, 3, 7] * 3)
    batches, _ = _batches(path, 4)
    n_docs = 0
    for b in batches:
        assert {k: (b[k].shape, b[k].dtype.name) for k in KEYS} == {
            **{k: ((2, 64), "int32") for k in KEYS[:4]}, "mask": ((2, 64), "float32")}
        np.testing.assert_array_equal(b["mask"], (b["segment_ids"] > 0).astype(np.float32))
        for r in range(2):
            seg, pos, inp, tgt = (b[k][r] for k in ("segment_ids", "positions", "inputs", "targets"))
            assert (np.diff(seg[seg > 0]) >= 0).all() and (seg[np.argmax(seg == 0):] == 0).all() | (seg > 0).all()
            for s_id in np.unique(seg[seg > 0]):
                idx = np.flatnonzero(seg == s_id)
                assert (np.diff(idx) == 1).all()  # contiguous
                np.testing.assert_array_equal(pos[idx], np.arange(idx.size))  # positions within the document
                assert inp[idx[0]] == BYTE.bos_id and tgt[idx[-1]] == BYTE.eos_id  # whole documents
                np.testing.assert_array_equal(inp[idx[1:]], tgt[idx[:-1]])  # next-token pairs inside it
                n_docs += 1
    assert n_docs > 10
    assert 0.5 < data.packing_efficiency(batches[0]) <= 1.0


@pytest.mark.parametrize("split", ["restart", "continue"])
def test_long_documents_are_split(tmp_path, split):
    path, _ = _jsonl(tmp_path, [60])  # ~330 bytes: 6 pieces of 64
    (b,), _ = _batches(path, 1, global_batch=4, shuffle=False, split_positions=split)
    pieces = [b["positions"][r][b["segment_ids"][r] == 1] for r in range(4)]
    assert all(p.size == 64 for p in pieces)
    expected = [np.arange(64) + (64 * r if split == "continue" else 0) for r in range(4)]
    for p, e in zip(pieces, expected):
        np.testing.assert_array_equal(p, e)
    np.testing.assert_array_equal(b["inputs"][1][0], b["targets"][0][-1])  # the pieces join up


def test_concat_packing(tmp_path):
    path, _ = _jsonl(tmp_path, [2, 5, 3, 8, 1, 4] * 5)
    (b,), _ = _batches(path, 1, packing="concat")
    assert (b["mask"] == 1).all()
    np.testing.assert_array_equal(b["positions"], np.broadcast_to(np.arange(64), (2, 64)))
    np.testing.assert_array_equal(b["inputs"][:, 1:][b["segment_ids"][:, 1:] == b["segment_ids"][:, :-1]],
                                  b["targets"][:, :-1][b["segment_ids"][:, 1:] == b["segment_ids"][:, :-1]])


def test_determinism_and_seed(tmp_path):
    path, _ = _jsonl(tmp_path, list(range(1, 40)))
    a, _ = _batches(path, 3, seed=0)
    b, _ = _batches(path, 3, seed=0)
    c, _ = _batches(path, 3, seed=1)
    assert all(_same(x, y) for x, y in zip(a, b))
    assert not all(_same(x, y) for x, y in zip(a, c))


@pytest.mark.slow
def test_resume_from_state_past_epoch_boundary_shuffled(tmp_path):
    """`get_state` after k batches, restored into a fresh iterator, gives exactly the batches the uninterrupted
    iterator gives next, across several epochs of a small shuffled corpus."""
    path, docs = _jsonl(tmp_path, [3, 9, 1, 14, 6, 2, 11, 5])  # ~1.5 batches per epoch
    full, _ = _batches(path, 12)
    tokens_per_epoch = sum(len(d.encode()) + 1 for d in docs)
    assert 12 * 2 * 64 > 4 * tokens_per_epoch  # the 12 batches span several epochs
    for k in (1, 3, 5, 8):
        _, it = _batches(path, k)
        state = json.loads(json.dumps(it.get_state()))  # JSON round trip: what the checkpoint stores
        fresh = iter(data.make_dataset(data.DocumentSource(path), BYTE, seq_len=64, global_batch=2,
                                       options=data.PipelineOptions(seed=0)))
        fresh.set_state(state)
        for j in range(k, 12):
            assert _same(next(fresh), full[j]), (k, j)


def test_a_process_builds_its_rows_and_any_layout_resumes_from_the_merged_state(tmp_path):
    """Rows built per process (the streams that hold them) equal those rows of the global batch, for row sets of
    any split (halves, interleaved, one row, all rows on every process as under ring or context spanning the
    processes); the states of the processes merge into one from which a different split continues exactly."""
    path, _ = _jsonl(tmp_path, [3, 30, 7, 1, 22, 9, 14, 2, 5, 40, 11, 6] * 3)  # streams that drift apart
    src = data.DocumentSource(path)

    def make(rows):
        return iter(data.make_dataset(src, BYTE, seq_len=32, global_batch=4, options=data.PipelineOptions(seed=0),
                                      rows=rows))

    full = make(None)
    ref = [next(full) for _ in range(24)]  # past the first group of packing bins (16 rows per stream)
    for split in ([[0, 1], [2, 3]], [[0, 2], [1, 3]], [[3]], [[0, 1, 2, 3]] * 2):
        its = [make(rows) for rows in split]
        for it, rows in zip(its, split):
            np.testing.assert_array_equal(it.rows, rows)
            for j in range(20):
                b = next(it)
                assert all(np.array_equal(b[k], ref[j][k][rows]) for k in KEYS), (split, rows, j)
        states = [json.loads(json.dumps(it.get_state())) for it in its]  # per process, JSON round trip
        if split == [[0, 1], [2, 3]]:
            assert states[0]["streams"]["0"] != states[1]["streams"]["2"]  # the streams have drifted apart
            merged = data.merge_states(states)
            for rows in ([0, 1, 2, 3], [1, 2], [3]):  # resumed under another process layout
                it = make(rows)
                it.set_state(merged)
                for j in range(20, 24):
                    assert _same(next(it), {k: v[rows] for k, v in ref[j].items()}), (rows, j)
            with pytest.raises(ValueError, match="not \\[2, 3\\] of this process"):
                make([2, 3]).set_state(states[0])  # process 0's state alone lacks process 1's streams


def test_data_state_saved_before_streams_were_named(tmp_path):
    """A checkpoint's data state of the previous format (Grain's zip state of one process's streams in order)
    continues exactly where it names the streams."""
    path, _ = _jsonl(tmp_path, [3, 30, 7, 1, 22, 9, 14, 2])
    src = data.DocumentSource(path)
    it = iter(data.make_dataset(src, BYTE, seq_len=32, global_batch=2, options=data.PipelineOptions(seed=0)))
    ref = [next(it) for _ in range(4)]
    it = iter(data.make_dataset(src, BYTE, seq_len=32, global_batch=2, options=data.PipelineOptions(seed=0)))
    next(it), next(it)
    legacy = {"parents": [it.get_state()["streams"][s] for s in ("0", "1")]}
    fresh = iter(data.make_dataset(src, BYTE, seq_len=32, global_batch=2, options=data.PipelineOptions(seed=0)))
    fresh.set_state(legacy)
    assert _same(next(fresh), ref[2]) and _same(next(fresh), ref[3])


def test_one_document_serves_every_process(tmp_path):
    """A corpus of one document forms one packing stream, which every process builds and cuts its row from."""
    path, _ = _jsonl(tmp_path, [200])
    src = data.DocumentSource(path)
    full = next(iter(data.make_dataset(src, BYTE, seq_len=64, global_batch=2, options=data.PipelineOptions(seed=0))))
    for row in (0, 1):
        b = next(iter(data.make_dataset(src, BYTE, seq_len=64, global_batch=2, options=data.PipelineOptions(seed=0),
                                        rows=[row])))
        assert _same(b, {k: v[[row]] for k, v in full.items()})
    with pytest.raises(ValueError, match="row indices of the global batch of 2"):
        data.make_dataset(src, BYTE, seq_len=64, global_batch=2, options=data.PipelineOptions(seed=0), rows=[2])


def test_max_tokens(tmp_path):
    path, docs = _jsonl(tmp_path, [5] * 10)
    src = data.DocumentSource(path)
    n0 = data.document_tokens(docs[0], BYTE).size
    assert token_limit(src, BYTE, n0 + 3) == (2, 3)
    (b,), _ = _batches(path, 1, shuffle=False, max_tokens=n0 + 3, global_batch=1)
    seg = b["segment_ids"][0]
    assert (seg == 1).sum() == n0 - 1 and (seg == 2).sum() == 2  # doc 0, then 3 tokens (2 pairs) of doc 1
    np.testing.assert_array_equal(b["inputs"][0][seg == 3][: n0 - 1], b["inputs"][0][seg == 1])  # next epoch


# --------------------------------------------------------------------------- placement


def _mesh(ring=1, context=4):
    return ring_mesh(ring, context)


@pytest.mark.parametrize("ring,context", [(1, 4), (2, 2)], ids=["context4", "ring2-context2"])
def test_put_batch_shards_rows_and_the_zigzag_sequence(tmp_path, ring, context):
    mesh = _mesh(ring, context)
    path, _ = _jsonl(tmp_path, [5] * 20)
    (batch,), _ = _batches(path, 1, seq_len=32, global_batch=4)
    out = put_batch(batch, mesh)
    assert set(out) == set(batch)
    sharding = NamedSharding(mesh, P(("data", "fsdp"), ("ring", "context")))
    c = 32 // (2 * ring)  # zigzag chunk: ring rank r holds chunks r and 2R-1-r, each split over context
    for k, v in out.items():
        assert v.sharding == sharding and v.shape == batch[k].shape and v.dtype == batch[k].dtype
        assert len(v.addressable_shards) == 8
        host = np.asarray(v)
        for r in range(ring):
            block = host[:, r * 2 * c:(r + 1) * 2 * c]
            want = np.concatenate([batch[k][:, r * c:(r + 1) * c], batch[k][:, (2 * ring - 1 - r) * c:(2 * ring - r) * c]], 1)
            np.testing.assert_array_equal(block, want)
        for sh in v.addressable_shards:
            assert sh.data.shape == (4 // (8 // (ring * context)), 32 // (ring * context))
            np.testing.assert_array_equal(np.asarray(sh.data), host[sh.index])
        np.testing.assert_array_equal(natural_order(host, mesh), batch[k])  # per-token results come back


# Two simulated processes of 4 devices each (the mesh's devices in order, as `jax.devices()` gives them process by
# process): (mesh shape, rows each process builds) for the axes that span them.
LAYOUTS = {
    "ring-spans": ((1, 1, 2, 4), [[0, 1, 2, 3]] * 2),  # ring across processes, context inside: every row
    "context-spans": ((1, 1, 1, 8), [[0, 1, 2, 3]] * 2),  # Ulysses across processes: every row
    "fsdp-spans": ((1, 2, 1, 4), [[0, 1], [2, 3]]),  # the batch axes: each process its rows
    "data-and-ring": ((2, 1, 2, 2), [[0, 1], [2, 3]]),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_process_builds_its_rows_and_places_its_sequence_slices(tmp_path, layout):
    """With several processes (simulated), each builds the rows its devices hold (`process_rows`) and places on each
    of its devices exactly the block of the global zigzag batch that device holds; under ring spanning the processes
    a process's devices hold, in token order, its ring rank's two zigzag chunks."""
    from jaxlong.core.batch import batch_sharding, device_block, process_rows, zigzag_order

    shape, want_rows = LAYOUTS[layout]
    mesh = jax.make_mesh(shape, ("data", "fsdp", "ring", "context"), axis_types=(jax.sharding.AxisType.Auto,) * 4)
    position = {d: i for i, d in enumerate(mesh.devices.flat)}

    def process_of(d):
        return position[d] // 4

    ring, seq, gb = shape[2], 64, 4
    glob = np.arange(gb * seq).reshape(gb, seq)  # token (row, position) ids
    zz = glob[:, zigzag_order(seq, ring)] if ring > 1 else glob
    index = batch_sharding(mesh).devices_indices_map((gb, seq))
    for p in (0, 1):
        rows = process_rows(mesh, gb, p, process_of)
        np.testing.assert_array_equal(rows, want_rows[p])
        local = zz[rows]  # what the process builds: its rows, permuted on the host
        held = set()
        for d, idx in index.items():
            if process_of(d) == p:
                np.testing.assert_array_equal(device_block(local, idx, rows, gb), zz[idx])
                held.update(zz[idx].ravel().tolist())
        if layout == "ring-spans":  # ring rank p: chunks p and 3 - p of every row (chunk = seq / 4 tokens)
            c = seq // 4
            chunks = np.concatenate([glob[:, p * c:(p + 1) * c], glob[:, (3 - p) * c:(4 - p) * c]], 1)
            assert held == set(chunks.ravel().tolist())
    with pytest.raises(ValueError, match="holds rows"):
        device_block(zz[[0]], (slice(2, 4), slice(None)), np.array([0]), gb)


def test_put_batch_of_this_process_rows():
    """`put_batch` with the rows of this process: in one process they are every row, in any order of building."""
    mesh = _mesh(1, 4)
    batch = {"inputs": np.arange(4 * 8, dtype=np.int32).reshape(4, 8)}
    out = put_batch(batch, mesh, rows=np.arange(4), global_batch=4)
    np.testing.assert_array_equal(np.asarray(out["inputs"]), batch["inputs"])
    with pytest.raises(ValueError, match="holds rows"):
        put_batch({"inputs": batch["inputs"][:2]}, mesh, rows=np.array([0, 1]), global_batch=4)


def test_put_batch_indivisible():
    with pytest.raises(ValueError, match="inputs"):
        put_batch({"inputs": np.zeros((3, 8), np.int32)}, _mesh())


# --------------------------------------------------------------------------- .parquet / .array_record sources


def _parquet(path, texts, *, row_group_size=7, field="text", **columns):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({field: pa.array(texts, pa.string()), **columns}), path, row_group_size=row_group_size)
    return path


def test_parquet_reads_the_jsonl_documents_across_row_groups(tmp_path):
    path, docs = _jsonl(tmp_path, [1 + 3 * i for i in range(30)])
    docs[4] = ""  # an empty string is an empty document in both formats
    path.write_text("".join(json.dumps({"text": d}) + "\n\n" for d in docs), encoding="utf-8")  # blank lines: none
    texts = [t for d in docs for t in (d, None)]  # nulls: no document, like the blank lines
    pq_path = _parquet(tmp_path / "c.parquet", texts, row_group_size=7, id=list(range(len(texts))))
    import pyarrow.parquet as pq

    assert pq.ParquetFile(pq_path).metadata.num_row_groups == 9
    js, pqs = data.DocumentSource(path), data.DocumentSource(pq_path)
    assert len(pqs) == len(js) == 30
    assert [pqs[i] for i in range(30)] == [js[i] for i in range(30)] == docs
    a, _ = _batches(path, 3, seed=3)
    b, _ = _batches(pq_path, 3, seed=3)
    assert all(_same(x, y) for x, y in zip(a, b))


def test_parquet_random_access_reads_one_row_group_at_a_time(tmp_path):
    import pickle

    docs = [f"document {i} " + "x" * i for i in range(40)]
    src = data.DocumentSource(_parquet(tmp_path / "c.parquet", docs, row_group_size=6))
    part = src.parts[0]
    assert isinstance(part, data.sources.ParquetDocuments) and len(part.rows) == 7
    reads = []
    read = part._file.read_row_group
    part._file.read_row_group = lambda g, **kw: reads.append(g) or read(g, **kw)
    assert [src[i] for i in range(40)] == docs
    assert reads == list(range(7))  # in order: each row group decoded once
    order = np.random.default_rng(0).permutation(40)
    assert [src[int(i)] for i in order] == [docs[i] for i in order]
    assert src[-1] == docs[-1]
    with pytest.raises(IndexError):
        src[40]
    copy = pickle.loads(pickle.dumps(src))  # Grain workers get a pickled source
    assert [copy[int(i)] for i in order[:10]] == [docs[i] for i in order[:10]]


def test_directory_mixing_parquet_jsonl_and_txt(tmp_path):
    d = tmp_path / "d"
    (d / "sub").mkdir(parents=True)
    _, jdocs = _jsonl(d, [3, 4], name="a.jsonl")
    _parquet(d / "b.parquet", ["p0", None, "p1", "p2"], row_group_size=2)
    (d / "sub" / "c.txt").write_text("a text file")
    src = data.DocumentSource(d)
    assert [src[i] for i in range(len(src))] == [*jdocs, "p0", "p1", "p2", "a text file"]


@pytest.mark.parametrize("case", ["no_column", "not_string", "not_parquet", "all_null", "no_pyarrow"])
def test_bad_parquet_names_the_file_and_option(tmp_path, case, monkeypatch):
    f = tmp_path / "x.parquet"
    if case == "not_parquet":
        f.write_text("not parquet at all")
        match = r"x.parquet is not a readable Parquet file"
    elif case == "all_null":
        _parquet(f, [None, None])
        match = r"x.parquet'.*corpus is empty"
    else:
        _parquet(f, ["a", "b"], field="body", title=["t", "u"], n=[1, 2])
        match = {"no_column": r"x.parquet has no column 'text' \(data.text_field='text'\); its string columns: "
                              r"\['body', 'title'\]",
                 "not_string": r"x.parquet column 'n' has type int64, not a string \(data.text_field='n'\)",
                 "no_pyarrow": r"x.parquet needs the pyarrow package.*pip install 'jaxlong\[parquet\]'"}[case]
    if case == "no_pyarrow":
        import importlib.util

        find = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "pyarrow" else find(name, *a))
    with pytest.raises(ValueError, match=match):
        data.DocumentSource(f, text_field="n" if case == "not_string" else "text")


def test_array_record_documents(tmp_path):
    pytest.importorskip("array_record")
    from array_record.python.array_record_module import ArrayRecordWriter

    docs = ["first document", "", "third — unicode ✓", "x" * 5000]
    w = ArrayRecordWriter(str(tmp_path / "c.array_record"), "group_size:1")
    for d in docs:
        w.write(d.encode("utf-8"))
    w.close()
    src = data.DocumentSource(tmp_path / "c.array_record")
    assert [src[i] for i in (3, 0, 2, 1)] == [docs[i] for i in (3, 0, 2, 1)]
    w = ArrayRecordWriter(str(tmp_path / "bin.array_record"), "group_size:1")
    w.write(b"\x00\x01binary")
    w.close()
    with pytest.raises(ValueError, match="bin.array_record is not a text file"):
        data.DocumentSource(tmp_path / "bin.array_record")


@pytest.mark.slow
def test_train_cli_on_a_parquet_corpus(tmp_path, capsys):
    from helpers import TINY
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from jaxlong.train.__main__ import main

    docs = [f"def f{i}(x):\n    return x * {i}\n" * (1 + i % 4) for i in range(60)]
    path = _parquet(tmp_path / "c.parquet", docs, row_group_size=8)
    args = [*TINY, "mesh.fsdp=2", "mesh.context=4", "seq_len=128", "global_batch=4", "model.vocab_size=257",
            "steps=2", "eval_every=0", f"run_dir={tmp_path}", "run_name=pq", f"data.path={path}"]
    assert main(args) == 0
    losses = [e.value for e in EventAccumulator(str(tmp_path / "pq")).Reload().Scalars("loss")]
    assert len(losses) == 2 and all(np.isfinite(losses))
    capsys.readouterr()
    assert main([*args, "run_name=bad", "data.text_field=body"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "c.parquet has no column 'body' (data.text_field='body')" in err


def test_read_ahead_changes_no_batch_and_no_state(tmp_path):
    """`data.read_threads` / `data.read_buffer` (Grain's read-ahead) change neither the batches nor the saved state:
    reading in the consuming thread one document ahead and on 8 threads 100 ahead give the same, and a state saved
    under one continues under the other."""
    path, _ = _jsonl(tmp_path, [3, 30, 7, 1, 22, 9, 14, 2, 5, 40, 11, 6] * 2)
    src = data.DocumentSource(path)

    def make(threads, buffer):
        return iter(data.make_dataset(src, BYTE, seq_len=32, global_batch=4,
                                      options=data.PipelineOptions(seed=0, read_threads=threads, read_buffer=buffer)))

    slow, fast = make(0, 1), make(8, 100)
    for _ in range(10):
        assert _same(next(slow), next(fast))
    assert slow.get_state() == fast.get_state()
    resumed = make(8, 100)
    resumed.set_state(slow.get_state())
    assert _same(next(resumed), next(slow))
    with pytest.raises(ValueError, match="data.read_threads=-1 must be >= 0"):
        make(-1, 1)
