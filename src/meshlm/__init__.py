"""meshlm: train language models on a named device mesh with declared sharding (JAX/XLA GSPMD)."""

__version__ = "0.1.0"


def generate(run_dir, prompts, max_new_tokens: int = 64, **kwargs):
    """Text continuations of `prompts` (a string or a list) by a run directory's model (or
    "hf:DIR"); keyword arguments as `meshlm.inference.generate`. Imports JAX on first use."""
    from meshlm.inference import generate as _generate

    return _generate(run_dir, prompts, max_new_tokens, **kwargs)
