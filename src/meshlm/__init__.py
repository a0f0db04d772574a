"""meshlm: train language models on a named device mesh with declared sharding (JAX/XLA GSPMD)."""

__version__ = "0.1.0"
