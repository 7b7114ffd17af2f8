"""Test setup: 8 simulated CPU devices, float32 matmuls at full precision.

XLA_FLAGS must be set before jax is imported anywhere, so this file does it at import time.
"""
import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
