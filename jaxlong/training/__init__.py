"""Training: the train step and its input layout, the train loop, checkpoints."""
