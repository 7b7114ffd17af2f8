"""`jaxlong.plan.fit` and its command line: the pruned search finds the brute-force winner under a monotone
memory and cost model, respects its compile budget and cache, names the closest candidate when nothing fits, and
runs end to end on a real CPU compile through `python -m jaxlong.memory --fit`."""

import json
import os
import pathlib
import random
import re
import subprocess
import sys

import pytest
from helpers import tiered
from xla_flags import user_env

from jaxlong.config import load_config
from jaxlong.plan import fit as fit_lib
from jaxlong.plan import fit_report as fit_cli
from jaxlong.plan.target import cuda_plugin_available

ROOT = pathlib.Path(__file__).resolve().parents[2]

GiB = 1024**3
TINY = ["model.hidden=64", "model.layers=1", "model.heads=4", "model.kv_heads=2", "model.head_dim=16",
        "model.mlp_hidden=128", "model.vocab_size=256", "seq_len=1024", "global_batch=8", "mesh.fsdp=-1",
        "mesh.context=4", "attention.block_q=128", "attention.block_k=128"]


def _levels(cfg):
    """The fake model's view of a config: one level per dimension, 0 = fastest, most memory."""
    att = 0 if cfg.attention.impl == "ulysses" else 1 + cfg.model.heads // max(cfg.attention.heads_per_stage, 1)
    remat = fit_lib.REMAT_LEVELS.index(cfg.remat.policy)
    mlp = 0 if not cfg.tiling.mlp else (1 if cfg.tiling.mlp_tiles == 0 else 2)
    keep = 0 if cfg.remat.policy == "none" or cfg.remat.keep_attention == cfg.model.layers else 1
    return att, remat, int(cfg.tiling.loss), mlp, keep


class FakeModel:
    """Monotone memory (decreasing in every level) and cost (increasing), random weights; counts plan calls."""

    def __init__(self, seed: int):
        r = random.Random(seed)
        self.mem_w = [r.uniform(0.5, 8) for _ in range(5)]
        self.cost_w = [r.uniform(0.01, 1) for _ in range(5)]
        self.mesh_mem = {c: r.uniform(0, 10) for c in (1, 2, 4, 8)}
        self.mesh_cost = {c: r.uniform(0, 1) for c in (1, 2, 4, 8)}
        self.calls = 0

    def plan(self, cfg, target=None, **kw):
        self.calls += 1
        lv = _levels(cfg)
        total = (60 + self.mesh_mem[cfg.mesh.context] - sum(w * x for w, x in zip(self.mem_w, lv))) * GiB
        host = (40 * GiB if cfg.remat.policy == "offload" else 0) + 20 * GiB * cfg.remat.keep_attention
        return {"peak": total * 0.9, "total": total, "host": host / 8, "host_per_node": host,
                "source": "fake", "estimate": {"step_seconds": self.cost(cfg)}}

    def cost(self, cfg, p=None):
        return 1 + self.mesh_cost[cfg.mesh.context] + sum(w * x for w, x in zip(self.cost_w, _levels(cfg)))


def _brute_force(cfg, model, budget, host_budget):
    _, cands, _ = fit_lib.candidate_space(cfg, 8, 1)
    best = None
    for c in cands:
        cc = fit_lib.configure(cfg, c.overrides)
        p = model.plan(cc)
        if p["total"] <= budget and p["host_per_node"] <= host_budget:
            if best is None or model.cost(cc) < best[1]:
                best = (c.key, model.cost(cc))
    return best, len(cands)


