"""Value-based and off-policy agents on Anakin against their reference implementations, in one process.

Each row (`CASES`) trains a podracer agent from the command line's own
settings (its preset for the environment, `podracer.anakin.train.build`) and,
alternated with it in this process, its peer at the same settings:

- pqn on CartPole-v1 and Breakout-MinAtar against purejaxql's PQN
  (`bench/peer_purejaxql.py`, its CartPole and MinAtar configs, which the
  podracer presets copy; purejaxql uses RAdam where podracer uses Adam, shuffles
  the whole flattened rollout where podracer shuffles each environment's steps,
  and ends the bootstrap at a time limit where podracer bootstraps from the
  final observation).
- dqn on CartPole-v1, without a peer: `bench/peer_purejaxql.py` ports
  purejaxql's PQN only, so no purejaxql DQN runs here at the same settings;
  the row's peer fields are null and its `note` says why.
- sac on brax `inverted_pendulum` against brax's own SAC trainer, in brax's
  layout (one step, 4 gradient steps) and the preset's (8 steps, 32 gradient
  steps): `bench/sac.py`'s side by side (its docstring has the settings), whose
  rows this bench prints too; their `sps` and `peer_sps` are the medians of
  `--rounds` alternated chunks, and their times to a score come from those
  chunks (they have no whole runs).

`sps` is steady-state environment steps per second of training: podracer's
compiled call (its preset's `updates_per_call` updates) and the peer compiled
for the same steps, called in alternation `--rounds` times, the median of each
(the first round warms up and is not counted; the peer's chunk also
initialises its network and environments, a small part of it). Whole runs,
alternated too, give `run_sps` (their average speed, compilation excluded,
the best of `--repeats`), `compile_s` and `time_to_score_s`: compilation plus
training until an interval's mean episode return reaches the row's `score`
(intervals: podracer's calls; the peer's run cut into as many equal parts),
null if the run never reaches it. Runs here are brief (`--steps` scales every
row's length), so a score a row's full-length run reaches may stay null.

To add a row, append a `Case` (its `peer` may be None: the peer columns are
then null, and its `note` says why).

    python bench/offpolicy.py [--repeats 1] [--rounds 10] [--steps 1.0] [--only ALGO_OR_ENV]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Callable, NamedTuple

import common  # noqa: F401  (puts the repository on sys.path)
import jax
import numpy as np

import peer_purejaxql
import sac as sac_bench
from podracer.anakin.train import build
from podracer.orchestrate.parse import parse_configs


class Run(NamedTuple):
    sps: float
    compile_s: float
    time_to_score_s: float | None
    final_return: float


class Peer(NamedTuple):
    name: str
    run: Callable[[int, int, int, float], Run]  # (seed, steps, intervals, score) -> one whole run
    chunk: Callable[[int, int], Callable]  # (steps, run_steps) -> compiled `chunk(key)` training `steps` steps


class Case(NamedTuple):
    algo: str  # --algo
    env: str  # --env (its preset applies)
    steps: int  # environment steps of a full bench run
    score: float  # the episode return `time_to_score_s` waits for
    peer: Peer | None = None
    note: str | None = None  # why a row has no peer, or what else a reader must know


def podracer_program(case: Case, seed: int, steps: int):
    """The command line's program (`podracer.anakin.train.build`) for `steps` steps on one device."""
    with tempfile.TemporaryDirectory() as run_dir:
        configs = parse_configs([f"--algo={case.algo}", f"--env={case.env}", f"--total-steps={steps}",
                                 f"--seed={seed}", f"--run-dir={run_dir}"])
    return build(configs, jax.devices()[:1])


def podracer_run(case: Case, seed: int, steps: int) -> tuple[Run, int]:
    """One whole run; also its number of calls."""
    program = podracer_program(case, seed, steps)
    runner = program.init(jax.random.PRNGKey(seed))
    start = time.perf_counter()
    train = program.step.lower(runner).compile()
    compile_s = time.perf_counter() - start
    scored, mean, start = None, float("nan"), time.perf_counter()
    for _ in range(program.calls.total):
        runner, metrics = train(runner)
        metrics = jax.device_get(metrics)
        if metrics["episodes"].sum():
            mean = float(metrics["episode_return_sum"].sum() / metrics["episodes"].sum())
        if scored is None and mean >= case.score:
            scored = compile_s + time.perf_counter() - start
    train_s = time.perf_counter() - start
    trained = program.calls.total * program.calls.steps_per_call
    return Run(trained / train_s, compile_s, scored, mean), program.calls.total


def steady_state(case: Case, steps: int, rounds: int) -> tuple[float, float | None]:
    """Median steps/s of podracer's call and of the peer's chunk of as many steps, alternated."""
    program = podracer_program(case, 0, steps)
    runner = program.init(jax.random.PRNGKey(0))
    ours = program.step.lower(runner).compile()
    chunk_steps = program.calls.steps_per_call
    peer = case.peer.chunk(chunk_steps, steps) if case.peer else None
    times: dict[str, list[float]] = {"ours": [], "peer": []}
    for round_ in range(rounds + 1):  # the first round warms each up and is not counted
        (runner, _), seconds = common.timed(ours, runner)
        times["ours"].append(seconds)
        if peer is not None:
            times["peer"].append(common.timed(peer, jax.random.PRNGKey(round_))[1])
    sps = lambda t: chunk_steps / statistics.median(t[1:]) if t else None
    return sps(times["ours"]), sps(times["peer"])


