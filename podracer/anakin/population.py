"""Anakin populations: what their programs take.

Every agent, ES included, gets its population from Anakin's one builder
(`podracer.anakin.loop.make_programs`): the one-agent program vmapped over a
leading agent axis, each agent built with its swept settings
(`podracer.population`) as traced scalars.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from podracer import population


def agent_inputs(members: list[population.Agent]) -> tuple[jax.Array, dict]:
    """What a population's `init` takes: each agent's key (from its seed) and swept settings, stacked [A]."""
    keys = jnp.stack([jax.random.PRNGKey(m.seed) for m in members])
    return keys, {k: jnp.asarray(v) for k, v in population.hyperparameters(members).items()}
