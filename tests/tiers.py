"""The tier of every test file, declared: a new test file joins a tier explicitly.

`python -m pytest` runs the fast tier (every test not marked `slow`), `python -m pytest -m slow` the slow tier
(docs/testing.md, with each tier's time budget). A file is "fast" (no test marked slow), "slow" (every test
marked slow) or "fast+slow" (a covering set of its cases fast, the rest slow: `helpers.tiered`).
`tests/conftest.py` checks at collection that every collected file is listed here and that its tests are in the
tiers it declares; `tests/test_architecture.py` that every test file on disk is listed.
"""

BUDGET_S = {"fast": 300, "slow": 1500}  # seconds on a quiet 2-core machine (docs/testing.md)

TIERS = {
    "core/test_liveness.py": "fast",
    "core/test_ordering.py": "fast",
    "core/test_processes.py": "fast",
    "core/test_sharding.py": "fast+slow",
    "core/test_xla_log.py": "fast",
    "data/test_data.py": "fast+slow",
    "data/test_chat_data.py": "fast+slow",
    "training/test_dpo.py": "fast+slow",
    "data/test_mixture.py": "fast",
    "evaluation/test_eval.py": "fast+slow",
    "evaluation/test_hostmem.py": "fast+slow",
    "generation/test_generate.py": "fast+slow",
    "generation/test_real_model_generate.py": "slow",
    "evaluation/test_real_model_eval.py": "slow",
    "evaluation/test_ruler.py": "fast+slow",
    "kernels/test_cudnn_attention.py": "fast+slow",
    "kernels/test_kernels.py": "fast+slow",
    "kernels/test_pallas_attention.py": "fast+slow",
    "kernels/test_window.py": "fast+slow",
    "layers/test_keep_attention.py": "fast+slow",
    "layers/test_remat.py": "fast+slow",
    "layers/test_rope.py": "fast+slow",
    "layers/test_tiled.py": "fast",
    "models/test_gemma3.py": "fast+slow",
    "models/test_gemma3_hf.py": "fast+slow",
    "models/test_hf.py": "fast+slow",
    "models/test_real_model.py": "slow",
    "parallel/test_packing.py": "fast+slow",
    "parallel/test_parallel.py": "fast+slow",
    "parallel/test_parallel_validate.py": "fast",
    "parallel/test_ring.py": "fast+slow",
    "parallel/test_ring_kernels.py": "fast+slow",
    "parallel/test_ring_memory.py": "fast+slow",
    "parallel/test_ring_segments.py": "fast+slow",
    "parallel/test_upipe.py": "fast+slow",
    "parallel/test_upipe_memory.py": "fast+slow",
    "plan/test_cost.py": "fast+slow",
    "plan/test_fit.py": "fast+slow",
    "plan/test_memory.py": "fast+slow",
    "plan/test_plan_gpu.py": "fast+slow",
    "test_architecture.py": "fast",
    "test_config.py": "fast",
    "test_crash_retry.py": "fast+slow",
    "test_docs.py": "fast+slow",
    "test_docs_fresh.py": "slow",
    "test_experiments.py": "slow",
    "test_gpu_check_smoke.py": "slow",
    "test_suggestions.py": "fast",
    "training/test_faults.py": "fast+slow",
    "training/test_grad_accum.py": "fast+slow",
    "training/test_multinode.py": "slow",
    "training/test_multinode_pairs.py": "slow",
    "training/test_multiprocess.py": "slow",
    "training/test_reliability.py": "fast",
    "training/test_train.py": "fast+slow",
    "training/test_recipe.py": "fast+slow",
}
