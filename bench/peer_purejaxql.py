"""A faithful, compact copy of purejaxql's PQN for gymnax (`purejaxql/pqn_gymnax.py`, Apache-2.0,
https://github.com/mttga/purejaxql), the peer of `bench/offpolicy.py`.

purejaxql is not on PyPI; this file is written from the published source as
remembered, not downloaded, and ported only as far as today's flax and gymnax
need (`gymnax.wrappers.purerl`, whose step answers terminated and truncated apart; `jax.tree.map`). Same structure as the
original: one jitted `train` of nested `lax.scan`s (environment steps, the
Q(lambda) targets backwards, epochs, minibatches of the whole flattened
rollout permuted), a 2 x 128 ReLU MLP with layer norm (and the dummy batch
norm on its input that the original keeps for its checkpoints), RAdam with
global-norm clipping, epsilon decaying linearly from the update counter, no
target network. `done` is the environment's (a time limit ends the bootstrap
as a termination does). The only addition: each update's sum and count of
finished episodes' returns, so that the bench can find when a score is reached
(the original logs the mean of `returned_episode_returns` over every step).
"""

from __future__ import annotations

from typing import Any

import chex
import flax.linen as nn
import gymnax
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training.train_state import TrainState
from gymnax.wrappers.purerl import FlattenObservationWrapper, LogWrapper


class QNetwork(nn.Module):
    action_dim: int
    hidden_size: int = 128
    num_layers: int = 2
    norm_type: str = "layer_norm"
    norm_input: bool = False

    @nn.compact
    def __call__(self, x: jnp.ndarray, train: bool):
        if self.norm_input:
            x = nn.BatchNorm(use_running_average=not train)(x)
        else:
            x_dummy = nn.BatchNorm(use_running_average=not train)(x)  # noqa: F841 (kept as in the original)
        if self.norm_type == "layer_norm":
            normalize = lambda x: nn.LayerNorm()(x)
        elif self.norm_type == "batch_norm":
            normalize = lambda x: nn.BatchNorm(use_running_average=not train)(x)
        else:
            normalize = lambda x: x
        for _ in range(self.num_layers):
            x = nn.relu(normalize(nn.Dense(self.hidden_size)(x)))
        return nn.Dense(self.action_dim)(x)


@chex.dataclass(frozen=True)
class Transition:
    obs: chex.Array
    action: chex.Array
    reward: chex.Array
    done: chex.Array
    next_obs: chex.Array
    q_val: chex.Array


class CustomTrainState(TrainState):
    batch_stats: Any
    timesteps: int = 0
    n_updates: int = 0
    grad_steps: int = 0


