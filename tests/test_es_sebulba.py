"""Sebulba ES: the ES agent on Sebulba's actor threads (one fresh episode per environment) and learner."""

import json
import queue
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
from jax.flatten_util import ravel_pytree
from podracer.normalize import reduce_stats
from podracer.protocol import parallel
from podracer.orchestrate.cli import main
from podracer.orchestrate.spec import RunSpec
from podracer.config import NetworkConfig, RunConfig
from podracer.es.agent import generation_key, make_agent
from podracer.es.config import ESConfig, make_strategy
from podracer.networks import make_policy_network
from podracer.sebulba.actor import Actor, ActorSettings, make_acting, run_actor
from podracer.sebulba.config import SebulbaConfig, split_devices
from podracer.sebulba.control import Control
from podracer.sebulba.envs import EnvPoolEnvs, EnvStep, EpisodeTally, env_spec
from podracer.sebulba.learner import make_learn_step
from podracer.sebulba.params import ParamsStore
from podracer.sebulba import train_es as sebulba_train_es
from podracer.sebulba.train_es import es_env_index, make_es_layout
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


def test_tally_keeps_each_environments_first_episode_and_ignores_the_rest():
    tally = EpisodeTally(2)
    f, t = False, True
    tally.record(_step([0, 1], [0, 0], [f, f]))  # the resets after `start`
    # Environment 0 ends its episode (return 3 over 2 steps).
    tally.record(_step([0, 1], [1, 1], [t, f], episode_return=[3, 0], length=[2, 0]))
    assert not tally.done
    # Environment 0 auto-resets and plays on, ignored; environment 1 is cut by the time limit.
    tally.record(_step([0, 1], [0, 5], [f, f], truncated=[f, t], episode_return=[0, 9], length=[0, 3]))
    assert tally.done
    # Environment 0's second episode ends too: it does not replace the first one.
    tally.record(_step([0, 1], [1, 0], [t, f], episode_return=[1, 0], length=[1, 0]))
    assert tally.returns.tolist() == [3, 9] and tally.lengths.tolist() == [2, 3]


def test_layout_gives_each_thread_whole_members_then_its_evaluation_episodes():
    sebulba = SebulbaConfig(actor_threads=2)
    layout = make_es_layout(ESConfig(population=4, episodes_per_member=2, eval_episodes=3), sebulba,
                            split_devices(sebulba, jax.devices()[:2]))
    assert (layout.members_per_thread, layout.member_envs, layout.eval_envs,
            layout.envs_per_thread) == (2, 4, 2, 6)
    # Thread 1 plays members 2 and 3 (environments 4..7 of the population's 8), then evaluation
    # episodes numbered after the population's.
    assert es_env_index(1, layout, 8).tolist() == [4, 5, 6, 7, 10, 11]
    # A thread's environments split evenly over the learner devices: evaluation rounds up.
    sebulba = SebulbaConfig(actor_devices=(0,), learner_devices=(1, 2, 3))
    layout = make_es_layout(ESConfig(population=8, eval_episodes=2), sebulba, split_devices(sebulba, jax.devices()))
    assert (layout.member_envs, layout.eval_envs, layout.envs_per_thread) == (8, 4, 12)


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


