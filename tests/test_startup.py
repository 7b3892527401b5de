"""Start-up: the persistent compilation cache, the time to the first step, the imports a run skips."""

import json
import os
import subprocess
import time

import pytest

from conftest import LAUNCHER, PYTHON, REPO_ROOT
from podracer.errors import PodracerError
from podracer.orchestrate import compile_cache

SHORT = ["--num-envs=8", "--rollout-len=16", "--updates-per-call=2", "--total-steps=1024",
         "--checkpoint-every=0"]
DELAY_S = 2.0  # the process's own start-up before the launcher's code runs, in the timed run


def _environ(**changes):
    """This process's environment without the test session's cache variables, plus `changes`."""
    environ = {k: v for k, v in os.environ.items()
               if k not in (compile_cache.ENV_VAR, compile_cache.JAX_ENV_VAR)}
    return {**environ, **changes}


def _launch(args, cwd, environ, delay_s=0.0):
    """The launcher in a new process (after `delay_s` of the process's own); returns (result, wall)."""
    code = (f"import runpy, sys, time; time.sleep({delay_s}); sys.argv = {[LAUNCHER, *args]!r}; "
            f"runpy.run_path({LAUNCHER!r}, run_name='__main__')")
    start = time.monotonic()
    result = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=300,
                            cwd=cwd, env=environ)
    assert result.returncode == 0, result.stderr[-3000:]
    return result, time.monotonic() - start


def _summary(run_dir):
    return json.loads((run_dir / "summary.json").read_text())


def _entries(cache):
    return list(cache.iterdir())


def test_a_repeated_run_reads_its_programs_from_the_cache_and_a_changed_one_compiles(tmp_path):
    environ = _environ(XDG_CACHE_HOME=str(tmp_path / "xdg"), HOME=str(tmp_path))
    cache = tmp_path / "xdg" / "podracer" / "jax"  # the default place

    _launch([*SHORT, f"--run-dir={tmp_path / 'first'}"], tmp_path, environ)
    first = _summary(tmp_path / "first")
    programs = first["compile_cache"]["misses"]
    assert first["compile_cache"] == {"dir": str(cache), "hit": False, "hits": 0, "misses": programs}
    assert programs >= 2  # the initialisation and the training program, at least
    assert len(_entries(cache)) == programs  # each written, however fast it compiled

    # The same settings again, the cache named by the flag: every program is read back.
    _, wall = _launch([*SHORT, f"--run-dir={tmp_path / 'again'}", f"--compile-cache={cache}"], tmp_path,
                      environ, delay_s=DELAY_S)
    again = _summary(tmp_path / "again")
    assert again["compile_cache"] == {"dir": str(cache), "hit": True, "hits": programs, "misses": 0}
    assert again["params_fingerprints"] == first["params_fingerprints"]  # the same programs
    # Counted from the process's start (its first DELAY_S included), up to training's.
    assert DELAY_S + again["compile_s"] < again["time_to_first_step_s"] < wall - again["train_s"]

    # Another network (the cache named by the variable): its programs compile anew.
    _launch([*SHORT, f"--run-dir={tmp_path / 'changed'}", "--hidden", "32", "32"], tmp_path,
            {**environ, compile_cache.ENV_VAR: str(cache)})
    changed = _summary(tmp_path / "changed")
    assert changed["compile_cache"]["dir"] == str(cache) and not changed["compile_cache"]["hit"]
    assert changed["compile_cache"]["misses"] >= 2  # its initialisation and training program
    assert len(_entries(cache)) == programs + changed["compile_cache"]["misses"]

    # Another seed: the seed's key is an argument of the programs, not part of them.
    _launch([*SHORT, "--seed=1", f"--run-dir={tmp_path / 'seed1'}"], tmp_path, environ)
    seed1 = _summary(tmp_path / "seed1")
    assert seed1["compile_cache"] == {"dir": str(cache), "hit": True, "hits": programs, "misses": 0}
    assert seed1["params_fingerprints"] != first["params_fingerprints"]


def test_off_compiles_everything_and_keeps_nothing(tmp_path):
    jax_cache = tmp_path / "jax-variable"  # JAX's own variable, which off overrides
    environ = _environ(XDG_CACHE_HOME=str(tmp_path / "xdg"), HOME=str(tmp_path),
                       **{compile_cache.JAX_ENV_VAR: str(jax_cache)})
    _launch([*SHORT, f"--run-dir={tmp_path / 'run'}", "--compile-cache=off"], tmp_path, environ)
    assert _summary(tmp_path / "run")["compile_cache"] == {"dir": None, "hit": False, "hits": 0,
                                                          "misses": 0}
    assert not jax_cache.exists() and not (tmp_path / "xdg").exists()


