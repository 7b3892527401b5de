"""JAX's persistent compilation cache: on by default, in a per-user directory.

A run compiles its programs once per configuration; the next run of the same
programs (same settings, devices, podracer, JAX and jaxlib) reads the compiled
executables back instead of compiling them. `--compile-cache` chooses where:

    --compile-cache=DIR               # a local directory, or gs://BUCKET/PATH
    --compile-cache=off               # compile everything, keep nothing

Without the flag: `$PODRACER_COMPILE_CACHE` (a directory, or `off`), else JAX's
own `$JAX_COMPILATION_CACHE_DIR`, else, for a `gs://` run directory,
`compile_cache/` beside it in its bucket (a TPU slice's workers are new
machines each time: only the bucket outlives them), else
`$XDG_CACHE_HOME/podracer/jax` (`~/.cache/podracer/jax`). A default directory
that cannot be created turns the cache off; one given by flag or variable is
refused in one line. The cache is JAX's: it grows with every new program
(delete the directory to empty it), and it is trusted, so never point it at a
directory others can write.

Every program is cached, however quickly it compiled (JAX's defaults keep only
those that took a second or more, which would leave most of a CartPole run's
start-up compiling anew each time). Only process 0 of a multi-process run
writes; every process reads.
"""

from __future__ import annotations

import os
import posixpath
from typing import Mapping

from podracer.errors import PodracerError
from podracer import storage

ENV_VAR = "PODRACER_COMPILE_CACHE"
JAX_ENV_VAR = "JAX_COMPILATION_CACHE_DIR"
OFF = "off"
CACHE_FOLDER = "compile_cache"  # beside a gs:// run directory


def default_dir(environ: Mapping[str, str]) -> str:
    """`$XDG_CACHE_HOME/podracer/jax`, or `~/.cache/podracer/jax`."""
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "podracer", "jax")


def beside(run_dir: str) -> str:
    """`compile_cache` in the folder that holds a `gs://` run directory."""
    bucket_and_path = run_dir[len(storage.REMOTE_SCHEME):].rstrip("/")
    parent = posixpath.dirname(bucket_and_path) or bucket_and_path  # a run at the bucket's root
    return f"{storage.REMOTE_SCHEME}{parent}/{CACHE_FOLDER}"


def resolve(flag: str, run_dir: str, environ: Mapping[str, str]) -> tuple[str | None, str]:
    """The cache directory (None: off) and where that choice came from ("" for the default)."""
    for value, origin in ((flag, f"--compile-cache={flag}"),
                          (environ.get(ENV_VAR, ""), f"{ENV_VAR}={environ.get(ENV_VAR)}"),
                          (environ.get(JAX_ENV_VAR, ""), f"{JAX_ENV_VAR}={environ.get(JAX_ENV_VAR)}")):
        if value:
            return (None if value == OFF else value), origin
    if run_dir.startswith(storage.REMOTE_SCHEME):
        return beside(run_dir), ""
    return default_dir(environ), ""


def prepare(path: str | None, origin: str) -> str | None:
    """Create the directory; None if it is the default and cannot be, a one-line error if given."""
    if path is None:
        return None
    try:
        if storage.is_remote(path):
            storage.check(path)  # gs:// with its optional dependency; another scheme is refused
        else:
            path = os.path.abspath(os.path.expanduser(path))
            os.makedirs(path, exist_ok=True)
            if not os.access(path, os.W_OK):
                raise PermissionError("not writable")
    except PodracerError as err:
        if not origin:
            return None
        raise PodracerError(f"{origin}: {err}") from None
    except OSError as err:
        if not origin:
            return None
        raise PodracerError(f"{origin}: cannot create or write that directory for the compilation "
                            f"cache ({err.strerror or err}); pass a writable directory, or "
                            f"--compile-cache=off") from None
    return path


def configure(path: str | None) -> None:
    """Point JAX's persistent compilation cache at `path` (None: off), for the whole process.

    JAX opens its cache once, at the first compilation; a process that trains
    again with another directory (`podracer.train` called twice) has it
    reopened there.
    """
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    if path is not None:
        # Every program, however small: a CartPole run's programs compile in 0.01-3 s.
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_enable_compilation_cache", path is not None)
    compilation_cache.reset_cache()  # opened again, at the next compilation, where it now points
