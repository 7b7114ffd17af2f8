"""`python -m jaxlong.generate`: text from a run's checkpoint or a Hugging Face directory (see `__main__`)."""
