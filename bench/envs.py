"""What each JAX suite costs on Anakin, and podracer against brax's own PPO trainer on brax envs.

Per suite, at the same batch (64 environments): `env_sps`, raw environment
steps/s with uniformly random actions (one jitted `lax.scan` of the vmapped
adapter step, auto-reset included), and `ppo_sps`, podracer's Anakin PPO
training steps/s (64 envs x 64 steps, 4 epochs x 4 minibatches, 64x64 MLPs).

Then brax's `brax.training.agents.ppo.train` and podracer on brax `fast` and
`inverted_pendulum` (spring backend) with the same settings: 64 envs, 64x64
MLPs, 4 epochs x 4 minibatches of 1,024 transitions (brax: batch_size 64,
unroll_length 16; podracer: rollout_len 64), measured in this one process,
one after the other. Brax's steps/s is that of its training between its
second and last progress reports (its compilation and first chunk left out);
podracer's is the median of its compiled calls.

    python bench/envs.py [--steps 262144] [--suites brax:fast navix:Navix-Empty-5x5-v0 ...]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import common  # noqa: F401  (puts the repository on sys.path)
import jax
import jax.numpy as jnp

from podracer.anakin.env import make_env
from podracer.anakin.loop import AnakinConfig, make_anakin
from podracer.config import OptimConfig, make_optimizer
from podracer.networks import make_network
from podracer.ppo import PPOConfig
from podracer.protocol import parallel

NUM_ENVS, ROLLOUT, UPDATES_PER_CALL = 64, 64, 4
SUITES = ("CartPole-v1", "brax:fast", "brax:inverted_pendulum", "jumanji:Snake-v1",
          "craftax:Craftax-Classic-Symbolic-v1", "navix:Navix-Empty-5x5-v0")


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
            state, ts = jax.vmap(env.step)(jax.random.split(env_key, NUM_ENVS), state, action)
            # The observations too: a constant reward (inverted_pendulum's 1 a step) would let
            # XLA drop the physics altogether.
            return state, ts.reward.sum() + ts.obs.astype(jnp.float32).sum()

        return jax.lax.scan(step, state, jax.random.split(key, steps // NUM_ENVS))[1].sum()

    common.timed(run, jax.random.PRNGKey(0))
    return steps / common.timed(run, jax.random.PRNGKey(1))[1]


def ppo_sps(env_id: str, calls: int) -> float:
    env = make_env(env_id)
    network = make_network(env.spec.obs_shape, env.spec.action_dim, env.spec.discrete,
                           action_mask=env.spec.action_mask)
    config = AnakinConfig(num_envs=NUM_ENVS, rollout_len=ROLLOUT, updates_per_call=UPDATES_PER_CALL)
    optimizer = make_optimizer(OptimConfig(lr=3e-4), 1000)
    init, train = make_anakin(env, network, optimizer, PPOConfig(epochs=4, minibatches=4), config,
                              parallel.make_mesh(jax.devices()[:1]))
    runner = init(jax.random.PRNGKey(0))
    train = train.lower(runner).compile()
    times = []
    for _ in range(calls + 1):
        (runner, _), seconds = common.timed(train, runner)
        times.append(seconds)
    return NUM_ENVS * ROLLOUT * UPDATES_PER_CALL / statistics.median(times[1:])


def brax_ppo_sps(name: str, steps: int) -> float:
    from brax import envs
    from brax.training.agents.ppo import networks as ppo_networks

    if not hasattr(jax, "device_put_replicated") or _removed(jax, "device_put_replicated"):
        # brax 0.14's trainer still calls it; jax 0.10 removed it (jax.device_put's drop-in).
        jax.device_put_replicated = lambda x, devices: jax.device_put(
            jax.tree.map(lambda a: jnp.stack([a] * len(devices)), x), devices[0])
    from brax.training.agents.ppo import train as ppo

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        env = envs.get_environment(name, backend="spring") if name != "fast" else envs.get_environment(name)
    reports = []
    factory = lambda *a, **k: ppo_networks.make_ppo_networks(
        *a, **k, policy_hidden_layer_sizes=(64, 64), value_hidden_layer_sizes=(64, 64))
    ppo.train(environment=env, num_timesteps=steps, num_envs=NUM_ENVS, batch_size=NUM_ENVS,
              unroll_length=16, num_minibatches=4, num_updates_per_batch=4, episode_length=1000,
              num_evals=6, num_eval_envs=NUM_ENVS, network_factory=factory, run_evals=True,
              progress_fn=lambda step, _: reports.append((step, time.perf_counter())), seed=0)
    (step_a, time_a), (step_b, time_b) = reports[1], reports[-1]
    return (step_b - step_a) / (time_b - time_a)


def _removed(module, name: str) -> bool:
    try:
        getattr(module, name)
        return False
    except AttributeError:
        return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=262_144, help="raw env steps timed per suite")
    parser.add_argument("--calls", type=int, default=5, help="podracer PPO calls timed per suite")
    parser.add_argument("--brax-steps", type=int, default=655_360, help="brax PPO's num_timesteps")
    parser.add_argument("--suites", nargs="*", default=list(SUITES))
    parser.add_argument("--no-brax-trainer", action="store_true")
    args = parser.parse_args()
    rows, result = [], {}
    for env_id in args.suites:
        try:
            raw, trained = env_sps(env_id, args.steps), ppo_sps(env_id, args.calls)
        except Exception as err:  # a missing extra: say so in the table, go on
            rows.append((env_id, f"skipped ({type(err).__name__}: {str(err)[:60]})", ""))
            continue
        rows.append((env_id, f"{raw:,.0f}", f"{trained:,.0f}"))
        result[env_id] = {"env_sps": raw, "ppo_sps": trained}
        print(rows[-1], flush=True)
    if not args.no_brax_trainer:
        for name in ("fast", "inverted_pendulum"):
            theirs = brax_ppo_sps(name, args.brax_steps)
            ours = result.get(f"brax:{name}", {}).get("ppo_sps") or ppo_sps(f"brax:{name}", args.calls)
            rows.append((f"brax {name}: brax PPO / podracer PPO", f"{theirs:,.0f}", f"{ours:,.0f}"))
            result[f"brax_trainer:{name}"] = {"brax_ppo_sps": theirs, "podracer_ppo_sps": ours}
            print(rows[-1], flush=True)
    common.report(f"JAX suites on Anakin, {NUM_ENVS} envs", rows, ("env", "env_sps", "ppo_sps"), result)


if __name__ == "__main__":
    main()
