"""`python -m jaxlong.export`: the Hugging Face export command (`__main__.py`)."""
