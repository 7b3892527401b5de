"""Anakin PPO throughput on CartPole-v1 against the raw env ceiling and a peer PPO.

Reference hyperparameters (the common single-file JAX PPO's): 4 envs x 128 steps,
4 epochs x 4 minibatches, 64x64 tanh MLPs, Adam 2.5e-4 annealed, 500k steps.
Everything is measured in this one process, side by side:

- podracer: `podracer.anakin.loop.make_programs` on one device.
- peer: `bench/peer_purejaxrl.py`, a faithful copy of that single-file PPO.
- env ceiling: gymnax CartPole stepped with random actions at the same batch.
- podracer anakin, --network=lstm: the same program with an LSTM core (a 64-unit
  torso, a 64-unit LSTM, 64-unit actor and critic heads), steady state only:
  what memory costs at the same batch (minibatches of one whole environment
  sequence each).

`sps` is steady-state env steps/s of training: both programs compiled for the
same chunk of work (122 updates, 62,464 env steps), called in alternation, the
median chunk of each (the peer's chunk also initialises its network and
environments, well under 1% of it). Whole 500k-step runs, alternated too, give
`compile_s`, `time_to_solve_s` (compile time plus training time until an
interval's mean episode return reaches 475) and `run_sps` (their average speed,
first call included).

    python bench/anakin_ppo.py [--repeats 2] [--rounds 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

import common  # noqa: F401  (puts the repository on sys.path)
import jax
import numpy as np

import peer_purejaxrl
from podracer.protocol import parallel
from podracer.envs.jax_envs import make_env
from podracer.agent import fixed_agent
from podracer.anakin.loop import AnakinConfig, make_programs
from podracer.config import OptimConfig, make_optimizer
from podracer.networks import make_network
from podracer.ppo import PPOConfig, make_agent

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


NUM_UPDATES = TOTAL // (NUM_ENVS * ROLLOUT)  # 976 = 8 calls x 122 updates
UPDATES_PER_CALL = NUM_UPDATES // 8


def podracer_program(network_kind: str = "mlp"):
    env = make_env("CartPole-v1")
    network = make_network(env.spec.obs_shape, env.spec.action_dim, env.spec.discrete, network=network_kind)
    config = AnakinConfig(num_envs=NUM_ENVS, rollout_len=ROLLOUT, updates_per_call=UPDATES_PER_CALL)
    optimizer = make_optimizer(OptimConfig(lr=2.5e-4), NUM_UPDATES * 16)
    agent_for = fixed_agent(make_agent, network, optimizer, PPOConfig(), env.spec, config.rollout_len)
    return make_programs(env, agent_for, config, parallel.make_mesh(jax.devices()[:1]))[:2]


def podracer_run(seed: int) -> dict:
    init, train = podracer_program()
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
    steps = 8 * UPDATES_PER_CALL * NUM_ENVS * ROLLOUT
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


def steady_state(rounds: int) -> tuple[float, float, float]:
    """Median env steps/s of (podracer, peer, podracer LSTM) over `rounds` alternating equal chunks."""
    init, train = podracer_program()
    runner = init(jax.random.PRNGKey(7))
    ours = train.lower(runner).compile()
    init, train = podracer_program("lstm")
    lstm_runner = init(jax.random.PRNGKey(7))
    lstm = train.lower(lstm_runner).compile()
    peer_config = dict(peer_purejaxrl.REFERENCE_CONFIG, TOTAL_TIMESTEPS=UPDATES_PER_CALL * NUM_ENVS * ROLLOUT)
    peer = jax.jit(peer_purejaxrl.make_train(peer_config)).lower(jax.random.PRNGKey(7)).compile()
    times = {"ours": [], "peer": [], "lstm": []}
    for round_ in range(rounds + 1):  # the first round warms each up and is not counted
        (runner, _), seconds = common.timed(ours, runner)
        if round_:
            times["ours"].append(seconds)
        _, seconds = common.timed(peer, jax.random.PRNGKey(round_))
        if round_:
            times["peer"].append(seconds)
        (lstm_runner, _), seconds = common.timed(lstm, lstm_runner)
        if round_:
            times["lstm"].append(seconds)
    steps = UPDATES_PER_CALL * NUM_ENVS * ROLLOUT
    return tuple(steps / statistics.median(times[name]) for name in ("ours", "peer", "lstm"))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2, help="alternating whole runs of each")
    parser.add_argument("--rounds", type=int, default=15, help="alternating steady-state chunks of each")
    args = parser.parse_args()
    ceiling = env_ceiling()
    sps, peer_sps, lstm_sps = steady_state(args.rounds)
    ours, peer = [], []
    for repeat in range(args.repeats):  # alternate so both see the same machine noise
        ours.append(podracer_run(repeat))
        peer.append(peer_run(repeat))
    best = lambda runs: max(runs, key=lambda r: r["sps"])
    o, p = best(ours), best(peer)
    fmt = lambda v: "-" if v is None else f"{v:,.1f}" if isinstance(v, float) else str(v)
    rows = [(name, fmt(steady), fmt(r["sps"]), fmt(min(x["compile_s"] for x in runs)),
             fmt(r["time_to_solve_s"]), fmt(r["final_return"]))
            for name, steady, r, runs in (("podracer anakin", sps, o, ours),
                                          ("peer single-file PPO", peer_sps, p, peer))]
    rows.append(("podracer anakin --network=lstm", fmt(lstm_sps), "-", "-", "-", "-"))
    rows.append(("gymnax env ceiling", fmt(ceiling), "-", "-", "-", "-"))
    solve_times = [r["time_to_solve_s"] for r in ours]
    report_result = {
        "bench": "anakin_ppo", "env": "CartPole-v1", "sps": sps, "peer_sps": peer_sps,
        "ratio_to_peer": sps / peer_sps, "env_ceiling_sps": ceiling, "lstm_sps": lstm_sps,
        "run_sps": o["sps"], "peer_run_sps": p["sps"],
        "compile_s": min(r["compile_s"] for r in ours), "peer_compile_s": min(r["compile_s"] for r in peer),
        "time_to_solve_s": None if None in solve_times else max(solve_times),
        "solved_runs": sum(t is not None for t in solve_times), "runs": len(ours),
        "peer_time_to_solve_s": p["time_to_solve_s"],
    }
    common.report("Anakin PPO, CartPole-v1, 4 envs x 128 steps, 500k steps", rows,
                  ("run", "steady steps/s", "run steps/s", "compile s", "time to solve s", "final return"),
                  report_result)

if __name__ == "__main__":
    main()
