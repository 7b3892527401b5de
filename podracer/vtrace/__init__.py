"""Pure-functional IMPALA (V-trace actor-critic): import the update into your own loop.

    from podracer import vtrace
    update = jax.jit(vtrace.make_update(apply_fn, optax.adam(3e-4), vtrace.ImpalaConfig()))
    state, metrics = update(state, batch, bootstrap_value, key)

The update is called exactly as `podracer.ppo.make_update`'s, so Anakin and
Sebulba run either one.
"""

from podracer.vtrace.agent import make_agent
from podracer.vtrace.config import IMPALA_FIX, ImpalaConfig
from podracer.vtrace.losses import Sequences, impala_loss
from podracer.vtrace.update import make_update
from podracer.vtrace.vtrace import VTraceOutput, vtrace_td_error_and_advantage
from podracer.types import TrainState, Transition

__all__ = [
    "IMPALA_FIX",
    "ImpalaConfig",
    "Sequences",
    "TrainState",
    "Transition",
    "VTraceOutput",
    "impala_loss",
    "make_agent",
    "make_update",
    "vtrace_td_error_and_advantage",
]
