"""What `--init-from-dataset` and `--record-dataset` do around a training run, for every pair.

A run session calls three functions, each a no-op when its flag is not given:

- `check_data_config(data, writes)` before anything is built;
- PPO only, on a run that is not resuming: `warm_start_state` on the freshly
  initialised `TrainState` (Anakin's `runner.train`, Sebulba's learner state;
  replicated on any sharding): its params and observation statistics become the
  behaviour-cloned ones, the same in every process;
- in process 0 only, `record_policy` on the final policy, built by `ppo_policy`
  (a PPO `TrainState`) or `es_policy` (an ES search distribution's mean). It
  plays gymnax episodes for `arch="anakin"` (`make_recorder`) and envpool ones
  for `arch="sebulba"` (`record_envpool`).

    state, cloned = warm_start_state(state, data, spec, run.env, network, ppo_config, run.seed)
    policy = ppo_policy(state, network.apply, ppo_config, data.record_deterministic)
    policy = es_policy(strategy_mean, obs_stats, es_config, network_config, spec)
    recorded = record_policy(data, arch, run.env, policy, run.seed)

Either dataset directory may be `gs://BUCKET/PATH`: `DatasetWriter` records
locally and uploads, the readers read a temporary local copy.

The orchestrator hands them to the run session (`HOOKS`, through
`podracer.session.session.handing`), which makes these calls for every pair.
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
from podracer.acting import Policy
from podracer.data.record import make_recorder
from podracer.data.record_envpool import record_envpool
from podracer.data.spec import ACTION, IS_LAST, OBSERVATION, STEPS, import_tfds, step_spec_for_env
from podracer.data.writer import DatasetWriter, check_new_dataset_dir
from podracer.errors import PodracerError
from podracer.normalize import init_running_stats, update_stats
from podracer.policy import env_spec_of
from podracer.ppo import PPOConfig, init_train_state
from podracer import storage
from podracer.session.session import DatasetHooks
from podracer.types import TrainState
from podracer.version import __version__

# Episodes recorded per jitted call: bounds memory to this many full-length episodes.
RECORD_CHUNK = 256


def check_data_config(data: DataConfig, writes: bool = True) -> None:
    """Fail before training, not after it: the extras are installed, the dataset to clone
    exists, and (in the process that `writes` the recording) the output directory is free
    (and, in a bucket, writable)."""
    for flag, path in (("--record-dataset", data.record_dataset), ("--init-from-dataset", data.init_from_dataset)):
        try:
            storage.check(path)  # another scheme, or gs:// without gcsfs
        except PodracerError as error:
            raise PodracerError(f"{flag}={error}") from None
    if data.record_dataset or data.init_from_dataset:
        import_tfds()
    if data.record_dataset and writes:
        check_new_dataset_dir(data.record_dataset)
        if storage.is_remote(data.record_dataset):
            storage.probe_writable(data.record_dataset, "--record-dataset")
        else:
            storage.probe_creatable(data.record_dataset, "--record-dataset")
    if data.init_from_dataset:
        find_dataset_dir(data.init_from_dataset)


def load_demonstrations(data_dir: str, spec, env_id: str, gamma: float) -> Demonstrations:
    """Every acting step of the dataset, checked against the spaces of `spec` (an `EnvSpec`,
    of environment `env_id`) with one-line errors."""
    action_shape = () if spec.discrete else (spec.action_dim,)
    purpose = f"behaviour cloning on {env_id}"
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


def warm_start_state(train: TrainState, data: DataConfig, spec, env_id: str, network,
                     ppo_config: PPOConfig, seed: int) -> tuple[TrainState, dict]:
    """Replace a PPO train state's initial params (and observation statistics) by cloned ones.

    `train` may be placed on any sharding (replicated, as Anakin's runner and
    Sebulba's learner hold it, on one process or several); the result is placed
    the same way. `spec` is the run's `EnvSpec` (gymnax or envpool), `network`
    the PPO actor-critic. Returns `(train, summary)`; the PPO optimiser state is
    kept as initialised.
    """
    if not data.init_from_dataset:
        return train, {}
    start = time.perf_counter()
    demos = load_demonstrations(data.init_from_dataset, spec, env_id, ppo_config.gamma)
    config = BCConfig(batch_size=data.bc_batch_size, value_coef=data.bc_value_coef,
                      normalize_observations=ppo_config.normalize_observations)
    initial = parallel.to_host(train.params)
    key = jax.random.fold_in(jax.random.PRNGKey(seed), 0xBC)
    cloned, metrics = behaviour_clone(network.apply, initial, demos, config, data.bc_lr,
                                      data.bc_steps, key)

    # Every process cloned the same values; place them as the state's replicated ones.
    def place(new, old):
        new = np.asarray(new)
        return jax.make_array_from_callback(old.shape, old.sharding, lambda index: new[index])

    train = train._replace(params=jax.tree.map(place, cloned.params, train.params),
                           obs_stats=jax.tree.map(place, cloned.obs_stats, train.obs_stats))
    return train, {
        "bc_steps": data.bc_steps,
        "bc_demonstrations": int(len(demos.action)),
        "bc_log_likelihood": metrics["log_likelihood"],
        "bc_s": time.perf_counter() - start,
    }


def record_policy(data: DataConfig, arch: str, env_id: str, policy: Policy, seed: int) -> dict:
    """Record `data.record_episodes` episodes of `policy` into the new `data.record_dataset`.

    `arch` picks the environments the run trained on: "anakin" plays gymnax's
    `env_id` (jitted `make_recorder`), "sebulba" envpool's (`record_envpool`).
    Returns the summary's `dataset_dir`, `dataset_episodes`, `dataset_return_mean`.
    """
    if not data.record_dataset:
        return {}
    if arch not in ("anakin", "sebulba"):
        raise ValueError(f"arch must be 'anakin' or 'sebulba', got {arch!r}")
    spec = env_spec_of(arch, env_id)
    key = jax.random.fold_in(jax.random.PRNGKey(seed), 0xDA7A)
    metadata = {"env": env_id, "policy": policy.name, "deterministic": policy.deterministic,
                "seed": seed, "podracer_version": __version__}
    with DatasetWriter(data.record_dataset, step_spec_for_env(spec), metadata=metadata) as writer:
        if arch == "anakin":
            returns = _record_gymnax(writer, env_id, policy, data.record_episodes, key)
        else:
            returns = record_envpool(writer, env_id, policy, data.record_episodes, seed, key)
    return {"dataset_dir": data.record_dataset, "dataset_episodes": len(returns),
            "dataset_return_mean": float(np.mean(returns))}


def _record_gymnax(writer: DatasetWriter, env_id: str, policy: Policy, num_episodes: int,
                   key: jax.Array) -> list[float]:
    """`num_episodes` episodes in jitted chunks of `make_recorder`; returns their returns."""
    from podracer.envs.jax_envs import make_env

    params = parallel.to_host(policy.params)
    chunk = min(num_episodes, RECORD_CHUNK)
    record = jax.jit(make_recorder(make_env(env_id), policy.act_fn, chunk))
    returns = []
    for call in range(math.ceil(num_episodes / chunk)):
        episodes = unpad_episodes(record(params, jax.random.fold_in(key, call)))
        for episode in episodes[: num_episodes - writer.num_episodes]:
            writer.add_episode(episode[STEPS])
            returns.append(float(episode["episode_return"]))
    return returns


# What the orchestrator hands every run's session.
HOOKS = DatasetHooks(check=check_data_config, warm_start=warm_start_state, record=record_policy)
