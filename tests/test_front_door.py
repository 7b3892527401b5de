"""Every TPU verb through the front door: `python launch/tpu.py VERB` and the `podracer` command."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from podracer.command import main
from podracer.provision.cli import VERBS

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("verb", VERBS)
def test_every_verb_has_help_through_the_launcher(verb, capsys):
    assert main([verb, "--help"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith(f"usage: python launch/tpu.py {verb} ") and err == ""


def _front_door(program: list[str], *argv: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([*program, *argv], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=120)


def test_attach_and_logs_help_in_a_process_of_launch_tpu_py():
    for verb in ("attach", "logs"):
        done = _front_door([sys.executable, str(REPO / "launch" / "tpu.py")], verb, "--help")
        assert (done.returncode, done.stderr) == (0, ""), done.stderr
        assert done.stdout.startswith(f"usage: python launch/tpu.py {verb} ")


def test_the_podracer_command_names_itself_in_each_verbs_help():
    script = shutil.which("podracer")
    if script is None:
        pytest.skip("the podracer console script is not installed (pip install -e .)")
    for verb in ("attach", "logs"):
        done = _front_door([script], verb, "--help")
        assert (done.returncode, done.stderr) == (0, ""), done.stderr
        assert done.stdout.startswith(f"usage: podracer {verb} ")


def test_attach_and_logs_take_their_arguments_from_the_launcher(capsys):
    """A slice name or a run's bucket path: no longer an "unexpected argument"."""
    flags = ["--zone=us-central2-b", "--project=p", "--dry-run"]
    for argv in (["attach", "my-slice", *flags], ["logs", "my-slice", "--worker=1", *flags]):
        assert main(argv) == 0, capsys.readouterr().err
        out, err = capsys.readouterr()
        assert err == "" and "nodes/my-slice" in out and "GetNode" in out
