"""What a compiled plan cannot see: attention kernel workspace, collective buffers, headroom.

XLA's buffer assignment counts every buffer of the program except the scratch memory that library calls
allocate at run time. A deviceless GPU compile leaves cuDNN's workspace at 0 bytes (`u8[0]`), and NCCL's
communication buffers are allocated by NCCL itself, outside XLA's accounting. The planner adds them as rows of
their own; these are models, written from the kernels' source, not measurements.

cuDNN flash attention backward (cudnn-frontend `CompositeSDPABackwardNode`, BHSD layout, non-deterministic
algorithm, the one JAX's `dot_product_attention(implementation='cudnn')` uses): the workspace holds
  dQ_accum     float32 `[b, h_q, s_q, d]`: dQ accumulated by atomic adds across key blocks, 4*b*h_q*s_q*d bytes
  softmax_sum  float32 `[b, h_q, s_q]`: rowsum(dO * O), 4*b*h_q*s_q bytes
(GQA's full-head dK/dV buffers are virtual in this layout: no memory). The forward needs no sizeable workspace.
Only one attention backward call runs at a time (the layer scan is sequential), so the row is the largest
single call: `jaxlong.kernels.cudnn` runs the backward one query head per call (`BWD_HEADS_PER_CALL`), for
Ulysses' H/C local heads and U-Pipe's U/C heads alike (h_q = 1, s_q = S).
The blockwise (pure JAX) and reference kernels are XLA programs: all their memory is in the compiled plan.

Collective buffers (NCCL): each communicator allocates, per channel, send and receive buffers of
`NCCL_BUFFSIZE` (4 MiB by default) for the simple protocol; on NVLink machines NCCL uses up to 32 channels.
The model is `2 * 4 MiB * 32 = 256 MiB` per communicator, with one communicator per device group that the
step's collectives use: the FSDP group (all-gather, reduce-scatter over fsdp x context), the context group
(Ulysses all-to-all) and all devices (loss all-reduce) -- three, 768 MiB. It is an estimate (NCCL sizes its
buffers from topology and environment); override it with `--collective-buffers`.

Headroom: XLA's GPU runtime allocates the program's temporaries as one block and its arguments and outputs
as separate buffers through a BFC allocator; `--headroom` (default 2% of device memory) leaves room for that
allocator's fragmentation and for what JAX keeps besides the step (the input batch, the metrics, the
PRNG key). Run with `XLA_PYTHON_CLIENT_MEM_FRACTION` high enough (e.g. 0.97) for the plan to be usable: JAX
preallocates 75% of device memory by default.
"""

from __future__ import annotations

import re

from jaxlong.config import Config
from jaxlong.core.units import MiB, parse_bytes
from jaxlong.kernels.cudnn import BWD_HEADS_PER_CALL

NCCL_BUFFER_BYTES = 4 * MiB
NCCL_CHANNELS = 32
COMMUNICATORS = 3  # FSDP group, context group, all devices


def attention_workspace_bytes(cfg: Config, backend: str, context: int, batch_local: int, ring: int = 1) -> int:
    """Bytes per device of the attention kernel's run-time workspace (largest single call; module docstring).

    Args:
      cfg: the run's config (model heads, head_dim, seq_len, attention.impl and heads_per_stage).
      backend: the resolved kernel: `cudnn` has a workspace; `blockwise` and `reference` have none outside XLA.
      context: the context-parallel degree C; batch_local: sequences per device.
      ring: the ring degree R: ring attention's largest kernel call is its diagonal block of S/R queries.
    """
    if backend != "cudnn":
        return 0
    m = cfg.model
    heads_local = ((cfg.attention.heads_per_stage or context) if cfg.attention.impl == "upipe" else m.heads) // context
    rows = batch_local * min(heads_local, BWD_HEADS_PER_CALL) * (cfg.seq_len // max(ring, 1))
    return 4 * rows * m.head_dim + 4 * rows  # dQ_accum + softmax_sum, float32


def collective_buffer_bytes(devices: int, override: int | None = None) -> int:
    """NCCL buffers per device (module docstring); `override` replaces the model. 0 on a single device."""
    if override is not None:
        return override
    return 0 if devices <= 1 else COMMUNICATORS * 2 * NCCL_BUFFER_BYTES * NCCL_CHANNELS


def parse_headroom(text: str, device_memory: int) -> int:
    """`'2%'` (of device memory) or a size (`'1GiB'`, bytes) -> bytes.

    Raises:
      ValueError: unparseable, or a percentage outside [0, 50].
    """
    m = re.fullmatch(r"\s*([0-9.]+)\s*%\s*", text)
    if m:
        pct = float(m.group(1))
        if not 0 <= pct <= 50:
            raise ValueError(f"--headroom {text!r}: a percentage must be between 0 and 50")
        return int(device_memory * pct / 100)
    return parse_bytes(text, option="--headroom")
