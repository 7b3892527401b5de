"""The command line as a newcomer meets it: its version, the verbs' help, `plot` as a verb,
a compilation that shows it is alive, a rounded total said on the first line, start-up
inside the wall time, and a population plot whose legend leaves the curves alone."""

import io
import json
import os
import re
import subprocess

import jax
import pytest

import podracer
from conftest import LAUNCHER, PYTHON, REPO_ROOT
from podracer.orchestrate import plan
from podracer.orchestrate.parse import parse_configs
from podracer.session import heartbeat
from podracer.session.logger import RunLogger


def _launch(*args, cwd=REPO_ROOT, timeout=300, module=False):
    command = [PYTHON, "-m", "podracer"] if module else [PYTHON, LAUNCHER]
    return subprocess.run([*command, *args], capture_output=True, text=True, cwd=cwd, timeout=timeout)


# ------------------------------------------------------------------ flags and verbs


@pytest.mark.parametrize("module", [False, True], ids=["launcher", "python-m-podracer"])
def test_version_prints_the_version(module):
    result = _launch("--version", module=module)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"podracer {podracer.__version__}\n" and result.stderr == ""


def test_eval_help_names_its_verb_and_lists_options_once():
    result = _launch("eval", "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: podracer eval ")
    assert result.stdout.count("options:") == 1 and "--episodes INT" in result.stdout


def _write_run(run_dir, rows, summary):
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (run_dir / "summary.json").write_text(json.dumps(summary))
    return run_dir


