"""Test session set-up: eight CPU devices, before anything starts JAX's backend; shared fixtures."""

import atexit
import os
import shutil
import sys
import tempfile

import pytest

# One compilation cache per test process (each pytest-xdist worker its own),
# inherited by every launcher subprocess: the many short runs of one program
# compile it once, no process reads an entry that another test process is
# writing, and nothing reaches the user's own cache (~/.cache/podracer/jax).
# JAX's own variable points this process's direct calls of the drivers there too.
_CACHE = tempfile.mkdtemp(prefix="podracer-jax-cache-")
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
os.environ["PODRACER_COMPILE_CACHE"] = os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAUNCHER = os.path.join(REPO_ROOT, "launch", "tpu.py")
PYTHON = sys.executable

GCS_BUCKET = "podracer-runs"


def wait_for(predicate, timeout_s: float, poll_s: float = 0.01) -> bool:
    """Whether `predicate()` became true within `timeout_s`: a deadline to wait on, never a race."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(poll_s)
    return False


def kill_at_first_checkpoint(argv, run_dir, timeout_s: float = 180) -> int:
    """Start `launch/tpu.py ARGV` and SIGKILL it as soon as its first checkpoint in `run_dir` is complete
    (mid-run, for a run of many saves); returns the env steps of its last complete checkpoint."""
    import subprocess

    from podracer.session.checkpoint import checkpoint_steps

    proc = subprocess.Popen([PYTHON, LAUNCHER, *argv], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env=dict(os.environ))
    try:
        appeared = wait_for(lambda: checkpoint_steps(str(run_dir)), timeout_s)
    finally:
        proc.kill()
        _, stderr = proc.communicate(timeout=60)
    assert appeared, "no checkpoint appeared: " + stderr[-3000:]
    return checkpoint_steps(str(run_dir))[-1]


@pytest.fixture(scope="module")
def gcs_emulator(tmp_path_factory):
    """A local Cloud Storage emulator (`gcs_emulator.Emulator`) for one test module.

    Its clients' variables are set in `os.environ` while the module runs, so
    subprocesses started with `env=dict(os.environ)` reach it; pass
    `gcs_emulator.variables` yourself to an environment built otherwise. The
    module is skipped where the `gcs` extra or the emulator is not installed.
    """
    import importlib.util

    # Found, not imported: gcsfs reads its variables when first imported, which
    # must be after they are set below.
    for module in ("google.cloud.storage", "gcsfs", "gcp_storage_emulator"):
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            pytest.skip(f"needs {module}")
    from gcs_emulator import running_emulator

    with running_emulator(tmp_path_factory.mktemp("emulator")) as emulator, pytest.MonkeyPatch.context() as env:
        for name, value in emulator.variables.items():
            env.setenv(name, value)
        yield emulator


@pytest.fixture(scope="module")
def gcs_bucket(gcs_emulator):
    """The bucket `GCS_BUCKET` in the module's emulator, empty at first (a google.cloud.storage Bucket)."""
    return gcs_emulator.create_bucket(GCS_BUCKET)


@pytest.fixture(scope="module")
def offline_install(tmp_path_factory):
    """Variables for pip and uv on a TPU worker emulated here: they install the staged lock
    and `uv` from a local wheelhouse (this machine has no index), `libtpu` left out."""
    from wheelhouse import build_wheelhouse, offline_variables

    from podracer.provision import staging

    # With bytecode: a worker imports jax in seconds, not the tens of seconds compiling takes.
    wheels = build_wheelhouse([*staging.lock((*staging.WORKER_EXTRAS, "tpu")), f"uv=={staging.UV_VERSION}"],
                              exclude=["podracer-rl", "libtpu"], bytecode=True)
    # One uv cache for every worker, beside the wheelhouse it unpacks (and as lasting), as
    # fresh machines' would not be: an install takes seconds, not a minute.
    return offline_variables(wheels, tmp_path_factory.mktemp("offline"),
                             wheels.with_name(wheels.name + "-uv-cache"))
