"""Facts about the machine: accelerator tables and peak FLOP/s, XLA flags per backend, the host
allocator on CPU. Jax-free at import where the CLI needs them before JAX loads."""
