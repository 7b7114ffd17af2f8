"""Chat data for SFT (`jaxlong.data.chat_data`): records in TRL's formats, rendered by a chat template, the loss
on assistant tokens found by `{% generation %}` tags and turn by turn alike; a template that renders past turns
differently refused under `data.chat_turns=all`; conversations packed whole with document masks, too long ones
refused or dropped, mixed with text; the SFT loss of packed conversations on a context-parallel mesh with
gradient accumulation equal to a by-hand loss of each conversation alone on one device, forward and gradients;
(slow tier) SmolLM2-135M-Instruct's template against transformers' token ids and assistant masks."""

import json
import re
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import assert_trees_close, mesh_for, reference_cfg, tiered, tiny_cfg

from jaxlong.config import runtime
from jaxlong import data as data_lib
from jaxlong.config import ConfigError
from jaxlong.core.batch import put_batch
from jaxlong.data.chat import ChatTemplate
from jaxlong.data.chat_data import ChatSource, encode_conversation
from jaxlong.data.tokenizer import ByteTokenizer
from jaxlong.layers import loss as loss_lib
from jaxlong.models import llama
from jaxlong.training import step as step_lib
from jaxlong.objectives.lm import LanguageModeling
from jaxlong.training.accumulate import loss_and_grads

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "smollm2" / "chat_sft.json"
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
TAGGED = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}{% generation %}"
          "{{ m['content'] + '<|im_end|>\\n' }}{% endgeneration %}{% else %}"
          "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# Qwen3-like: an assistant turn's reasoning is shown only in the last turn
DROPS_PAST = ("{% for m in messages %}{% set c = m['content'] %}{% if m['role'] == 'assistant' and not loop.last %}"
              "{% set c = c.split('</think>')[-1] %}{% endif %}{{ '<|im_start|>' + m['role'] + '\\n' + c + "
              "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
CHATS = [
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]},
    {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"},
                  {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"},
                  {"role": "assistant", "content": "6, of course"}]},
    {"prompt": [{"role": "user", "content": "name a colour"}], "completion": [{"role": "assistant", "content": "teal"}]},
    {"prompt": "The sky is", "completion": " blue."},
]


def _files(tmp_path, records=CHATS, template=CHATML):
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "t.jinja").write_text(template)
    return tmp_path / "chat.jsonl", tmp_path / "t.jinja"


def _source(path, template_file, seq_len=256, **kw):
    return ChatSource(path, ByteTokenizer(), ChatTemplate(template_file.parent, template_file, mark_generation=True),
                      seq_len, **kw)


def _trained_text(c):
    return ByteTokenizer().decode(np.where(c.trained, c.tokens, -1))


def test_assistant_tokens_by_tags_equal_those_by_turns_and_only_they_are_trained(tmp_path):
    path, plain = _files(tmp_path)
    (tmp_path / "tagged.jinja").write_text(TAGGED)
    by_turn, by_tag = _source(path, plain), _source(path, tmp_path / "tagged.jinja")
    expected = ["hello there<|im_end|>\n", "4<|im_end|>\n6, of course<|im_end|>\n", "teal<|im_end|>\n", " blue."]
    for i, want in enumerate(expected):
        a, b = by_turn[i], by_tag[i]
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.trained, b.trained)
        assert _trained_text(a) == want
    assert by_turn[3].trained[-1] and by_turn[3].tokens[-1] == ByteTokenizer.eos_id  # EOS closes a text answer
    last = _source(path, plain, turns="last")
    assert _trained_text(last[1]) == "6, of course<|im_end|>\n"


def test_a_template_that_drops_past_reasoning_trains_the_last_turn_or_is_refused(tmp_path):
    rec = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "<think>x</think>b"},
                        {"role": "user", "content": "c"}, {"role": "assistant", "content": "<think>y</think>d"}]}
    path, tpl = _files(tmp_path, [rec], DROPS_PAST)
    with pytest.raises(ValueError, match=r"chat.jsonl:1: the chat template renders assistant turn 1 differently .*"
                                         r"\(data.chat_turns=last\)"):
        _source(path, tpl)
    assert _trained_text(_source(path, tpl, turns="last")[0]) == "<think>y</think>d<|im_end|>\n"


@pytest.mark.parametrize("line, error", [
    ('{"text": "x"}', r'chat.jsonl:2: a chat record needs \{"messages"'),
    ('{"messages": [{"role": "user", "content": "x"}]}', "chat.jsonl:2: no assistant message to train on"),
    ('{"messages": [{"role": "user"}]}', r"chat.jsonl:2: messages\[0\] must be a message"),
    ("not json", "chat.jsonl:2 is not valid JSON"),
    ('{"prompt": "x", "completion": [{"role": "assistant", "content": "y"}]}',
     "chat.jsonl:2: prompt and completion must both be text or both lists of messages"),
])
def test_bad_records_are_named_by_file_and_line(tmp_path, line, error):
    path, tpl = _files(tmp_path)
    path.write_text(json.dumps(CHATS[0]) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=error):
        _source(path, tpl)


