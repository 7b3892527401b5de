"""Anakin PPO throughput on CartPole-v1 against the raw env ceiling and a peer PPO.

Reference hyperparameters (the common single-file JAX PPO's): 4 envs x 128 steps,
4 epochs x 4 minibatches, 64x64 tanh MLPs, Adam 2.5e-4 annealed, 500k steps.
Everything is measured in this one process, side by side:

- podracer: `podracer.anakin.make_anakin` on one device.
- peer: `bench/peer_purejaxrl.py`, a faithful copy of that single-file PPO.
- env ceiling: gymnax CartPole stepped with random actions at the same batch.

`sps` is steady-state env steps/s of training (compilation excluded);
`time_to_solve_s` is compile time plus training time until an interval's mean
episode return reaches 475.

    python bench/anakin_ppo.py [--repeats 2]
"""

from __future__ import annotations

import argparse
import time

import common  # noqa: F401  (puts the repository on sys.path)
import jax
import jax.numpy as jnp
import numpy as np
import optax

import peer_purejaxrl
from podracer import parallel
from podracer.anakin.env import make_env
from podracer.anakin.loop import AnakinConfig, make_anakin
from podracer.config import OptimConfig, make_optimizer
from podracer.networks import make_network
from podracer.ppo import PPOConfig

NUM_ENVS, ROLLOUT, TOTAL, SOLVED = 4, 128, 500_000, 475.0


def env_ceiling(num_steps: int = 200_000) -> float:
    env = make_env("CartPole-v1")

    @jax.jit
    def run(key):
        state, _ = jax.vmap(env.reset)(jax.random.split(key, NUM_ENVS))

        def step(state, key):
            keys = jax.random.split(key, NUM_ENVS + 1)
            action = jax.random.randint(keys[0], (NUM_ENVS,), 0, 2)
            state, ts = jax.vmap(env.step)(keys[1:], state, action)
            return state, ts.reward.sum()

        return jax.lax.scan(step, state, jax.random.split(key, num_steps // NUM_ENVS))[1].sum()

    common.timed(run, jax.random.PRNGKey(0))
    _, seconds = common.timed(run, jax.random.PRNGKey(1))
    return num_steps / seconds


def podracer_run(seed: int) -> dict:
    env = make_env("CartPole-v1")
    network = make_network(env.spec.obs_shape, env.spec.action_dim, env.spec.discrete)
    ppo_config = PPOConfig()
    num_updates = TOTAL // (NUM_ENVS * ROLLOUT)  # 976 = 8 calls x 122 updates
    config = AnakinConfig(num_envs=NUM_ENVS, rollout_len=ROLLOUT, updates_per_call=num_updates // 8)
    optimizer = make_optimizer(OptimConfig(lr=2.5e-4), num_updates * 16)
    init, train = make_anakin(env, network, optimizer, ppo_config, config,
                              parallel.make_mesh(jax.devices()[:1]))
    runner = init(jax.random.PRNGKey(seed))
    start = time.perf_counter()
    train = train.lower(runner).compile()
    compile_s = time.perf_counter() - start
    returns, solved_at, start = [], None, time.perf_counter()
    for _ in range(8):
        runner, metrics = train(runner)
        m = jax.device_get(metrics)
        mean = float(m["episode_return_sum"].sum() / max(1, m["episodes"].sum()))
        returns.append(mean)
        if solved_at is None and mean >= SOLVED:
            solved_at = time.perf_counter() - start
    train_s = time.perf_counter() - start
    steps = 8 * config.updates_per_call * NUM_ENVS * ROLLOUT
    return {"sps": steps / train_s, "compile_s": compile_s, "final_return": returns[-1],
            "time_to_solve_s": None if solved_at is None else compile_s + solved_at}


def peer_run(seed: int) -> dict:
    train = jax.jit(peer_purejaxrl.make_train(peer_purejaxrl.REFERENCE_CONFIG))
    key = jax.random.PRNGKey(seed)
    start = time.perf_counter()
    compiled = train.lower(key).compile()
    compile_s = time.perf_counter() - start
    out, train_s = common.timed(compiled, key)
    returns = np.asarray(out["returns"])
    steps = len(returns) * NUM_ENVS * ROLLOUT
    # Same criterion as ours: mean return over an eighth of the run.
    chunks = [np.nanmean(c) for c in np.array_split(returns, 8)]
    solved = next((i for i, c in enumerate(chunks) if c >= SOLVED), None)
    return {"sps": steps / train_s, "compile_s": compile_s, "final_return": float(chunks[-1]),
            "time_to_solve_s": None if solved is None else compile_s + train_s * (solved + 1) / 8}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2, help="alternating runs of each; best sps kept")
    args = parser.parse_args()
    ceiling = env_ceiling()
    ours, peer = [], []
    for repeat in range(args.repeats):  # alternate so both see the same machine noise
        ours.append(podracer_run(repeat))
        peer.append(peer_run(repeat))
    best = lambda runs: max(runs, key=lambda r: r["sps"])
    o, p = best(ours), best(peer)
    fmt = lambda v: "-" if v is None else f"{v:,.1f}" if isinstance(v, float) else str(v)
    rows = [(name, fmt(r["sps"]), fmt(r["compile_s"]), fmt(r["time_to_solve_s"]), fmt(r["final_return"]))
            for name, r in (("podracer anakin", o), ("peer single-file PPO", p))]
    rows.append(("gymnax env ceiling", fmt(ceiling), "-", "-", "-"))
    solve_times = [r["time_to_solve_s"] for r in ours]
    report_result = {
        "bench": "anakin_ppo", "env": "CartPole-v1", "sps": o["sps"], "peer_sps": p["sps"],
        "ratio_to_peer": o["sps"] / p["sps"], "env_ceiling_sps": ceiling,
        "compile_s": min(r["compile_s"] for r in ours), "peer_compile_s": min(r["compile_s"] for r in peer),
        "time_to_solve_s": None if None in solve_times else max(solve_times),
        "solved_runs": sum(t is not None for t in solve_times), "runs": len(ours),
        "peer_time_to_solve_s": p["time_to_solve_s"],
    }
    common.report("Anakin PPO, CartPole-v1, 4 envs x 128 steps, 500k steps",
                  rows, ("run", "steps/s", "compile s", "time to solve s", "final return"), report_result)


if __name__ == "__main__":
    main()