def test_where_the_cache_goes():
    resolve = compile_cache.resolve
    xdg = {"XDG_CACHE_HOME": "/xdg"}
    assert resolve("", "runs/x", xdg) == ("/xdg/podracer/jax", "")
    assert resolve("", "runs/x", {"HOME": "/home/u"})[0] == os.path.join(
        os.path.expanduser("~"), ".cache", "podracer", "jax")
    assert resolve("", "gs://b/runs/x", xdg) == ("gs://b/runs/compile_cache", "")
    assert resolve("", "gs://b/x/", xdg) == ("gs://b/compile_cache", "")
    jax_var = {**xdg, "JAX_COMPILATION_CACHE_DIR": "/j"}
    assert resolve("", "gs://b/runs/x", jax_var) == ("/j", "JAX_COMPILATION_CACHE_DIR=/j")
    ours = {**jax_var, "PODRACER_COMPILE_CACHE": "off"}
    assert resolve("", "runs/x", ours) == (None, "PODRACER_COMPILE_CACHE=off")
    assert resolve("/mine", "runs/x", ours) == ("/mine", "--compile-cache=/mine")
    assert resolve("off", "runs/x", xdg) == (None, "--compile-cache=off")


def test_a_default_cache_that_cannot_be_made_is_off_and_a_given_one_is_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    assert compile_cache.prepare(str(blocker / "jax"), "") is None
    with pytest.raises(PodracerError) as err:
        compile_cache.prepare(str(blocker / "jax"), f"--compile-cache={blocker / 'jax'}")
    assert str(err.value).startswith(f"--compile-cache={blocker / 'jax'}: cannot")
    assert "\n" not in str(err.value) and "--compile-cache=off" in str(err.value)
    assert compile_cache.prepare(str(tmp_path / "new" / "jax"), "x") == str(tmp_path / "new" / "jax")
    assert (tmp_path / "new" / "jax").is_dir()


@pytest.mark.parametrize("args, environ, fragment", [
    (["--compile-cache=/dev/null/cache"], {}, "--compile-cache=/dev/null/cache: cannot"),
    (["--compile-cache=s3://bucket/cache"], {}, "--compile-cache=s3://bucket/cache: s3://"),
    ([], {compile_cache.ENV_VAR: "/dev/null/cache"}, "PODRACER_COMPILE_CACHE=/dev/null/cache: cannot"),
])
def test_a_cache_that_cannot_be_used_is_one_line_exit_2_before_anything(args, environ, fragment, tmp_path):
    result = subprocess.run([PYTHON, LAUNCHER, *args, "--total-steps=1000"], capture_output=True,
                            text=True, timeout=120, cwd=tmp_path, env={**os.environ, **environ})
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and fragment in result.stderr, result.stderr
    assert list(tmp_path.iterdir()) == []  # no run directory


# Modules a default Anakin run never needs: gymnax's and tensorboardX's unused imports
# (seaborn, pandas, scipy, pyplot; boto3, Cloud Storage), Sebulba's envpool, the TPU
# provisioner's client, W&B.
NOT_IMPORTED = ("pandas", "scipy.stats", "matplotlib.figure", "boto3", "google.cloud.storage", "envpool",
                "google.cloud.tpu_v2", "wandb")


def test_a_default_anakin_run_imports_no_module_it_does_not_use(tmp_path):
    args = [*SHORT, f"--run-dir={tmp_path / 'run'}"]
    code = ("import json, sys; from podracer.orchestrate.cli import main; "
            f"assert main({args!r}) == 0; "
            f"print(json.dumps([m for m in {NOT_IMPORTED!r} if m in sys.modules]))")
    result = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=300,
                            cwd=REPO_ROOT, env=dict(os.environ))
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.splitlines()[-1]) == []
    assert (tmp_path / "run" / "tensorboard").is_dir()  # TensorBoard's writer still wrote


def test_gymnax_renders_with_its_plotting_libraries_loaded_on_first_use():
    code = ("import sys, jax, matplotlib; matplotlib.use('Agg'); "
            "from podracer.envs.jax_envs import make_env; env = make_env('Catch-bsuite'); "
            "loaded = 'pandas' in sys.modules or 'matplotlib.figure' in sys.modules; "
            "_, state = env.env.reset(jax.random.PRNGKey(0), env.params); "
            "env.env.render(state, env.params); "
            "print(loaded, type(sys.modules['matplotlib.pyplot']).__name__, "
            "sys.modules['seaborn'].color_palette('cubehelix', 2) is not None)")
    result = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=120,
                            cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["False", "module", "True"]


def test_a_resumed_run_reads_its_checkpoint_config_and_makes_its_environment_once(tmp_path, monkeypatch):
    """The command line's checks before anything is built are not made again by the run."""
    import podracer
    from podracer.envs import jax_envs as anakin_env
    from podracer.session import checkpoint

    run = dict(num_envs=8, rollout_len=16, updates_per_call=2, checkpoint_every=0,
               run_dir=str(tmp_path / "run"))
    podracer.train(total_steps=512, **run)
    probes, made = [], []
    original_init, original_env = checkpoint.Checkpointer.__init__, anakin_env.GymnaxEnv.__init__

    def counting_probe(self, *args, create=True, **kwargs):
        probes.append(create)
        original_init(self, *args, create=create, **kwargs)

    def counting_env(self, env_id):
        made.append(env_id)
        original_env(self, env_id)

    monkeypatch.setattr(checkpoint.Checkpointer, "__init__", counting_probe)
    monkeypatch.setattr(anakin_env.GymnaxEnv, "__init__", counting_env)
    anakin_env.make_env.cache_clear()
    summary = podracer.train(total_steps=1024, **run)
    assert summary["resumed_from_env_steps"] == 512
    assert probes == [False, True]  # the command line's check, then the run's own checkpointer
    assert made == ["CartPole-v1"]
