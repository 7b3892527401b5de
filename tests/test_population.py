"""Populations (`--num-seeds`, `--sweep`): each agent is the run of one agent, in one compiled program.

Agents are compared with runs of one agent of the same seed and settings, on
1 and 8 devices, agents split over the devices (8 agents) and replicated (2
agents, environments split); the statistics against hand-computed values;
the command line end to end (ranking, summary, rows, TensorBoard, plot, eval,
bitwise resume, one-line refusals).
"""

import json
import os
import subprocess

import jax
import numpy as np
import pytest

from conftest import LAUNCHER, PYTHON, REPO_ROOT
from podracer import population as pop
from podracer.anakin import train as anakin_train
from podracer.anakin import train_es
from podracer.orchestrate import cli
from podracer.orchestrate.parse import parse

SMALL = ["--num-envs=8", "--rollout-len=16", "--updates-per-call=2", "--hidden", "16", "16",
         "--total-steps=512"]


def _params_after_one_call(argv, devices, es=False):
    configs = parse(argv).configs
    build = (train_es if es else anakin_train).build
    built = build(configs, devices)
    runner = built.init(jax.random.PRNGKey(configs.run.seed))
    initial = jax.device_get(runner.train.strategy.mean if es else runner.train.params)
    runner, _ = built.step(runner)
    runner, _ = built.step(runner)
    assert built.step._cache_size() == 1  # one program for the whole population, called twice
    params = runner.train.strategy.mean if es else runner.train.params
    return jax.device_get(initial), jax.device_get(params)


def _agent(tree, i):
    return jax.tree.map(lambda x: x[i], tree)


