"""jaxlong: long-context LLM training in JAX (FSDP, Ulysses context parallelism, U-Pipe)."""

__version__ = "0.1.0"