def test_the_span_markers_of_generation_tags_are_refused_in_content(tmp_path):
    path, tpl = _files(tmp_path, [{"messages": [{"role": "user", "content": "a\ue000"},
                                                {"role": "assistant", "content": "b"}]}], TAGGED)
    with pytest.raises(ValueError, match=r"chat.jsonl:1: a message contains U\+E000 or U\+E001"):
        _source(path, tpl)


def test_a_conversation_longer_than_seq_len_is_refused_or_dropped_never_cut(tmp_path):
    path, tpl = _files(tmp_path)
    n = len(_source(path, tpl)[1]) - 1
    with pytest.raises(ValueError, match=rf"chat.jsonl:2 is {n + 1} tokens \({n} next-token pairs\), more than "
                                         rf"seq_len={n - 1} pairs; a conversation is never cut: .* data.too_long=drop"):
        _source(path, tpl, seq_len=n - 1)
    kept = _source(path, tpl, seq_len=n - 1, too_long="drop")
    assert kept.dropped == 1 and len(kept) == 3 and max(kept.lengths) <= n - 1


def test_config_refuses_chat_with_concatenation_or_a_token_cap(tmp_path):
    with pytest.raises(ConfigError, match=r"data.path is null \(the embedded corpus, which is text\)"):
        tiny_cfg("data.format=chat")
    with pytest.raises(ConfigError, match="data.packing='concat' would let conversations attend to each other"):
        tiny_cfg("data.format=chat", "data.path=x.jsonl", "data.packing=concat")
    with pytest.raises(ConfigError, match="data.max_tokens would cut a conversation"):
        tiny_cfg("data.format=chat", "data.path=x.jsonl", "data.max_tokens=100")
    with pytest.raises(ConfigError, match="data.chat_turns='first' is not allowed"):
        tiny_cfg("data.format=chat", "data.path=x.jsonl", "data.chat_turns=first")
    path, _ = _files(tmp_path)
    missing = tiny_cfg("data.format=chat", f"data.path={path}", "data.chat_template=nope.jinja")
    with pytest.raises(ValueError, match="data.chat_template='nope.jinja': no such file"):
        data_lib.first_source(missing, ByteTokenizer())  # when the run starts: a trained run keeps its copy


def _chat_cfg(tmp_path, *extra):
    path, tpl = _files(tmp_path, CHATS * 3)
    return tiny_cfg("model.vocab_size=257", f"data.path={path}", "data.format=chat", f"data.chat_template={tpl}",
                    "eval_every=0", *extra)


def test_packed_conversations_keep_their_assistant_mask_and_mix_with_text(tmp_path):
    cfg = _chat_cfg(tmp_path, "global_batch=2", "seq_len=256")
    tok = ByteTokenizer()
    source = data_lib.first_source(cfg, tok)
    batch = next(data_lib.batch_iterator(cfg, tok, source=source))
    for row in range(2):  # every packed conversation: its segment's mask is its trained targets
        seg = batch["segment_ids"][row]
        for s in set(seg[seg > 0].tolist()):
            at = seg == s
            inputs = batch["inputs"][row][at]
            conv = next(source[i] for i in range(len(source)) if np.array_equal(source[i].tokens[:-1], inputs))
            np.testing.assert_array_equal(batch["mask"][row][at], conv.trained[1:])
    mixed = _chat_cfg(tmp_path, "global_batch=2", "seq_len=256", "data.path=null",
                      f"data.sources=[{{path: {tmp_path / 'chat.jsonl'}, name: chat}}, {{path: null, format: text}}]")
    b = next(data_lib.batch_iterator(mixed, tok))
    src, mask = b[data_lib.SOURCE_FEATURE], b["mask"]
    assert mask[src == 2].all() and 0 < mask[src == 1].mean() < 0.5  # text: every token; chat: the answers


MESHES = {  # slow tier: Ulysses x ring with FSDP and two micro-batches; U-Pipe x ring, tiled loss. The fast tier's
    # context-parallel equality of packed documents with masks is DPO's (tests/training/test_dpo.py); the assistant
    # masks themselves are checked on the host above
    "ulysses-ring-fsdp-accum2": ("mesh.fsdp=2", "mesh.ring=2", "mesh.context=2", "grad_accum=2"),
    "upipe-ring-tiled": ("mesh.fsdp=1", "mesh.ring=2", "mesh.context=4", "attention.impl=upipe",
                         "attention.heads_per_stage=4", "tiling.loss=true", "tiling.loss_tile=16"),
}


