"""A new user's first hour: runs that don't collide, a CLI that says what it will do, clean stops."""

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
import typing

import pytest

from conftest import LAUNCHER, PYTHON, REPO_ROOT


def _launch(args, cwd, timeout=180, env=None):
    return subprocess.run([PYTHON, LAUNCHER, *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env=env)


def _files(root):
    return {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}


# ------------------------------------------------------------------ mistakes


@pytest.mark.parametrize("args, fragment", [
    (["--totl-steps=1000"], "did you mean --total-steps?"),
    (["--gama=0.9"], "did you mean --gamma?"),
    (["--env=Pong-v5"], "use --arch=sebulba"),
    (["--arch=sebulba", "--env=Catch-bsuite"], "use --arch=anakin"),
    (["--algo=es", "--epochs=3"], "--epochs is a ppo setting"),
    (["--arch=sebulba", "--algo=es", "--num-envs=8"], "--num-envs does not apply"),
    (["--gamma=1.5"], "--gamma must be in [0, 1], got 1.5"),
])
def test_a_mistake_says_what_to_do_and_creates_nothing(args, fragment, tmp_path):
    result = _launch([*args, "--total-steps=1000"], cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and fragment in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == []  # no run directory, no runs/latest


def _numeric_fields():
    from podracer.orchestrate.parse import SECTIONS

    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            kind = hints[field.name]
            element = typing.get_args(kind)[0] if typing.get_origin(kind) is tuple else kind
            if element in (int, float):
                yield section, cls, field


# Numeric settings whose every value means something (or that a later check covers).
UNBOUNDED = {
    "process_id",  # -1: not joining a run; else checked against --num-processes
    "actor_devices", "learner_devices",  # checked against this host's devices
    "target_entropy_per_dim",  # SAC's entropy target: any real number per action dimension (-1 by default)
}


def test_every_numeric_setting_declares_its_range():
    from podracer.bounds import bound_of

    missing = [f"{section}.{field.name}" for section, _, field in _numeric_fields()
               if bound_of(field) is None and field.name not in UNBOUNDED]
    assert missing == []


@pytest.mark.parametrize("section, name", [(s, f.name) for s, _, f in _numeric_fields()
                                           if f.name not in UNBOUNDED])
def test_a_value_outside_its_range_is_refused(section, name, capsys):
    from podracer.bounds import bound_of
    from podracer.orchestrate.cli import main
    from podracer.orchestrate.parse import SECTIONS

    field = next(f for f in dataclasses.fields(SECTIONS[section]) if f.name == name)
    bound = bound_of(field)
    bad = bound.low - 1 if bound.low is not None else bound.high + 1
    if bound.high is not None and bound.low is not None:
        bad = bound.high + 0.5 if isinstance(field.default, float) else bound.high + 1
    if bound.low_open and bound.low is not None:
        bad = bound.low  # the open end itself
    flag = "--" + name.replace("_", "-")
    from podracer.algorithms import ALGORITHMS

    arch, algo = {"es": ("anakin", "es"), "sebulba": ("sebulba", "ppo"),
                  **{name: ("anakin", name) for name in ALGORITHMS}}.get(section, ("anakin", "ppo"))
    value = [str(bad)] if isinstance(field.default, tuple) else [f"{bad}"]
    is_int = isinstance(field.default, int) or (isinstance(field.default, tuple)
                                                and isinstance(field.default[0], int))
    value = [str(int(bad))] if is_int else value
    code = main([f"--arch={arch}", f"--algo={algo}", flag, *value, "--print-config"])
    err = capsys.readouterr().err
    assert code == 2 and f"{flag} must be {bound.describe()}" in err, err


def test_wandb_without_the_package_fails_before_compiling(tmp_path):
    code = ("import sys; sys.modules['wandb'] = None\n"
            "from podracer.orchestrate.cli import main\n"
            "sys.exit(main(['--wandb', '--total-steps=1000']))\n")
    result = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=60,
                            cwd=tmp_path, env={**os.environ, "PYTHONPATH": REPO_ROOT})
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "pip install wandb" in result.stderr and "compiling" not in result.stdout
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ say what will run


@pytest.mark.parametrize("triple", [("anakin", "ppo", "CartPole-v1"), ("anakin", "ppo", "Pendulum-v1"),
                                    ("sebulba", "ppo", "Pong-v5"), ("anakin", "es", "Pendulum-v1"),
                                    ("sebulba", "es", "CartPole-v1"), ("sebulba", "impala", "Pong-v5"),
                                    ("anakin", "impala", "CartPole-v1"), ("anakin", "muzero", "CartPole-v1")])
def test_print_config_is_the_preset_over_the_defaults(triple, capsys):
    from podracer.orchestrate.cli import main
    from podracer.orchestrate.parse import SECTIONS
    from podracer.config import USES
    from podracer.presets import preset_for

    arch, algo, env = triple
    assert main([f"--arch={arch}", f"--algo={algo}", f"--env={env}", "--seed=7",
                 "--print-config"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert list(printed) == list(USES[(arch, algo)])
    preset = preset_for(arch, algo, env)
    assert preset  # every triple above has one
    for section, values in printed.items():
        for field in dataclasses.fields(SECTIONS[section]):
            given = {"seed": 7, "arch": arch, "algo": algo, "env": env}
            expected = given[field.name] if field.name in given else \
                preset.get(field.name, field.default)
            if field.name == "run_dir":
                assert re.fullmatch(rf"runs/{arch}-{algo}-{env}-\d{{8}}-\d{{6}}(-\d+)?", values[field.name])
                continue
            expected = list(expected) if isinstance(expected, tuple) else expected
            assert values[field.name] == expected, (section, field.name)


def test_help_shows_the_defaults_of_the_triple_it_is_given():
    plain = _launch(["--help"], cwd=REPO_ROOT).stdout
    sebulba = _launch(["--help", "--arch=sebulba", "--env=CartPole-v1"], cwd=REPO_ROOT).stdout
    squeeze = lambda text: " ".join(text.split())  # noqa: E731 (argparse wraps lines)
    assert "--num-envs INT Environments stepped in parallel, split evenly over every device. " \
           "(default: 32 for --arch=anakin --algo=ppo --env=CartPole-v1; 64 otherwise" in squeeze(plain)
    assert "(default: 120 for --arch=sebulba --algo=ppo --env=CartPole-v1; 24 otherwise" in squeeze(sebulba)
    assert "RESUMES" in plain and "runs/latest" in plain  # --run-dir explains resuming


# ------------------------------------------------------------------ run directories


def test_runs_one_after_another_each_get_a_directory_and_latest_follows(tmp_path):
    """The Quickstart lines (README, docs/getting-started.md), shortened: each its own run, none refused."""
    first = _launch(["--total-steps=4096", "--checkpoint-every=0"], cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    second = _launch(["--env=Pendulum-v1", "--total-steps=4096"], cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    runs = sorted(p.name for p in (tmp_path / "runs").iterdir() if not p.is_symlink())
    assert len(runs) == 2 and runs[0].startswith("anakin-ppo-CartPole-v1-") \
        and runs[1].startswith("anakin-ppo-Pendulum-v1-")
    assert os.readlink(tmp_path / "runs" / "latest") == runs[1]
    summary = json.loads((tmp_path / "runs" / "latest" / "summary.json").read_text())
    assert summary["env"] == "Pendulum-v1" and summary["config"]["run"]["env"] == "Pendulum-v1"
    assert summary["config"]["ppo"]["gamma"] == 0.9  # the preset, resolved
    line = second.stdout.splitlines()[0]
    assert line.startswith("podracer anakin ppo on Pendulum-v1, 1 cpu device; new run in runs/")
    assert "--gamma=0.9 (preset)" in line and "--total-steps=4096 (given)" in line
    assert "compiled in" in second.stdout


def test_a_finished_run_run_again_changes_nothing_and_a_longer_one_resumes(tmp_path):
    run_dir = tmp_path / "run"
    args = ["--total-steps=8192", f"--run-dir={run_dir}", "--updates-per-call=2"]
    assert _launch(args, cwd=tmp_path).returncode == 0
    before = _files(run_dir)
    again = _launch(args, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert "is a finished run" in again.stdout and str(run_dir / "summary.json") in again.stdout
    assert "compiling" not in again.stdout
    assert _files(run_dir) == before  # summary.json byte for byte, and everything else

    longer = _launch(["--total-steps=12288", f"--run-dir={run_dir}", "--updates-per-call=2"],
                     cwd=tmp_path)
    assert longer.returncode == 0, longer.stderr
    assert f"resuming {run_dir} from env step 8,192" in longer.stdout.splitlines()[0]
    assert json.loads((run_dir / "summary.json").read_text())["resumed_from_env_steps"] == 8192


# ------------------------------------------------------------------ signals


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_compilation_exits_at_once_and_cleanly(sig, tmp_path):
    # A program that takes seconds to compile: the signal lands inside XLA's compiler.
    process = subprocess.Popen(
        [PYTHON, LAUNCHER, "--total-steps=100000", "--num-envs=64", "--epochs=8",
         "--unroll-minibatches", f"--run-dir={tmp_path / 'run'}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        for line in process.stdout:
            if line.startswith("compiling"):
                break
        time.sleep(0.5)
        assert process.poll() is None  # still compiling
        sent = time.monotonic()
        process.send_signal(sig)
        _, err = process.communicate(timeout=30)
    finally:
        process.kill()
    assert process.returncode == 128 + sig, err
    assert time.monotonic() - sent < 5  # not after the compilation
    assert err == f"interrupted by {signal.Signals(sig).name} before training started; nothing was saved\n"
    assert not list((tmp_path / "run").rglob("summary.json"))


# ------------------------------------------------------------------ the distribution


def test_the_distribution_is_not_named_podracer_and_installs_the_command():
    import importlib.metadata

    assert importlib.metadata.distribution("podracer-rl").metadata["Name"] == "podracer-rl"
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.distribution("podracer")
    command = os.path.join(os.path.dirname(sys.executable), "podracer")
    result = subprocess.run([command, "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "usage: podracer" in result.stdout
