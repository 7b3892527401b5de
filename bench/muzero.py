#!/usr/bin/env python
"""Anakin MuZero throughput on CartPole: steps/s of training, and the search's simulations/s.

Builds the run exactly as `--algo=muzero` does (the CartPole preset: 8
environments, rollouts of 4 steps, 128 replayed sequences per update, 8
simulations a step) and times, in interleaved rounds, each figure the fastest
of its rounds (contention on a shared machine only ever adds time):

- train: one call of the fused program (`--updates-per-call` updates, each a
  rollout with search then one update): the steps/s a run gets.
- act: the acting phase alone (`loop.Programs.act`: search and environment
  steps of one rollout), in steps/s and simulations/s, one simulation being one
  evaluation of the learned model (dynamics and prediction) for one environment.

The buffer is filled first, so every timed update learns. The table comes
first; the last line printed is one JSON object with `sps`, `act_sps` and
`simulations_per_s`.

    python bench/muzero.py
    python bench/muzero.py --num-simulations=16 --num-envs=32
"""

from __future__ import annotations

import argparse
import os
import sys

import common  # noqa: F401  (puts the repository on sys.path)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env", default="CartPole-v1")
    parser.add_argument("--num-envs", type=int, default=8)
    parser.add_argument("--rollout-len", type=int, default=4)
    parser.add_argument("--num-simulations", type=int, default=8)
    parser.add_argument("--updates-per-call", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=5, help="timed calls of each, interleaved")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax

    from podracer.anakin.train import build
    from podracer.orchestrate.parse import parse_configs

    configs = parse_configs([
        "--arch=anakin", "--algo=muzero", f"--env={args.env}", f"--num-envs={args.num_envs}",
        f"--rollout-len={args.rollout_len}", f"--num-simulations={args.num_simulations}",
        f"--updates-per-call={args.updates_per_call}", "--learning-starts=0"])
    built = build(configs, jax.devices()[:1], profile=True)
    act, learn = built.phases
    runner = built.init(jax.random.key(0))
    # Fill the buffer past its first sampled sequence so that every timed update learns.
    for _ in range(2):
        (runner, _), _ = common.timed(built.step, runner)
    steps_per_call = args.num_envs * args.rollout_len * args.updates_per_call
    train_s, act_s = [], []
    for _ in range(args.rounds):
        (runner, _), seconds = common.timed(built.step, runner)
        train_s.append(seconds)
        (runner, _), seconds = common.timed(act, runner)
        act_s.append(seconds)
    sps = steps_per_call / min(train_s)
    act_sps = args.num_envs * args.rollout_len / min(act_s)
    result = {"algo": "muzero", "arch": "anakin", "env": args.env, "num_envs": args.num_envs,
              "num_simulations": args.num_simulations, "sps": round(sps, 1), "act_sps": round(act_sps, 1),
              "simulations_per_s": round(act_sps * args.num_simulations, 1)}
    rows = [("train (act + learn)", f"{sps:,.0f}", ""),
            ("act (search + env)", f"{act_sps:,.0f}", f"{act_sps * args.num_simulations:,.0f}")]
    common.report(f"Anakin MuZero on {args.env}, {args.num_envs} envs, {args.num_simulations} simulations",
                  rows, ("phase", "steps/s", "simulations/s"), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
