"""`python -m jaxlong.eval`: the evaluation command (`__main__.py`)."""
