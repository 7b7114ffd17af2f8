"""Data mixtures (`data.sources`, jaxlong.data.mixture): each source's realised share of the training tokens holds
its weight, the mixture is deterministic by seed and resumes exactly, long-document upsampling raises the share
of long documents, the length rules drop what they say, bad mixtures are one-line errors before compiling (each
naming data.sources[i] and its path), heavily repeated sources are warned about, and the trainer logs the realised
shares."""
import json
import re

import numpy as np
import pytest
from helpers import TINY
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from jaxlong import data
from jaxlong.data import heldout
from jaxlong.config import ConfigError, load_config
from jaxlong.data import mixture
from jaxlong.training.checkpoint import config_changes

BYTE = data.ByteTokenizer()
WORDS = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta"]


def _corpus(path, lengths, seed):
    """A .jsonl corpus of documents of about `lengths` bytes each (words of 4-6 bytes with spaces)."""
    rng = np.random.default_rng(seed)
    docs = [" ".join(rng.choice(WORDS, size=max(n // 6, 1))) for n in lengths]
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """Three sources of different document lengths: short (30-200 bytes), medium (100-500), long (300-2,000)."""
    d = tmp_path_factory.mktemp("corpora")
    rng = np.random.default_rng(0)
    return {"short": _corpus(d / "short.jsonl", rng.integers(30, 200, 400), 1),
            "medium": _corpus(d / "medium.jsonl", rng.integers(100, 500, 200), 2),
            "long": _corpus(d / "long.jsonl", rng.integers(300, 2000, 120), 3)}


def _cfg(corpora, weights, *extra, seq_len=256, global_batch=4, **rules):
    sources = ", ".join("{" + ", ".join([f"path: {corpora[name]}", f"weight: {w}",
                                         *(f"{k}: {v}" for k, v in rules.get(name, {}).items())]) + "}"
                        for name, w in weights.items())
    return load_config(None, [*TINY, f"seq_len={seq_len}", f"global_batch={global_batch}",
                              f"data.sources=[{sources}]", *extra])


def _shares(it, names, tokens):
    """Realised token shares of the batches of `it` until `tokens` tokens (padding excluded), and the batches."""
    counts, batches = dict.fromkeys(names, 0), []
    while sum(counts.values()) < tokens:
        b = next(it)
        batches.append(b)
        for k, v in data.source_shares(b[data.SOURCE_FEATURE], names).items():
            counts[k] += v
    total = sum(counts.values())
    return {k: v / total for k, v in counts.items()}, batches


@pytest.mark.parametrize("weights", [{"short": 0.6, "long": 0.4}, {"short": 0.1, "medium": 0.3, "long": 0.6}],
                         ids=["two", "three"])
def test_realised_token_shares_are_within_2_percent_of_the_weights(corpora, weights):
    """Over 10^5 tokens each source's share of the non-padding tokens is its weight (relative) +- 0.02, though
    the sources' documents differ 10x in length (a mixture by documents would be far off)."""
    cfg = _cfg(corpora, weights)
    shares, batches = _shares(data.batch_iterator(cfg, BYTE), list(weights), 100_000)
    total = sum(weights.values())
    for name, w in weights.items():
        assert abs(shares[name] - w / total) <= 0.02, (name, shares)
    for b in batches:  # the source feature marks exactly the tokens that are not padding
        assert np.array_equal(b[data.SOURCE_FEATURE] > 0, b["segment_ids"] > 0)


def test_concat_packing_mixes_by_token_share_too(corpora):
    """`data.packing=concat` (full rows, no padding): every token carries its source and the shares hold."""
    weights = {"short": 0.6, "long": 0.4}
    shares, batches = _shares(data.batch_iterator(_cfg(corpora, weights, "data.packing=concat"), BYTE),
                              list(weights), 100_000)
    assert all((b[data.SOURCE_FEATURE] > 0).all() for b in batches)
    assert abs(shares["short"] - 0.6) <= 0.02, shares


def test_the_mixture_is_deterministic_by_seed_and_resumes_with_the_next_batch(corpora):
    weights = {"short": 0.5, "medium": 0.2, "long": 0.3}
    cfg = _cfg(corpora, weights, long={"upsample_long": 2})
    a = data.batch_iterator(cfg, BYTE)
    first = [next(a) for _ in range(7)]
    state = json.loads(json.dumps(a.get_state()))  # as a checkpoint stores it
    rest = [next(a) for _ in range(6)]
    b = data.batch_iterator(cfg, BYTE)
    assert all(np.array_equal(x[k], y[k]) for x, y in zip(first, (next(b) for _ in range(7))) for k in x)
    resumed = data.batch_iterator(cfg, BYTE, state=state)
    assert all(np.array_equal(x[k], y[k]) for x, y in zip(rest, (next(resumed) for _ in range(6))) for k in x)
    # the tokens each source fed count on from the state: the trainer's realised shares survive a resume
    fed = np.bincount(np.concatenate([x[data.SOURCE_FEATURE].ravel() for x in first + rest]), minlength=4)[1:]
    assert resumed.source_tokens() == a.source_tokens() == fed.tolist()
    other = data.batch_iterator(_cfg(corpora, weights, "seed=1", long={"upsample_long": 2}), BYTE)
    assert not np.array_equal(next(other)["inputs"], first[0]["inputs"])


def _long_share(batches, source: int, threshold: int) -> float:
    """Share of a source's tokens in documents of at least `threshold` tokens (each a segment of a row: the
    documents here are shorter than seq_len, so none is split)."""
    long = total = 0
    for b in batches:
        for seg, src in zip(b["segment_ids"], b[data.SOURCE_FEATURE]):
            for s in np.unique(seg[seg > 0]):
                sel = seg == s
                if src[sel][0] == source:
                    n = int(sel.sum())
                    total += n
                    long += n if n >= threshold else 0
    return long / total


def test_upsampling_long_documents_raises_their_share_and_keeps_the_source_shares(corpora):
    """`upsample_long: 3` on the medium source (documents of 100-500 tokens, long from seq_len // 2 = 256):
    its long documents' share of its tokens goes from p to about 3p / (3p + 1 - p); the sources' shares hold."""
    weights = {"short": 0.5, "medium": 0.5}
    before, plain = _shares(data.batch_iterator(_cfg(corpora, weights, seq_len=512), BYTE), list(weights), 100_000)
    after, upsampled = _shares(data.batch_iterator(_cfg(corpora, weights, seq_len=512,
                                                        medium={"upsample_long": 3}), BYTE), list(weights), 100_000)
    p, q = _long_share(plain, 2, 256), _long_share(upsampled, 2, 256)
    assert 0.2 < p < 0.8 and abs(q - 3 * p / (3 * p + 1 - p)) < 0.05, (p, q)
    for shares in (before, after):
        assert abs(shares["medium"] - 0.5) <= 0.02, shares


def test_length_rules_drop_documents_outside_them(corpora):
    """`min_doc_tokens` / `max_doc_tokens` keep only documents within them (each document one segment)."""
    cfg = _cfg(corpora, {"short": 0.5, "long": 0.5}, seq_len=2048, global_batch=2,
               short={"min_doc_tokens": 100}, long={"max_doc_tokens": 800})
    _, batches = _shares(data.batch_iterator(cfg, BYTE), ["short", "long"], 30_000)
    for b in batches:
        for seg, src in zip(b["segment_ids"], b[data.SOURCE_FEATURE]):
            for s in np.unique(seg[seg > 0]):
                n, which = int((seg == s).sum()), int(src[seg == s][0])
                assert (n >= 100) if which == 1 else (n <= 800), (which, n)


def _lengths(path) -> list[int]:
    """Token counts (next-token pairs of `[BOS] text [EOS]`, as the length rules count) of a .jsonl corpus."""
    return [len(BYTE.encode(json.loads(x)["text"])) + 1 for x in path.read_text().splitlines()]


def test_a_rule_that_keeps_no_document_is_refused_when_the_data_is_opened(corpora):
    """`batch_iterator` (what the trainer calls before compiling) measures every source and refuses rules that keep
    none of its documents: one line naming data.sources[i], its path, the rule, the source's own document count (400,
    not one packing stream's 100) and the lengths seen."""
    longest, shortest = max(_lengths(corpora["short"])), min(_lengths(corpora["long"]))
    best = min(max(_lengths(corpora["short"])[s::4]) for s in range(4))  # each of the 4 streams keeps a document
    cases = [({"short": {"min_doc_tokens": 5000}},
              rf"^data.sources\[0\] \({corpora['short']}\): min_doc_tokens=5000 keeps none of its 400 documents: the "
              rf"longest is {longest} tokens; use min_doc_tokens <= {best} \(each of the 4 packing streams needs a "
              rf"document\), or drop the source$"),
             ({"long": {"max_doc_tokens": 20}},
              rf"^data.sources\[1\] \({corpora['long']}\): max_doc_tokens=20 keeps none of its 120 documents: the "
              rf"shortest is {shortest} tokens; use max_doc_tokens >= {shortest}, or drop the source$"),
             ({"long": {"upsample_long": 2, "long_doc_tokens": 10**6}},
              r"^data.sources\[1\] \(.*\): upsample_long=2 has no long document to draw: none of its 120 documents"),
             ({"short": {"min_doc_tokens": longest}},  # 1 document kept: 3 of the 4 packing streams get none
              rf"^data.sources\[0\] \(.*\): 1 of its 400 documents is within its length rules \(min_doc_tokens="
              rf"{longest}\), and each of the 4 packing streams needs one .*; use min_doc_tokens <= {best}, or")]
    for rules, message in cases:
        with pytest.raises(ValueError, match=message) as e:
            data.batch_iterator(_cfg(corpora, {"short": 0.5, "long": 0.5}, **rules), BYTE)
        assert "\n" not in str(e.value)
    data.batch_iterator(_cfg(corpora, {"short": 0.5, "long": 0.5}, short={"min_doc_tokens": best}), BYTE)  # accepted


def test_a_large_source_is_measured_on_a_sample_and_a_stream_without_a_kept_document_says_so(tmp_path, corpora,
                                                                                                monkeypatch):
    """A source larger than `SAMPLE_DOCUMENTS` is measured on a sample, runs of consecutive documents spread over
    it; a rule that the sample passes but a packing stream's documents do not is refused when that stream first
    reads, naming the source, its path and its own document count."""
    monkeypatch.setattr(mixture, "SAMPLE_DOCUMENTS", 64)
    texts = ["x" * 10] * 400
    lengths = mixture.measure_lengths(texts, lambda t: len(t) + 1)
    assert not lengths.complete and lengths.counted() == "64 documents sampled from its 400"
    assert len(set((lengths.indices * 32 // 400).tolist())) == 32  # 2 documents from each of 32 runs
    texts[int(lengths.indices[0])] = "y" * 100  # the one document min_doc_tokens keeps, in the sample
    path = _corpus(tmp_path / "one_long.jsonl", [], 0)
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    it = data.batch_iterator(_cfg({"one_long": path, **corpora}, {"one_long": 0.5, "long": 0.5},
                                  one_long={"min_doc_tokens": 50}), BYTE)
    with pytest.raises(ValueError, match=rf"^data.sources\[0\] \({path}\): no document within its length rules "
                                         r"\(min_doc_tokens=50\) among the 100 of its 400 documents dealt to packing "
                                         r"stream \d of 4 \(each stream needs one\)"):
        for _ in range(20):
            next(it)


def test_a_source_repeated_heavily_is_warned_about_once_with_its_epochs(tmp_path, corpora, capsys):
    """A two-document source at weight 0.9 (1,100 tokens; 4 x 1,024 tokens a step) is repeated ~3.4 times per step,
    ~67 epochs over 20 steps: one warning line with its counts, none for the large source. Epochs alone (more than
    10) warn too, and figures extrapolated from a sample carry '~'."""
    tiny = tmp_path / "tiny.jsonl"  # 550 tokens each: [BOS] 549 bytes [EOS] is 550 next-token pairs
    tiny.write_text("".join(json.dumps({"text": "x" * 549}) + "\n" for _ in range(2)), encoding="utf-8")
    cfg = load_config(None, [*TINY, "seq_len=1024", "global_batch=4", "steps=20", f"data.sources=[{{path: "
                             f"{corpora['long']}, weight: 0.1}}, {{path: {tiny}, weight: 0.9}}]"])
    data.batch_iterator(cfg, BYTE, warn=print)
    out = capsys.readouterr().out.splitlines()
    assert out == [f"warning: data.sources[1] ({tiny}): 2 documents, 1,100 tokens, at weight 0.9 (90% of the tokens) "
                   "are repeated ~3.4 times per step (~67 epochs over the 20 steps); lower its weight or give it more "
                   "documents"], out
    src = data.MixedSource("b", 1.0, min_tokens=50, label="data.sources[0] (b.jsonl)")
    full = data.SourceLengths(10, np.arange(10), np.full(10, 100))
    assert mixture.repetition_warnings([full], [src], 10, 1000) == []  # 10 epochs: no warning
    assert mixture.repetition_warnings([full], [src], 20, 1000) == [
        "warning: data.sources[0] (b.jsonl): 10 documents within its length rules (min_doc_tokens=50), 1,000 tokens, "
        "at weight 1 (100% of the tokens) are repeated over ~20 epochs in the 1,000 steps; lower its weight or give "
        "it more documents"]
    sampled = data.SourceLengths(1000, np.arange(10), np.full(10, 100))
    (line,) = mixture.repetition_warnings([sampled], [src], 2_000, 1000)
    assert "~1,000 documents within its length rules (min_doc_tokens=50), ~100,000 tokens" in line \
        and "~20 epochs" in line, line


@pytest.mark.parametrize("override, message", [
    ("data.sources=[{path: A, weight: 0}]", r"data.sources\[0\].weight=0.0 must be > 0 and finite"),
    ("data.sources=[{path: A, weight: .inf}, {path: B}]", r"data.sources\[0\].weight=inf must be > 0 and finite"),
    ("data.sources=[{path: A}, {path: B, weight: .nan}]", r"data.sources\[1\].weight=nan must be > 0 and finite"),
    ("data.sources=[{path: A, weight: -1}]", r"data.sources\[0\].weight=-1.0 must be > 0 and finite"),
    ("data.sources=[{path: A, upsample_long: 0.5}]", r"data.sources\[0\].upsample_long=0.5 must be >= 1"),
    ("data.sources=[{path: A, min_doc_tokens: 50, max_doc_tokens: 10}]", r"max_doc_tokens=10 must be > min_doc_tokens"),
    ("data.sources=[{path: A}, {path: A}]", r"data.sources\[1\]: another source has the name 'A'"),
    ("data.sources=[{path: A, weights: 1}]", r"data.sources\[0\]: unknown config key 'weights'"),
    ("data.sources=A", r"data.sources' is a list of sections"),
], ids=["weight", "inf-weight", "nan-weight", "negative-weight", "upsample", "min-max", "same-name", "unknown-key",
        "not-a-list"])
def test_bad_mixtures_are_one_line_config_errors(override, message):
    with pytest.raises(ConfigError, match=message) as e:
        load_config(None, [override])
    assert "\n" not in str(e.value)


def test_data_path_and_sources_together_are_refused():
    with pytest.raises(ConfigError, match="data.path='x.jsonl' and data.sources are both set"):
        load_config(None, ["data.path=x.jsonl", "data.sources=[{path: y.jsonl}]"])


def test_a_changed_mixture_is_a_data_change_on_resume(corpora):
    """`--resume` refuses a changed `data.sources` (the batches would change) as it refuses a changed corpus."""
    a = _cfg(corpora, {"short": 0.6, "long": 0.4})
    b = _cfg(corpora, {"short": 0.5, "long": 0.5})
    from jaxlong.config import Config, to_dict
    changes = config_changes(to_dict(a), to_dict(b), to_dict(Config()))
    assert len(changes) == 1 and changes[0].startswith("data.sources:"), changes


def test_the_trainer_logs_the_realised_shares_and_a_missing_source_is_one_line(corpora, tmp_path, capsys):
    """`python -m jaxlong.train data.sources=[...]` trains on the mixture (validation holds documents out of the
    first source) and writes `data/share/NAME` to TensorBoard; a source that does not exist is one line naming
    it, exit 2, before anything compiles."""
    from jaxlong.train.__main__ import main

    sources = f"data.sources=[{{path: {corpora['short']}, weight: 0.7}}, {{path: {corpora['long']}, weight: 0.3}}]"
    args = [*TINY, "mesh.fsdp=2", "mesh.context=4", "seq_len=128", "global_batch=4", "model.vocab_size=257",
            "steps=6", "eval_every=6", "eval_batches=1", f"run_dir={tmp_path}", "run_name=mix", sources]
    assert main(args) == 0
    ea = EventAccumulator(str(tmp_path / "mix")).Reload()
    shares = {n: ea.Scalars(f"data/share/{n}")[-1].value for n in ("short", "long")}
    # 3,072 tokens over 4 packing streams: within about one 128-token piece per stream of the weights
    assert abs(sum(shares.values()) - 1) < 1e-6 and abs(shares["short"] - 0.7) < 0.1, shares
    assert len(ea.Scalars("eval/loss")) == 1
    capsys.readouterr()
    missing = sources.replace(str(corpora["long"]), str(tmp_path / "nowhere.jsonl"))
    assert main([*args, "run_name=bad", missing]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"error: data.sources[1] ({tmp_path / 'nowhere.jsonl'}): does not "
                                              "exist;"), err


def test_a_validation_split_the_first_source_cannot_fill_names_it_and_its_documents(corpora, tmp_path):
    """With validation on, a first source of two documents that cannot fill the validation batches is one line
    naming data.sources[0], its path and its own document count; so is one of a single document."""
    two = tmp_path / "two.jsonl"
    two.write_text("".join(json.dumps({"text": "x" * 548}) + "\n" for _ in range(2)), encoding="utf-8")
    cfg = load_config(None, [*TINY, "seq_len=128", "global_batch=4", "eval_every=5", "eval_batches=2",
                             f"data.sources=[{{path: {two}, weight: 0.9}}, {{path: {corpora['long']}, weight: 0.1}}]"])
    with pytest.raises(ValueError, match=rf"^data.sources\[0\] \({two}\): eval_batches=2: its 2 documents cannot "
                                         r"fill 2 validation batches of 4 x seq_len=128 tokens") as e:
        heldout.validation_split(cfg, data.first_source(cfg), BYTE)
    assert "\n" not in str(e.value)
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps({"text": "x"}) + "\n", encoding="utf-8")
    cfg = load_config(None, [*TINY, "eval_every=5", f"data.sources=[{{path: {one}}}, {{path: {two}}}]"])
    with pytest.raises(ValueError, match=rf"^data.sources\[0\] \({one}\): eval_fraction=.*: it has 1 document"):
        heldout.validation_split(cfg, data.first_source(cfg), BYTE)


def test_held_out_documents_stay_out_of_every_source_that_reads_their_corpus(tmp_path):
    """Two sources cut from one corpus by length (as the tiny recipe's short and long files): the documents held
    out for validation (indices of the first source's corpus) are left out of both, not only the first."""
    rng = np.random.default_rng(7)
    docs = [f"Q{i:03d}Q " + " ".join(rng.choice(WORDS, size=int(rng.integers(10, 120)))) for i in range(120)]
    path = tmp_path / "one.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    sources = (f"[{{path: {path}, name: short, weight: 0.5, max_doc_tokens: 300}}, "
               f"{{path: {path}, name: long, weight: 0.5, min_doc_tokens: 301}}]")
    cfg = load_config(None, [*TINY, "seq_len=256", "global_batch=4", f"data.sources={sources}"])
    sizes = [len(BYTE.encode(d)) for d in docs]
    held = [i for i in range(len(docs)) if i % 5 == 0]
    assert {sizes[i] > 300 for i in held} == {True, False}  # held-out documents of both sources' lengths
    it = iter(data.batch_iterator(cfg, BYTE, source=data.first_source(cfg), exclude=held))
    seen = set()
    for _ in range(60):
        b = next(it)
        text = bytes(int(t) for t in b["inputs"].ravel() if 0 < t < 256).decode("utf-8", "replace")
        seen |= {int(m) for m in re.findall(r"Q(\d{3})Q", text)}
    assert seen and not seen & set(held), sorted(seen & set(held))
    assert len(seen) > 0.5 * (len(docs) - len(held))  # the rest is trained on
