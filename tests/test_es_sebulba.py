"""Sebulba ES: envpool slots play population members, the learner tells as Anakin does."""

import json
import signal
import subprocess
import threading
import time
import warnings

import envpool
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import LAUNCHER, PYTHON, REPO_ROOT
from podracer import es
from podracer.protocol import parallel
from podracer.orchestrate.cli import main
from podracer.orchestrate.spec import RunSpec
from podracer.config import NetworkConfig, RunConfig
from podracer.es.config import ESConfig, make_strategy
from podracer.sebulba.config import SebulbaConfig, split_devices
from podracer.sebulba.control import Control
from podracer.sebulba.envs import EnvPoolEnvs, EnvStep
from podracer.sebulba.es import (make_es_layout, make_es_learner_step, make_slot_params,
                                 member_fitness, thread_members)
from podracer.sebulba.es_actor import EpisodeTally, play_generation
from podracer.sebulba import train_es as sebulba_train_es
from podracer.session.timing import Timings

SMALL = (16,)  # hidden widths: small policies compile and evaluate fast


def _configs(tmp_path, env="CartPole-v1", total_steps=10_000, seed=0, network=SMALL, sebulba=None,
             **es_settings):
    return RunSpec(run=RunConfig(arch="sebulba", algo="es", env=env, total_steps=total_steps, seed=seed,
                                 run_dir=str(tmp_path)),
                   agent=ESConfig(**es_settings), sebulba=sebulba or SebulbaConfig(),
                   network=NetworkConfig(hidden=network))


# ---------------------------------------------------------------- counting episodes


def _step(ids, reward, terminated, truncated=None, done=None, episode_return=None, length=None):
    n = len(ids)
    truncated = np.zeros(n, bool) if truncated is None else np.asarray(truncated)
    terminated = np.asarray(terminated)
    done = terminated | truncated if done is None else np.asarray(done)
    return EnvStep(np.asarray(ids, np.int32), np.zeros((n, 1), np.float32),
                   np.asarray(reward, np.float32), terminated, truncated, done,
                   np.zeros(n, np.float32) if episode_return is None else np.asarray(episode_return, np.float32),
                   np.zeros(n, np.int32) if length is None else np.asarray(length, np.int32))


def test_tally_keeps_each_slots_first_episode_and_ignores_the_rest():
    tally = EpisodeTally(2)
    f, t = False, True
    # The resets after `start`: both slots act on their first observation.
    assert tally.record(_step([0, 1], [0, 0], [f, f])).tolist() == [t, t]
    # Slot 0 ends its episode (return 3 over 2 steps); its final observation is not acted on.
    counted = tally.record(_step([0, 1], [1, 1], [t, f], episode_return=[3, 0], length=[2, 0]))
    assert counted.tolist() == [f, t] and not tally.done
    # Slot 0 auto-resets and plays on, ignored; slot 1 is cut by the time limit.
    counted = tally.record(_step([0, 1], [0, 5], [f, f], truncated=[f, t], episode_return=[0, 9],
                                 length=[0, 3]))
    assert counted.tolist() == [f, f] and tally.done
    # Slot 0's second episode ends too: it does not replace the first one.
    counted = tally.record(_step([0, 1], [1, 0], [t, f], episode_return=[1, 0], length=[1, 0]))
    assert counted.tolist() == [f, f]
    assert tally.returns.tolist() == [3, 9] and tally.lengths.tolist() == [2, 3]
    assert tally.ignored_steps == 3  # slot 0 twice, slot 1 once


def test_member_fitness_is_the_mean_over_its_copies():
    sebulba = SebulbaConfig(actor_threads=2)
    layout = make_es_layout(ESConfig(population=4, episodes_per_member=2, eval_episodes=3), sebulba,
                            split_devices(sebulba, jax.devices()[:2]))
    assert (layout.members_per_thread, layout.member_slots, layout.eval_slots,
            layout.slots_per_thread) == (2, 4, 2, 6)
    assert thread_members(1, layout).tolist() == [2, 3]
    returns = np.array([10, 20, 1, 3, 500, 500], np.float32)
    assert member_fitness(returns, layout, 2).tolist() == [15, 2]


class Recording(EnvPoolEnvs):
    """Remembers every reset and action it was given, to replay them on a bare envpool."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = []

    def start(self):
        self.calls.append(None)
        super().start()

    def send(self, action, env_ids):
        self.calls.append(np.array(action))
        super().send(action, env_ids)


def _replay_by_hand(calls, num_envs, seed):
    """Replay the resets and actions on a bare envpool; per generation, each env's sum of
    rewards and agent steps until its first episode end, and the observations acted on then."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pool = envpool.make("CartPole-v1", env_type="gymnasium", num_envs=num_envs,
                            batch_size=num_envs, num_threads=1, seed=seed)
        pool.observation_space  # built on first use; here, where its notices are silenced
    generations = []
    for call in calls:
        if call is None:
            pool.async_reset()
            returns, lengths, running = np.zeros(num_envs), np.zeros(num_envs, int), np.ones(num_envs, bool)
            observed = [[] for _ in range(num_envs)]
            generations.append((returns, lengths, observed))
        else:
            pool.send(call, np.arange(num_envs))
        obs, reward, terminated, truncated, _ = pool.recv()
        if call is not None:  # a reset pays nothing and is no agent step
            returns += np.where(running, reward, 0.0)
            lengths += running
            running &= ~(terminated | truncated)
        for i in np.flatnonzero(running):
            observed[i].append(obs[i])
    pool.close()
    return generations


