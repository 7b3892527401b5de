"""The program cache: compiled programs kept whole and read back only while nothing that made them changed."""

import contextlib
import importlib
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from podracer.config import RunConfig
from podracer.session import program_cache


@pytest.fixture
def command_line(monkeypatch):
    """As in a run started from the command line, which keeps its programs."""
    monkeypatch.setattr(program_cache, "_from_command_line", True)


@pytest.fixture
def helper(tmp_path, monkeypatch):
    """A module of this test's own, on a file the test can change."""
    (tmp_path / "kept_helper.py").write_text("def scale(x):\n    return x * 2.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("kept_helper", None)
    module = importlib.import_module("kept_helper")
    yield module
    sys.modules.pop("kept_helper", None)


@contextlib.contextmanager
def _jax_cache(path):
    """JAX's persistent cache at `path` (None: off), as a run sets it, for the `with` block."""
    from jax.experimental.compilation_cache import compilation_cache

    from podracer.orchestrate import compile_cache

    names = ("jax_enable_compilation_cache", "jax_compilation_cache_dir",
             "jax_persistent_cache_min_compile_time_secs", "jax_persistent_cache_min_entry_size_bytes")
    before = {name: getattr(jax.config, name) for name in names}
    compile_cache.configure(path)
    try:
        yield
    finally:
        for name, value in before.items():
            jax.config.update(name, value)
        compilation_cache.reset_cache()


@pytest.fixture
def jax_cache_off():
    """JAX's persistent cache off while the test runs, so that XLA compiles each program here.

    A program JAX's cache answers is not kept whole (`program_cache.compile_and_keep`):
    with the cache on, whether a test's program is kept would depend on what earlier
    tests of the same process compiled, and on whether one of them made JAX cache
    programs as small as these (`compile_cache.configure`).
    """
    with _jax_cache(None):
        yield


@pytest.fixture
def jax_cache_answering(tmp_path):
    """JAX's persistent cache on, in a directory of the test's own, keeping every program."""
    with _jax_cache(str(tmp_path / "jax-cache")):
        yield


def _kept(cache):
    """The entries kept, by key."""
    return sorted((cache / program_cache.PROGRAMS).glob("*" + program_cache.SUFFIX))


def _compiled(name, fn, args, cache, configs=None):
    return program_cache.compiled(name, jax.jit(fn), args, configs or {}, str(cache))


def test_a_kept_program_is_read_back_until_a_file_it_was_made_from_changes(command_line, jax_cache_off, helper,
                                                                            tmp_path):
    x = jnp.arange(4.0)
    cache = tmp_path / "cache"
    program, read_back = _compiled("scale", lambda v: helper.scale(v) + 1, (x,), cache)
    assert not read_back and len(_kept(cache)) == 1
    program, read_back = _compiled("scale", lambda v: helper.scale(v) + 1, (x,), cache)
    assert read_back
    np.testing.assert_array_equal(program(x), x * 2 + 1)

    # The helper's file changes (as an edit would): the kept program is stale.
    path = tmp_path / "kept_helper.py"
    path.write_text("def scale(x):\n    return x * 3.0  # changed\n")
    stat = os.stat(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    helper = importlib.reload(helper)
    program, read_back = _compiled("scale", lambda v: helper.scale(v) + 1, (x,), cache)
    assert not read_back
    np.testing.assert_array_equal(program(x), x * 3 + 1)
    program, read_back = _compiled("scale", lambda v: helper.scale(v) + 1, (x,), cache)
    assert read_back  # kept again, as it is now
    np.testing.assert_array_equal(program(x), x * 3 + 1)


def test_the_key_covers_arguments_settings_and_name_but_not_where_a_run_writes(command_line, tmp_path):
    from podracer.orchestrate.parse import parse_configs

    configs = parse_configs([])
    key = lambda name, args, c=configs: program_cache.key(name, args, c)
    x = jnp.zeros(3)
    assert key("step", (x,)) == key("step", (jnp.ones(3),))  # values are not part of it
    assert key("step", (x,)) != key("init", (x,))
    assert key("step", (x,)) != key("step", (jnp.zeros(4),))
    assert key("step", (x,)) != key("step", (jnp.zeros(3, jnp.int32),))
    assert key("step", (x,)) != key("step", (jax.device_put(x, jax.devices()[1]),))
    assert key("step", (x,)) != key("step", ({"x": x},))
    assert key("step", (x,)) != key("step", (x,), parse_configs(["--lr=3e-4"]))
    assert key("step", (x,)) != key("step", (x,), parse_configs(["--hidden", "32", "32"]))
    assert key("step", (x,)) == key("step", (x,), parse_configs([f"--run-dir={tmp_path / 'other'}",
                                                               f"--compile-cache={tmp_path}"]))


def _host_setting_flags(configs):
    """A flag changing each setting the key leaves out, but where the run writes (a path)."""
    flags = []
    for section, name in sorted(program_cache.HOST_SETTINGS - {("run", "run_dir"), ("run", "compile_cache")}):
        value, flag = getattr(configs[section], name), name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(f"--no-{flag}" if value else f"--{flag}")
        elif isinstance(value, (int, float)):
            flags.append(f"--{flag}={value * 2 + 7}")
        else:
            flags.append(f"--{flag}={value}-other")
    return flags


def _lowered_programs(argv):
    """The texts of the initialisation and training programs a command-line run would compile."""
    from podracer.anakin import train, train_es
    from podracer.orchestrate.parse import parse_configs

    configs = parse_configs(argv)
    built = (train_es if configs["run"].algo == "es" else train).build(configs, jax.devices()[:1])
    init = built.init.program.trace(*built.init.inputs(jax.random.PRNGKey(configs["run"].seed))).lower()
    state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=x.weak_type), init.out_info)
    return init.as_text(), built.step.trace(state).lower().as_text()