@pytest.mark.parametrize(*tiered("seed", range(12), fast={0, 1}))
def test_pruned_search_finds_the_brute_force_winner_and_skips_nothing_better(seed):
    cfg = load_config(None, TINY)
    model = FakeModel(seed)
    budget = random.Random(100 + seed).uniform(35, 65) * GiB
    host_budget = 30 * GiB if seed % 3 == 0 else 2048 * GiB  # some seeds rule offload out by host memory
    expected, n = _brute_force(cfg, model, budget, host_budget)
    model.calls = 0
    options = fit_lib.FitOptions(max_compiles=10**6, cost_model=model.cost, plan_fn=model.plan, progress=False)
    res = fit_lib.fit(cfg, None, budget=budget, host_budget=host_budget, options=options)
    assert len(res.rows) + len(res.pruned) >= n
    if expected is None:
        assert res.winner is None and res.closest is not None
    else:
        assert res.winner["overrides"] == expected[0]
        assert res.winner["step_seconds"] == pytest.approx(expected[1])
    # no candidate left uncompiled would have fit and been faster than the winner
    for p in res.pruned:
        if p["reason"].startswith("invalid"):
            continue
        cc = fit_lib.configure(cfg, p["overrides"].split())
        q = model.plan(cc)
        fits = q["total"] <= budget and q["host_per_node"] <= host_budget
        assert not (fits and (res.winner is None or model.cost(cc) < res.winner["step_seconds"])), p
    assert res.compiles == len(res.rows) < n  # pruning saved compiles


def test_candidates_are_searched_in_order_of_their_analytic_estimate():
    """The expected-speed order the search bisects is `analytic_cost`, fastest first: the lightest candidate
    (no remat, Ulysses, no tiling) first."""
    cfg = load_config(None, TINY)
    _, cands, _ = fit_lib.candidate_space(cfg, 8, 1)
    costs = [fit_lib.analytic_cost(fit_lib.configure(cfg, c.overrides)) for c in cands]
    assert costs == sorted(costs) and costs[0] < costs[-1]
    assert cands[0].levels == (0, 0, 0, 0, 0)


