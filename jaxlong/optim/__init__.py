"""The optimizer: AdamW with warmup and cosine decay (`adamw`)."""
