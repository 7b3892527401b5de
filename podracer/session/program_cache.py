"""Compiled programs kept whole across command-line runs, so that a rerun skips tracing and lowering.

JAX's persistent compilation cache (`podracer.orchestrate.compile_cache`) spares
a rerun XLA's compilation, but not the Python work that finds its key: tracing
and lowering every program again, 0.6-0.8 s of a CartPole run's start-up on a
2-core CPU. A run started from the command line therefore also keeps each
program it compiles, serialized (`jax.experimental.serialize_executable`), in
`programs/` inside that cache directory, under a key made of everything that
decides the program and is known before tracing:

- the program's name and its arguments' structure, shapes, dtypes and shardings;
- every setting of the run, except those no program sees (`HOST_SETTINGS`):
  where it writes, what it logs and checkpoints, and its seed, whose key is an
  argument (so another `--seed` reads back the same programs; a test lowers
  every Anakin program with each of them changed and finds it unchanged);
- the devices and processes; JAX, jaxlib, Python, `sys.path`; every JAX option;
  the environment variables that configure JAX, XLA, accelerators and podracer.

An entry also lists every Python module loaded when the program was compiled,
with its file's size and modification time: it is read back only if each of
those files is unchanged and each module already loaded here comes from the
same file. Any doubt (a change, a damaged entry, a failed load) means compiling
as usual, through JAX's cache.

Only a program XLA compiled in this process is kept. One that JAX's cache
answered (the same program under another key, from settings it does not
depend on) is not: XLA:CPU serializes such a program without some of its kernels, and
reading it back would fail at its first call. Instead, before JAX's cache is
asked, a program XLA compiled in an earlier run is kept again (`renew`): an
entry made stale by an edit that leaves its program as it was (the lowered
text and compiler options, whose hash each entry holds), or one kept under
another key for the same program (another `--total-steps`), which every entry
is also found by (`by-program/`, hard links named by `program_id`).

Anakin's drivers use it (`RunSession.compiled_init_and_step`); Sebulba's
actor and learner programs are compiled by their first calls, through JAX's
cache only. Only command-line runs use it (`use_from_command_line`): from Python
(`podracer.train`, a notebook) code can change without any file changing. One
process, a local cache directory, and programs whose only calls out of XLA are
LAPACK's (JAX sets LAPACK up while lowering, which a program read back skips,
so it is set up here first).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import sys
import tempfile
from typing import Any, Callable

import jax
import numpy as np

from podracer.session import startup

PROGRAMS = "programs"  # inside the compilation cache directory
BY_PROGRAM = "by-program"  # inside PROGRAMS: the same entries, named by what XLA compiled (`program_id`)
SUFFIX = ".program"
# Settings no kept program depends on: where a run writes, what it checkpoints and
# logs, and the seed (the programs take its key as an argument).
HOST_SETTINGS = {("run", "run_dir"), ("run", "compile_cache"), ("run", "seed"),
                 ("checkpoint", "checkpoint_every"), ("checkpoint", "keep_checkpoints"),
                 ("logging", "wandb"), ("logging", "wandb_project")}
# Environment variables that can change a program or the devices it runs on.
ENV_PREFIXES = ("JAX_", "XLA_", "TPU_", "LIBTPU", "CUDA_", "NVIDIA_", "ROCR_", "HIP_", "PODRACER_")
LAPACK_PREFIX = "lapack_"

_from_command_line = False


def use_from_command_line() -> None:
    """This process was started from the command line: its code is its files."""
    global _from_command_line
    _from_command_line = True


def directory(cache_dir: str | None) -> str | None:
    """Where programs are kept beside JAX's cache at `cache_dir`; None where they are not kept."""
    if not _from_command_line or cache_dir is None or "://" in cache_dir or jax.process_count() > 1:
        return None
    return os.path.join(cache_dir, PROGRAMS)


