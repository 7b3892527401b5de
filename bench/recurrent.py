"""Recurrent PPO on CartPole-v1 against the single-file recurrent PPO (PureJaxRL's ppo_rnn.py).

The reference's settings on both sides: a 128-unit relu torso, a GRU of 128,
128-unit relu heads, 4 envs x 128 steps, 4 epochs x 4 minibatches of whole
environment sequences, Adam 2.5e-4 annealed, 500k steps. Measured in this one
process, side by side:

- podracer gru / lstm: Anakin's program (`podracer.anakin.loop.make_programs`)
  with `--network=gru` (or lstm) `--hidden 128 128 --activation=relu`, one device.
- peer: `bench/peer_purejaxrl_rnn.py`, a faithful copy of ppo_rnn.py.

`sps` is steady-state env steps/s: each program compiled for the same chunk
of work (61 updates, 31,232 env steps), called in alternation, the median
chunk of each (the peer's chunk also initialises its network and
environments). `compile_s` is each program's compile time. With `--runs N`,
N whole 500k-step runs of podracer gru and of the peer, alternated, give
`final_return` (the mean return over the last eighth of the run).

    python bench/recurrent.py [--rounds 9] [--runs 0]
"""

from __future__ import annotations

import argparse
import statistics
import time

import common  # noqa: F401  (puts the repository on sys.path)
import jax
import numpy as np

import peer_purejaxrl_rnn as peer_rnn
from podracer.envs.jax_envs import make_env
from podracer.agent import fixed_agent
from podracer.anakin.loop import AnakinConfig, make_programs
from podracer.config import OptimConfig, make_optimizer
from podracer.networks import make_network
from podracer.ppo import PPOConfig, make_agent
from podracer.protocol import parallel

NUM_ENVS, ROLLOUT, TOTAL = 4, 128, 500_000
NUM_UPDATES = TOTAL // (NUM_ENVS * ROLLOUT)  # 976 = 16 chunks of 61 updates
UPDATES_PER_CALL = NUM_UPDATES // 16
CHUNK_STEPS = UPDATES_PER_CALL * NUM_ENVS * ROLLOUT


def podracer_train(network_kind: str):
    """(runner, compiled train, compile_s) of one chunk of Anakin recurrent PPO on one device."""
    env = make_env("CartPole-v1")
    network = make_network(env.spec.obs_shape, env.spec.action_dim, env.spec.discrete, (128, 128), "relu",
                           network=network_kind)
    config = AnakinConfig(num_envs=NUM_ENVS, rollout_len=ROLLOUT, updates_per_call=UPDATES_PER_CALL)
    optimizer = make_optimizer(OptimConfig(lr=2.5e-4), NUM_UPDATES * 16)
    agent_for = fixed_agent(make_agent, network, optimizer, PPOConfig(), env.spec, ROLLOUT)
    programs = make_programs(env, agent_for, config, parallel.make_mesh(jax.devices()[:1]))
    runner = programs.init(jax.random.PRNGKey(7))
    start = time.perf_counter()
    train = programs.train.lower(runner).compile()
    return runner, train, time.perf_counter() - start


def peer_train(total_steps: int):
    """(compiled train, compile_s) of the peer for `total_steps` steps."""
    config = dict(peer_rnn.REFERENCE_CONFIG, TOTAL_TIMESTEPS=total_steps)
    start = time.perf_counter()
    train = jax.jit(peer_rnn.make_train(config)).lower(jax.random.PRNGKey(7)).compile()
    return train, time.perf_counter() - start


def steady_state(rounds: int) -> dict:
    """Median steps/s and compile s of (gru, lstm, peer) over `rounds` alternating equal chunks."""
    gru_runner, gru, gru_compile = podracer_train("gru")
    lstm_runner, lstm, lstm_compile = podracer_train("lstm")
    peer, peer_compile = peer_train(CHUNK_STEPS)
    times = {"gru": [], "lstm": [], "peer": []}
    for round_ in range(rounds + 1):  # the first round warms each up and is not counted
        (gru_runner, _), seconds = common.timed(gru, gru_runner)
        times["gru"].append(seconds)
        _, seconds = common.timed(peer, jax.random.PRNGKey(round_))
        times["peer"].append(seconds)
        (lstm_runner, _), seconds = common.timed(lstm, lstm_runner)
        times["lstm"].append(seconds)
    sps = {name: CHUNK_STEPS / statistics.median(t[1:]) for name, t in times.items()}
    return {"sps": sps, "compile_s": {"gru": gru_compile, "lstm": lstm_compile, "peer": peer_compile}}


def whole_runs(runs: int) -> dict:
    """Final returns of `runs` whole 500k-step runs of podracer gru and the peer, alternated."""
    ours, theirs = [], []
    peer, _ = peer_train(TOTAL)
    for seed in range(runs):
        runner, train, _ = podracer_train("gru")
        returns = []
        for _ in range(16):
            runner, metrics = train(runner)
            m = jax.device_get(metrics)
            returns.append(float(m["episode_return_sum"].sum() / max(1, m["episodes"].sum())))
        ours.append(float(np.mean(returns[-2:])))  # the last eighth of the run
        out = jax.device_get(peer(jax.random.PRNGKey(seed)))
        theirs.append(float(np.nanmean(np.array_split(np.asarray(out["returns"]), 8)[-1])))
    return {"final_return": ours, "peer_final_return": theirs}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9, help="alternating steady-state chunks of each")
    parser.add_argument("--runs", type=int, default=0, help="alternating whole 500k-step runs of each")
    args = parser.parse_args()
    steady = steady_state(args.rounds)
    sps, compile_s = steady["sps"], steady["compile_s"]
    learned = whole_runs(args.runs) if args.runs else {}
    fmt = lambda v: "-" if v is None else f"{v:,.1f}"
    mean = lambda key: float(np.mean(learned[key])) if key in learned else None
    rows = [("podracer anakin --network=gru", fmt(sps["gru"]), fmt(compile_s["gru"]), fmt(mean("final_return"))),
            ("podracer anakin --network=lstm", fmt(sps["lstm"]), fmt(compile_s["lstm"]), "-"),
            ("peer ppo_rnn.py (GRU)", fmt(sps["peer"]), fmt(compile_s["peer"]), fmt(mean("peer_final_return")))]
    result = {"bench": "recurrent", "env": "CartPole-v1", "rows": [
        {"network": network, "sps": sps[network], "peer_sps": sps["peer"],
         "ratio_to_peer": sps[network] / sps["peer"], "compile_s": compile_s[network],
         "peer_compile_s": compile_s["peer"],
         **({"final_return": learned["final_return"], "peer_final_return": learned["peer_final_return"]}
            if network == "gru" and learned else {})}
        for network in ("gru", "lstm")]}
    common.report("Recurrent PPO, CartPole-v1, 4 envs x 128 steps, GRU/LSTM of 128 (steady state)", rows,
                  ("run", "steady steps/s", "compile s", "final return"), result)


if __name__ == "__main__":
    main()
