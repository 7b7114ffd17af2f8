"""The data section of the config (`data.*`): the corpus or a mixture of sources (`data.sources`), the tokenizer,
packing, chat and preference data, and their checks (docs/data.md, docs/post-training.md)."""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxlong.core.errors import ConfigError, check_choice
from jaxlong.data.chat_data import ChatTurns, DataFormat, TooLong
from jaxlong.data.mixture import source_name
from jaxlong.data.pipeline import Packing, SplitPositions
from jaxlong.data.tokenizer import TOKENIZERS

__all__ = ["DataConfig", "SourceConfig", "check_data", "check_sources", "check_chat"]


@dataclass
class SourceConfig:
    """One corpus of a data mixture (`data.sources`, `jaxlong.data.mixture`): its share of the training tokens
    and its length rules, in tokens of `data.tokenizer` (a document is `[BOS] text [EOS]`)."""

    path: str | None = None  # as `data.path`; null: the embedded corpus
    weight: float = 1.0  # share of the training tokens, relative to the other sources' weights
    name: str = ""  # the name TensorBoard's data/share/NAME uses; "" derives it from the path
    text_field: str | None = None  # null: `data.text_field`
    min_doc_tokens: int = 0  # shorter documents are dropped
    max_doc_tokens: int | None = None  # longer documents are dropped (null: none)
    long_doc_tokens: int = 0  # a document this long or longer is "long"; 0: seq_len // 2
    upsample_long: float = 1.0  # long documents are drawn this many times as often (>= 1)
    format: str | None = None  # "text" or "chat" (conversations, docs/post-training.md); null: `data.format`


@dataclass
class DataConfig:
    """Training text. `path: null` is the embedded corpus: the Python standard library's source files.
    `sources` (a list of `SourceConfig`) mixes several corpora instead; `path` must be null then."""

    path: str | None = None
    tokenizer: str = "byte"  # "byte", or a path to a Hugging Face tokenizer.json
    max_tokens: int | None = None  # cap on corpus tokens read (None: all)
    text_field: str = "text"  # the field of each .jsonl / .parquet record that holds the document
    packing: Packing = "documents"  # "documents" (whole documents, segment ids) or "concat" (concatenate and cut)
    split_positions: SplitPositions = "restart"  # pieces of a long document: positions "restart" at 0 or "continue"
    shuffle: bool = True  # shuffle the documents each epoch (seeded by `seed` and the epoch)
    # Per packing stream: threads that read and tokenize ahead, and documents read ahead (Grain's ReadOptions;
    # its defaults of 16 and 500 cost seconds of start-up per stream and are slower on a few cores). No batch
    # depends on them.
    read_threads: int = 4
    read_buffer: int = 64
    sources: list[SourceConfig] = field(default_factory=list)
    # Post-training (docs/post-training.md): "chat" reads conversations ({"messages": [...]} or prompt/completion
    # records), renders them with the chat template and trains on the assistant's tokens only.
    format: DataFormat = "text"
    chat_turns: ChatTurns = "all"  # assistant turns trained: "all", or the "last" of each conversation
    too_long: TooLong = "refuse"  # a conversation longer than seq_len: "refuse" (stop) or "drop" (counted)
    chat_template: str | None = None  # a Jinja file that replaces the tokenizer's template (or gives one)
    # Preference pairs: the row holds each pair's prompt once, chosen and rejected as two branches after it
    # (jaxlong.data.preference): fewer positions, the same loss.
    shared_prompt: bool = False
    # For plans only (`python -m jaxlong.memory --estimate/--fit`, jaxlong.plan.packing): a sample of the data's
    # document lengths in tokens, so a plan of packed documents counts the attention tiles the kernels skip between
    # documents; [] measures a chat or preference file where it exists, else counts dense causal attention.
    doc_lengths: list[int] = field(default_factory=list)


def check_data(d: DataConfig) -> None:
    """The data section: the corpus, the tokenizer, packing and reading options, a mixture's sources
    (`check_sources`) and chat data's rules (`check_chat`). Whether each corpus exists and what its documents hold is
    checked when the pipeline opens it (`jaxlong.data.batch_iterator`), before anything compiles.

    Raises:
      ConfigError: naming the `data.*` option, its value and what would work.
    """
    if d.path is not None and not str(d.path).strip():
        raise ConfigError("data.path is empty; give a .txt/.jsonl file or directory, or null for the embedded corpus")
    if d.tokenizer not in TOKENIZERS and not str(d.tokenizer).endswith(".json"):
        raise ConfigError(f"data.tokenizer={d.tokenizer!r} is not allowed; choose one of: "
                          f"{', '.join(sorted(TOKENIZERS))}, or the path of a Hugging Face tokenizer.json")
    check_choice("data.packing", d.packing, Packing)
    check_choice("data.split_positions", d.split_positions, SplitPositions)
    if not str(d.text_field).strip():
        raise ConfigError("data.text_field is empty; give the name of the field that holds each document's text")
    if d.read_threads < 0:
        raise ConfigError(f"data.read_threads={d.read_threads} must be >= 0 (0 reads in the training thread)")
    if d.read_buffer < 1:
        raise ConfigError(f"data.read_buffer={d.read_buffer} must be >= 1 document")
    check_sources(d)
    check_chat(d)
    if d.shared_prompt and d.format != "preference":
        raise ConfigError(f"data.shared_prompt=true shares the prompt of preference pairs; data.format is "
                          f"{d.format!r}: set data.format=preference, or data.shared_prompt=false",
                          key="data.shared_prompt", value=True, keys=("data.format",))
    if d.max_tokens is not None and d.max_tokens <= 0:
        raise ConfigError(f"data.max_tokens={d.max_tokens} must be positive, or null for the whole corpus")


