"""`python -m jaxlong.memory`: the memory planning command (`__main__.py`) and the `--fit` options it shares
with `python -m jaxlong.train` (`fit_options.py`)."""
