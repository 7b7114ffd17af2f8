"""Attention kernels on one device: the blockwise (flash) kernel in JAX, cuDNN, Pallas (Triton) for GPUs."""