def test_fitness_is_each_slots_return_until_done_also_across_generation_resets(tmp_path):
    config = _configs(tmp_path, variant="ars_v2", population=6, episodes_per_member=2, eval_episodes=2,
                      sigma=1.0)
    setup = sebulba_train_es.build(config, jax.devices()[:2])
    layout = setup.layout
    assert layout.slots_per_thread == 14
    envs = Recording("CartPole-v1", layout.slots_per_thread, layout.slots_per_thread, 1, seed=7)
    device = setup.split.actor[0]
    state, obs_stats = jax.device_put((setup.state, setup.obs_stats), device)
    params = setup.slot_params(state, setup.es_key, jax.device_put(thread_members(0, layout), device))
    member_slot = np.arange(layout.slots_per_thread) < layout.member_slots
    played = []
    for generation in range(2):  # the second starts from slots left mid-episode by the first
        tally, seen = play_generation(envs, setup.act, params, obs_stats,
                                      es.init_running_stats(4), member_slot, Control(), Timings())
        played.append((tally, seen))
    envs.close()

    by_hand = _replay_by_hand(envs.calls, layout.slots_per_thread, seed=7)
    assert len(by_hand) == 2
    for (tally, seen), (returns, lengths, observed) in zip(played, by_hand):
        np.testing.assert_array_equal(tally.returns, returns)
        np.testing.assert_array_equal(tally.lengths, lengths)
        assert len(set(lengths.tolist())) > 3  # members play differently: not a vacuous check
        assert tally.ignored_steps > 0  # short episodes waited for the longest one
        # ARS V2's statistics: the members' observations acted on, one per agent step.
        members_observed = np.concatenate([np.stack(observed[i]) for i in np.flatnonzero(member_slot)])
        assert float(seen.count) == len(members_observed) == lengths[member_slot].sum()
        np.testing.assert_allclose(seen.mean, members_observed.mean(0), rtol=1e-4, atol=1e-6)
    fitness = member_fitness(played[0][0].returns, layout, 2)
    np.testing.assert_array_equal(fitness, played[0][0].returns[:12].reshape(6, 2).mean(1))


# ---------------------------------------------------------------- the update


def _quadratic(params, key=None):
    return -jnp.sum((params - jnp.linspace(-1.0, 1.0, params.shape[-1])) ** 2, axis=-1)


@pytest.mark.parametrize("variant", ["openai", "ars_v1"])
def test_actor_ask_and_learner_tell_equal_anakins_sharded_step(variant):
    # Members split over 2 actor threads, the update on 3 learner devices, versus
    # Anakin's protocol over 4 devices and the pure tell, on the same generations.
    config = ESConfig(variant=variant, population=8, eval_episodes=2, sigma=0.1, es_lr=0.05)
    strategy = make_strategy(config)
    sebulba = SebulbaConfig(actor_threads=2)
    layout = make_es_layout(config, sebulba, split_devices(sebulba, jax.devices()[:4]))
    slot_params = make_slot_params(strategy, lambda flat: flat, layout, 1)
    learner_mesh = parallel.make_mesh(jax.devices()[1:4])
    learner_step = make_es_learner_step(strategy, learner_mesh, normalize=False)
    anakin_step = es.make_sharded_step(strategy, _quadratic, parallel.make_mesh(jax.devices()[4:8]))

    tell, quadratic = jax.jit(strategy.tell), jax.jit(_quadratic)
    initial = strategy.init(jnp.zeros(6))
    anakin = jax.device_put(initial, parallel.replicated(parallel.make_mesh(jax.devices()[4:8])))
    sebulba_state, pure = initial, initial
    obs_stats, no_seen = es.init_running_stats(1), jax.tree.map(lambda x: x[None], es.init_running_stats(1))
    for generation in range(3):
        key = jax.random.fold_in(jax.random.PRNGKey(5), generation)
        anakin, _ = anakin_step(anakin, key)
        ask_key = jax.random.split(jax.random.split(key, 1)[0])[0]  # the key the sharded step asks with
        actor_state = jax.device_put(sebulba_state, jax.devices()[0])
        rows = [slot_params(actor_state, ask_key, thread_members(t, layout)) for t in range(2)]
        for row in rows:
            np.testing.assert_array_equal(row[layout.member_slots:], np.broadcast_to(actor_state.mean, (1, 6)))
        fitness = np.concatenate([quadratic(row[: layout.member_slots]) for row in rows])
        sebulba_state, obs_stats, metrics = learner_step(sebulba_state, obs_stats, ask_key, fitness, no_seen)
        pure, _ = tell(pure, ask_key, fitness)
    assert int(sebulba_state.generation) == 3
    assert not np.allclose(sebulba_state.mean, 0.0)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), sebulba_state, pure)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), sebulba_state,
                 jax.device_get(anakin))


