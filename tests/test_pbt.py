"""Population-based training (`--pbt`) and sampled sweeps (`--sweep NAME=loguniform:LOW:HIGH --num-samples=N`).

Exploit and explore on hand-built populations; the ranking's schedule; the
same PBT trajectory with the agents on 1 device and split over 8; from the
command line on CartPole (Anakin PPO): half the agents with useless learning
rates, PBT ends far above the same grid without it, and a control whose
interval never ends does not; the summary's events, TensorBoard, the lineage
plot, the best agent's policy, a bitwise resume; one-line refusals.
"""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import LAUNCHER, PYTHON
from podracer import pbt
from podracer import population as pop
from podracer.anakin import train as anakin_train
from podracer.orchestrate import cli
from podracer.orchestrate.parse import parse
from podracer.sampling import Space


def _config(resample: float, **settings) -> pbt.PBTConfig:
    return pbt.PBTConfig(interval=1, fraction=0.25, perturb=1.25, resample=resample, settings=settings)


# lr: drawn from loguniform:1e-4:1e-2, positive; gamma: drawn from its list, in [0, 1].
_SETTINGS = pbt.config_of(parse(["--pbt", "--sweep", "lr=loguniform:1e-4:1e-2", "--sweep", "gamma=0.9,0.99,1.0",
                                 "--num-samples=2"]).configs).settings
LR, GAMMA = _SETTINGS["lr"], _SETTINGS["gamma"]


def test_each_settings_space_and_range_come_from_its_sweep_and_its_field():
    assert LR == pbt.Setting(Space("loguniform", (1e-4, 1e-2)), LR.low, math.inf) and 0 <= LR.low < 1e-30
    assert GAMMA == pbt.Setting(Space("list", (0.9, 0.99, 1.0)), 0.0, 1.0)


def test_the_worst_agents_copy_the_best_agents_states_exactly():
    returns = jnp.asarray([5.0, 1.0, 7.0, 3.0, 0.0, 9.0, 2.0, 8.0])  # best: 5, 7; worst: 4, 1
    states = {"params": jax.random.normal(jax.random.PRNGKey(0), (8, 3, 2)),
              "opt": {"mu": jax.random.normal(jax.random.PRNGKey(1), (8, 5)), "count": jnp.arange(8)}}
    picked = set()
    for seed in range(20):
        donor = np.asarray(pbt.donors(jax.random.PRNGKey(seed), returns, 0.25))
        assert set(np.flatnonzero(donor != pbt.NO_DONOR)) == {1, 4}
        picked |= set(donor[[1, 4]].tolist())
        copied = pbt.exploit(jnp.asarray(donor), states)
        for before, after in zip(jax.tree.leaves(states), jax.tree.leaves(copied)):
            for agent in range(8):
                source = agent if donor[agent] == pbt.NO_DONOR else donor[agent]
                np.testing.assert_array_equal(after[agent], before[source])
    assert picked == {5, 7}  # drawn from the whole top fraction, not always its best
    # Half of 5 agents is 2: never more than half, so no agent both gives and takes.
    assert pbt.num_replaced(5, 0.5) == 2 and pbt.num_replaced(3, 0.25) == 1


def test_explore_perturbs_or_resamples_only_the_copies_within_each_settings_range():
    donor = jnp.asarray([-1, 0, -1, 0] * 64)
    hparams = {"lr": jnp.full(256, 1e-2, jnp.float32), "gamma": jnp.full(256, 1.0, jnp.float32)}
    copies = np.asarray(donor) != pbt.NO_DONOR
    moved = pbt.explore(jax.random.PRNGKey(0), donor, hparams, _config(0.0, lr=LR, gamma=GAMMA))
    lr, gamma = np.asarray(moved["lr"]), np.asarray(moved["gamma"])
    np.testing.assert_array_equal(lr[~copies], np.float32(1e-2))
    up, down = np.float32(1e-2) * np.float32(1.25), np.float32(1e-2) * np.float32(0.8)
    assert set(np.unique(lr[copies]).tolist()) == {up, down}
    assert set(np.unique(gamma[copies]).tolist()) == {np.float32(0.8), 1.0}  # x1.25 clipped to 1
    resampled = pbt.explore(jax.random.PRNGKey(1), donor, hparams, _config(1.0, lr=LR, gamma=GAMMA))
    lr, gamma = np.asarray(resampled["lr"])[copies], np.asarray(resampled["gamma"])[copies]
    assert np.all((lr >= 1e-4 * (1 - 1e-6)) & (lr <= 1e-2 * (1 + 1e-6))) and lr.min() < 1e-3 < lr.max()
    assert set(np.unique(gamma).tolist()) == set(np.float32([0.9, 0.99, 1.0]).tolist())