def _differs(a, b):
    return any(not np.allclose(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _close(a, b, **tol):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(x, y, **tol)


@pytest.fixture(scope="module")
def single_seed1():
    """One agent, seed 1, lr 1e-3, on one device: what agent 5 of the population must equal."""
    return _params_after_one_call(SMALL + ["--seed=1", "--lr=1e-3"], jax.devices()[:1])[1]


POP8 = SMALL + ["--num-seeds=4", "--sweep", "lr=0,1e-3"]  # agents 0-3: lr 0; 4-7: lr 1e-3; seeds 0-3


@pytest.mark.parametrize("devices", [1, 8], ids=["1-device", "8-devices-agents-split"])
def test_agent_equals_the_run_of_one_agent(devices, single_seed1):
    initial, params = _params_after_one_call(POP8, jax.devices()[:devices])
    # Agent 5: the second setting (lr=1e-3), seed 1.
    _close(_agent(params, 5), single_seed1, rtol=2e-4, atol=2e-5)
    # Agent 1 (lr=0, seed 1) has not moved; agent 5 has: the setting is the agent's own.
    _close(_agent(params, 1), _agent(initial, 1), rtol=0, atol=0)
    assert _differs(_agent(params, 5), _agent(initial, 5))
    # Seeds differ: agents 4 and 5 start apart.
    assert _differs(_agent(initial, 4), _agent(initial, 5))


def test_replicated_agents_on_eight_devices_equal_the_run_of_one_agent(single_seed1):
    # Two agents do not split over 8 devices: each device holds both, environments split.
    _, params = _params_after_one_call(SMALL + ["--num-seeds=2", "--lr=1e-3"], jax.devices())
    _close(_agent(params, 1), single_seed1, rtol=2e-4, atol=2e-5)


def test_recurrent_agents_split_over_devices_equal_the_run_of_one_agent():
    # Each agent carries its own GRU state through the rollout and the update.
    gru = SMALL + ["--network=gru", "--minibatches=2"]
    _, alone = _params_after_one_call(gru + ["--seed=1"], jax.devices()[:1])
    _, params = _params_after_one_call(gru + ["--num-seeds=2"], jax.devices()[:2])
    _close(_agent(params, 1), alone, rtol=2e-4, atol=2e-5)
    assert _differs(_agent(params, 0), alone)


def test_es_agent_equals_the_run_of_one_agent():
    es = ["--algo=es", "--population=8", "--generations-per-call=2", "--eval-episodes=2", "--horizon=20",
          "--hidden", "8", "--total-steps=640"]
    _, alone = _params_after_one_call(es + ["--seed=1", "--sigma=0.1"], jax.devices()[:1], es=True)
    _, params = _params_after_one_call(es + ["--num-seeds=2", "--sweep", "sigma=0.05,0.1"],
                                       jax.devices()[:2], es=True)
    np.testing.assert_allclose(params[3], alone, rtol=1e-4, atol=1e-5)  # sigma 0.1, seed 1
    assert not np.allclose(params[1], alone, atol=1e-4)  # sigma 0.05, seed 1: another agent


def test_sweeps_as_given_pair_their_values_instead_of_crossing_them():
    sweeps = ["--num-seeds=2", "--sweep", "lr=0,1e-3", "--sweep", "ent-coef=0.02,0"]
    grid = pop.agents(parse(SMALL + sweeps).configs)
    paired = pop.agents(parse(SMALL + sweeps + ["--sweep-as-given"]).configs)
    assert [a.settings for a in grid[::2]] == [{"lr": 0.0, "ent_coef": 0.02}, {"lr": 0.0, "ent_coef": 0.0},
                                               {"lr": 1e-3, "ent_coef": 0.02}, {"lr": 1e-3, "ent_coef": 0.0}]
    assert [(a.index, a.seed, a.settings) for a in paired] == [
        (0, 0, {"lr": 0.0, "ent_coef": 0.02}), (1, 1, {"lr": 0.0, "ent_coef": 0.02}),
        (2, 0, {"lr": 1e-3, "ent_coef": 0.0}), (3, 1, {"lr": 1e-3, "ent_coef": 0.0})]
    # And the program trains each agent with its pair: agent 3 is the run of seed 1 alone with both.
    _, params = _params_after_one_call(SMALL + sweeps + ["--sweep-as-given"], jax.devices()[:1])
    _, alone = _params_after_one_call(SMALL + ["--seed=1", "--lr=1e-3", "--ent-coef=0"], jax.devices()[:1])
    _close(_agent(params, 3), alone, rtol=2e-4, atol=2e-5)


def test_iqm_and_stratified_bootstrap():
    assert pop.iqm(np.arange(10.0)) == pytest.approx(4.5)  # the mean of 2..7
    assert pop.iqm([1.0, 2.0, 3.0, 100.0]) == pytest.approx(2.5)
    # Stratified: every replicate keeps 2 scores of stratum 0 and 6 of stratum 1, so the
    # IQM (the middle 4 of 8) is always 10; resampling across strata would vary it.
    scores, strata = [0.0, 0.0] + [10.0] * 6, [0, 0] + [1] * 6
    assert pop.stratified_bootstrap_ci(scores, strata) == (10.0, 10.0)
    low, high = pop.stratified_bootstrap_ci(np.arange(20.0), [0] * 20)
    assert low < pop.iqm(np.arange(20.0)) < high and high - low < 10


@pytest.mark.parametrize("args, expected", [
    (["--sweep", "hidden=8,16"], "--sweep hidden: it changes the compiled program's shapes"),
    (["--sweep", "num-envs=8,16"], "--sweep num-envs: it changes"),
    (["--sweep", "lr=abc"], "--sweep lr: expected float, got 'abc'"),
    (["--sweep", "gamma=0.9,2"], "--sweep gamma: --gamma must be in [0, 1], got 2.0"),
    (["--sweep", "lr"], "is not NAME=V1,V2"),
    (["--sweep", "lr=0.1", "--sweep", "lr=0.2"], "given twice"),
    (["--algo=es", "--sweep", "lr=0.1"], "not a setting of --algo=es"),
    (["--arch=sebulba", "--num-seeds=2"], "populations train on --arch=anakin only"),
    (["--num-seeds=2", "--record-dataset=/tmp/x"], "--record-dataset works with one agent"),
    (["--num-seeds=0"], "--num-seeds must be > 0"),
    (["--sweep", "lr=1e-3,3e-4", "--sweep", "gamma=0.9,0.95,0.99", "--sweep-as-given"],
     "every list needs the same length (lr has 2, gamma has 3)"),
    (["--num-seeds=2", "--sweep-as-given"], "--sweep-as-given pairs the values of --sweep lists, and none"),
])
def test_bad_population_input_is_one_line_exit_2(args, expected, capsys):
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert expected in err and err.count("\n") == 1, err


@pytest.mark.parametrize("argv, cores, expected", [
    ([], 8, 1),  # one agent: its environments stay together (split, it would average gradients every minibatch)
    (["--num-seeds=16"], 2, 2),
    (["--num-seeds=16"], 1, 1),
    (["--num-seeds=3"], 2, 1),  # 3 agents do not split over 2 devices: one device holds all
    (["--num-seeds=4", "--sweep", "lr=1e-3,3e-3,1e-2"], 8, 6),  # 12 agents: the largest split within 8 cores
    (["--algo=impala", "--num-seeds=2"], 4, 2),
    (["--algo=es"], 2, 2),  # 64 members: 32 antithetic pairs
    (["--algo=es", "--population=6"], 2, 1),  # 3 pairs
    (["--algo=es", "--population=24"], 8, 6),  # 12 pairs: 6 devices of 2 pairs
    (["--arch=sebulba", "--num-envs=8"], 8, 1),
])
def test_default_cpu_devices_split_populations_and_es_one_per_core(argv, cores, expected):
    assert cli.default_cpu_devices(parse(argv).configs, cores) == expected


def test_usable_cores_without_an_affinity_call(monkeypatch):
    """macOS and Windows have no os.sched_getaffinity: every run would fail there without the fallback."""
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 6)
    assert cli.usable_cores() == 6


def test_a_population_runs_on_one_cpu_device_per_core_by_default(tmp_path):
    """Without --cpu-devices, the launcher splits a 2-agent population over two CPU devices, and
    says so; a device count chosen through XLA_FLAGS is kept."""
    if cli.usable_cores() < 2:
        pytest.skip("needs two CPU cores")
    argv = [*SMALL, "--num-seeds=2"]
    result = _launch(*argv, f"--run-dir={tmp_path / 'split'}", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    first = result.stdout.splitlines()[0]
    assert "2 cpu devices (one per core" in first and "--cpu-devices=1 keeps one" in first, first
    assert json.loads((tmp_path / "split" / "summary.json").read_text())["devices"] == 2
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    result = subprocess.run([PYTHON, LAUNCHER, *argv, f"--run-dir={tmp_path / 'kept'}"], capture_output=True,
                            text=True, timeout=300, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "1 cpu device;" in result.stdout.splitlines()[0]
    assert json.loads((tmp_path / "kept" / "summary.json").read_text())["devices"] == 1


def test_a_population_keeps_the_devices_of_a_jax_already_running(tmp_path):
    """From Python after JAX has started (a notebook), the default split is not attempted: the
    population trains on the devices JAX already has."""
    script = ("import jax, podracer; jax.devices(); "
              f"s = podracer.train(num_seeds=2, run_dir={str(tmp_path / 'nb')!r}, num_envs=8, rollout_len=16, "
              "updates_per_call=2, hidden=(16, 16), total_steps=512); print('devices', s['devices'])")
    result = subprocess.run([PYTHON, "-c", script], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                            env={**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}, "PYTHONPATH": REPO_ROOT})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "devices 1" in result.stdout.splitlines()[-1], result.stdout[-500:]


def _launch(*args, cwd, timeout=300):
    return subprocess.run([PYTHON, LAUNCHER, *args], capture_output=True, text=True, timeout=timeout,
                          cwd=cwd)


SWEEP = ["--num-envs=16", "--rollout-len=32", "--updates-per-call=4", "--num-seeds=2", "--no-anneal-lr",
         "--sweep", "lr=0,3e-3", "--cpu-devices=2"]


@pytest.fixture(scope="module")
def sweep_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("sweep")
    result = _launch(*SWEEP, "--total-steps=24576", f"--run-dir={root / 'run'}", cwd=root)
    assert result.returncode == 0, result.stderr[-3000:]
    return root, json.loads((root / "run" / "summary.json").read_text()), result.stdout


def test_sweep_ranks_the_working_learning_rate_first(sweep_run):
    _, summary, stdout = sweep_run
    ranked = summary["settings_ranked"]
    assert [e["settings"]["lr"] for e in ranked] == [pytest.approx(3e-3), 0.0]
    assert ranked[0]["iqm"] > ranked[1]["iqm"] + 15, ranked  # lr=0 stays a random policy (~22)
    assert "population ranked by the IQM" in stdout and "lr=0.003" in stdout
    assert summary["num_agents"] == 4 and len(summary["agents"]) == 4
    assert [(a["seed"], a["settings"]["lr"]) for a in summary["agents"]] == [(0, 0), (1, 0), (0, 3e-3), (1, 3e-3)]
    low, high = summary["iqm_ci"]
    assert low <= summary["iqm"] <= high
    assert summary["population_sps"] == pytest.approx(4 * summary["sps"])


def test_rows_tensorboard_plot_and_eval_per_agent(sweep_run):
    root, summary, _ = sweep_run
    rows = [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(len(row["agents"]) == 4 and "episode_return_mean_iqm" in row for row in rows)
    last = [a["episode_return_mean"] for a in rows[-1]["agents"]]
    assert rows[-1]["episode_return_mean"] == pytest.approx(np.mean(last))
    events = b"".join(p.read_bytes() for p in (root / "run" / "tensorboard").iterdir())
    assert b"agent_3/episode_return_mean" in events and b"agent_0/loss" in events
    from podracer import plot
    from podracer.policy import load_policy

    assert os.path.exists(plot.plot([str(root / "run")], str(root / "pop.png")))
    # One IQM and band per setting of the sweep, never the two settings' agents averaged together.
    groups = plot.read_population(str(root / "run"), "episode_return_mean")
    assert [(g["setting"], len(g["agents"])) for g in groups] == [("lr=0", 2), ("lr=0.003", 2)]
    for group, agents in zip(groups, ([0, 1], [2, 3])):
        scores = [[a["episode_return_mean"] for a in row["agents"]] for row in rows]
        np.testing.assert_allclose(group["iqm"], [np.mean([r[i] for i in agents]) for r in scores])
        assert np.all(group["low"] <= group["iqm"] + 1e-9) and np.all(group["iqm"] <= group["high"] + 1e-9)
    assert groups[1]["iqm"][-1] > groups[0]["iqm"][-1] + 15
    labels = [t.get_text() for t in plot.figure([str(root / "run")]).axes[0].get_legend().get_texts()]
    assert len(labels) == 2 and "lr=0 IQM of 2 agents" in labels[0] and "lr=0.003 IQM" in labels[1]
    result = _launch("eval", f"--run-dir={root / 'run'}", "--agent=2", "--episodes=4", cwd=root)
    assert result.returncode == 0 and json.loads(result.stdout.splitlines()[-1])["agent"] == 2
    obs = np.zeros((3, 4), np.float32)
    assert load_policy(str(root / "run"), agent=3)(obs, jax.random.PRNGKey(0)).shape == (3,)


def test_population_resumes_bitwise(sweep_run, tmp_path):
    _, summary, _ = sweep_run
    run_dir = tmp_path / "run"
    first = _launch(*SWEEP, "--total-steps=12288", f"--run-dir={run_dir}", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    second = _launch(*SWEEP, "--total-steps=24576", f"--run-dir={run_dir}", cwd=tmp_path)
    assert second.returncode == 0, second.stderr[-2000:]
    resumed = json.loads((run_dir / "summary.json").read_text())
    assert resumed["resumed_from_env_steps"] == 12288
    assert resumed["params_fingerprints"] == summary["params_fingerprints"]
    assert resumed["settings_ranked"][0]["iqm"] == summary["settings_ranked"][0]["iqm"]