# ---------------------------------------------------------------- learning


def _sebulba_threads():
    return [t for t in threading.enumerate() if t.name.startswith("sebulba-") and t.is_alive()]


def test_learns_cartpole_and_writes_the_run_files(tmp_path):
    # With seed 3 the initial mean scores about 10 (one action throughout), a random
    # policy about 22; 475 needs a policy that balances for almost the whole episode.
    configs = _configs(tmp_path, seed=3, population=32, eval_episodes=8, total_steps=200_000,
                       sebulba=SebulbaConfig(log_every=1))
    summary, (state, _) = sebulba_train_es.train_es(configs, jax.devices()[:2])
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    returns = [row["mean_params_return"] for row in rows]
    assert returns[0] < 100 and returns[-1] == summary["mean_params_return"] >= 475, returns  # at the end
    assert summary["episode_return_mean"] > 300
    assert summary["generations"] == len(rows) == int(state.generation)
    assert rows[-1]["env_steps"] == summary["env_steps"] >= 200_000 > rows[-2]["env_steps"]
    for key in ("env_steps", "sps", "episode_return_mean", "mean_params_return", "generations",
                "wall_s", "time_env_step_s", "time_learner_update_s"):
        assert key in rows[-1]
    assert summary["eval_steps"] > 0 and summary["ignored_steps"] > 0
    assert _sebulba_threads() == []
    # The same run with a step size too small to move the mean (1e-9), for 40k steps:
    # its policy stays the initial one (about 10), far below 475.
    control = _configs(tmp_path / "control", seed=3, population=32, eval_episodes=8, total_steps=40_000,
                       es_lr=1e-9, sebulba=SebulbaConfig(log_every=1))
    sebulba_train_es.train_es(control, jax.devices()[:2])
    control_rows = [json.loads(line) for line in (tmp_path / "control" / "metrics.jsonl").read_text().splitlines()]
    assert max(row["mean_params_return"] for row in control_rows) < 100, control_rows


# ---------------------------------------------------------------- stopping and bad input

LONG_RUN = ["--arch=sebulba", "--algo=es", "--population=16", "--hidden", "16",
            "--total-steps=1000000000", "--log-every=1"]


def test_sigterm_stops_every_thread(tmp_path):
    process = subprocess.Popen([PYTHON, LAUNCHER, *LONG_RUN, f"--run-dir={tmp_path}"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               cwd=REPO_ROOT)
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"training did not start: {process.stderr.read()}")
        time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=60)  # a generous deadline: a stuck thread shows as "still busy" below
    except subprocess.TimeoutExpired:
        process.kill()
        pytest.fail("still running 60 s after SIGTERM")
    stderr = process.stderr.read()
    assert process.returncode == 143, stderr
    assert "stopped by signal 15" in stderr and "Traceback" not in stderr and "still busy" not in stderr
    assert json.loads((tmp_path / "summary.json").read_text())["generations"] >= 2


def test_actor_failure_stops_every_thread(tmp_path, monkeypatch):
    class Failing(EnvPoolEnvs):
        def recv(self):
            self.calls = getattr(self, "calls", 0) + 1
            if self.calls == 100:
                raise RuntimeError("environment exploded")
            return super().recv()

    monkeypatch.setattr(sebulba_train_es, "EnvPoolEnvs", Failing)
    configs = _configs(tmp_path, population=8, total_steps=10**9,
                       sebulba=SebulbaConfig(actor_threads=2))
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="environment exploded"):
        sebulba_train_es.train_es(configs, jax.devices()[:2])
    assert time.monotonic() - start < 60
    assert _sebulba_threads() == []


@pytest.mark.parametrize("args, message", [
    (["--actor-devices", "0", "--actor-threads=3"], "--population=64 does not split over 3 actor threads"),
    (["--horizon=100"], "--horizon does not apply to --arch=sebulba --algo=es"),
    (["--env=CartPol-v1"], "unknown envpool environment"),
])
def test_bad_input_is_one_line_exit_2(args, message, tmp_path, capsys):
    code = main(["--arch=sebulba", "--algo=es", *args, f"--run-dir={tmp_path}/run"])
    stderr = capsys.readouterr().err
    assert code == 2, stderr
    assert stderr.count("\n") == 1 and message in stderr
    assert not (tmp_path / "run").exists()