def check_sources(d: DataConfig) -> None:
    """`data.sources`: a mixture, each source's weight (finite, > 0) and length rules (`jaxlong.data.mixture`);
    whether each corpus exists and whether its rules keep any of its documents are checked when the pipeline
    opens it (`jaxlong.data.batch_iterator`), before anything compiles.

    Raises:
      ConfigError: naming `data.sources[i].KEY`, its value and what would work.
    """
    if not d.sources:
        return
    if d.path is not None:
        raise ConfigError(f"data.path={d.path!r} and data.sources are both set: give the corpus as one of "
                          "data.sources (with its weight), or drop data.sources")
    if d.max_tokens is not None:
        raise ConfigError("data.max_tokens caps one corpus; with data.sources use each source's own rules "
                          "(min_doc_tokens, max_doc_tokens) or drop data.max_tokens")
    names = set()
    for i, src in enumerate(d.sources):
        at = f"data.sources[{i}]"
        if src.path is not None and not str(src.path).strip():
            raise ConfigError(f"{at}.path is empty; give a .txt/.jsonl/.parquet file or directory, or null for "
                              "the embedded corpus")
        if not 0 < src.weight < float("inf"):  # NaN fails too
            raise ConfigError(f"{at}.weight={src.weight} must be > 0 and finite (its share of the training tokens, "
                              "relative to the other sources' weights, e.g. 1); drop the source to leave it out")
        if src.min_doc_tokens < 0:
            raise ConfigError(f"{at}.min_doc_tokens={src.min_doc_tokens} must be >= 0")
        if src.max_doc_tokens is not None and src.max_doc_tokens <= src.min_doc_tokens:
            raise ConfigError(f"{at}.max_doc_tokens={src.max_doc_tokens} must be > min_doc_tokens="
                              f"{src.min_doc_tokens}, or null")
        if src.long_doc_tokens < 0:
            raise ConfigError(f"{at}.long_doc_tokens={src.long_doc_tokens} must be >= 0 (0: seq_len // 2)")
        if not src.upsample_long >= 1:
            raise ConfigError(f"{at}.upsample_long={src.upsample_long} must be >= 1 (1: long documents as often "
                              "as the corpus has them; drop long ones with max_doc_tokens)")
        if src.text_field is not None and not str(src.text_field).strip():
            raise ConfigError(f"{at}.text_field is empty; give the field that holds each document's text, or null")
        name = source_name(src, i)
        if name in names:
            raise ConfigError(f"{at}: another source has the name {name!r}; give each a distinct name")
        names.add(name)


def check_chat(d: DataConfig) -> None:
    """The chat keys (docs/post-training.md): `data.format` and each source's `format`, `data.chat_turns`,
    `data.too_long`, and what conversations need: whole-document packing (`data.packing=documents`: each
    conversation its own segment), no `data.max_tokens` (it would cut one). `data.chat_template`, the records and
    their lengths are checked when the run starts and opens the source (`jaxlong.data.open_source`), before
    anything compiles (a trained run keeps its copy of the template, so evaluation needs no file).

    Raises:
      ConfigError: naming the option, its value and what would work.
    """
    if any(n <= 0 for n in d.doc_lengths):
        raise ConfigError(f"data.doc_lengths={d.doc_lengths}: document lengths are positive token counts")
    check_choice("data.format", d.format, DataFormat)
    check_choice("data.chat_turns", d.chat_turns, ChatTurns)
    check_choice("data.too_long", d.too_long, TooLong)
    formats = [d.format] if not d.sources else [s.format or d.format for s in d.sources]
    for i, src in enumerate(d.sources):
        if src.format is not None:
            check_choice(f"data.sources[{i}].format", src.format, DataFormat)
    records = ("chat", "preference")
    fmt = next((f for f in formats if f in records), None)
    if fmt is None:
        return
    nulls = [f"data.sources[{i}].path" for i, s in enumerate(d.sources) if formats[i] in records and s.path is None] \
        if d.sources else ["data.path"] * (d.path is None)
    if nulls:
        example = "configs/data/stdlib_chat.jsonl" if fmt == "chat" else "configs/data/stdlib_preference.jsonl"
        raise ConfigError(f"{nulls[0]} is null (the embedded corpus, which is text) under data.format={fmt}: give a "
                          f".jsonl file or directory of {fmt} records ({example} is one)"
                          + (", or format: text for that source" if d.sources else ""))
    if d.packing != "documents":
        raise ConfigError(f"data.packing={d.packing!r} would let conversations attend to each other: {fmt} data "
                          f"packs each conversation as its own document (data.packing=documents)")
    if d.max_tokens is not None:
        raise ConfigError(f"data.max_tokens would cut a conversation; with data.format={fmt} drop it (too long "
                          f"ones: data.too_long)")