def test_fitness_is_each_environments_return_until_done_also_across_generation_resets(tmp_path):
    """Sebulba's actor thread, running the ES agent, resets its batch every generation and ships each
    environment's first episode: its return, its agent steps and (ARS V2) its observations."""
    config = _configs(tmp_path, variant="ars_v2", population=6, episodes_per_member=2, eval_episodes=2,
                      sigma=1.0)
    setup = sebulba_train_es.build(config, jax.devices()[:2])
    layout = setup.layout
    assert layout.envs_per_thread == 14
    envs = Recording("CartPole-v1", layout.envs_per_thread, layout.envs_per_thread, 1, seed=7)
    device = setup.split.actor[0]
    store, out, control = ParamsStore([device]), queue.Queue(maxsize=1), Control()
    store.publish(setup.agent.acting_state(setup.state), 0)
    actor = Actor(0, envs, ActorSettings(setup.horizon, synchronous=True), device, setup.acting, store, out,
                  setup.mesh, jax.random.PRNGKey(0), control, Timings(), es_env_index(0, layout, 12))
    thread = threading.Thread(target=run_actor, args=(actor,), daemon=True)
    thread.start()
    played = []
    try:
        for generation in range(2):  # the second starts from environments left mid-episode by the first
            if generation:
                store.publish(setup.agent.acting_state(setup.state), generation)
            shipment = out.get(timeout=120)
            returns, env_index, steps = (np.asarray(row)[0] for row in shipment.batch)
            played.append((returns, steps, jax.device_get(shipment.bootstrap), shipment))
            assert env_index.tolist() == list(range(12)) + [12, 13]
    finally:
        control.stop.set()
        thread.join(timeout=30)
    assert not thread.is_alive()

    by_hand = _replay_by_hand(envs.calls, layout.envs_per_thread, seed=7)
    assert len(by_hand) >= 2
    member = np.arange(layout.envs_per_thread) < layout.member_envs
    for (returns, steps, seen, shipment), (hand_returns, lengths, observed) in zip(played, by_hand):
        np.testing.assert_array_equal(returns, hand_returns)
        np.testing.assert_array_equal(steps, lengths)
        assert len(set(lengths.tolist())) > 3  # members play differently: not a vacuous check
        assert shipment.dropped_steps > 0  # short episodes waited for the longest one
        # The episodes the log counts are the same ones: each environment's first.
        np.testing.assert_array_equal(np.sort(shipment.episode_returns), np.sort(hand_returns))
        # ARS V2's statistics, over every environment as `learn` merges them: the members'
        # observations acted on, one per agent step (the evaluation episodes' left out).
        seen = reduce_stats(seen)
        members_observed = np.concatenate([np.stack(observed[i]) for i in np.flatnonzero(member)])
        assert float(seen.count) == len(members_observed) == lengths[member].sum()
        np.testing.assert_allclose(seen.mean, members_observed.mean(0), rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------- the update


@pytest.mark.parametrize("variant", ["openai", "ars_v1"])
def test_members_and_learner_equal_the_pure_ask_and_tell(variant):
    """The ES agent as Sebulba runs it: 2 actor threads' members (`for_rollout`), their returns
    gathered by 3 learner devices in their own column order (`learn`), versus the strategy's own
    `ask` and `tell` of the whole population, over 3 generations."""
    config = ESConfig(variant=variant, population=8, episodes_per_member=2, eval_episodes=2, sigma=0.1,
                      es_lr=0.05)
    spec = env_spec("CartPole-v1")
    policy = make_policy_network(spec.obs_shape, spec.action_dim, spec.discrete, (4,))
    sebulba = SebulbaConfig(actor_devices=(0,), learner_devices=(1, 2, 3), actor_threads=2)
    layout = make_es_layout(config, sebulba, split_devices(sebulba, jax.devices()[:4]))
    assert (layout.member_envs, layout.eval_envs) == (8, 1)
    mesh = parallel.make_mesh(jax.devices()[1:4])
    agent = make_agent(policy, None, config, spec, 500, (parallel.DATA_AXIS,), eval_envs=layout.eval_envs)
    acting = make_acting(agent, jax.eval_shape(agent.init, jax.random.PRNGKey(0)), spec, layout.envs_per_thread)
    learn = make_learn_step(agent.learn, mesh)
    target = lambda flat: -np.sum((flat - np.linspace(-1.0, 1.0, flat.shape[-1])) ** 2, axis=-1)
    state = jax.device_put(agent.init(jax.random.PRNGKey(5)), parallel.replicated(mesh))
    strategy = make_strategy(config)
    pure = jax.device_get(state.strategy)
    for generation in range(3):
        batches = []
        for thread in range(2):
            index = es_env_index(thread, layout, 16)
            members = acting.for_rollout(jax.device_put(state, jax.devices()[0]), index)
            # One row per environment: 4 members' 2 episodes each, then the mean's evaluation episode.
            flat = np.asarray(jax.vmap(lambda tree: ravel_pytree(tree)[0])(members.params))
            np.testing.assert_array_equal(flat[:8:2], flat[1:8:2])
            np.testing.assert_array_equal(flat[8], jax.device_get(state.strategy.mean))
            at_mean = target(flat[8])
            # Each member's two episodes differ: its fitness is their mean.
            returns = np.concatenate([target(flat[:8]) + np.tile([1.0, -1.0], 4), [at_mean]])
            rows = (returns.astype(np.float32), index, np.full(layout.envs_per_thread, 7.0, np.float32))
            batches.append(parallel.from_host(tuple(row[None] for row in rows), parallel.time_major_sharded(mesh)))
        seen = parallel.from_host(((),) * 2, parallel.sharded(mesh))
        state, metrics = learn(state, tuple(batches), seen, jax.random.PRNGKey(0), ((), ()))
        key = generation_key(jax.device_get(state)._replace(strategy=pure))
        expected = target(np.asarray(strategy.ask(pure, key, jnp.arange(8))))
        pure, _ = strategy.tell(pure, key, jnp.asarray(expected, jnp.float32))
        np.testing.assert_allclose(float(metrics["mean_params_return"]), at_mean, rtol=1e-5)
        assert float(metrics["member_steps"]) == 7 * 16 and float(metrics["eval_steps"]) == 7 * 2
    assert int(state.strategy.generation) == 3
    initial = agent.init(jax.random.PRNGKey(5)).strategy.mean
    assert not np.allclose(jax.device_get(state.strategy.mean), initial)  # not vacuous
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 jax.device_get(state.strategy), jax.device_get(pure))


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
    (["--env=Pong-v5"], "GiB of observations per actor thread"),
    (["--env=py:test_sebulba_gym:make_countdown"], "has no time limit (max_episode_steps)"),
])
def test_bad_input_is_one_line_exit_2(args, message, tmp_path, capsys):
    code = main(["--arch=sebulba", "--algo=es", *args, f"--run-dir={tmp_path}/run"])
    stderr = capsys.readouterr().err
    assert code == 2, stderr
    assert stderr.count("\n") == 1 and message in stderr
    assert not (tmp_path / "run").exists()
