"""Anakin in profile mode: the one program split into phases that the host times apart.

Production Anakin fuses acting and learning into one jitted program per
`updates_per_call` updates, so the host cannot see inside it. Profile mode
compiles each phase as its own program (an agent: acting, learning, the same
steps the fused program runs (`podracer.anakin.loop.make_programs`); ES: evaluating
the population, `tell`, evaluating the mean parameters), runs them one after
the other and waits for each, so `measure` times each phase. The computation is
the same; steps/s in profile mode are not the production figure (a host round
trip and a device sync between phases, no fusion across them).
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from podracer.protocol import parallel
from podracer.anakin.es import ESPhases

NOTE = ("Anakin profile mode splits the one jitted program into separately compiled phases "
        "and waits for each; its steps/s are not the production figure")

Measure = Callable[[str], object]  # `Profiler.measure`


def stack_metrics(rows: list[dict]) -> dict:
    """Per-update metrics on the host, stacked as the fused program stacks them."""
    rows = [parallel.to_host(row) for row in rows]
    return jax.tree.map(lambda *values: np.stack(values), *rows)


def compile_agent_phases(act, learn, runner):
    """Ahead-of-time compiled `act` and `learn` (`loop.Programs`) for `runner`'s shapes."""
    act_lowered = act.lower(runner)
    _, experience = act_lowered.out_info
    return act_lowered.compile(), learn.lower(runner.train, experience).compile()


def make_profiled_train(act, learn, updates_per_call: int, measure: Measure) -> Callable:
    """`train(runner) -> (runner, metrics)` like `loop.Programs.train`, each phase timed on its own."""

    def train(runner):
        rows = []
        for _ in range(updates_per_call):
            with measure("acting"):
                runner, experience = jax.block_until_ready(act(runner))
            with measure("learning"):
                train_state, metrics = jax.block_until_ready(learn(runner.train, experience))
            runner = runner._replace(train=train_state)
            rows.append(metrics)
        with measure("metrics_to_host"):
            return runner, stack_metrics(rows)

    return train


def compile_es_phases(phases: ESPhases, runner, hparams=None) -> ESPhases:
    """`phases` (`make_anakin_es_phases`) compiled ahead of time for `runner`'s shapes.

    A population's phases (`make_anakin_es_population_phases`) take the agents'
    settings `hparams` first; the compiled phases come back with them bound.
    """
    bound = () if hparams is None else (hparams,)
    split = phases.split_keys.lower(*bound, runner.key)
    _, generation_keys, eval_key = split.out_info
    evaluate = phases.evaluate.lower(*bound, runner.strategy, runner.obs_stats, generation_keys[0])
    tell = phases.tell.lower(*bound, runner.strategy, runner.obs_stats, *evaluate.out_info)
    evaluate_mean = phases.evaluate_mean.lower(*bound, runner.strategy.mean, runner.obs_stats, eval_key)
    compiled = (split, evaluate, tell, evaluate_mean)
    return ESPhases(*(functools.partial(c.compile(), *bound) for c in compiled))


def make_profiled_es_step(phases: ESPhases, measure: Measure, agents: bool = False) -> Callable:
    """`step(runner) -> (runner, metrics)` like `make_anakin_es`'s, each phase timed on its own.

    With `agents` the phases are a population's, every value with a leading
    agent axis; the metrics are then laid out `[agent, generation, ...]` as the
    fused population step's.
    """

    def step(runner):
        key, generation_keys, eval_key = phases.split_keys(runner.key)
        state, obs_stats, rows = runner.strategy, runner.obs_stats, []
        for generation_key in generation_keys:
            with measure("evaluate"):
                ask_key, fitness, seen = jax.block_until_ready(
                    phases.evaluate(state, obs_stats, generation_key))
            with measure("tell"):
                state, obs_stats, metrics = jax.block_until_ready(
                    phases.tell(state, obs_stats, ask_key, fitness, seen))
            rows.append(metrics)
        with measure("evaluate_mean"):
            mean_return = jax.block_until_ready(phases.evaluate_mean(state.mean, obs_stats, eval_key))
        with measure("metrics_to_host"):
            stacked = stack_metrics(rows)
            if agents:
                stacked = jax.tree.map(lambda x: np.moveaxis(x, 0, 1), stacked)
            finite = jnp.all(jnp.isfinite(state.mean), axis=-1 if agents else None)
            metrics = dict(stacked, mean_params_return=parallel.to_host(mean_return),
                           params_finite=parallel.to_host(finite))
        return runner._replace(strategy=state, obs_stats=obs_stats, key=key), metrics

    return step