def test_ranking_happens_when_an_interval_ends_and_counts_the_episodes_since_the_last():
    config = pbt.PBTConfig(interval=3, fraction=0.5, perturb=1.25, resample=0.0, settings={"lr": LR})
    state = pbt.init_state(jax.random.PRNGKey(0), 4)
    train, hparams = jnp.arange(4.0), {"lr": jnp.full(4, 1e-3, jnp.float32)}
    ranked = []
    for call in range(5):  # 2 updates a call: intervals end in calls 2, 3 and 5 (updates 3, 6, 9)
        episodes = jnp.ones((2, 4), jnp.int32)
        return_sum = jnp.broadcast_to(jnp.asarray([1.0, 4.0, 3.0, 2.0]) * (call + 1), (2, 4))
        state, train, hparams, donor = pbt.after_call(config, state, train, hparams, episodes, return_sum)
        ranked.append(bool(np.any(np.asarray(donor) != pbt.NO_DONOR)))
        if ranked[-1]:
            # Agent 0 and 3 were worst over the interval: they now hold agent 1's or 2's state.
            assert set(np.flatnonzero(np.asarray(donor) != pbt.NO_DONOR)) == {0, 3}
            assert set(np.asarray(train)[[0, 3]].tolist()) <= {1.0, 2.0}
            assert int(state.episodes.sum()) == 0 and float(state.return_sum.sum()) == 0
    assert ranked == [False, True, True, False, True]
    assert int(state.updates[0]) == 10


# 4 sampled settings x 2 seeds; half the copies' settings are drawn anew from the distributions.
PBT_SMALL = ["--num-envs=8", "--rollout-len=16", "--updates-per-call=2", "--hidden", "16", "16",
             "--num-seeds=2", "--sweep", "lr=loguniform:1e-4:1e-2", "--sweep", "ent-coef=uniform:0:0.02",
             "--num-samples=4", "--pbt", "--pbt-interval=2", "--pbt-fraction=0.5", "--pbt-resample=0.5"]


def _pbt_trajectory(devices, calls=4):
    configs = parse(PBT_SMALL).configs
    built = anakin_train.build(configs, devices)
    runner = built.init(jax.random.PRNGKey(configs.run.seed))
    drawn = np.asarray([[a.settings[name] for a in pop.agents(configs)] for name in ("ent_coef", "lr")],
                       np.float32)
    np.testing.assert_array_equal(np.stack(jax.device_get(jax.tree.leaves(runner.hparams))), drawn)
    donors, settings = [], []
    for _ in range(calls):
        runner, metrics = built.step(runner)
        donors.append(np.asarray(metrics["pbt_donor"])[-1])
        settings.append(np.stack([np.asarray(v)[-1] for v in jax.tree.leaves(metrics["pbt_settings"])]))
    return np.stack(donors), np.stack(settings), jax.device_get(runner.train.params)


def test_agents_split_over_eight_devices_follow_the_trajectory_of_one_device():
    one = _pbt_trajectory(jax.devices()[:1])
    split = _pbt_trajectory(jax.devices())  # 8 agents on 8 devices: one each, ranked after a gather
    np.testing.assert_array_equal(split[0], one[0])
    np.testing.assert_array_equal(split[1], one[1])
    for a, b in zip(jax.tree.leaves(split[2]), jax.tree.leaves(one[2])):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5)
    assert np.all((one[0] != pbt.NO_DONOR).sum(axis=1) == 4)  # every call ranked, half replaced


def test_sampled_sweeps_are_drawn_from_the_seed():
    argv = ["--sweep", "lr=loguniform:1e-4:1e-2", "--sweep", "ent-coef=choice:0,0.01",
            "--sweep", "gamma=uniform:0.9:0.999", "--num-samples=16"]
    drawn = pop.agents(parse(argv + ["--seed=3"]).configs)
    again = pop.agents(parse(argv + ["--seed=3"]).configs)
    other = pop.agents(parse(argv + ["--seed=4"]).configs)
    assert [a.settings for a in drawn] == [a.settings for a in again] != [a.settings for a in other]
    lr = np.asarray([a.settings["lr"] for a in drawn])
    assert np.all((lr >= 1e-4) & (lr <= 1e-2)) and lr.min() < 1e-3 < lr.max()
    assert {a.settings["ent_coef"] for a in drawn} == {0.0, 0.01}
    assert all(0.9 <= a.settings["gamma"] <= 0.999 for a in drawn)
    assert [a.seed for a in drawn] == [3] * 16  # one seed per setting, as a grid's
    with_seeds = pop.agents(parse(argv + ["--seed=3", "--num-seeds=2"]).configs)
    assert [a.settings for a in with_seeds[::2]] == [a.settings for a in drawn]