def key(name: str, args: tuple, configs: dict[str, Any]) -> str:
    """What decides the program `name` compiled for `args`, known without tracing it, as a hash."""
    from podracer.session.checkpoint import config_record

    settings = {section: {k: v for k, v in values.items() if (section, k) not in HOST_SETTINGS}
                for section, values in config_record(configs).items()}
    leaves, tree = jax.tree.flatten(args)
    arguments = [str(tree)] + [(np.shape(x), str(getattr(x, "dtype", None) or np.result_type(x)),
                                bool(getattr(x, "weak_type", False)),
                                str(getattr(x, "sharding", None))) for x in leaves]
    return _hash({"name": name, "settings": settings, "arguments": arguments, **_surroundings()})


def _surroundings() -> dict:
    """What decides a compiled program besides its own text: devices, versions, options, variables."""
    import jaxlib

    return {
        "devices": [(d.platform, d.device_kind, d.id, d.process_index) for d in jax.devices()],
        "processes": (jax.process_count(), jax.process_index()),
        "versions": (jax.__version__, jaxlib.__version__, sys.version, sys.executable),
        "sys_path": sys.path,
        "jax_options": sorted((k, repr(v)) for k, v in jax.config.values.items()),
        "environment": sorted((k, v) for k, v in os.environ.items() if k.startswith(ENV_PREFIXES)),
    }


def _hash(parts: dict) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=repr).encode()).hexdigest()


def module_files() -> list[tuple[str, str, int, int]]:
    """(module, file, size, modification time in ns) of every loaded module that has a file."""
    files = []
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if not isinstance(path, str):
            continue
        try:
            stat = os.stat(path)
        except OSError:
            continue
        files.append((name, path, stat.st_size, stat.st_mtime_ns))
    return files


def unchanged(files: list[tuple[str, str, int, int]]) -> bool:
    """Each file as it was, and each of its modules loaded here loaded from it."""
    for name, path, size, mtime_ns in files:
        loaded = sys.modules.get(name)
        if loaded is not None and getattr(loaded, "__file__", None) != path:
            return False
        try:
            stat = os.stat(path)
        except OSError:
            return False
        if stat.st_size != size or stat.st_mtime_ns != mtime_ns:
            return False
    return True


def _calls_out(compiled) -> set[str]:
    """The targets of the program's custom calls (kernels outside XLA)."""
    import re

    return set(re.findall(r'custom_call_target="([^"]+)"', compiled.as_text()))


def _set_up_lapack() -> bool:
    """What JAX does while lowering a LAPACK call; False if this JAX cannot be asked to."""
    try:
        from jax._src.lax import linalg
        linalg.initialize_lapack()
    except (ImportError, AttributeError):
        return False
    return True


def _read(path: str) -> dict | None:
    try:
        with open(path, "rb") as f:
            return pickle.load(f)
    except Exception:  # a cache entry never fails a run: a damaged one is compiled anew
        return None


def _loaded(entry: dict):
    """The program of `entry`, or None if it cannot be loaded here."""
    from jax.experimental import serialize_executable

    try:
        if entry["lapack"] and not _set_up_lapack():
            return None
        by_id = {device.id: device for device in jax.devices()}
        return serialize_executable.deserialize_and_load(
            *entry["program"], execution_devices=[by_id[i] for i in entry["devices"]])
    except Exception:  # a foreign or damaged entry is compiled anew
        return None


def load(path: str):
    """The program kept at `path`, or None (none, damaged, stale, or not loadable here)."""
    entry = _read(path)
    files = entry.get("files") if isinstance(entry, dict) else None
    if files is None or not unchanged(files):  # an entry that does not list its files is never fresh
        return None
    return _loaded(entry)


def fingerprint(lowered) -> str | None:
    """What XLA compiles from `lowered`: its program text and the compiler options given to
    its `jax.jit`, as a hash; None where this JAX does not tell the options."""
    options = getattr(getattr(lowered, "_lowering", None), "_compiler_options_kvs", None)
    if options is None:
        return None
    text = lowered.as_text() + repr(sorted(options))
    return hashlib.sha256(text.encode()).hexdigest()


def program_id(lowered, program_fingerprint: str | None) -> str | None:
    """The name of a kept program by what XLA compiled, whatever run it was compiled for: its
    `fingerprint`, its arguments' and results' structure and `_surroundings`; None without one."""
    if program_fingerprint is None:
        return None
    return _hash({"module": program_fingerprint, "trees": (str(lowered.in_tree), str(lowered.out_tree)),
                  **_surroundings()})


