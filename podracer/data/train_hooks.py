"""What `--init-from-dataset` and `--record-dataset` do around an Anakin PPO run.

`train_ppo` calls three functions, each a no-op when its flag is not given:
`check_data_config` before anything is built, `warm_start` on the freshly
initialised runner of a run that is not resuming (its params become the
behaviour-cloned ones; every process clones the same), and, in process 0 only,
`record_trained_policy` on the final train state.
"""

from __future__ import annotations

import math
import time

import jax
import numpy as np
import optax

from podracer.protocol import parallel
from podracer.bc import BCConfig, Demonstrations, make_bc_update
from podracer.data.config import DataConfig
from podracer.data.episodes import demonstrations, unpad_episodes
from podracer.data.reader import find_dataset_dir, load_episodes
from podracer.data.record import make_recorder, policy_act_fn
from podracer.data.spec import ACTION, IS_LAST, OBSERVATION, STEPS, import_tfds, step_spec_for_env
from podracer.data.writer import DatasetWriter, check_new_dataset_dir
from podracer.errors import PodracerError
from podracer.normalize import init_running_stats, update_stats
from podracer.ppo import PPOConfig, init_train_state
from podracer.types import TrainState
from podracer.version import __version__

# Episodes recorded per jitted call: bounds memory to this many full-length episodes.
RECORD_CHUNK = 256


def check_data_config(data: DataConfig, writes: bool = True) -> None:
    """Fail before training, not after it: the extra is installed, the dataset to clone
    exists, and (in the process that `writes` the recording) the output directory is free."""
    if data.record_dataset or data.init_from_dataset:
        import_tfds()
    if data.record_dataset and writes:
        check_new_dataset_dir(data.record_dataset)
    if data.init_from_dataset:
        find_dataset_dir(data.init_from_dataset)


def load_demonstrations(data_dir: str, env, gamma: float) -> Demonstrations:
    """Every acting step of the dataset, checked against `env`'s spaces (one-line errors)."""
    spec = env.spec
    action_shape = () if spec.discrete else (spec.action_dim,)
    purpose = f"behaviour cloning on {env.env_id}"
    batch = load_episodes(data_dir, requirements={OBSERVATION: spec.obs_shape, ACTION: action_shape,
                                                  IS_LAST: ()}, purpose=purpose)
    demos = demonstrations(batch, gamma)
    if len(demos.action) == 0:
        raise PodracerError(f"dataset {data_dir} has no steps with actions; {purpose} needs some")
    action = np.asarray(demos.action)
    if spec.discrete:
        if action.dtype.kind not in "iu":
            raise PodracerError(f"dataset {data_dir}: steps/action holds {action.dtype} values but "
                                f"{purpose} needs integer actions")
        if action.min() < 0 or action.max() >= spec.action_dim:
            raise PodracerError(f"dataset {data_dir}: steps/action has values in [{action.min()}, "
                                f"{action.max()}] but {purpose} needs 0..{spec.action_dim - 1}")
    return demos._replace(obs=np.asarray(demos.obs, spec.obs_dtype), action=action)


def behaviour_clone(apply_fn, params, demos: Demonstrations, config: BCConfig, learning_rate: float,
                    num_steps: int, key: jax.Array) -> tuple[TrainState, dict]:
    """`num_steps` behaviour-cloning updates in one jitted scan; returns the state and last metrics.

    With `config.normalize_observations`, the state's observation statistics are
    those of the demonstrations, so a PPO run can carry on from them.
    """
    obs_shape = np.shape(demos.obs)[1:]
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(learning_rate))
    state = init_train_state(params, optimizer, obs_shape)
    if config.normalize_observations:
        state = state._replace(obs_stats=update_stats(init_running_stats(obs_shape), demos.obs))
    update = make_bc_update(apply_fn, optimizer, config)

    @jax.jit
    def run(state, demos, key):
        return jax.lax.scan(lambda s, k: update(s, demos, k), state, jax.random.split(key, num_steps))

    state, metrics = run(state, demos, key)
    return state, {name: float(values[-1]) for name, values in jax.device_get(metrics).items()}


def warm_start(runner, data: DataConfig, env, network, ppo_config: PPOConfig, seed: int):
    """Replace the runner's initial params (and observation statistics) by cloned ones.

    Returns `(runner, summary)`; the PPO optimiser state is kept as initialised.
    """
    if not data.init_from_dataset:
        return runner, {}
    start = time.perf_counter()
    demos = load_demonstrations(data.init_from_dataset, env, ppo_config.gamma)
    config = BCConfig(batch_size=data.bc_batch_size, value_coef=data.bc_value_coef,
                      normalize_observations=ppo_config.normalize_observations)
    initial = parallel.to_host(runner.train)
    key = jax.random.fold_in(jax.random.PRNGKey(seed), 0xBC)
    cloned, metrics = behaviour_clone(network.apply, initial.params, demos, config, data.bc_lr,
                                      data.bc_steps, key)
    # Every process cloned the same values; place them as the runner's replicated ones.
    def place(new, old):
        new = np.asarray(new)
        return jax.make_array_from_callback(old.shape, old.sharding, lambda index: new[index])

    train = runner.train._replace(
        params=jax.tree.map(place, cloned.params, runner.train.params),
        obs_stats=jax.tree.map(place, cloned.obs_stats, runner.train.obs_stats))
    return runner._replace(train=train), {
        "bc_steps": data.bc_steps,
        "bc_demonstrations": int(len(demos.action)),
        "bc_log_likelihood": metrics["log_likelihood"],
        "bc_s": time.perf_counter() - start,
    }


def record_trained_policy(train: TrainState, data: DataConfig, env, network, ppo_config: PPOConfig,
                          seed: int) -> dict:
    """Record `data.record_episodes` episodes of the policy in `train` into `data.record_dataset`."""
    if not data.record_dataset:
        return {}
    state = parallel.to_host(train)
    act_fn = policy_act_fn(network.apply, ppo_config, data.record_deterministic)
    chunk = min(data.record_episodes, RECORD_CHUNK)
    record = jax.jit(make_recorder(env, act_fn, chunk))
    key = jax.random.fold_in(jax.random.PRNGKey(seed), 0xDA7A)
    metadata = {"env": env.env_id, "policy": "ppo", "deterministic": data.record_deterministic,
                "seed": seed, "podracer_version": __version__}
    returns = []
    with DatasetWriter(data.record_dataset, step_spec_for_env(env.spec), metadata=metadata) as writer:
        for call in range(math.ceil(data.record_episodes / chunk)):
            episodes = unpad_episodes(record(state, jax.random.fold_in(key, call)))
            for episode in episodes[: data.record_episodes - writer.num_episodes]:
                writer.add_episode(episode[STEPS])
                returns.append(float(episode["episode_return"]))
    return {"dataset_dir": data.record_dataset, "dataset_episodes": len(returns),
            "dataset_return_mean": float(np.mean(returns))}