def make_train(config):
    config["NUM_UPDATES"] = config["TOTAL_TIMESTEPS"] // config["NUM_STEPS"] // config["NUM_ENVS"]
    config["NUM_UPDATES_DECAY"] = config["TOTAL_TIMESTEPS_DECAY"] // config["NUM_STEPS"] // config["NUM_ENVS"]
    assert (config["NUM_STEPS"] * config["NUM_ENVS"]) % config["NUM_MINIBATCHES"] == 0

    basic_env, env_params = gymnax.make(config["ENV_NAME"])
    env = LogWrapper(FlattenObservationWrapper(basic_env))
    vmap_reset = lambda n: lambda rng: jax.vmap(env.reset, in_axes=(0, None))(jax.random.split(rng, n), env_params)
    vmap_step = lambda n: lambda rng, state, action: jax.vmap(env.step, in_axes=(0, 0, 0, None))(
        jax.random.split(rng, n), state, action, env_params)

    def eps_greedy_exploration(rng, q_vals, eps):
        rng_a, rng_e = jax.random.split(rng)
        greedy_actions = jnp.argmax(q_vals, axis=-1)
        return jnp.where(jax.random.uniform(rng_e, greedy_actions.shape) < eps,
                         jax.random.randint(rng_a, greedy_actions.shape, 0, q_vals.shape[-1]), greedy_actions)

    def train(rng):
        eps_scheduler = optax.linear_schedule(config["EPS_START"], config["EPS_FINISH"],
                                              config["EPS_DECAY"] * config["NUM_UPDATES_DECAY"])
        lr_scheduler = optax.linear_schedule(config["LR"], 1e-20, config["NUM_UPDATES_DECAY"]
                                             * config["NUM_MINIBATCHES"] * config["NUM_EPOCHS"])
        lr = lr_scheduler if config.get("LR_LINEAR_DECAY", False) else config["LR"]
        network = QNetwork(action_dim=env.action_space(env_params).n, hidden_size=config.get("HIDDEN_SIZE", 128),
                           num_layers=config.get("NUM_LAYERS", 2), norm_type=config["NORM_TYPE"],
                           norm_input=config.get("NORM_INPUT", False))

        def create_agent(rng):
            init_x = jnp.zeros((1, *env.observation_space(env_params).shape))
            variables = network.init(rng, init_x, train=False)
            tx = optax.chain(optax.clip_by_global_norm(config["MAX_GRAD_NORM"]), optax.radam(learning_rate=lr))
            return CustomTrainState.create(apply_fn=network.apply, params=variables["params"],
                                           batch_stats=variables["batch_stats"], tx=tx)

        rng, _rng = jax.random.split(rng)
        train_state = create_agent(_rng)

        def _update_step(runner_state, unused):
            train_state, expl_state, rng = runner_state

            def _step_env(carry, _):
                last_obs, env_state, rng = carry
                rng, rng_a, rng_s = jax.random.split(rng, 3)
                q_vals = network.apply({"params": train_state.params, "batch_stats": train_state.batch_stats},
                                       last_obs, train=False)
                _rngs = jax.random.split(rng_a, config["NUM_ENVS"])
                eps = jnp.full(config["NUM_ENVS"], eps_scheduler(train_state.n_updates))
                new_action = jax.vmap(eps_greedy_exploration)(_rngs, q_vals, eps)
                # Today's gymnax answers terminated and truncated apart; the original's `done` is either.
                new_obs, new_env_state, reward, terminated, truncated, info = vmap_step(config["NUM_ENVS"])(
                    rng_s, env_state, new_action)
                new_done = jnp.logical_or(terminated, truncated)
                transition = Transition(obs=last_obs, action=new_action, reward=config.get("REW_SCALE", 1) * reward,
                                        done=new_done, next_obs=new_obs, q_val=q_vals)
                return (new_obs, new_env_state, rng), (transition, info)

            rng, _rng = jax.random.split(rng)
            (*expl_state, rng), (transitions, infos) = jax.lax.scan(_step_env, (*expl_state, _rng), None,
                                                                    config["NUM_STEPS"])
            expl_state = tuple(expl_state)
            train_state = train_state.replace(timesteps=train_state.timesteps
                                              + config["NUM_STEPS"] * config["NUM_ENVS"])

            last_q = network.apply({"params": train_state.params, "batch_stats": train_state.batch_stats},
                                   transitions.next_obs[-1], train=False)
            last_q = jnp.max(last_q, axis=-1)

            def _get_target(lambda_returns_and_next_q, transition):
                lambda_returns, next_q = lambda_returns_and_next_q
                target_bootstrap = transition.reward + config["GAMMA"] * (1 - transition.done) * next_q
                delta = lambda_returns - next_q
                lambda_returns = target_bootstrap + config["GAMMA"] * config["LAMBDA"] * delta
                lambda_returns = (1 - transition.done) * lambda_returns + transition.done * transition.reward
                next_q = jnp.max(transition.q_val, axis=-1)
                return (lambda_returns, next_q), lambda_returns

            last_q = last_q * (1 - transitions.done[-1])
            lambda_returns = transitions.reward[-1] + config["GAMMA"] * last_q
            _, targets = jax.lax.scan(_get_target, (lambda_returns, last_q),
                                      jax.tree.map(lambda x: x[:-1], transitions), reverse=True)
            lambda_targets = jnp.concatenate((targets, lambda_returns[np.newaxis]))

            def _learn_epoch(carry, _):
                train_state, rng = carry

                def _learn_phase(carry, minibatch_and_target):
                    train_state, rng = carry
                    minibatch, target = minibatch_and_target

                    def _loss_fn(params):
                        q_vals, updates = network.apply({"params": params, "batch_stats": train_state.batch_stats},
                                                        minibatch.obs, train=True, mutable=["batch_stats"])
                        chosen = jnp.take_along_axis(q_vals, jnp.expand_dims(minibatch.action, -1), -1).squeeze(-1)
                        return 0.5 * jnp.square(chosen - target).mean(), (updates, chosen)

                    (loss, (updates, qvals)), grads = jax.value_and_grad(_loss_fn, has_aux=True)(train_state.params)
                    train_state = train_state.apply_gradients(grads=grads)
                    train_state = train_state.replace(grad_steps=train_state.grad_steps + 1,
                                                      batch_stats=updates["batch_stats"])
                    return (train_state, rng), (loss, qvals)

                def preprocess_transition(x, rng):
                    x = x.reshape(-1, *x.shape[2:])
                    x = jax.random.permutation(rng, x)
                    return x.reshape(config["NUM_MINIBATCHES"], -1, *x.shape[1:])

                rng, _rng = jax.random.split(rng)
                minibatches = jax.tree.map(lambda x: preprocess_transition(x, _rng), transitions)
                targets = jax.tree.map(lambda x: preprocess_transition(x, _rng), lambda_targets)
                rng, _rng = jax.random.split(rng)
                (train_state, rng), (loss, qvals) = jax.lax.scan(_learn_phase, (train_state, rng),
                                                                 (minibatches, targets))
                return (train_state, rng), (loss, qvals)

            rng, _rng = jax.random.split(rng)
            (train_state, rng), (loss, qvals) = jax.lax.scan(_learn_epoch, (train_state, rng), None,
                                                             config["NUM_EPOCHS"])
            train_state = train_state.replace(n_updates=train_state.n_updates + 1)
            finished = infos["returned_episode"]
            metrics = {"env_step": train_state.timesteps, "td_loss": loss.mean(), "qvals": qvals.mean(),
                       "return_sum": jnp.where(finished, infos["returned_episode_returns"], 0.0).sum(),
                       "episodes": finished.sum()}
            return (train_state, expl_state, rng), metrics

        rng, _rng = jax.random.split(rng)
        obs, env_state = vmap_reset(config["NUM_ENVS"])(_rng)
        rng, _rng = jax.random.split(rng)
        runner_state, metrics = jax.lax.scan(_update_step, (train_state, (obs, env_state), _rng), None,
                                             config["NUM_UPDATES"])
        return {"runner_state": runner_state, "metrics": metrics}

    return train


