"""Stateless layers below the parallel ops: RMSNorm and RoPE, the loss, tiled loss and MLP, remat policies."""
