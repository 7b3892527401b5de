"""Acting by search: mctx's Gumbel MuZero policy over the learned model, one search per observation.

Each observation is searched from its own key (a vmap over the batch), so an
environment's action depends on its key only, not on how the batch is split
over devices. The search's action is Gumbel-top-k sampled at the root and
sequentially halved; its `action_weights` (the prior improved by the
completed Q-values) are the policy target MuZero learns from.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import mctx

from podracer.muzero.config import MuZeroConfig
from podracer.muzero.targets import support_to_scalar


class SearchOutput(NamedTuple):
    action: jax.Array  # [B]
    action_weights: jax.Array  # [B, A]: the improved policy
    value: jax.Array  # [B]: the search's value of the root


def model_functions(network, config: MuZeroConfig, discount: float | jax.Array | None = None):
    """mctx's `(root_fn(params, obs) -> RootFnOutput, recurrent_fn)` of `network` (`MuZeroNetwork`)."""
    scalar = lambda logits: support_to_scalar(logits, config.support_size)
    gamma = config.gamma if discount is None else discount

    def root_fn(params, obs):
        state, policy_logits, value_logits = network.apply(params, obs, method="initial")
        return mctx.RootFnOutput(prior_logits=policy_logits, value=scalar(value_logits), embedding=state)

    def recurrent_fn(params, key, action, state):
        del key  # the model is deterministic
        state, reward_logits, policy_logits, value_logits = network.apply(params, state, action,
                                                                          method="recurrent")
        reward = scalar(reward_logits)
        output = mctx.RecurrentFnOutput(reward=reward, discount=jnp.full_like(reward, gamma),
                                        prior_logits=policy_logits, value=scalar(value_logits))
        return output, state

    return root_fn, recurrent_fn


def make_search(network, config: MuZeroConfig, deterministic: bool = False) -> Callable:
    """`search(params, obs [B, ...], keys [B]) -> SearchOutput`.

    `deterministic` searches without Gumbel noise (the action with the best
    improved-policy score among the considered ones): for evaluation.
    """
    root_fn, recurrent_fn = model_functions(network, config)

    def one(params, obs, key):
        output = mctx.gumbel_muzero_policy(
            params, key, root_fn(params, obs[None]), recurrent_fn, config.num_simulations,
            max_num_considered_actions=config.max_considered_actions,
            gumbel_scale=0.0 if deterministic else 1.0)
        root_value = output.search_tree.node_values[:, output.search_tree.ROOT_INDEX]
        return SearchOutput(output.action[0], output.action_weights[0], root_value[0])

    def search(params, obs, keys):
        with jax.named_scope("search"):
            return jax.vmap(one, in_axes=(None, 0, 0))(params, obs, keys)

    return search
