"""JAX's persistent compilation cache for every process of a CPU group.

JAX writes cache entries from process 0 only, assuming every process computes the same key. On
XLA:CPU the key hashes the topology each process sees, which differs by process (jax 0.10), so the
other processes never find an entry and recompile the step on every start, supervised restarts
included. On CPU each process therefore writes its own entry under its own key (no two processes
write one file); on other platforms JAX's rule stands.
"""

from __future__ import annotations

import inspect
import warnings

_ARGS = ["cache_key", "compile_time_secs", "module_name", "backend", "executable", "host_callbacks"]


def write_on_every_cpu_process() -> bool:
    """Extend JAX's cache writes to every CPU process. Returns whether the hook is installed (False
    where this JAX's private write function is not the one it was written against)."""
    try:
        from jax._src import compilation_cache, compiler, config, distributed
    except ImportError:
        return False
    write = getattr(compiler, "_cache_write", None)
    if write is None or getattr(write, "meshlm_every_process", False):
        return write is not None
    if list(inspect.signature(write).parameters) != _ARGS:
        return False

    def cache_write(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks) -> None:
        if distributed.global_state.process_id == 0 or backend.platform != "cpu":
            return write(cache_key, compile_time_secs, module_name, backend, executable, host_callbacks)
        if host_callbacks or compile_time_secs < config.persistent_cache_min_compile_time_secs.value:
            return None
        try:
            compilation_cache.put_executable_and_time(
                cache_key, module_name, executable, backend, int(compile_time_secs)
            )
        except Exception as e:  # as JAX does: a cache that cannot be written is a warning
            warnings.warn(f"could not write the compilation cache entry for {module_name!r}: {e}", stacklevel=2)
        return None

    cache_write.meshlm_every_process = True
    compiler._cache_write = cache_write
    return True
