"""Pure-functional PPO: import the update into your own loop.

    from podracer import ppo
    update = jax.jit(ppo.make_update(apply_fn, optax.adam(3e-4), ppo.PPOConfig()))
    state, metrics = update(state, batch, bootstrap_value, key)
"""

from podracer.ppo.agent import make_agent
from podracer.ppo.config import PPOConfig
from podracer.ppo.gae import gae_advantages
from podracer.ppo.losses import Samples, normalize_advantages, ppo_loss
from podracer.ppo.update import init_train_state, make_act, make_update, policy_inputs, random_permutation
from podracer.types import TrainState, Transition

__all__ = [
    "PPOConfig",
    "Samples",
    "TrainState",
    "Transition",
    "gae_advantages",
    "init_train_state",
    "make_act",
    "make_agent",
    "make_update",
    "normalize_advantages",
    "policy_inputs",
    "ppo_loss",
    "random_permutation",
]
