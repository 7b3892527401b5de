"""Every cross-cutting flag on every (architecture, algorithm) pair: it takes effect, or is refused.

One run per pair carries the flags that combine (`--wandb` offline, `--profile`,
`--checkpoint-every`, `--cpu-devices`, `--record-dataset`); `--num-processes`
(on the pairs tests/test_multiprocess.py does not join over two processes) and
`--init-from-dataset` get runs of their own. Each flag's effect is checked
in what the run wrote, and the summaries are checked to mean the same.

The combined runs are on the environments beyond gymnax and envpool (`ENVS`): a
JAX suite per Anakin pair (Navix; Jumanji's Knapsack, with its legal-action
mask; brax's `fast`, with continuous actions; all run without shard_map's
replication check) and a Gymnasium vector environment for Sebulba, so every
flag is proven on them too; the other runs are on CartPole-v1. SAC's runs are all
on gymnax's Pendulum, continuous, whose episodes end within each of its calls.
"""

import json
import os
import subprocess

import pytest

from conftest import LAUNCHER, PYTHON
from podracer.algorithms import ALGORITHMS

PAIRS = {
    ("anakin", "ppo"): ["--num-envs=8", "--rollout-len=16", "--updates-per-call=2", "--total-steps=2048"],
    ("anakin", "es"): ["--population=8", "--generations-per-call=2", "--eval-episodes=2", "--horizon=50",
                       "--total-steps=3200"],
    ("sebulba", "ppo"): ["--num-envs=4", "--rollout-len=16", "--total-steps=1024"],
    ("anakin", "impala"): ["--num-envs=8", "--rollout-len=16", "--updates-per-call=2", "--total-steps=2048",
                           "--minibatches=2"],
    ("sebulba", "impala"): ["--num-envs=4", "--rollout-len=16", "--total-steps=1024", "--minibatches=1"],
    ("sebulba", "es"): ["--population=8", "--eval-episodes=2", "--total-steps=1500"],
    # Calls of 200 steps of each environment: every call ends one Pendulum episode in each.
    ("anakin", "sac"): ["--env=Pendulum-v1", "--num-envs=8", "--rollout-len=8", "--updates-per-call=25",
                        "--total-steps=3200", "--learning-starts=128", "--batch-size=32", "--hidden", "16", "16"],
    ("anakin", "dqn"): ["--num-envs=8", "--rollout-len=8", "--n-step=3", "--updates-per-call=2", "--total-steps=1024",
                        "--learning-starts=128", "--batch-size=32"],
    ("anakin", "pqn"): ["--num-envs=8", "--rollout-len=16", "--updates-per-call=2", "--total-steps=2048",
                        "--minibatches=2"],
    ("anakin", "muzero"): ["--num-envs=8", "--rollout-len=4", "--updates-per-call=2", "--total-steps=1024",
                           "--learning-starts=64", "--num-simulations=2"],
}
IDS = [f"{arch}-{algo}" for arch, algo in PAIRS]
ENVS = {("anakin", "ppo"): "navix:Navix-Empty-5x5-v0", ("anakin", "impala"): "jumanji:Knapsack-v1",
        ("anakin", "es"): "brax:fast", ("sebulba", "ppo"): "gymnasium:CartPole-v1",
        ("sebulba", "impala"): "gymnasium:CartPole-v1", ("sebulba", "es"): "gymnasium:CartPole-v1",
        ("anakin", "sac"): "Pendulum-v1", ("anakin", "dqn"): "jumanji:Knapsack-v1",
        ("anakin", "muzero"): "navix:Navix-Empty-5x5-v0", ("anakin", "pqn"): "navix:Navix-Empty-5x5-v0"}
CHECKPOINT_EVERY = {("anakin", "ppo"): 256, ("anakin", "es"): 800, ("sebulba", "ppo"): 128,
                    ("sebulba", "es"): 300, ("anakin", "impala"): 256, ("sebulba", "impala"): 128,
                    ("anakin", "sac"): 1600, ("anakin", "dqn"): 256, ("anakin", "muzero"): 256,
                    ("anakin", "pqn"): 256}