def purejaxql(config: dict) -> Peer:
    """purejaxql's PQN at `config`, its run length and decay horizon set by the bench."""

    def make(steps: int, run_steps: int):
        return peer_purejaxql.make_train(dict(config, TOTAL_TIMESTEPS=steps, TOTAL_TIMESTEPS_DECAY=run_steps))

    def run(seed: int, steps: int, intervals: int, score: float) -> Run:
        key = jax.random.PRNGKey(seed)
        start = time.perf_counter()
        compiled = jax.jit(make(steps, steps)).lower(key).compile()
        compile_s = time.perf_counter() - start
        out, train_s = common.timed(compiled, key)
        metrics = jax.device_get(out["metrics"])
        parts = np.array_split(np.arange(len(metrics["episodes"])), intervals)
        means = [float(metrics["return_sum"][p].sum() / max(1, metrics["episodes"][p].sum())) for p in parts]
        reached = next((i for i, m in enumerate(means) if m >= score), None)
        trained = len(metrics["episodes"]) * config["NUM_ENVS"] * config["NUM_STEPS"]
        scored = None if reached is None else compile_s + train_s * (reached + 1) / intervals
        return Run(trained / train_s, compile_s, scored, means[-1])

    def chunk(steps: int, run_steps: int):
        return jax.jit(make(steps, run_steps)).lower(jax.random.PRNGKey(0)).compile()

    return Peer("purejaxql pqn", run, chunk)


CASES: list[Case] = [
    Case("pqn", "CartPole-v1", 250_000, 475.0, purejaxql(peer_purejaxql.CARTPOLE)),
    Case("pqn", "Breakout-MinAtar", 2_000_000, 10.0, purejaxql(peer_purejaxql.MINATAR)),
    Case("dqn", "CartPole-v1", 400_000, 475.0, None,
         "no peer: bench/peer_purejaxql.py ports purejaxql's PQN only, not a DQN to run at the same settings"),
]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1, help="alternating whole runs of each side")
    parser.add_argument("--rounds", type=int, default=10, help="alternating steady-state chunks of each side")
    parser.add_argument("--steps", type=float, default=1.0, help="scale every row's run length")
    parser.add_argument("--only", default="", help="run only the rows whose algo or env contains this")
    args = parser.parse_args()
    results, table = [], []
    fmt = lambda v: "-" if v is None else f"{v:,.1f}" if isinstance(v, float) else str(v)
    ratio = lambda v: "-" if v is None else f"{v:.2f}"
    for case in [c for c in CASES if args.only in c.env or args.only == c.algo]:
        steps = int(case.steps * args.steps)
        sps, peer_sps = steady_state(case, steps, args.rounds)
        ours, peers = [], []
        for repeat in range(args.repeats):  # alternated, so both sides meet the same machine noise
            run, intervals = podracer_run(case, repeat, steps)
            ours.append(run)
            if case.peer is not None:
                peers.append(case.peer.run(repeat, steps, intervals, case.score))
        best = lambda runs: max(runs, key=lambda r: r.sps) if runs else None
        o, p = best(ours), best(peers)
        row = {"algo": case.algo, "env": case.env, "steps": steps, "score": case.score, "sps": sps,
               "run_sps": o.sps, "time_to_score_s": o.time_to_score_s, "final_return": o.final_return,
               "compile_s": o.compile_s, "peer": case.peer and case.peer.name, "peer_sps": peer_sps,
               "peer_run_sps": p and p.sps, "peer_time_to_score_s": p and p.time_to_score_s,
               "peer_final_return": p and p.final_return, "peer_compile_s": p and p.compile_s,
               "ratio_to_peer": peer_sps and sps / peer_sps, "note": case.note}
        results.append(row)
        table.append((case.algo, case.env, f"{steps:,}", fmt(sps), fmt(peer_sps), ratio(row["ratio_to_peer"]),
                      fmt(o.time_to_score_s), fmt(p and p.time_to_score_s), f"{case.score:g}",
                      fmt(o.final_return), fmt(p and p.final_return), row["peer"] or "-"))
    if args.only == "sac" or args.only in f"brax:{sac_bench.ENV}":
        measured = sac_bench.side_by_side(args.rounds)
        for layout in ("same layout", "preset layout"):
            ours = measured[layout]
            row = {"algo": "sac", "env": f"brax:{sac_bench.ENV}", "layout": layout,
                   "steps": (args.rounds + 1) * sac_bench.CHUNK_STEPS, "score": sac_bench.SCORE,
                   "sps": ours["sps"], "time_to_score_s": ours["time_to_score_s"], "final_return": ours["return"],
                   "peer": "brax.training.agents.sac", "peer_sps": measured["brax_sps"],
                   "peer_time_to_score_s": measured["brax_time_to_score_s"],
                   "peer_final_return": measured["brax_return"],
                   "ratio_to_peer": ours["sps"] / measured["brax_sps"],
                   "note": f"{layout}; times to score from the alternated chunks, no whole runs"}
            results.append(row)
            table.append(("sac", f"{row['env']} ({layout})", f"{row['steps']:,}", fmt(row["sps"]),
                          fmt(row["peer_sps"]), ratio(row["ratio_to_peer"]), fmt(ours["time_to_score_s"]),
                          fmt(measured["brax_time_to_score_s"]), f"{sac_bench.SCORE:g}", fmt(ours["return"]),
                          fmt(measured["brax_return"]), row["peer"]))
    common.report("Off-policy and value-based agents on Anakin, one device", table,
                  ("algo", "env", "steps", "steps/s", "peer steps/s", "ratio", "time to score s",
                   "peer time to score s", "score", "final return", "peer final return", "peer"),
                  {"bench": "offpolicy", "rows": results})


if __name__ == "__main__":
    main()
