"""The manual and the front page: the site builds with `--strict`, the README stays a front
page whose set-up commands CI reads, and every shell command a page shows is run by a test
or marked as needing what a test cannot have.

A command is accounted for in one of four ways:
- a trailing comment that starts with `needs` (`# needs a TPU slice`, `# needs an accelerator`);
- it only asks (`--help`, `--print-config`, `--version`): this file runs it;
- `pip install -e ".[EXTRA]"`: the extra is checked to exist in pyproject.toml;
- `COVERED` names the test that runs it (often shortened), which must exist.
Every training command shown unmarked must also parse as the launcher parses it.
"""

import os
import re
import shlex
import subprocess
import tomllib
from pathlib import Path

from conftest import LAUNCHER, PYTHON, REPO_ROOT

ROOT = Path(REPO_ROOT)
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_FENCES = {"bash", "sh", "shell", "console"}
COMMAND_PREFIXES = ("python ", "pip ", "podracer ", "tensorboard ", "gcloud ")
ASKING = ("--help", "--print-config", "--version")
LAUNCH = "python launch/tpu.py"

# Commands that a test runs (with fewer steps, or on fewer devices, where a run would be long).
COVERED = {
    "pip install -e . && python launch/tpu.py": ".ci/run",  # CI: command 1 in a new virtual environment
    'pip install -e ".[dev]" && python -m pytest': ".ci/run",  # CI: command 2
    f"{LAUNCH} --arch=anakin --algo=ppo": "tests/test_anakin.py::test_default_run_solves_cartpole",
    f"{LAUNCH} --algo=ppo": "tests/test_anakin.py::test_default_run_solves_cartpole",
    f"{LAUNCH} --env=Pendulum-v1":
        "tests/test_first_hour.py::test_runs_one_after_another_each_get_a_directory_and_latest_follows",
    f"{LAUNCH} --cpu-devices=8 --num-envs=64": "tests/test_every_pair.py::test_cpu_devices_splits_the_cpu",
    f"{LAUNCH} --arch=sebulba --algo=ppo":
        "tests/test_sebulba_train.py::test_learns_cartpole_where_a_zero_learning_rate_cannot",
    f"{LAUNCH} --arch=sebulba --env=Pong-v5": "tests/test_sebulba_train.py::test_pong_runs_on_frames",
    f"{LAUNCH} --arch=sebulba --cpu-devices=4 --actor-devices 0 --learner-devices 1 2 3":
        "tests/test_sebulba_train.py::test_one_actor_device_three_learners_asynchronous",
    f"{LAUNCH} --arch=sebulba --algo=impala": "tests/test_impala.py::test_sebulba_impala_solves_cartpole_with_policy_lag",
    f"{LAUNCH} --arch=anakin --algo=impala": "tests/test_every_pair.py::test_num_processes_joins_two_processes",
    f"{LAUNCH} --arch=sebulba --algo=muzero":
        "tests/test_muzero_run.py::test_sebulba_muzero_learns_cartpole_where_a_zero_learning_rate_cannot",
    f"{LAUNCH} --arch=anakin --algo=muzero":
        "tests/test_muzero_run.py::test_muzero_learns_cartpole_and_a_learning_rate_of_zero_does_not",
    f"{LAUNCH} --algo=es": "tests/test_es_anakin.py::test_cli_run_writes_metrics_and_summary",
    f"{LAUNCH} --algo=pqn": "tests/test_pqn_runs.py::test_the_defaults_solve_cartpole_where_a_zero_learning_rate_cannot",
    f"{LAUNCH} --arch=sebulba --algo=pqn":
        "tests/test_pqn_runs.py::test_sebulba_learns_cartpole_where_a_zero_learning_rate_cannot",
    f"{LAUNCH} --arch=anakin --algo=es": "tests/test_es_anakin.py::test_cli_run_writes_metrics_and_summary",
    f"{LAUNCH} --arch=anakin --algo=es --variant=ars_v2 --population=32":
        "tests/test_cli.py::test_eval_and_load_policy_of_an_es_run",
    f"{LAUNCH} --arch=sebulba --algo=es": "tests/test_es_sebulba.py::test_learns_cartpole_and_writes_the_run_files",
    f"{LAUNCH} --env=MemoryChain-bsuite --network=lstm --num-envs=64 --rollout-len=24 --minibatches=2":
        "tests/test_recurrent.py::test_an_lstm_solves_a_memory_task_a_feed_forward_policy_cannot",
    f"{LAUNCH} --arch=sebulba --env=CartPole-NoVel-v1 --network=lstm --num-envs=16 --minibatches=2":
        "tests/test_recurrent.py::test_sebulba_lstm_balances_cartpole_without_velocities",
    f"{LAUNCH} --num-processes=2 --cpu-devices=2": "tests/test_every_pair.py::test_num_processes_joins_two_processes",
    f"{LAUNCH} --num-seeds=16": "tests/test_population.py::test_a_population_runs_on_one_cpu_device_per_core_by_default",
    f"{LAUNCH} --num-seeds=4 --sweep lr=1e-4,3e-4": "tests/test_population.py::test_sweep_ranks_the_working_learning_rate_first",
    f"{LAUNCH} --num-seeds=4 --sweep lr=1e-4,3e-4,1e-3 --sweep ent-coef=0,0.01":
        "tests/test_population.py::test_sweep_ranks_the_working_learning_rate_first",
    f"{LAUNCH} --algo=es --num-seeds=8 --sweep sigma=0.02,0.05":
        "tests/test_population.py::test_es_agent_equals_the_run_of_one_agent",
    f"{LAUNCH} --num-seeds=4 --sweep lr=1e-3,3e-4 --sweep ent-coef=0.01,0 --sweep-as-given":
        "tests/test_population.py::test_sweeps_as_given_pair_their_values_instead_of_crossing_them",
    f"{LAUNCH} --sweep lr=loguniform:1e-4:1e-2 --sweep ent-coef=choice:0,0.01 --num-samples=16":
        "tests/test_pbt.py::test_sampled_sweeps_are_drawn_from_the_seed",
    f"{LAUNCH} --num-seeds=2 --sweep lr=1e-6,2e-6,3e-3,5e-3 --pbt --pbt-interval=8 --pbt-fraction=0.5 --pbt-resample=0":
        "tests/test_pbt.py::test_pbt_rescues_the_useless_learning_rates_and_a_control_does_not",
    f"{LAUNCH} --num-seeds=2 --sweep lr=loguniform:1e-4:1e-2 --sweep ent-coef=uniform:0:0.02 --num-samples=4 --pbt":
        "tests/test_pbt.py::test_agents_split_over_eight_devices_follow_the_trajectory_of_one_device",
    "python -m podracer.plot runs/latest --out pbt.png": "tests/test_pbt.py::test_lineage_plot_and_the_best_agents_policy",
    f"{LAUNCH} eval --run-dir=runs/latest --agent=best --episodes=10":
        "tests/test_pbt.py::test_lineage_plot_and_the_best_agents_policy",
    f"{LAUNCH} eval --run-dir=runs/latest --episodes=10": "tests/test_cli.py::test_eval_and_load_policy",
    f"{LAUNCH} eval --run-dir=runs/latest --episodes=100": "tests/test_cli.py::test_eval_and_load_policy",
    f"{LAUNCH} eval --run-dir=runs/latest --episodes=3 --video=cartpole.mp4":
        "tests/test_video.py::test_eval_video_from_the_command_line_prints_no_console_noise_and_refuses_without_pygame",
    f"{LAUNCH} plot runs/latest --out curves.png": "tests/test_newcomer.py::test_plot_is_a_verb",
    f"{LAUNCH} plot runs/latest --out profile.png": "tests/test_profile.py::test_plot_of_a_profiled_run_is_a_png",
    f"{LAUNCH} --arch=sebulba --profile": "tests/test_profile.py::test_sebulba_profile_table_trace_and_events",
    f"{LAUNCH} --env=brax:inverted_pendulum --total-steps=1000000":
        "tests/test_suites_learn.py::test_brax_learns_inverted_pendulum",
    f"{LAUNCH} --env=navix:Navix-Empty-5x5-v0": "tests/test_every_pair.py::test_the_summaries_common_keys_mean_the_same",
    f"{LAUNCH} --arch=sebulba --env=gymnasium:CartPole-v1":
        "tests/test_sebulba_gym.py::test_learns_gymnasium_cartpole_as_envpool_does",
    f"{LAUNCH} --record-dataset=/tmp/cartpole --record-episodes=20":
        "tests/test_data_bc.py::test_warm_start_from_expert_dataset_reaches_what_random_cannot",
    f"{LAUNCH} --init-from-dataset=/tmp/cartpole --bc-steps=2000":
        "tests/test_data_bc.py::test_warm_start_from_expert_dataset_reaches_what_random_cannot",
    f"{LAUNCH} --arch=anakin --algo=sac --env=Pendulum-v1":
        "tests/test_sac_learns.py::test_the_preset_reaches_minus_250_on_pendulum_and_a_zero_learning_rate_does_not",
    f"{LAUNCH} --algo=dqn":
        "tests/test_dqn_anakin.py::test_the_preset_solves_cartpole_and_a_learning_rate_of_zero_does_not",
    f"{LAUNCH} --arch=sebulba --init-from-dataset=/tmp/cartpole":
        "tests/test_data_hooks.py::test_sebulba_ppo_warm_start_clones_an_expert",
}