@pytest.mark.slow
@pytest.mark.gpu_compile
@pytest.mark.subprocess
@pytest.mark.skipif(not cuda_plugin_available(), reason="the CUDA plugin (pip install 'jax[cuda12]') is not installed")
def test_the_default_fit_at_128k_on_8_h100_uses_no_remat_and_no_offload(tmp_path):
    """The documented `python -m jaxlong.memory --fit --target h100 --config configs/llama3_1_8b.yaml
    seq_len=131072` (GPU compile, no GPU): Llama-3.1-8B fits 128K tokens with no remat, so the winner spends no
    speed on remat or host offload (a search that compiles memory savers first spent its 12 compiles, the default,
    before it reached them and picked offload). Run with a third of the default's compiles: a candidate with no
    remat and no offload is among the first 4 (the 4th compile); the default's 12 pick one too (the plan with the
    default MLP tiles, as fast by the estimate), since the candidates after them recompute or offload more."""
    out = tmp_path / "fit.json"
    proc = subprocess.run([sys.executable, "-m", "jaxlong.memory", "--fit", "--target", "h100", "--config",
                           "configs/llama3_1_8b.yaml", "seq_len=131072", "--max-compiles", "4", "--out", str(out)],
                          cwd=ROOT, env=user_env(dict(os.environ), str(ROOT)), capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["compiles"] <= 4 and res["winner"] is not None
    winner = res["winner"]
    assert "remat.policy=none" in winner["overrides"] and winner["host_per_node"] == 0, winner["overrides"]
    assert winner["total"] <= res["budget"]


def test_compile_budget_is_respected_and_the_rest_is_listed():
    cfg = load_config(None, TINY)
    model = FakeModel(3)
    options = fit_lib.FitOptions(max_compiles=3, cost_model=model.cost, plan_fn=model.plan, progress=False)
    res = fit_lib.fit(cfg, None, budget=50 * GiB, host_budget=2048 * GiB, options=options)
    assert model.calls == res.compiles == 3
    assert any("--max-compiles 3 reached" in p["reason"] for p in res.pruned)


def test_cache_hits_cost_no_compile():
    cfg = load_config(None, TINY)
    model, cache = FakeModel(5), {}
    options = fit_lib.FitOptions(max_compiles=100, cost_model=model.cost, plan_fn=model.plan, cache=cache,
                                 progress=False)
    first = fit_lib.fit(cfg, None, budget=50 * GiB, options=options)
    calls = model.calls
    assert calls == first.compiles == len(cache) > 0
    options = fit_lib.FitOptions(max_compiles=1, cost_model=model.cost, plan_fn=model.plan, cache=cache, progress=False)
    again = fit_lib.fit(cfg, None, budget=50 * GiB, options=options)
    assert model.calls == calls and again.compiles == 0
    assert all(r["cached"] for r in again.rows)
    assert [r["overrides"] for r in again.rows] == [r["overrides"] for r in first.rows]


def test_nothing_fits_names_the_closest_candidate_with_its_peak():
    cfg = load_config(None, TINY)
    model = FakeModel(7)
    options = fit_lib.FitOptions(max_compiles=20, cost_model=model.cost, plan_fn=model.plan, progress=False)
    res = fit_lib.fit(cfg, None, budget=1 * GiB, options=options)
    assert res.winner is None
    closest = min(res.rows, key=lambda r: r["total"])
    assert res.closest is closest
    text = fit_cli.format_report(res, 1 * GiB, None)
    assert f"the closest candidate is #{closest['index']} [{fit_lib.strip_implied(closest['overrides'])}] with peak " \
           f"{closest['peak'] / GiB:.1f} GiB" in text
    # the most memory-saving candidate of each mesh split is compiled first; a candidate that does not fit
    # settles only candidates of its own mesh split and attention setting (memory is not monotone across them)
    first = res.rows[:3]
    assert len({r["overrides"].split(" attention")[0] for r in first}) == 3
    assert all("attention.impl=upipe" in r["overrides"] and r["levels"][1] == 3 for r in first)

    def setting(overrides: str) -> str:
        return " ".join(o for o in overrides.split() if o.startswith(("mesh.", "attention.")))

    for p in res.pruned:
        if p["by"] is not None:
            assert setting(p["by"]) == setting(p["overrides"]), p
    assert res.compiles < res.candidates


def test_estimate_cost_model_needs_a_planner_with_estimates():
    cfg = load_config(None, TINY)
    calls = []

    def old_plan(cfg, target=None, *, headroom="2%", collective_buffers=None):
        calls.append(cfg)
        return {}

    options = fit_lib.FitOptions(plan_fn=old_plan, progress=False)
    with pytest.raises(fit_lib.FitError, match="--cost-model analytic"):
        fit_lib.fit(cfg, None, budget=GiB, options=options)
    assert not calls
    with pytest.raises(fit_lib.FitError, match="no step-time estimate"):
        fit_lib.estimated_cost(cfg, {"total": 1})


def test_analytic_cost_is_monotone_along_every_dimension():
    cfg = load_config(None, TINY)
    _, cands, _ = fit_lib.candidate_space(cfg, 8, 1)
    cost = {c: fit_lib.analytic_cost(fit_lib.configure(cfg, c.overrides)) for c in cands}
    for a in cands:
        for b in cands:
            if a != b and a.below(b):
                assert cost[a] <= cost[b], (a.key, b.key)


def test_bad_fit_inputs_are_one_line_errors_before_compiling(capsys):
    from jaxlong.memory import __main__ as memory
    from jaxlong.train import __main__ as train

    assert memory.main(["--fit", "--cost-model", "analytic", "--target", "h999", *TINY]) == 2
    assert "unknown GPU" in capsys.readouterr().err
    assert memory.main(["--fit", "--cost-model", "analytic", "--max-compiles", "0", *TINY]) == 2
    assert "--max-compiles 0" in capsys.readouterr().err
    assert train.main(["--fit", "--cost-model", "analytic", "--budget", "lots", *TINY]) == 2
    err = capsys.readouterr().err
    assert "--budget 'lots'" in err and len(err.strip().splitlines()) == 1
    if not fit_cli.distributed.gpu_driver_present():  # no GPU and no --target: one line naming --target
        assert train.main(["--fit", *TINY]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and "no NVIDIA GPU" in err and "--target h100" in err


@pytest.mark.slow
def test_fit_end_to_end_on_a_real_cpu_compile(tmp_path, capsys):
    """Two real compiles of the train step (CPU approximation), ranked by the closed-form cost."""
    from jaxlong.memory import __main__ as memory

    out = tmp_path / "fit.json"
    rc = memory.main(["--fit", "--cost-model", "analytic", "--max-compiles", "2", "--budget", "1GiB",
                      "--out", str(out), *TINY])
    text = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert rc == 0 and data["winner"] is not None
    assert 1 <= data["compiles"] <= 2 and len(data["compiled"]) == data["compiles"]
    assert all(r["source"].startswith("CPU approximation") for r in data["compiled"])
    assert all(r["total"] > 0 and r["tokens_per_s_per_gpu"] > 0 for r in data["compiled"])
    assert data["command"].startswith("python -m jaxlong.train ") and data["command"] in text
    assert len(data["pruned"]) + data["compiles"] >= data["candidates"]
    win = data["winner"]["overrides"].split()
    # the ready-to-paste command gives back the winner's config
    assert load_config(None, data["command"].split()[3:]) == fit_lib.configure(load_config(None, TINY), win)
    # experiments/fit_report.py renders the search: a row per compiled candidate, the winner's command line
    sys.path.insert(0, str(ROOT))
    from experiments import fit_report

    report = tmp_path / "fit.md"
    assert fit_report.main([str(out), "--out", str(report)]) == 0
    md = report.read_text()
    rows = [line for line in md.splitlines() if re.match(r"\| \d+ \|", line)]
    assert len(rows) == data["compiles"] and "yes, **winner**" in md and data["command"] in md


def test_train_fit_applies_and_prints_the_winners_overrides(monkeypatch, capsys):
    """`python -m jaxlong.train --fit`: the config it trains is the winner's; the default cost model reads the
    plan's step-time estimate (here from a fake planner)."""
    from jaxlong.plan import planner
    from jaxlong.train import __main__ as train

    model = FakeModel(11)
    monkeypatch.setattr(planner, "plan", model.plan)
    monkeypatch.setattr(fit_cli.distributed, "gpu_driver_present", lambda: True)  # the GPUs the fake plans for
    args = train.parse_args(["--fit", "--budget", "50GiB", "--max-compiles", "80", *TINY])
    cfg = fit_cli.fit_for_training(args, load_config(None, args.overrides), args.overrides)
    out = capsys.readouterr().out
    assert model.calls <= 80
    expected, _ = _brute_force(load_config(None, TINY), model, 50 * GiB, 2048 * GiB)
    base = load_config(None, TINY)
    assert cfg == fit_lib.configure(base, expected[0].split())
    printed = [line[5:] for line in out.splitlines() if line.startswith("fit: ")]
    assert printed and set(printed) <= set(expected[0].split())
    assert fit_lib.configure(base, printed) == cfg  # the printed lines are exactly the changes


def test_two_nodes_add_ring_splits_with_and_without_packed_documents():
    """Across nodes the sequence may also be split over `mesh.ring` (hybrid Ulysses x ring); ring attention masks
    packed documents too, so those splits are searched with either `data.packing`."""
    for packing in ("concat", "documents"):
        cfg = load_config(None, [*TINY, f"data.packing={packing}", "seq_len=2048"])
        splits, cands, _ = fit_lib.candidate_space(cfg, 8, 2)
        assert any("mesh.ring=2" in " ".join(s) for s in splits)
        assert any("mesh.ring=2" in c.key for c in cands), packing
        assert all("mesh.num_devices=16" in c.key for c in cands)


def test_a_candidate_that_fails_to_compile_is_listed_and_the_search_goes_on():
    cfg = load_config(None, TINY)
    model = FakeModel(2)

    def flaky(c, target=None, **kw):
        if c.remat.policy == "offload":
            raise RuntimeError("RESOURCE_EXHAUSTED: out of memory while compiling")
        return model.plan(c, target, **kw)

    options = fit_lib.FitOptions(max_compiles=100, cost_model=model.cost, plan_fn=flaky, progress=False)
    res = fit_lib.fit(cfg, None, budget=50 * GiB, options=options)
    failed = [p for p in res.pruned if p["reason"].startswith("does not compile: RuntimeError: RESOURCE_EXHAUSTED")]
    assert failed and all("remat.policy=offload" in p["overrides"] for p in failed)
    assert res.winner is not None and "remat.policy=offload" not in res.winner["overrides"]


def test_a_setup_the_program_refuses_while_tracing_costs_no_compile():
    """A ValueError from tracing (e.g. the Pallas kernel's int32 limit on a long sequence of several heads) rules
    the candidate out without spending the compile budget: the budget goes to setups XLA compiles."""
    cfg = load_config(None, TINY)
    model = FakeModel(3)

    tried = []

    def limited(c, target=None, **kw):
        tried.append(c)
        if len(tried) <= 5:  # the first five setups the search tries are refused
            raise ValueError("attention.backend=pallas: q has more than 2,147,483,647 elements")
        return model.plan(c, target, **kw)

    options = fit_lib.FitOptions(max_compiles=3, cost_model=model.cost, plan_fn=limited, progress=False)
    res = fit_lib.fit(cfg, None, budget=50 * GiB, options=options)
    refused = [p for p in res.pruned if p["reason"].startswith("refused before compiling: ValueError")]
    assert len(refused) == 5
    assert res.compiles == len(res.rows) == 3 and model.calls == 3  # three real compiles, none lost to refusals


@pytest.mark.parametrize(*tiered("seed", range(8), fast={0, 1}))
def test_equal_estimates_go_to_the_lighter_candidate(seed):
    """A roofline estimate does not see tile or stage launches, so candidates that differ only in the MLP tile
    count can tie exactly; the tie goes to the candidate expected faster (fewer tiles, stages, remat), whatever
    the compile order, as in the brute-force search over the expected-speed order."""
    cfg = load_config(None, TINY)
    model = FakeModel(seed)
    model.cost_w[3] = 0.0  # MLP tiling: no cost, so its levels tie
    budget = random.Random(200 + seed).uniform(35, 65) * GiB
    expected, _ = _brute_force(cfg, model, budget, 2048 * GiB)
    options = fit_lib.FitOptions(max_compiles=10**6, cost_model=model.cost, plan_fn=model.plan, progress=False)
    res = fit_lib.fit(cfg, None, budget=budget, host_budget=2048 * GiB, options=options)
    if expected is None:
        assert res.winner is None
    else:
        assert res.winner["overrides"] == expected[0]
        ties = [r for r in res.rows if r["fits"] and r["step_seconds"] == res.winner["step_seconds"]]
        assert min(r["levels"][3] for r in ties) == res.winner["levels"][3]


class UlyssesLightModel(FakeModel):
    """U-Pipe's stage buffers cost memory that Ulysses does not pay: U-Pipe with U = H needs more than Ulysses
    (as the GPU compile of Llama-3.1-8B shows), so memory is monotone along U but not from Ulysses to U-Pipe."""

    def plan(self, cfg, target=None, **kw):
        p = super().plan(cfg, target, **kw)
        if cfg.attention.impl == "ulysses":
            # as light as U-Pipe at its smallest U (levels 1 + heads / 2 of `_levels`), less 6 GiB of stage buffers
            total = p["total"] - (self.mem_w[0] * (1 + cfg.model.heads // 2) + 6) * GiB
            p = {**p, "total": total, "peak": total * 0.9}
        return p


@pytest.mark.parametrize(*tiered("seed", range(10), fast={0, 1}))
def test_a_upipe_candidate_that_does_not_fit_does_not_rule_out_ulysses(seed):
    cfg = load_config(None, TINY)
    model = UlyssesLightModel(seed)
    budget = random.Random(300 + seed).uniform(30, 60) * GiB
    expected, _ = _brute_force(cfg, model, budget, 2048 * GiB)
    options = fit_lib.FitOptions(max_compiles=10**6, cost_model=model.cost, plan_fn=model.plan, progress=False)
    res = fit_lib.fit(cfg, None, budget=budget, host_budget=2048 * GiB, options=options)
    assert (res.winner and res.winner["overrides"]) == (expected and expected[0])
    for p in res.pruned:
        if p["reason"].startswith("needs at least") and "attention.impl=ulysses" in p["overrides"]:
            assert "attention.impl=ulysses" in p["by"]


class PackingHoleModel(FakeModel):
    """U-Pipe at the middle U needs more memory than at U = H (XLA's buffer packing: 82.1 GiB at U = 16 against
    79.3 at U = 32 for Llama-3.1-8B at 6.5M tokens on 8xH100): memory is not monotone in U. Ulysses never fits,
    U = H fits with light settings, the middle U never does."""

    def plan(self, cfg, target=None, **kw):
        p = super().plan(cfg, target, **kw)
        heads, u = cfg.model.heads, cfg.attention.heads_per_stage or cfg.mesh.context
        if cfg.attention.impl == "ulysses":
            total = p["total"] + 100 * GiB
        elif u == heads:
            total = p["total"] - 30 * GiB
        elif u != cfg.mesh.context:
            total = p["total"] + 100 * GiB
        else:
            total = p["total"]
        return {**p, "total": total, "peak": total * 0.9}


@pytest.mark.parametrize(*tiered("seed", range(6), fast={0, 1}))
def test_a_candidate_that_does_not_fit_says_nothing_about_another_heads_per_stage(seed):
    cfg = load_config(None, TINY)
    model = PackingHoleModel(seed)
    budget = 45 * GiB
    expected, _ = _brute_force(cfg, model, budget, 2048 * GiB)
    assert expected is not None
    options = fit_lib.FitOptions(max_compiles=10**6, cost_model=model.cost, plan_fn=model.plan, progress=False)
    res = fit_lib.fit(cfg, None, budget=budget, host_budget=2048 * GiB, options=options)
    assert res.winner["overrides"] == expected[0]


def test_kept_attention_levels_count_what_each_offload_grouping_leaves_room_for():
    """Llama-3.1-8B at 4M tokens on 8 GPUs with 1.5 TiB of host per node: a layer input and a layer's kept attention
    (bf16 output + float32 lse) are 32 GiB and 32.25 GiB per node. Plain offload holds 32 inputs (room to keep 15
    layers), groups of 2 hold 16 + 2 (29 layers), groups of 4 hold 8 + 4 (all 32): the search tries 32, 29, 15
    and 0 kept layers, and groups of 2 and 4 as offload levels."""
    cfg = load_config(str(ROOT / "configs/llama3_1_8b.yaml"), ["seq_len=4194304", "mesh.num_devices=8"])
    budget = 1536 * GiB
    assert fit_lib.offload_groupings(32) == [1, 2, 4]
    assert [fit_lib.kept_layers_that_fit(cfg, budget, k) for k in (1, 2, 4)] == [15, 29, 32]
    assert fit_lib.keep_levels(cfg, budget) == [32, 29, 15, 0]
    remat = fit_lib.dimension_levels(cfg, budget)[1]
    assert remat[-2:] == [("remat.policy=offload", "remat.offload_every=2"),
                          ("remat.policy=offload", "remat.offload_every=4")]
    assert fit_lib.keep_levels(cfg, None) == [32, 0]  # no host budget (CPU approximation): all or none
    assert fit_lib.offload_groupings(4) == [1]  # 4 layers: groups of 2 hold 2 + 2 inputs, no fewer than 4


def test_a_recipe_is_planned_stage_by_stage_and_written_back(monkeypatch, capsys, tmp_path):
    """`python -m jaxlong.memory --fit --config RECIPE.yaml`: each stage searched at its own length (here under a
    fake planner: the brute-force winner of each stage's config), a table of the stages with the recipe's estimated
    time (each stage's tokens over its winner's tokens/s over the devices), and `--write-recipe` writes the recipe
    with every stage's winner in it: expanded again, each stage is its winner's config."""
    import yaml

    from jaxlong.memory import __main__ as memory
    from jaxlong.memory import recipe_fit
    from jaxlong.plan import planner
    from jaxlong.recipes import expand

    model = FakeModel(5)
    monkeypatch.setattr(planner, "plan", model.plan)
    monkeypatch.setattr(fit_cli.distributed, "gpu_driver_present", lambda: True)  # the GPUs the fake plans for
    recipe, planned = tmp_path / "recipe.yaml", tmp_path / "planned.yaml"
    recipe.write_text(yaml.safe_dump({"stages": [
        {"name": "1k", "steps": 30, "seq_len": 1024, "remat.policy": "full"},
        {"name": "2k", "steps": 10, "seq_len": 2048, "remat": {"policy": "offload"}, "model.rope_theta": 1e6}]}))
    overrides = [t for t in TINY if not t.startswith("seq_len=")]
    rc = memory.main(["--fit", "--config", str(recipe), "--budget", "50GiB", "--max-compiles", "80",
                      "--write-recipe", str(planned), *overrides])
    out = capsys.readouterr().out
    assert rc == 0, out[-3000:]
    stages = expand(load_config(recipe, overrides), overrides)
    rows = [line for line in out.splitlines() if re.match(r"\| \d \((1k|2k)\) \|", line)]
    assert len(rows) == 2 and "| 0 (1k) | 1,024 | 30 |" in rows[0] and "| 1 (2k) | 2,048 | 10 |" in rows[1]
    command = re.search(r"train it with (python -m jaxlong.train .*)", out).group(1).split()
    assert command[3:5] == ["--config", str(planned)] and "mesh.fsdp=-1" not in command  # the plan's keys win
    again = expand(load_config(planned, command[5:]), command[5:])
    total = 0.0
    for s, p in zip(stages, again):
        (key, cost), _ = _brute_force(s.cfg, model, 50 * GiB, 2048 * GiB)
        want = fit_lib.configure(s.cfg, key.split())
        for section in ("mesh", "attention", "remat", "tiling"):
            assert getattr(p.cfg, section) == getattr(want, section), (s.name, section)
        assert p.cfg.model.rope_theta == s.cfg.model.rope_theta and p.cfg.seq_len == s.cfg.seq_len
        total += recipe_fit.stage_seconds(s.cfg, s.end - s.start, s.cfg.seq_len * s.cfg.global_batch / cost / 8)
    hours = re.search(r"estimated time of the recipe's training steps: ([\d.,]+) (h|min|s)", out)
    scale = {"h": 3600, "min": 60, "s": 1}[hours.group(2)]
    assert float(hours.group(1).replace(",", "")) * scale == pytest.approx(total, rel=0.05)
    assert "python -m jaxlong.train --config " + str(recipe) not in out  # no per-stage command: the recipe's
    assert memory.main(["--fit", "--config", str(recipe), "--out", str(tmp_path / "x.json"), *overrides]) == 2
    assert "give a directory" in capsys.readouterr().err
    assert memory.main(["--fit", "--write-recipe", str(planned), *TINY]) == 2
    assert "the config has no stages" in capsys.readouterr().err