def test_plot_is_a_verb(tmp_path):
    rows = [{"env_steps": 1000 * i, "sps": 1000.0, "wall_s": 1.0 * i, "episode_return_mean": 10.0 * i}
            for i in range(1, 5)]
    run = _write_run(tmp_path / "run", rows, {"arch": "anakin", "algo": "ppo", "env": "CartPole-v1"})
    result = _launch("plot", str(run), f"--out={tmp_path / 'curves.png'}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"{tmp_path / 'curves.png'}\n" and (tmp_path / "curves.png").stat().st_size > 0
    assert _launch("plot", "--help").stdout.startswith("usage: podracer plot ")
    missing = _launch("plot", str(tmp_path / "nothing"), cwd=tmp_path)
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and "pass the directory" in missing.stderr


@pytest.mark.parametrize("arch, said", [("anakin", "unknown gymnax environment 'Nope-v9'"),
                                        ("sebulba", "unknown envpool environment 'Nope-v9'")])
def test_help_for_an_unknown_environment_says_it_is_unknown(arch, said):
    result = _launch("--help", f"--arch={arch}", "--env=Nope-v9")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and said in result.stderr


# ------------------------------------------------------------------ the population plot


def test_the_population_plots_legend_is_below_its_panels(tmp_path):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from podracer import plot

    settings = [{"lr": 0.0003}, {"lr": 0.0003}, {"lr": 0.001}, {"lr": 0.001}]
    rows = []
    for i in range(1, 9):
        scores = [10.0 * i + agent for agent in range(4)]
        rows.append({"env_steps": 4096 * i, "sps": 1000.0, "wall_s": 1.0 * i,
                     "episode_return_mean": sum(scores) / 4, "agents": [
                         {"episode_return_mean": score} for score in scores]})
    summary = {"arch": "anakin", "algo": "ppo", "env": "CartPole-v1",
               "agents": [{"agent": i, "seed": i % 2, "settings": s} for i, s in enumerate(settings)]}
    run = _write_run(tmp_path / "sweep", rows, summary)
    fig = plot.figure([str(run)])
    FigureCanvasAgg(fig).draw()
    legend = fig.axes[0].get_legend()
    assert len(legend.get_texts()) == 2  # one IQM per setting
    box = legend.get_window_extent()
    for ax in fig.axes:
        panel = ax.get_window_extent()
        label = ax.xaxis.label.get_window_extent()
        assert not box.overlaps(panel) and box.y1 <= label.y0, (box, panel, label)
    assert box.y0 >= 0  # inside the figure, not cut off


# ------------------------------------------------------------------ the compilation shows it is alive


class _Terminal(io.StringIO):
    def isatty(self):
        return True


@pytest.mark.parametrize("stream", [io.StringIO(), _Terminal()], ids=["pipe", "terminal"])
def test_the_heartbeat_says_what_and_ticks_until_it_ends(stream):
    import time

    heartbeat.begin("compiling the training program of anakin ppo on CartPole-v1", stream, interval_s=0.02)
    time.sleep(0.5)
    heartbeat.end()
    text = stream.getvalue()
    assert text.startswith("compiling the training program of anakin ppo on CartPole-v1")
    assert text.endswith("\n")
    if isinstance(stream, _Terminal):  # one line, rewritten with the seconds so far
        assert text.count("\n") == 1 and text.count("\r") >= 10
        assert re.search(r"\rcompiling .* \d+ s\n$", text)
    else:  # the line whole, then dots; every tenth ends its line with the seconds so far
        first, ticks = text.split("\n", 1)
        assert ticks.count(".") >= 10 and re.search(r"^\.{10} \d+ s$", ticks, re.M)
    written = len(text)
    time.sleep(0.1)
    assert len(stream.getvalue()) == written  # ended: nothing more


def test_progress_total_is_what_was_trained_when_generations_pass_it(tmp_path):
    # Sebulba ES ends in the generation that passes --total-steps (today: "51,001/50,000").
    out = io.StringIO()
    logger = RunLogger(str(tmp_path), 50_000, stream=out, min_interval_s=0)
    for steps in (25_300, 51_001):
        logger.log({"env_steps": steps, "sps": 1000.0, "episode_return_mean": 20.0})
    lines = out.getvalue().splitlines()
    assert "51,001/51,001 (100%)" in lines[-1] and "25,300/50,000 (50%)" in lines[0]


# ------------------------------------------------------------------ --total-steps, rounded up


@pytest.mark.parametrize("args", [
    ["--arch=anakin", "--algo=ppo", "--num-envs=8", "--rollout-len=64", "--updates-per-call=8",
     "--total-steps=5000"],
    ["--arch=anakin", "--algo=impala", "--num-envs=8", "--rollout-len=16", "--total-steps=100"],
    ["--arch=anakin", "--algo=es", "--population=64", "--generations-per-call=5", "--total-steps=200000"],
    ["--arch=anakin", "--algo=ppo", "--num-seeds=2", "--total-steps=70000"],
], ids=["ppo", "impala", "es", "population"])
def test_the_steps_said_are_the_steps_the_anakin_program_runs(args):
    from podracer.anakin import train, train_es

    configs = parse_configs(args)
    builder = train_es if configs.run.algo == "es" else train
    calls = builder.build(configs, jax.devices()[:1]).calls
    assert plan.trained_steps(configs) == calls.total * calls.steps_per_call
    assert plan.trained_steps(configs) > configs.run.total_steps * 1.05  # each of these rounds up
    assert plan.rounding_note(configs).startswith(f"--total-steps={configs.run.total_steps:,} trains ")


def test_sebulba_rounds_up_to_whole_updates_and_es_is_not_known_ahead():
    configs = parse_configs(["--arch=sebulba", "--num-envs=8", "--rollout-len=32", "--total-steps=1000"])
    assert plan.trained_steps(configs) == 1024 and plan.rounding_note(configs) == ""  # 2.4%: not said
    configs = parse_configs(["--arch=sebulba", "--num-envs=8", "--rollout-len=32", "--total-steps=300"])
    assert plan.rounding_note(configs) == "--total-steps=300 trains 512 env steps (whole updates of 256)"
    assert plan.trained_steps(parse_configs(["--arch=sebulba", "--algo=es"])) is None


def test_a_run_says_it_compiles_rounds_up_and_counts_start_up_in_its_wall_time(tmp_path):
    # The run's stdout is a pipe; its network's size is its own, so no other test's program is read back.
    result = _launch("--num-envs=8", "--rollout-len=64", "--updates-per-call=8", "--total-steps=5000",
                     "--hidden", "48", "48", "--checkpoint-every=0",
                     f"--run-dir={tmp_path / 'run'}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "; --total-steps=5,000 trains 8,192 env steps (whole calls of 4,096);" in lines[0]
    assert lines[1] == "compiling the training program of anakin ppo on CartPole-v1"
    compiled = next(i for i, line in enumerate(lines) if line.startswith("compiled in "))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    dots = "".join(lines[2:compiled]).count(".")
    assert summary["compile_s"] >= 2, "the program compiled too fast to show the heartbeat"
    assert dots >= int(summary["compile_s"]) - 1  # a dot a second, at least while XLA compiled
    progress = [line for line in lines if line.startswith("steps ")]
    assert "8,192/8,192 (100%)" in progress[-1] and summary["env_steps"] == 8192
    assert 0 < summary["time_to_first_step_s"] <= summary["wall_s"]
    assert summary["wall_s"] >= summary["time_to_first_step_s"] + summary["train_s"] - 0.5


def test_sebulba_es_progress_ends_at_the_steps_it_trained(tmp_path):
    result = _launch("--arch=sebulba", "--algo=es", "--population=8", "--eval-episodes=2", "--total-steps=1500",
                     "--checkpoint-every=0", f"--run-dir={tmp_path / 'run'}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    last = [line for line in result.stdout.splitlines() if line.startswith("steps ")][-1]
    trained = f"{summary['env_steps']:,}"
    assert summary["env_steps"] > 1500 and f"{trained}/{trained} (100%)" in last


def test_an_es_run_without_a_horizon_leaves_the_refusal_to_its_build(monkeypatch):
    # The first line is printed after the run directory is made: it must not refuse (nor leave it behind).
    from podracer.es import agent as es_agent
    from podracer.errors import PodracerError

    def no_time_limit(env, config):
        raise PodracerError(f"{env.env_id} has no episode time limit to default to; pass --horizon")

    monkeypatch.setattr(es_agent, "episode_horizon", no_time_limit)
    assert plan.rounding_note(parse_configs(["--algo=es", "--total-steps=1000"])) == ""