# purejaxql's configs (config/alg/pqn_cartpole.yaml, pqn_minatar.yaml), as remembered.
CARTPOLE = {
    "ENV_NAME": "CartPole-v1", "TOTAL_TIMESTEPS": 250_000, "TOTAL_TIMESTEPS_DECAY": 250_000, "NUM_ENVS": 32,
    "NUM_STEPS": 64, "EPS_START": 1.0, "EPS_FINISH": 0.05, "EPS_DECAY": 0.2, "NUM_MINIBATCHES": 16,
    "NUM_EPOCHS": 4, "NORM_INPUT": False, "NORM_TYPE": "layer_norm", "HIDDEN_SIZE": 128, "NUM_LAYERS": 2,
    "LR": 1e-4, "MAX_GRAD_NORM": 10, "LR_LINEAR_DECAY": False, "REW_SCALE": 0.1, "GAMMA": 0.99,
    "LAMBDA": 0.95}
MINATAR = {
    "ENV_NAME": "Breakout-MinAtar", "TOTAL_TIMESTEPS": 10_000_000, "TOTAL_TIMESTEPS_DECAY": 10_000_000,
    "NUM_ENVS": 128, "NUM_STEPS": 32, "EPS_START": 1.0, "EPS_FINISH": 0.01, "EPS_DECAY": 0.1,
    "NUM_MINIBATCHES": 32, "NUM_EPOCHS": 2, "NORM_INPUT": False, "NORM_TYPE": "layer_norm", "HIDDEN_SIZE": 128,
    "NUM_LAYERS": 2, "LR": 1e-4, "MAX_GRAD_NORM": 10, "LR_LINEAR_DECAY": True, "REW_SCALE": 1.0,
    "GAMMA": 0.99, "LAMBDA": 0.65}