def shell_commands(text: str) -> list[tuple[str, str]]:
    """(command, its trailing comment) for each command line of the page's shell blocks.

    Shell blocks are fenced bash/sh/shell/console blocks and, outside fences, indented
    ones; a line ending in a backslash continues on the next.
    """
    commands, fence, pending = [], None, ""
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("```"):
            fence = None if fence is not None else stripped[3:].strip()
            continue
        in_shell = fence in SHELL_FENCES if fence is not None else line.startswith("    ")
        if not (in_shell or pending):
            continue
        stripped, pending = (pending + " " + stripped if pending else stripped), ""
        if stripped.endswith("\\"):
            pending = stripped[:-1].rstrip()
            continue
        if stripped.startswith(COMMAND_PREFIXES):
            command, _, comment = stripped.partition(" # ")
            commands.append((" ".join(command.split()), comment.strip()))
    return commands


def _all_commands() -> list[tuple[str, str, str]]:
    return [(page.name, command, comment) for page in PAGES for command, comment in shell_commands(page.read_text())]


def _asks(command: str) -> bool:
    return command.startswith(LAUNCH) and any(flag in command.split() for flag in ASKING)


def _extras() -> set[str]:
    return set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])


def _test_exists(target: str) -> bool:
    path, _, name = target.partition("::")
    source = ROOT / path
    return source.is_file() and (not name or re.search(rf"^def {re.escape(name)}\(", source.read_text(), re.M))