@pytest.mark.parametrize("pair", [[], ["--algo=impala"], ["--algo=es"], ["--num-seeds=2", "--sweep", "lr=1e-3,3e-4"],
                                  ["--algo=es", "--num-seeds=2"]], ids=["ppo", "impala", "es", "ppo-population",
                                                                        "es-population"])
def test_the_settings_the_key_leaves_out_never_reach_a_program(pair):
    from podracer.orchestrate.parse import parse_configs

    small = [*pair, "--population=8" if "--algo=es" in pair else "--num-envs=8", "--total-steps=4096"]
    flags = _host_setting_flags(parse_configs(small))
    assert {flag.split("=")[0].removeprefix("--no-").removeprefix("--") for flag in flags} >= {"seed",
                                                                                               "checkpoint-every"}
    changed = parse_configs([*small, *flags])
    assert program_cache.key("step", (), changed) == program_cache.key("step", (), parse_configs(small))
    programs = _lowered_programs(small)
    assert _lowered_programs([*small, *flags]) == programs
    if not pair:  # ... where a setting in the key changes them (the comparison can fail)
        assert _lowered_programs([*small, "--hidden", "32", "32"])[1] != programs[1]


def test_a_module_loaded_from_another_file_is_a_change(command_line, helper, tmp_path):
    files = program_cache.module_files()
    assert program_cache.unchanged(files)
    moved = [(name, path + "x" if name == "kept_helper" else path, size, mtime)
             for name, path, size, mtime in files]
    assert not program_cache.unchanged(moved)


