"""Evaluation: held-out validation, per-token statistics, loss by position, passkey retrieval."""