@pytest.mark.parametrize("args, expected", [
    (["--pbt"], "--pbt perturbs the swept settings, and none is swept"),
    (["--pbt", "--num-seeds=4"], "--pbt perturbs the swept settings, and none is swept"),
    (["--pbt", "--sweep", "lr=1e-3"], "--pbt ranks agents against each other, and this population has one"),
    (["--pbt", "--sweep", "lr=1e-3,3e-4", "--pbt-interval=0"], "--pbt-interval must be > 0, got 0"),
    (["--pbt", "--sweep", "lr=1e-3,3e-4", "--pbt-fraction=0.6"], "--pbt-fraction must be in (0, 0.5], got 0.6"),
    (["--pbt", "--sweep", "lr=1e-3,3e-4", "--pbt-fraction=0"], "--pbt-fraction must be in (0, 0.5], got 0.0"),
    (["--pbt", "--sweep", "lr=1e-3,3e-4", "--profile"], "--profile times acting and learning"),
    (["--sweep", "lr=1e-3,3e-4", "--pbt-interval=4"], "--pbt-interval tunes population-based training, which is off"),
    (["--algo=es", "--pbt", "--sweep", "sigma=0.02,0.05"], "--pbt trains learning agents"),
    (["--sweep", "lr=uniform:1e-2:1e-4", "--num-samples=4"], "lr=uniform:0.01:0.0001 needs LOW < HIGH"),
    (["--sweep", "lr=loguniform:1e-3:1e-3", "--num-samples=4"], "needs LOW < HIGH"),
    (["--sweep", "lr=loguniform:0:1e-2", "--num-samples=4"], "loguniform:0:0.01 needs LOW > 0"),
    (["--sweep", "gamma=uniform:0.9:1.5", "--num-samples=4"], "--gamma must be in [0, 1], got 1.5"),
    (["--sweep", "lr=loguniform:1e-4:1e-2"], "is a distribution: say how many settings to draw with --num-samples"),
    (["--num-samples=4"], "--num-samples draws settings from --sweep distributions, and none is given"),
    (["--sweep", "lr=gauss:0:1", "--num-samples=4"], "'gauss' is not a distribution"),
    (["--sweep", "lr=uniform:1e-4", "--num-samples=4"], "takes two numbers, got 1"),
])
def test_bad_pbt_and_sampling_input_is_one_line_exit_2(args, expected, capsys):
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert expected in err and err.count("\n") == 1, err


# Half the agents learn nothing in this budget (lr 1e-6, 2e-6), half learn CartPole; 8 agents
# split over 2 CPU devices, so the ranking gathers across them. No resampling: what rescues the
# useless agents is copying the good ones.
GRID = ["--num-envs=16", "--rollout-len=32", "--updates-per-call=4", "--no-anneal-lr", "--num-seeds=2",
        "--sweep", "lr=1e-6,2e-6,3e-3,5e-3", "--cpu-devices=2", "--total-steps=24576"]
WITH_PBT = ["--pbt", "--pbt-fraction=0.5", "--pbt-interval=8", "--pbt-resample=0"]