def renew(path: str, program_fingerprint: str | None, same_program: str | None = None):
    """The program kept at `path` though files it was made from changed, or kept for another
    key (`same_program`: the `by_program` path of its `program_id`), if the lowered program is
    the one it was compiled from (`fingerprint`); kept again at `path` with today's files.

    After an edit that leaves a program as it was (a `git pull` of unrelated code),
    or under settings it does not depend on (another `--total-steps`), JAX's cache
    answers its compilation, and such a program is not kept (module docstring):
    without this the entry would stay stale, or never be made, and every later run
    would trace and lower it again. A serialized program written by the process
    XLA compiled it in is what is kept again.
    """
    if program_fingerprint is None:
        return None
    for candidate in (path, same_program):
        entry = _read(candidate) if candidate else None
        if isinstance(entry, dict) and entry.get("module") == program_fingerprint:
            program = _loaded(entry)
            if program is not None:
                if _write(path, dict(entry, files=module_files())):
                    _link(path, same_program)
                return program
    return None


def by_program(path: str, identity: str | None) -> str | None:
    """Where the entry at `path` is also found by its `program_id` (`identity`); None without one."""
    if identity is None:
        return None
    return os.path.join(os.path.dirname(path), BY_PROGRAM, identity + SUFFIX)


def _link(path: str, same_program: str | None) -> None:
    """`same_program` names the entry at `path` too (a hard link: its bytes are stored once)."""
    if same_program is None:
        return
    temporary = f"{same_program}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(same_program), exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        os.link(path, temporary)
        os.replace(temporary, same_program)
    except OSError:  # no hard links here: the program is found by its key only
        with contextlib.suppress(OSError):
            os.unlink(temporary)


def save(path: str, compiled, program_fingerprint: str | None = None, same_program: str | None = None) -> bool:
    """Keep `compiled` (its lowered program's `fingerprint`) at `path`, found by `same_program`
    too (`by_program`); False if it cannot be kept."""
    from jax.experimental import serialize_executable

    calls = _calls_out(compiled)
    if any(not call.startswith(LAPACK_PREFIX) for call in calls):
        return False
    try:
        entry = {"files": module_files(), "lapack": bool(calls), "module": program_fingerprint,
                 "devices": [device.id for device in compiled._executable._unloaded_executable.device_list],
                 "program": serialize_executable.serialize(compiled)}
    except Exception:  # a program that cannot be kept is compiled again next time
        return False
    if not _write(path, entry):
        return False
    _link(path, same_program)
    return True


def _write(path: str, entry: dict) -> bool:
    """`entry` at `path`, written whole, then renamed; False if it cannot be."""
    temporary = None
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, temporary = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            pickle.dump(entry, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(temporary, path)
    except Exception:  # a program that cannot be kept is compiled again next time
        if temporary is not None:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
        return False
    return True


def path_for(name: str, args: tuple, configs: dict[str, Any], cache_dir: str | None) -> str | None:
    """Where the program `name` for `args` is kept; None where programs are not kept."""
    where = directory(cache_dir)
    return None if where is None else os.path.join(where, key(name, args, configs) + SUFFIX)


def compiled(name: str, jitted: Callable, args: tuple, configs: dict[str, Any],
             cache_dir: str | None) -> tuple[Any, bool]:
    """`jitted` compiled for `args`, and whether it was read back without tracing."""
    path = path_for(name, args, configs, cache_dir)
    program = load(path) if path else None
    if program is not None:
        return program, True
    return compile_and_keep(jitted.lower(*args), path), False


def compile_and_keep(lowered, path: str | None):
    """`lowered` compiled, and kept at `path` (None: not kept) if XLA compiled it here;
    the program kept there instead, if `lowered` is the program it was compiled from (`renew`)."""
    if not path:
        return lowered.compile()
    program_fingerprint = fingerprint(lowered)
    same_program = by_program(path, program_id(lowered, program_fingerprint))
    program = renew(path, program_fingerprint, same_program)
    if program is not None:
        return program
    program, from_jax_cache = startup.compile_noting_the_cache(lowered)
    if not from_jax_cache:
        save(path, program, program_fingerprint, same_program)
    return program
