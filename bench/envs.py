"""What each JAX suite costs on Anakin, and podracer against brax's own PPO trainer on brax envs.

Per suite, at the same batch (64 environments): `raw_sps`, raw environment
steps/s with uniformly random actions (one jitted `lax.scan` of the adapter's
batched step, as Anakin's rollout runs it, auto-reset included), `ppo_sps`, podracer's Anakin PPO
training steps/s (64 envs x 64 steps, 4 epochs x 4 minibatches, 64x64 MLPs), and their
ratio `ppo_over_raw`. Craftax-Classic has a second PPO row with a recurrent network, as
the Craftax paper's PPO-RNN baseline (`--network=gru`, GRU of 256 after a 256 torso, relu):
the same sizes, its compile seconds apart.

Then brax's own PPO trainer (`brax.training.agents.ppo.train`) and podracer
on brax `fast` and `inverted_pendulum` (spring backend) with the same
settings: 64 envs, 64x64 MLPs, 4096 steps an update in 4 epochs x 4
minibatches of 1,024 transitions (brax: batch_size 64, unroll_length 16;
podracer: rollout_len 64), alternated chunk by chunk in this one process
(`brax_side_by_side`). Each side's steps/s is the median over the chunks.

    python bench/envs.py [--steps 262144] [--suites brax:fast navix:Navix-Empty-5x5-v0 ...]
                         [--rounds 8] [--chunk-updates 8] [--no-brax-trainer] [--no-recurrent]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import common  # noqa: F401  (puts the repository on sys.path)
import jax
import jax.numpy as jnp

from podracer.envs.jax_envs import make_env
from podracer.agent import fixed_agent
from podracer.anakin.loop import AnakinConfig, make_programs
from podracer.config import OptimConfig, make_optimizer
from podracer.networks import make_network
from podracer.ppo import PPOConfig, make_agent
from podracer.protocol import parallel

NUM_ENVS, ROLLOUT, UPDATES_PER_CALL = 64, 64, 4
SUITES = ("CartPole-v1", "brax:fast", "brax:inverted_pendulum", "jumanji:Snake-v1", "jumanji:PacMan-v1",
          "navix:Navix-Empty-5x5-v0", "craftax:Craftax-Classic-Symbolic-v1")
CRAFTAX = "craftax:Craftax-Classic-Symbolic-v1"
# The recurrent row's network: make_network's (hidden, activation, network).
RECURRENT = ((256, 256), "relu", "gru")


def env_sps(env_id: str, steps: int) -> float:
    env = make_env(env_id)
    spec = env.spec

    @jax.jit
    def run(key):
        state, _ = jax.vmap(env.reset)(jax.random.split(key, NUM_ENVS))

        def step(state, key):
            action_key, env_key = jax.random.split(key)
            if spec.discrete:
                action = jax.random.randint(action_key, (NUM_ENVS,), 0, spec.action_dim)
            else:
                action = jax.random.uniform(action_key, (NUM_ENVS, spec.action_dim), minval=-1, maxval=1)
            # As Anakin's rollout steps a batch: draws ahead, then `step_batch` (Craftax
            # makes a new world only where an episode ended).
            draws = jax.vmap(env.draw)(jax.random.split(env_key, NUM_ENVS))
            state, ts = env.step_batch(draws, state, action)
            # The observations too: a constant reward (inverted_pendulum's 1 a step) would let
            # XLA drop the physics altogether.
            return state, ts.reward.sum() + ts.obs.astype(jnp.float32).sum()

        return jax.lax.scan(step, state, jax.random.split(key, steps // NUM_ENVS))[1].sum()

    common.timed(run, jax.random.PRNGKey(0))
    return steps / common.timed(run, jax.random.PRNGKey(1))[1]


def make_podracer_ppo(env_id: str, updates_per_call: int = UPDATES_PER_CALL, network=((64, 64), "tanh", "mlp")):
    """podracer's compiled Anakin PPO call on one device, and its runner after a first call.

    `network`: make_network's (hidden, activation, network kind).
    """
    env = make_env(env_id)
    hidden, activation, kind = network
    network = make_network(env.spec.obs_shape, env.spec.action_dim, env.spec.discrete, hidden, activation,
                           kind, action_mask=env.spec.action_mask)
    config = AnakinConfig(num_envs=NUM_ENVS, rollout_len=ROLLOUT, updates_per_call=updates_per_call)
    optimizer = make_optimizer(OptimConfig(lr=3e-4), 1000)
    agent_for = fixed_agent(make_agent, network, optimizer, PPOConfig(epochs=4, minibatches=4), env.spec, ROLLOUT)
    init, train, _, _ = make_programs(env, agent_for, config, parallel.make_mesh(jax.devices()[:1]))
    runner = init(jax.random.PRNGKey(0))
    train = train.lower(runner).compile()
    runner, _ = common.timed(train, runner)[0]
    return train, runner


def ppo_sps(env_id: str, calls: int, network=((64, 64), "tanh", "mlp")) -> tuple[float, float]:
    """(median steps/s over `calls` calls, seconds to compile and make the first call)."""
    start = time.perf_counter()
    train, runner = make_podracer_ppo(env_id, network=network)
    compile_s = time.perf_counter() - start
    times = []
    for _ in range(calls):
        (runner, _), seconds = common.timed(train, runner)
        times.append(seconds)
    return NUM_ENVS * ROLLOUT * UPDATES_PER_CALL / statistics.median(times), compile_s


def brax_trainer(agent: str = "ppo"):
    """brax's `train` of `agent` (`brax.training.agents.ppo`, `sac`), on this jax.

    brax 0.14.2's trainers call `jax.device_put_replicated` once, to place their
    initial training state on their devices; jax 0.10 removed that function. The
    stand-in does what it did (a copy per device stacked on a leading axis, which
    `pmap` then splits: here one CPU device), before brax's first epoch and outside
    every timing.
    """
    import importlib

    try:
        jax.device_put_replicated
    except AttributeError:
        jax.device_put_replicated = lambda x, devices: jax.device_put(
            jax.tree.map(lambda a: jnp.stack([a] * len(devices)), x), devices[0])
    return importlib.import_module(f"brax.training.agents.{agent}.train").train


def brax_side_by_side(name: str, rounds: int, updates: int) -> tuple[float, float]:
    """Median steps/s of (brax's PPO trainer, podracer's Anakin PPO) on brax env `name`.

    Equal chunks, alternated in this process: brax trains `rounds` epochs of
    `updates` updates (64 envs x 4 unrolls of 16 steps, 4 epochs x 4 minibatches
    of 1,024), and between two of its epochs (its `progress_fn`) podracer runs
    one call of `updates` updates of 64 envs x 64 steps with the same epochs and
    minibatches. brax's figure is its own `training/sps`, the epoch it timed
    itself (compilation in the first, which is dropped; no evaluation: run_evals
    off); podracer's is its call, compiled beforehand.
    """
    steps_per_update = NUM_ENVS * ROLLOUT
    ours, runner = make_podracer_ppo(f"brax:{name}", updates)  # imports brax quietly (suites)
    from brax import envs
    from brax.training.agents.ppo import networks as ppo_networks

    train_brax = brax_trainer("ppo")
    state = {"runner": runner}
    brax_sps, our_sps = [], []

    def between_epochs(step, metrics):
        brax_sps.append(float(metrics["training/sps"]))
        (state["runner"], _), seconds = common.timed(ours, state["runner"])
        our_sps.append(updates * steps_per_update / seconds)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        env = envs.get_environment(name, backend="spring") if name != "fast" else envs.get_environment(name)
    factory = lambda *a, **k: ppo_networks.make_ppo_networks(
        *a, **k, policy_hidden_layer_sizes=(64, 64), value_hidden_layer_sizes=(64, 64))
    train_brax(environment=env, num_timesteps=(rounds + 1) * updates * steps_per_update, num_envs=NUM_ENVS,
               batch_size=NUM_ENVS, unroll_length=16, num_minibatches=4, num_updates_per_batch=4,
               episode_length=1000, num_evals=rounds + 2, run_evals=False, network_factory=factory,
               progress_fn=between_epochs, seed=0)
    # brax's first epoch compiled its program: that round is left out of both.
    return statistics.median(brax_sps[1:]), statistics.median(our_sps[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=262_144, help="raw env steps timed per suite")
    parser.add_argument("--calls", type=int, default=5, help="podracer PPO calls timed per suite")
    parser.add_argument("--rounds", type=int, default=8, help="alternating chunks, brax's trainer vs podracer")
    parser.add_argument("--chunk-updates", type=int, default=8, help="PPO updates per chunk")
    parser.add_argument("--suites", nargs="*", default=list(SUITES))
    parser.add_argument("--no-brax-trainer", action="store_true")
    parser.add_argument("--no-recurrent", action="store_true", help="leave out Craftax's recurrent PPO row")
    args = parser.parse_args()
    rows, result = [], {}
    runs = [(env_id, "mlp") for env_id in args.suites]
    if CRAFTAX in args.suites and not args.no_recurrent:
        runs.append((CRAFTAX, RECURRENT[2]))
    raws = {}
    for env_id, kind in runs:
        name = env_id if kind == "mlp" else f"{env_id} ({kind})"
        try:
            raw = raws[env_id] = raws.get(env_id) or env_sps(env_id, args.steps)
            trained, compile_s = ppo_sps(env_id, args.calls, RECURRENT if kind != "mlp" else ((64, 64), "tanh", "mlp"))
        except Exception as err:  # a missing extra: say so in the table, go on
            rows.append((name, f"skipped ({type(err).__name__}: {str(err)[:60]})", "", "", "", "", ""))
            continue
        rows.append((name, f"{raw:,.0f}", f"{trained:,.0f}", f"{trained / raw:.2f}", f"{compile_s:.0f}", "", ""))
        result[name] = {"raw_sps": raw, "ppo_sps": trained, "ppo_over_raw": trained / raw, "network": kind,
                        "ppo_compile_s": compile_s}
        print(rows[-1], flush=True)
    if not args.no_brax_trainer:
        for name in ("fast", "inverted_pendulum"):
            theirs, ours = brax_side_by_side(name, args.rounds, args.chunk_updates)
            rows.append((f"brax:{name}, alternated chunks", "", f"{ours:,.0f}", "", "", f"{theirs:,.0f}",
                         f"{ours / theirs:.2f}"))
            result[f"brax_trainer:{name}"] = {"brax_ppo_sps": theirs, "podracer_ppo_sps": ours,
                                              "ratio": ours / theirs, "rounds": args.rounds,
                                              "updates_per_round": args.chunk_updates}
            print(rows[-1], flush=True)
    common.report(f"JAX suites on Anakin, {NUM_ENVS} envs", rows,
                  ("env", "raw_sps", "ppo_sps", "ppo/raw", "ppo_compile_s", "brax_trainer_ppo_sps", "podracer/brax"),
                  result)


if __name__ == "__main__":
    main()
