"""Training metrics that are facts about the model and the hardware: model FLOPs per token and peak FLOP/s per
device (for MFU, the `--estimate` roofline and `--fit`'s analytic cost)."""

from __future__ import annotations

import jax

from jaxlong.config import Config

# Dense bf16 peak FLOP/s per device, for MFU.
# Sources: NVIDIA datasheets (H100/H200 SXM 989.4 TFLOP/s dense bf16, A100 312, B200 2,250).
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "B200": 2250e12}


def flops_per_token(cfg: Config) -> float:
    """Training FLOPs per token: 6 * (non-embedding matmul params) + causal attention 6 * layers * S * H * d.

    (Kaplan et al. 2020 §2.1 with the attention term; the causal mask halves 12 * layers * S * H * d.)
    """
    m = cfg.model
    per_layer = m.hidden * (m.heads + 2 * m.kv_heads) * m.head_dim + m.heads * m.head_dim * m.hidden
    per_layer += 3 * m.hidden * m.mlp_hidden
    matmul_params = m.layers * per_layer + m.hidden * m.vocab_size
    return 6.0 * matmul_params + 6.0 * m.layers * cfg.seq_len * m.heads * m.head_dim


def peak_flops(device_kind: str | None = None) -> float | None:
    """Dense bf16 peak FLOP/s of a device kind (default: the first device's), None when unknown (the CPU)."""
    kind = jax.devices()[0].device_kind if device_kind is None else device_kind
    return next((v for k, v in PEAK_FLOPS.items() if k in kind), None)
