"""`python -m jaxlong.memory`: the memory planning command (`__main__.py`) and the `--fit` plan of a recipe's
stages (`recipe_fit.py`); the `--fit` flags and reports it shares with `python -m jaxlong.train` are
`jaxlong.plan.fit_report`."""
