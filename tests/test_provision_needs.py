"""What a run needs on every worker: the extras its flags use, and a py: environment's module."""

import subprocess
import sys
from pathlib import Path

import pytest

from podracer.errors import PodracerError
from podracer.provision import staging
from podracer.provision.needs import env_module_files, worker_extras

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("flags, extras", [
    (["--arch=sebulba", "--env=Pong-v5"], ("gcs",)),
    (["--arch=anakin", "--env=brax:inverted_pendulum"], ("gcs", "brax")),
    (["--arch=anakin", "--env=jumanji:Snake-v1"], ("gcs", "jumanji")),
    (["--arch=anakin", "--env=craftax:Craftax-Classic-Symbolic-v1"], ("gcs", "craftax")),
    (["--arch=anakin", "--env=navix:Navix-Empty-5x5-v0"], ("gcs", "navix")),
    (["--arch=sebulba", "--env=gymnasium:CartPole-v1"], ("gcs",)),
    (["--record-dataset=gs://b/data"], ("gcs", "data")),
    (["--init-from-dataset", "gs://b/data"], ("gcs", "data")),
    (["--wandb"], ("gcs", "wandb")),
])
def test_the_extras_a_runs_flags_need(flags, extras):
    assert worker_extras(flags) == extras


def test_a_brax_runs_lock_lists_brax():
    lines = staging.lock(worker_extras(["--arch=anakin", "--env=brax:inverted_pendulum"]))
    assert any(line.startswith("brax==") for line in lines)
    assert not any(line.startswith("brax==") for line in staging.lock(("gcs",)))


def _sims(root: Path) -> None:
    (root / "my_sims.py").write_text(
        "import gymnasium\n\n\ndef make(num_envs):\n"
        "    return gymnasium.make_vec('CartPole-v1', num_envs=num_envs, vectorization_mode='sync')\n")


def test_a_py_envs_module_or_package_is_staged_from_the_working_directory(tmp_path):
    _sims(tmp_path)
    assert env_module_files("py:my_sims:make", tmp_path, ("gcs",)) == {"my_sims.py": tmp_path / "my_sims.py"}
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    for name in ("pkg/__init__.py", "pkg/sub/__init__.py", "pkg/sub/envs.py"):
        (tmp_path / name).write_text("")
    assert sorted(env_module_files("py:pkg.sub.envs:make", tmp_path, ("gcs",))) == [
        "pkg/__init__.py", "pkg/sub/__init__.py", "pkg/sub/envs.py"]
    assert env_module_files("CartPole-v1", tmp_path, ("gcs",)) == {}


def test_a_module_a_locked_distribution_installs_needs_nothing_and_any_other_is_refused(tmp_path):
    assert env_module_files("py:gymnasium.envs:make", tmp_path, ("gcs",)) == {}
    with pytest.raises(PodracerError, match=r"--env=py:rlax:make: the workers import rlax from "
                                            r"files staged from the working directory"):
        env_module_files("py:rlax:make", tmp_path, ("gcs",))  # installed here, a test tool only


def test_a_staged_module_is_importable_by_the_staged_launcher_from_anywhere(tmp_path):
    """The workers run code/launcher.py: its folder is the first entry of their sys.path."""
    code, elsewhere = tmp_path / "code", tmp_path / "run"
    code.mkdir(), elsewhere.mkdir()
    _sims(tmp_path)
    for name, path in env_module_files("py:my_sims:make", tmp_path, ("gcs",)).items():
        (code / name).write_bytes(path.read_bytes())
    (code / staging.LAUNCHER_NAME).write_text(staging.DEFAULT_LAUNCHER.read_text())
    done = subprocess.run([sys.executable, str(code / staging.LAUNCHER_NAME), "--arch=sebulba",
                           "--env=py:my_sims:make", "--num-envs=4", "--rollout-len=8",
                           "--total-steps=32", f"--run-dir={elsewhere / 'out'}"],
                          cwd=elsewhere, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (elsewhere / "out" / "summary.json").is_file()