@pytest.mark.parametrize(*tiered("mesh", list(MESHES), fast=set(), ids=list(MESHES)))
def test_sft_loss_on_a_context_parallel_mesh_equals_each_conversation_alone(tmp_path, mesh):
    """Packed conversations on the mesh against a by-hand masked loss: each conversation alone on one device
    (positions from 0, no packing), its assistant targets' losses summed over all, divided by their count."""
    cfg = _chat_cfg(tmp_path, "global_batch=4", "seq_len=256", "attention.block_q=16", "attention.block_k=16",
                    *MESHES[mesh])
    tok = ByteTokenizer()
    batch = next(data_lib.batch_iterator(cfg, tok, source=data_lib.first_source(cfg, tok)))
    batch.pop(data_lib.SOURCE_FEATURE, None)
    mesh = mesh_for(cfg, cfg.mesh.num_devices)
    params = step_lib.init_state(cfg, mesh)["params"]
    rt, graphdef = runtime(cfg, mesh), llama.model_graphdef(cfg.model, cfg.param_dtype)
    loss, grads = jax.jit(lambda p, b: loss_and_grads(LanguageModeling(), p, b, cfg.grad_accum, graphdef, rt)[:2])(
        params, put_batch(batch, mesh))

    ref = reference_cfg(cfg)
    ref_mesh = mesh_for(ref, 1)
    host = jax.tree.map(np.asarray, params)
    ref_params = jax.tree.map(lambda h, p: jax.device_put(h, p.sharding), host,
                              step_lib.init_state(ref, ref_mesh)["params"])
    ref_rt, ref_graphdef = runtime(ref, ref_mesh), llama.model_graphdef(ref.model, ref.param_dtype)

    alone = {k: [] for k in ("inputs", "targets", "mask")}  # each conversation its own row, padded at the end
    for row in range(cfg.global_batch):
        seg = batch["segment_ids"][row]
        for s in sorted(set(seg[seg > 0].tolist())):
            at = np.flatnonzero(seg == s)
            for k in alone:
                alone[k].append(np.pad(batch[k][row][at], (0, cfg.seq_len - at.size)))
    x, t, m = (np.stack(alone[k]) for k in ("inputs", "targets", "mask"))

    def by_hand(p):  # positions 0.. per row, no segment ids: nothing to leak across conversations
        hidden, head = llama.forward(ref_graphdef, p, x, ref_rt)
        return jax.numpy.sum(loss_lib.token_losses(hidden, head, t) * m) / m.sum()

    ref_loss, ref_grads = jax.jit(jax.value_and_grad(by_hand))(ref_params)
    assert len(x) > cfg.global_batch  # several conversations share a row
    assert batch["mask"].sum() < 0.6 * (batch["segment_ids"] > 0).sum()  # the loss is on the answers only
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    assert_trees_close(jax.tree.map(np.asarray, grads), jax.tree.map(np.asarray, ref_grads), rtol=1e-4, atol=1e-7)


def test_encode_needs_a_template_for_messages():
    with pytest.raises(ValueError, match="a conversation needs a chat template"):
        encode_conversation({"messages": CHATS[0]["messages"], "first": 0}, ByteTokenizer(), None)


@pytest.mark.slow
def test_smollm2_template_gives_transformers_ids_and_assistant_masks(tmp_path):
    """SmolLM2-135M-Instruct's own template (no generation tags: turn by turn) and the same with tags
    (`data.chat_template`) give the ids of transformers' `apply_chat_template` and the tokens its
    `return_assistant_tokens_mask` marks (tests/make_smollm2_chat.py)."""
    import sys  # noqa: PLC0415

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import smollm2  # noqa: PLC0415

    from jaxlong.data.tokenizer import HFTokenizer  # noqa: PLC0415

    golden = json.loads(FIXTURE.read_text(encoding="utf-8"))
    directory = smollm2.build()
    tok = HFTokenizer(directory)
    (tmp_path / "tagged.jinja").write_text(golden["tagged_template"])
    for template in (ChatTemplate(directory, mark_generation=True),
                     ChatTemplate(directory, tmp_path / "tagged.jinja", mark_generation=True)):
        for case in golden["cases"]:
            c = encode_conversation({"messages": case["messages"]}, tok, template)
            assert c.tokens.tolist() == case["ids"]
            assert c.trained.astype(int).tolist() == case["assistant_masks"]


def test_chat_batches_resume_from_the_saved_data_state(tmp_path):
    cfg = _chat_cfg(tmp_path, "global_batch=2", "seq_len=256")
    tok = ByteTokenizer()
    it = data_lib.batch_iterator(cfg, tok)
    for _ in range(2):
        next(it)
    state = json.loads(json.dumps(it.get_state()))  # as a checkpoint stores it
    want = next(it)
    again = data_lib.batch_iterator(cfg, tok, state=state)
    got = next(again)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])
    assert 0 < want["mask"].sum() < (want["segment_ids"] > 0).sum()