RECORD_EPISODES = 3


def _launch(pair, *flags, cwd, timeout=400):
    arch, algo = pair
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    return subprocess.run([PYTHON, LAUNCHER, f"--arch={arch}", f"--algo={algo}", *PAIRS[pair], *flags],
                          capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)


@pytest.fixture(scope="module", params=list(PAIRS), ids=IDS)
def combined(request, tmp_path_factory):
    """One run of a pair with every flag that combines with the others."""
    pair = request.param
    root = tmp_path_factory.mktemp("-".join(pair))
    result = _launch(pair, f"--env={ENVS[pair]}", f"--run-dir={root / 'run'}", "--wandb", "--profile", "--profile-trace-s=0",
                     f"--checkpoint-every={CHECKPOINT_EVERY[pair]}", "--keep-checkpoints=10",
                     "--cpu-devices=2", f"--record-dataset={root / 'dataset'}",
                     f"--record-episodes={RECORD_EPISODES}", cwd=root)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((root / "run" / "summary.json").read_text())
    return pair, root, summary, result


def test_wandb_logs_every_row_offline(combined):
    _, root, _, _ = combined
    runs = list((root / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    [events] = list(runs[0].glob("run-*.wandb"))
    logged = events.read_bytes()
    rows = [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows and all(key.encode() in logged for key in ("episode_return_mean", "sps"))


def test_profile_breaks_the_time_down(combined):
    _, _, summary, result = combined
    profile = summary["profile"]
    operations = {row["operation"] for row in profile["operations"]}
    assert {"logging", "checkpoint"} <= operations and "where the time went" in result.stdout


def test_checkpoint_every_saves_periodically(combined):
    pair, root, summary, _ = combined
    steps = sorted(int(p.name) for p in (root / "run" / "checkpoints").iterdir() if p.name.isdigit())
    # Periodic saves before the last one, at least one interval apart.
    assert len(steps) >= 2 and steps[-1] == summary["env_steps"]
    assert all(b - a >= CHECKPOINT_EVERY[pair] for a, b in zip(steps, steps[1:]))


def test_cpu_devices_splits_the_cpu(combined):
    _, _, summary, result = combined
    assert summary["devices"] == 2 and "2 cpu devices" in result.stdout.splitlines()[0]


def test_record_dataset_writes_the_trained_policys_episodes(combined):
    pair, root, summary, _ = combined
    from podracer import data

    batch = data.load_episodes(str(root / "dataset"))
    lengths = batch.mask.sum(axis=1) - 1  # transitions: the last step holds the final observation
    assert batch.mask.shape[0] == RECORD_EPISODES == summary["dataset_episodes"]
    assert (lengths > 0).all()
    assert summary["dataset_return_mean"] == pytest.approx(float(batch.steps["reward"].sum(axis=1).mean()),
                                                           rel=1e-5)
    metadata = json.loads((root / "dataset" / "metadata.json").read_text())
    assert metadata["policy"] == pair[1]


COMMON_KEYS = {"arch": str, "algo": str, "env": str, "env_steps": int, "sps": float,
               "episode_return_mean": float, "devices": int, "processes": int, "compile_s": float,
               "train_s": float, "wall_s": float, "time_to_first_step_s": float, "compile_cache": dict,
               "params_fingerprints": list, "config": dict}


def test_the_summaries_common_keys_mean_the_same(combined):
    pair, _, summary, _ = combined
    for key, kind in COMMON_KEYS.items():
        assert isinstance(summary[key], (int, float) if kind is float else kind), (key, summary[key])
    assert (summary["arch"], summary["algo"]) == pair and summary["env"] == ENVS[pair]
    total = int(next(f for f in PAIRS[pair] if f.startswith("--total-steps")).split("=")[1])
    assert summary["env_steps"] >= total and summary["sps"] > 0
    assert summary["wall_s"] > summary["train_s"] > 0 and summary["compile_s"] > 0
    assert summary["time_to_first_step_s"] > summary["compile_s"]  # from the process's start
    assert summary["time_to_first_step_s"] + summary["train_s"] <= summary["wall_s"]  # from the same start
    assert summary["compile_cache"]["dir"] == os.environ["PODRACER_COMPILE_CACHE"]  # conftest's
    assert summary["compile_cache"]["hits"] + summary["compile_cache"]["misses"] > 0
    assert summary["processes"] == len(summary["params_fingerprints"]) == 1
    assert summary["resumed_from_env_steps"] is None
    assert summary["config"]["run"]["arch"] == pair[0] and summary["config"]["checkpoint"][
        "checkpoint_every"] == CHECKPOINT_EVERY[pair]
    if pair[0] == "sebulba":  # over every process, as the sizes are
        assert (summary["actor_devices"], summary["learner_devices"], summary["actor_threads"]) == (1, 1, 1)


# Two processes need only train a little to show that they agree. Each of SAC's gradient steps
# averages over both processes through the host's collectives, which on a loaded 2-core CPU takes
# most of a second: 2 calls of 25 rollouts took 150 s, 4 rollouts (2 of them learning, once the
# buffer holds 128 transitions) take a few seconds. MuZero: 8 rollouts, 5 of them learning.
TWO_PROCESSES = {("anakin", "sac"): ["--updates-per-call=4", "--total-steps=256"],
                 ("anakin", "muzero"): ["--total-steps=256"]}
# tests/test_multiprocess.py runs PPO and ES on both architectures over two processes and proves
# more of them (they match one process), so their rows here would only repeat it.
JOINED_ELSEWHERE = {("anakin", "ppo"), ("sebulba", "ppo"), ("anakin", "es"), ("sebulba", "es")}
JOINED_HERE = [pair for pair in PAIRS if pair not in JOINED_ELSEWHERE]


@pytest.mark.parametrize("pair", JOINED_HERE, ids=[f"{arch}-{algo}" for arch, algo in JOINED_HERE])
def test_num_processes_joins_two_processes(pair, tmp_path):
    result = _launch(pair, f"--run-dir={tmp_path / 'run'}", "--num-processes=2", "--cpu-devices=2",
                     "--checkpoint-every=0", *TWO_PROCESSES.get(pair, []), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    prints = summary["params_fingerprints"]
    assert summary["processes"] == 2 and len(prints) == 2 and prints[0] == prints[1]
    assert result.stdout.count("summary\n") == 1  # process 0 reports


@pytest.fixture(scope="module")
def cartpole_dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("demos")
    result = _launch(("anakin", "ppo"), "--total-steps=150000", "--num-envs=32", "--rollout-len=32",
                     "--updates-per-call=8", f"--run-dir={root / 'run'}",
                     f"--record-dataset={root / 'dataset'}", "--record-episodes=8",
                     "--record-deterministic", cwd=root)
    assert result.returncode == 0, result.stderr[-3000:]
    return root / "dataset"


@pytest.mark.parametrize("pair", list(PAIRS), ids=IDS)
def test_init_from_dataset_clones_or_is_refused(pair, cartpole_dataset, tmp_path):
    result = _launch(pair, f"--run-dir={tmp_path / 'run'}", f"--init-from-dataset={cartpole_dataset}",
                     "--bc-steps=200", cwd=tmp_path)
    if pair[1] not in ALGORITHMS or not ALGORITHMS[pair[1]].clones:  # ES, or an agent that is no actor-critic
        assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
        assert "--init-from-dataset does not apply" in result.stderr
        assert not (tmp_path / "run").exists()
        return
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    # The clone fits the demonstrations (a trained policy's most likely actions) far better
    # than chance.
    assert summary["bc_steps"] == 200 and summary["bc_log_likelihood"] > -0.4  # chance: log(1/2) = -0.69
