"""How many env steps a run trains: `--total-steps` rounded up to the whole calls each pair runs.

Anakin trains whole calls of `--updates-per-call` updates (PPO, IMPALA) or
`--generations-per-call` generations (ES); Sebulba PPO and IMPALA whole
updates. The first line says so when the rounding adds more than
`NOTED_ROUNDING` (Craftax's 5,000 steps are 32,768: one call), so that a
total that grew is never a surprise. Sebulba ES plays whole generations whose
length its episodes decide: its total is known only when it is reached.
"""

from __future__ import annotations

import math

from podracer.errors import PodracerError
from podracer.orchestrate.spec import RunSpec

NOTED_ROUNDING = 0.05  # a rounding up by more than this fraction of --total-steps is said


def steps_per_call(configs: RunSpec) -> int | None:
    """Env steps of one call (Anakin) or update (Sebulba); None for Sebulba ES."""
    run = configs.run
    if run.algo == "es":
        if run.arch == "sebulba":
            return None
        from podracer.envs.jax_envs import make_env
        from podracer.es.agent import episode_horizon

        es = configs.agent
        horizon = episode_horizon(make_env(run.env), es)
        return es.population * es.episodes_per_member * horizon * es.generations_per_call
    arch = configs.architecture
    updates = arch.updates_per_call if run.arch == "anakin" else 1
    return arch.num_envs * arch.rollout_len * updates


def trained_steps(configs: RunSpec) -> int | None:
    """The env steps a run of `configs` trains (per agent of a population); None when not known ahead."""
    per_call = steps_per_call(configs)
    if per_call is None:
        return None
    return max(1, math.ceil(configs.run.total_steps / per_call)) * per_call


def rounding_note(configs: RunSpec) -> str:
    """`--total-steps=5,000 trains 32,768 env steps (...)` when the rounding is more than a few percent; else ""."""
    try:
        trained = trained_steps(configs)
    except PodracerError:  # no time limit to default --horizon to: the build says so, and cleans up
        return ""
    total = configs.run.total_steps
    if trained is None or trained <= total * (1 + NOTED_ROUNDING):
        return ""
    unit = "update" if configs.run.arch == "sebulba" else "call"
    return (f"--total-steps={total:,} trains {trained:,} env steps "
            f"(whole {unit}s of {steps_per_call(configs):,})")
