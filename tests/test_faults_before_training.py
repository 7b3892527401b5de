"""What can be found wrong before training is found before training, in one line, leaving nothing.

Each case runs the launcher as a user would (or `main` where nothing would be
built) and checks: exit status 2, one line on stderr that names the flag,
no compilation, no run directory, `runs/latest` untouched.
"""

import os
import subprocess
import time

import pytest

from conftest import LAUNCHER, PYTHON, REPO_ROOT
from podracer.orchestrate.distributed import free_port

RUN = ["--num-envs=16", "--rollout-len=16", "--updates-per-call=1", "--total-steps=4096"]


def _launch(args, cwd, timeout=120, pythonpath=()):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO_ROOT, *map(str, pythonpath)])}
    return subprocess.run([PYTHON, LAUNCHER, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=cwd, env=env)


def _refused(result, *words, before="compiling"):
    """Exit 2, one line naming `words`, and `before` (what the launcher prints as it starts to
    compile, or once it has compiled) not reached."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert all(word in lines[0] for word in words), lines[0]
    assert before not in result.stdout
    return lines[0]


@pytest.fixture
def earlier_run(tmp_path):
    """A directory with runs/latest pointing at an earlier run, which a refused run must leave alone."""
    earlier = tmp_path / "runs" / "earlier"
    earlier.mkdir(parents=True)
    (tmp_path / "runs" / "latest").symlink_to("earlier")
    return tmp_path


def _untouched(cwd):
    runs = cwd / "runs"
    assert sorted(os.listdir(runs)) == ["earlier", "latest"] and os.readlink(runs / "latest") == "earlier"


def test_an_unwritable_run_dir_is_refused_before_compiling(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    _refused(_launch([*RUN, f"--run-dir={blocker}/run"], tmp_path), "--run-dir")


def test_an_unwritable_record_dataset_path_is_refused_before_training(earlier_run):
    blocker = earlier_run / "a-file"
    blocker.write_text("")
    _refused(_launch([*RUN, f"--record-dataset={blocker}/dataset"], earlier_run), "--record-dataset")
    _untouched(earlier_run)


def test_a_batch_too_large_for_memory_is_refused_before_compiling(earlier_run):
    result = _launch(["--num-envs=1000000000", "--rollout-len=16"], earlier_run)
    _refused(result, "--num-envs=1,000,000,000", "GiB")
    _untouched(earlier_run)


def test_optimizer_steps_past_int32_are_refused_before_compiling(earlier_run):
    result = _launch(["--num-envs=16", "--rollout-len=16", f"--total-steps={2**40}"], earlier_run)
    _refused(result, "--total-steps", "int32", before="compiled in")
    _untouched(earlier_run)


def test_a_py_factory_with_the_wrong_signature_is_one_line(earlier_run):
    (earlier_run / "sims.py").write_text("def make(num_envs, render_mode):\n    raise AssertionError\n")
    result = _launch(["--arch=sebulba", "--env=py:sims:make", "--total-steps=1000"], earlier_run,
                     pythonpath=[earlier_run])
    _refused(result, "--env=py:sims:make", "make(num_envs, render_mode)")
    _untouched(earlier_run)


def test_eval_video_to_an_unwritable_path_is_one_line(tmp_path, capsys):
    from podracer.command import main

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    # A run that exists would play its episodes first; the path is refused before it is read.
    code = main(["eval", f"--run-dir={tmp_path / 'missing-run'}", f"--video={blocker}/play.gif"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "--video" in err and "Not a directory" in err, err


@pytest.mark.parametrize("flag", ["--lr=nan", "--lr=inf", "--profile-trace-s=nan", "--max-grad-norm=inf",
                                  f"--seed={2**64}", f"--total-steps={2**64}", f"--num-envs={2**70}",
                                  "--seed=4294967296"])
def test_numbers_the_program_cannot_use_are_refused(flag, capsys):
    from podracer.orchestrate.cli import main

    code = main([flag, "--print-config"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and flag.split("=")[0] in err, err


@pytest.mark.parametrize("sweep, words", [
    (["--sweep", "lr=1e-3,1e-3"], ["lr", "identical"]),
    (["--sweep", "lr=1e-3,1e-3", "--sweep", "ent-coef=0.01,0.01", "--sweep-as-given"],
     ["--sweep-as-given", "identical"]),
    (["--sweep", "lr=1e-3,nan"], ["--sweep lr", "finite", "nan"]),
])
def test_a_sweep_of_identical_or_meaningless_agents_is_refused(sweep, words, capsys):
    from podracer.orchestrate.cli import main

    code = main([*sweep, "--print-config"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and all(word in err for word in words), err


def test_a_value_repeated_in_one_of_paired_sweeps_is_not_a_repeated_setting(capsys):
    from podracer.orchestrate.cli import main

    code = main(["--sweep", "lr=1e-3,3e-4", "--sweep", "ent-coef=0.01,0.01", "--sweep-as-given", "--print-config"])
    assert code == 0, capsys.readouterr().err



@pytest.mark.parametrize("process_id", [1, 0], ids=["coordinator-silent", "peers-missing"])
def test_a_process_that_cannot_join_stops_after_the_join_timeout(process_id, tmp_path):
    # Process 1 finds no coordinator at the address; process 0 is the coordinator, and nobody joins it.
    address = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    result = _launch([*RUN, f"--coordinator={address}", f"--process-id={process_id}", "--num-processes=2",
                      "--join-timeout-s=2", f"--run-dir={tmp_path / 'run'}"], tmp_path, timeout=60)
    assert time.monotonic() - started < 30
    _refused(result, address, "--join-timeout-s=2")
    assert not (tmp_path / "run").exists()
