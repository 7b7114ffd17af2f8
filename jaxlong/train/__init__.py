"""`python -m jaxlong.train`: the training command (`__main__.py`)."""
