"""JAX's persistent compilation cache for every process of a CPU group.

JAX writes cache entries from process 0 only, assuming every process computes the same key. On
XLA:CPU the key hashes the topology each process sees, which differs by process (jax 0.10), so the
other processes never find an entry and recompile the step on every start, supervised restarts
included. On CPU each process therefore writes its own entry under its own key; on other
platforms JAX's rule stands. Were the keys equal on every process (the reason for JAX's rule),
processes would write one file at once: the hook is installed only for the JAX versions whose
keys were checked to differ (tests/test_multiprocess.py reads one entry per process).
"""

from __future__ import annotations

import inspect
import warnings

_ARGS = ["cache_key", "compile_time_secs", "module_name", "backend", "executable", "host_callbacks"]
CHECKED = ("0.10.",)  # JAX versions whose CPU keys were seen to differ by process


def write_on_every_cpu_process() -> bool:
    """Extend JAX's cache writes to every CPU process. Returns whether the hook is installed (False
    on a JAX version not checked, or whose private write function is not the one it was written
    against: JAX's own rule then stands)."""
    import jax

    try:
        from jax._src import compilation_cache, compiler, config, distributed
    except ImportError:
        return False
    write = getattr(compiler, "_cache_write", None)
    if write is None or getattr(write, "meshlm_every_process", False):
        return write is not None
    if not jax.__version__.startswith(CHECKED) or list(inspect.signature(write).parameters) != _ARGS:
        return False
    must_raise = getattr(compiler, "_should_raise_persistent_cache_error", lambda e: False)

    def cache_write(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks) -> None:
        if distributed.global_state.process_id == 0 or backend.platform != "cpu":
            return write(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks)
        if host_callbacks or compile_time_secs < config.persistent_cache_min_compile_time_secs.value:
            return None
        try:
            compilation_cache.put_executable_and_time(
                cache_key, module_name, executable, backend, int(compile_time_secs)
            )
        except Exception as e:  # as JAX does: a warning, unless JAX is set to raise cache errors
            if must_raise(e):
                raise
            warnings.warn(f"could not write the compilation cache entry for {module_name!r}: {e}", stacklevel=2)
        return None

    cache_write.meshlm_every_process = True
    compiler._cache_write = cache_write
    return True