def test_the_extractor_finds_commands_comments_and_continuations():
    text = ("text\n\n    python launch/tpu.py --a=1   # first\n\n```bash\npip install x\n"
            "python launch/tpu.py --b \\\n    --c=2     # needs a TPU slice\n```\n```text\npython not a command\n```\n")
    assert shell_commands(text) == [("python launch/tpu.py --a=1", "first"), ("pip install x", ""),
                                    ("python launch/tpu.py --b --c=2", "needs a TPU slice")]


def test_every_command_is_run_by_a_test_or_marked():
    extras, unaccounted = _extras(), []
    for page, command, comment in _all_commands():
        installs = re.fullmatch(r'pip install -e "\.\[(\w+)\]"', command)
        if comment.startswith("needs ") or _asks(command) or (installs and installs.group(1) in extras):
            continue
        if command in COVERED and _test_exists(COVERED[command]):
            continue
        unaccounted.append(f"{page}: {command}")
    assert unaccounted == [], "run these in a test (COVERED) or mark them '# needs ...'"
    assert all(_test_exists(target) for target in COVERED.values())


def test_every_command_the_pages_ask_runs():
    asked = sorted({command for _, command, _ in _all_commands() if _asks(command)})
    assert asked  # the pages show --help, --print-config and --version
    for command in asked:
        result = subprocess.run([PYTHON, LAUNCHER, *shlex.split(command)[2:]], capture_output=True, text=True,
                                cwd=REPO_ROOT, timeout=120)
        assert result.returncode == 0 and result.stdout, (command, result.stderr)


def test_every_unmarked_training_command_parses():
    from podracer.orchestrate.parse import parse

    for page, command, comment in _all_commands():
        argv = shlex.split(command)
        if comment.startswith("needs ") or argv[:2] != ["python", "launch/tpu.py"] or argv[2:3] in (
                ["eval"], ["plot"]) or _asks(command):
            continue
        parse(argv[2:])  # a PodracerError names the page's mistake


def test_mkdocs_builds_strict(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run([PYTHON, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                            capture_output=True, text=True, cwd=REPO_ROOT, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    built = {p.parent.name for p in (tmp_path / "site").glob("*/index.html")}
    pages = {p.stem for p in (ROOT / "docs").glob("*.md")} - {"index"}
    assert pages <= built
    assert "make_update" in (tmp_path / "site" / "api" / "index.html").read_text()  # from the docstrings


def test_the_readme_is_a_front_page_whose_set_up_ci_reads():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    # .ci/run takes the first two four-space `pip install` lines after this heading.
    section = readme.split("\n## Set-up: two commands\n", 1)[1].split("\n## ", 1)[0]
    assert [line for line in section.splitlines() if line.startswith("    pip install")] == [
        "    pip install -e . && python launch/tpu.py",
        '    pip install -e ".[dev]" && python -m pytest']
    linked = set(re.findall(r"\]\((docs/[\w-]+\.md)\)", readme))
    assert linked == {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")} - {"docs/index.md"}


def test_the_docs_extra_builds_the_site_and_dev_installs_it():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    docs = project["optional-dependencies"]["docs"]
    assert any(d.startswith("mkdocs-material") for d in docs) and any(d.startswith("mkdocstrings[python]")
                                                                      for d in docs)
    assert "podracer-rl[docs]" in project["optional-dependencies"]["dev"]