def test_a_file_changed_under_a_program_left_as_it_was_has_the_program_kept_again(command_line,
                                                                                  jax_cache_answering,
                                                                                  helper, tmp_path):
    """An edit that leaves the program as it was (here the helper's file touched): JAX's cache
    answers its compilation, which is not kept; the kept program is, with the file as it is now."""
    x = jnp.arange(4.0)
    cache = tmp_path / "cache"
    fn = lambda v: helper.scale(v) + 1
    assert not _compiled("scale", fn, (x,), cache)[1] and len(_kept(cache)) == 1
    path = tmp_path / "kept_helper.py"
    stat = os.stat(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    jax.clear_caches()  # as in a new process: JAX's persistent cache answers, not its memory
    program, read_back = _compiled("scale", fn, (x,), cache)
    assert not read_back  # stale: traced and lowered again ...
    np.testing.assert_array_equal(program(x), x * 2 + 1)
    program, read_back = _compiled("scale", fn, (x,), cache)
    assert read_back  # ... and kept again, with the file as it is now
    np.testing.assert_array_equal(program(x), x * 2 + 1)


def test_a_program_kept_for_other_settings_is_kept_for_these_too(command_line, jax_cache_answering, tmp_path):
    """The same program under another key (a setting it does not depend on): JAX's cache answers
    its compilation, which is not kept; the program the other key kept is, under this key too."""
    x = jnp.arange(4.0)
    cache = tmp_path / "cache"
    configs = lambda steps: {"run": RunConfig(total_steps=steps)}
    fn = lambda v: (v * 2 + 1,)
    assert not _compiled("step", fn, (x,), cache, configs(1000))[1] and len(_kept(cache)) == 1
    jax.clear_caches()  # as in a new process: JAX's persistent cache answers, not its memory
    program, read_back = _compiled("step", fn, (x,), cache, configs(2000))
    assert not read_back and len(_kept(cache)) == 2  # traced and lowered, and kept ...
    np.testing.assert_array_equal(program(x)[0], x * 2 + 1)
    [by_program] = (cache / program_cache.PROGRAMS / program_cache.BY_PROGRAM).iterdir()
    assert any(os.path.samefile(by_program, entry) for entry in _kept(cache))  # ... (a link, no copy)
    program, read_back = _compiled("step", fn, (x,), cache, configs(2000))
    assert read_back
    np.testing.assert_array_equal(program(x)[0], x * 2 + 1)
    # The same text returning another structure is another program (its results would be
    # unflattened wrongly), and so is other text.
    jax.clear_caches()
    program, _ = _compiled("step", lambda v: (v * 2 + 1, None), (x,), cache, configs(3000))
    assert len(program(x)) == 2 and program(x)[1] is None
    jax.clear_caches()
    program, _ = _compiled("step", lambda v: (v * 3 + 1,), (x,), cache, configs(4000))
    np.testing.assert_array_equal(program(x)[0], x * 3 + 1)


def test_the_fingerprint_renewing_a_program_covers_its_text_and_compiler_options():
    x = jnp.arange(4.0)
    lowered = lambda fn, **options: jax.jit(fn, compiler_options=options or None).lower(x)
    double = program_cache.fingerprint(lowered(lambda v: v * 2))
    assert double is not None and double == program_cache.fingerprint(lowered(lambda v: v * 2))
    assert double != program_cache.fingerprint(lowered(lambda v: v * 3))
    assert double != program_cache.fingerprint(lowered(lambda v: v * 2, xla_backend_optimization_level=1))


def test_a_damaged_entry_is_compiled_anew_and_replaced(command_line, jax_cache_off, tmp_path):
    x = jnp.arange(3.0)
    cache = tmp_path / "cache"
    _compiled("double", lambda v: v * 2, (x,), cache)
    [entry] = _kept(cache)
    entry.write_bytes(entry.read_bytes()[:100])
    program, read_back = _compiled("double", lambda v: v * 2, (x,), cache)
    assert not read_back
    np.testing.assert_array_equal(program(x), x * 2)
    assert _compiled("double", lambda v: v * 2, (x,), cache)[1]


def test_an_entry_that_does_not_list_its_files_is_not_read_back(command_line, jax_cache_off, tmp_path):
    import pickle

    x = jnp.arange(3.0)
    cache = tmp_path / "cache"
    _compiled("double", lambda v: v * 2, (x,), cache)
    [entry] = _kept(cache)
    assert _compiled("double", lambda v: v * 2, (x,), cache)[1]
    kept = pickle.loads(entry.read_bytes())
    entry.write_bytes(pickle.dumps({k: v for k, v in kept.items() if k != "files"}))
    assert not program_cache.load(str(entry))


def test_a_program_calling_out_of_xla_is_not_kept_and_lapack_is(command_line, jax_cache_off, tmp_path):
    x = jnp.arange(4.0)
    cache = tmp_path / "cache"
    host = lambda v: jax.pure_callback(lambda a: np.asarray(a) + 1, jax.ShapeDtypeStruct(v.shape, v.dtype), v)
    assert not _compiled("host", host, (x,), cache)[1]
    assert not _compiled("host", host, (x,), cache)[1] and _kept(cache) == []

    m = jnp.eye(3) + 1.0
    qr = lambda a: jnp.linalg.qr(a)[0]
    _compiled("qr", qr, (m,), cache)
    program, read_back = _compiled("qr", qr, (m,), cache)
    assert read_back
    np.testing.assert_allclose(program(m), np.linalg.qr(np.asarray(m))[0], atol=1e-5)


def test_from_python_nothing_is_kept_nor_read_back(tmp_path):
    assert not program_cache._from_command_line  # this test process never set it
    x = jnp.arange(3.0)
    cache = tmp_path / "cache"
    for _ in range(2):
        assert not _compiled("double", lambda v: v * 2, (x,), cache)[1]
    assert _kept(cache) == []