def _launch(*args, cwd, timeout=300):
    import subprocess

    return subprocess.run([PYTHON, LAUNCHER, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd)


@pytest.fixture(scope="module")
def cartpole_runs(tmp_path_factory):
    """The grid without PBT, with it, and with an interval past the run's 48 updates."""
    root = tmp_path_factory.mktemp("pbt")
    runs = {"grid": [], "pbt": WITH_PBT, "control": [*WITH_PBT, "--pbt-interval=1000"]}
    summaries = {}
    for name, extra in runs.items():
        result = _launch(*GRID, *extra, f"--run-dir={root / name}", cwd=root)
        assert result.returncode == 0, result.stderr[-3000:]
        summaries[name] = json.loads((root / name / "summary.json").read_text())
    return root, summaries


def test_pbt_rescues_the_useless_learning_rates_and_a_control_does_not(cartpole_runs):
    _, runs = cartpole_runs
    grid, with_pbt, control = runs["grid"]["iqm"], runs["pbt"]["iqm"], runs["control"]["iqm"]
    # The grid's IQM is the mean of two useless agents (~22) and two good ones; PBT's, of good ones.
    assert with_pbt > grid + 80, (with_pbt, grid)
    # An interval that never ends ranks nothing: the control trains exactly the grid.
    assert runs["control"]["pbt"]["events"] == []
    assert runs["control"]["params_fingerprints"] == runs["grid"]["params_fingerprints"]
    assert control == grid


def test_the_summary_lists_the_exploit_events_and_the_rows_the_settings(cartpole_runs):
    root, runs = cartpole_runs
    summary = runs["pbt"]
    events, final = summary["pbt"]["events"], summary["pbt"]["final_settings"]
    assert [e["update"] for e in events] == [u for u in (8, 16, 24, 32, 40, 48) for _ in range(4)]
    assert all(e["from"] != e["to"] and set(e["settings"]) == {"lr"} for e in events)
    assert len(final) == 8 and all(set(s) == {"lr"} for s in final)
    # The first ranking replaces the four agents of the useless learning rates with good ones.
    assert {e["to"] for e in events[:4]} == {0, 1, 2, 3} and {e["from"] for e in events[:4]} <= {4, 5, 6, 7}
    assert all(e["settings"]["lr"] > 1e-3 for e in events[:4])
    rows = [json.loads(line) for line in (root / "pbt" / "metrics.jsonl").read_text().splitlines()]
    assert [a["setting/lr"] for a in rows[-1]["agents"]] == [s["lr"] for s in final]
    for event in events:  # the settings an event reports are the row's, after the event
        row = next(r for r in rows if r.get("pbt") and event in r["pbt"])
        assert row["agents"][event["to"]]["setting/lr"] == event["settings"]["lr"]
    assert "setting/lr" not in rows[-1]  # settings are each agent's, never averaged
    events_files = b"".join(p.read_bytes() for p in (root / "pbt" / "tensorboard").iterdir())
    assert b"agent_7/setting/lr" in events_files


def test_lineage_plot_and_the_best_agents_policy(cartpole_runs):
    root, runs = cartpole_runs
    from podracer import plot
    from podracer.policy import best_agent, load_policy

    lineage = plot.read_lineage(str(root / "pbt"))
    assert lineage["settings"]["lr"].shape == (8, 12) and len(lineage["events"]) == 24
    assert plot.read_lineage(str(root / "grid")) is None
    fig = plot.figure([str(root / "pbt")])
    assert len(fig.axes) == 3 and fig.axes[2].get_ylabel() == "lr"
    scores = [a["episode_return_mean"] for a in runs["pbt"]["agents"]]
    best = best_agent(str(root / "pbt"))
    assert scores[best] == max(scores)
    obs = np.zeros((3, 4), np.float32)
    assert load_policy(str(root / "pbt"), agent="best")(obs, jax.random.PRNGKey(0)).shape == (3,)
    result = _launch("eval", f"--run-dir={root / 'pbt'}", "--agent=best", "--episodes=2", cwd=root)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout.splitlines()[-1])["agent"] == best


def test_a_pbt_run_resumes_bitwise(cartpole_runs, tmp_path):
    _, runs = cartpole_runs
    run_dir = tmp_path / "run"
    first = _launch(*GRID[:-1], *WITH_PBT, "--total-steps=10240", f"--run-dir={run_dir}", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    second = _launch(*GRID, *WITH_PBT, f"--run-dir={run_dir}", cwd=tmp_path)
    assert second.returncode == 0, second.stderr[-2000:]
    resumed = json.loads((run_dir / "summary.json").read_text())
    assert resumed["resumed_from_env_steps"] == 10240  # 20 updates: mid-interval, a ranking behind it
    assert resumed["params_fingerprints"] == runs["pbt"]["params_fingerprints"]
    assert resumed["pbt"] == runs["pbt"]["pbt"]
    assert math.isclose(resumed["iqm"], runs["pbt"]["iqm"])


def test_a_population_checkpointed_before_these_settings_existed_still_resumes():
    from podracer.session.checkpoint import config_differences, config_record

    current = config_record(parse(["--num-seeds=2"]).configs.recorded())
    saved = json.loads(json.dumps(current))
    for name in ("num_samples", "pbt", "pbt_interval", "pbt_fraction", "pbt_perturb", "pbt_resample"):
        del saved["population"][name]
    assert config_differences(saved, current) == []
    with_pbt = config_record(parse(["--num-seeds=2", "--sweep", "lr=1e-3,3e-4", "--pbt"]).configs.recorded())
    assert "--pbt (False saved, True now)" in config_differences(saved, with_pbt)