def test_held_out_conversations_stay_out_of_every_source_that_reads_their_file(tmp_path):
    """Two sources read one chat file (different length rules): the conversations validation holds out are in
    neither's training batches."""
    from jaxlong.data.heldout import held_out_documents  # noqa: PLC0415

    path, tpl = _files(tmp_path, [{"messages": [{"role": "user", "content": f"q{i}"},
                                                {"role": "assistant", "content": f"answer number {i}"}]}
                                  for i in range(40)])
    cfg = tiny_cfg("model.vocab_size=257", "data.format=chat", f"data.chat_template={tpl}", "seq_len=256",
                   "global_batch=2", f"data.sources=[{{path: {path}, name: a}}, {{path: {path}, name: b, "
                                     f"min_doc_tokens: 10}}]")
    tok = ByteTokenizer()
    source = data_lib.first_source(cfg, tok)
    held = held_out_documents(source, tok, 0.2, seed=0)
    it = data_lib.batch_iterator(cfg, tok, source=source, exclude=held)
    seen = set()
    for _ in range(12):
        b = next(it)
        seen |= {int(n) for n in re.findall(rb"answer number (\d+)", np.where(b["inputs"] < 256, b["inputs"], 32)
                                                                       .astype(np.uint8).tobytes())}
    answers = {int(re.search(r"\d+", source[i].tokens[:-1].astype(np.uint8).tobytes().decode()[-40:]).group())
               for i in held}
    assert len(seen) > 20 and not seen & answers, (sorted(seen & answers), sorted(answers))


def test_each_source_of_a_mixture_logs_its_own_loss(tmp_path):
    """The train step of a chat + text mixture (two micro-batches) reports each source's mean loss over its counted
    targets (the chat source's assistant tokens, every text token), equal to the per-token losses of a reference
    forward summed per source by hand."""
    path, tpl = _files(tmp_path, CHATS * 3)
    cfg = tiny_cfg("model.vocab_size=257", "seq_len=256", "global_batch=2", "grad_accum=2", "mesh.num_devices=1",
                   "mesh.fsdp=1", "mesh.context=1", f"data.chat_template={tpl}", "eval_every=0",
                   f"data.sources=[{{path: {path}, name: chat, format: chat}}, {{path: null, name: text}}]")
    batches = data_lib.batch_iterator(cfg, ByteTokenizer())
    batch = next(b for b in batches if {1, 2} <= set(b[data_lib.SOURCE_FEATURE].ravel().tolist()))  # both sources
    mesh = mesh_for(cfg, 1)
    state = step_lib.init_state(cfg, mesh)
    rt, graphdef = runtime(cfg, mesh), llama.model_graphdef(cfg.model, cfg.param_dtype)
    hidden, head = llama.forward(graphdef, state["params"], batch["inputs"], rt, batch["positions"],
                                 batch["segment_ids"])
    tl = np.asarray(loss_lib.token_losses(hidden, head, batch["targets"])) * batch["mask"]
    src = batch[data_lib.SOURCE_FEATURE]
    want = [tl[src == k].sum() / batch["mask"][src == k].sum() for k in (1, 2)]
    _, m = step_lib.make_train_step(cfg, mesh)(state, put_batch(batch, mesh))
    assert batch["mask"][src == 1].sum() < (src == 1).sum() and batch["mask"][src == 2].all()
    np.testing.assert_allclose(np.asarray(m["source_loss"]), want, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(m["source_tokens_trained"]), [batch["mask"][src == k].sum() for k in (1, 2)])
    np.testing.assert_allclose(float(m["loss"]), tl.sum() / batch["mask"].sum(), rtol=1e-5)


def test_a_run_keeps_its_chat_template_for_generation_once_the_file_is_gone(tmp_path):
    from jaxlong.data.chat import run_template  # noqa: PLC0415
    from jaxlong.data.imported import keep_chat_template  # noqa: PLC0415

    path, tpl = _files(tmp_path, template=TAGGED)
    cfg = tiny_cfg("data.format=chat", f"data.path={path}", f"data.chat_template={tpl}")
    run_dir = tmp_path / "run"
    keep_chat_template(cfg, run_dir, write=True)
    tpl.unlink()
    template = run_template(cfg.data.chat_template, None, run_dir=run_dir)  # generate/eval --chat on the run
    assert template.render([{"role": "user", "content": "hi"}]) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ValueError, match="no such file"):
        run_template(cfg.data.chat_template, None)  # without the run's copy
