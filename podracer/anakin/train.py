"""Host driver for Anakin PPO: build, restore, compile, call, log, checkpoint."""

from __future__ import annotations

import math
import signal
import time
from typing import Any

import jax
import numpy as np

from podracer.protocol import parallel
from podracer.anakin.env import make_env
from podracer.anakin.loop import make_anakin, make_anakin_phases, make_layout
from podracer.anakin.profiled import NOTE, compile_ppo_phases, make_profiled_ppo_train
from podracer.session.checkpoint import Checkpointer, check_resumable, config_record, stop_on_signals
from podracer.config import LogConfig, make_optimizer, used_configs
from podracer.data.config import DataConfig
from podracer.data.train_hooks import check_data_config, record_trained_policy, warm_start
from podracer.errors import Interrupted, PodracerError
from podracer.session.logger import RunLogger, start_wandb
from podracer.networks import make_network
from podracer.session.run_dir import prepare_run_dir
from podracer.session.profile import make_profiler, no_measure


def _interval_metrics(metrics) -> dict:
    """Reduce one call's stacked per-update metrics to one log row."""
    metrics = parallel.to_host(metrics)
    episodes = int(np.sum(metrics.pop("episodes")))
    return_sum = float(np.sum(metrics.pop("episode_return_sum")))
    length_sum = float(np.sum(metrics.pop("episode_length_sum")))
    finite = bool(np.all(metrics.pop("params_finite"))) and all(
        np.all(np.isfinite(value)) for value in metrics.values())
    row = {key: float(np.mean(value)) for key, value in metrics.items()}
    row["episodes"] = episodes
    row["episode_return_mean"] = return_sum / episodes if episodes else None
    row["episode_length_mean"] = length_sum / episodes if episodes else None
    row["finite"] = finite
    return row


def build(configs: dict[str, Any], devices=None, profile: bool = False):
    """Environment, mesh, sizes, network, the jitted `init`/`train` and, to profile, its phases."""
    run, ppo_config, anakin = configs["run"], configs["ppo"], configs["anakin"]
    env = make_env(run.env)
    mesh = parallel.make_mesh(devices)
    layout = make_layout(anakin, ppo_config, mesh)
    steps_per_call = layout.steps_per_update * anakin.updates_per_call
    num_calls = max(1, math.ceil(run.total_steps / steps_per_call))
    net = configs["network"]
    network = make_network(env.spec.obs_shape, env.spec.action_dim, env.spec.discrete,
                           net.hidden, net.activation)
    num_updates = num_calls * anakin.updates_per_call
    optimizer = make_optimizer(configs["optimizer"],
                               num_updates * ppo_config.epochs * ppo_config.minibatches)
    init, train = make_anakin(env, network, optimizer, ppo_config, anakin, mesh)
    phases = make_anakin_phases(env, network, optimizer, ppo_config, anakin, mesh) if profile else None
    return env, network, layout, steps_per_call, num_calls, init, train, phases


def train_ppo(configs: dict[str, Any], devices=None):
    """Train PPO with Anakin on `devices` (default: all); returns (summary, final runner).

    `configs` maps section names to config dataclasses, as `podracer.orchestrate.cli.parse_configs`
    returns them. A run directory with a checkpoint resumes from it. The `data`
    section can clone the initial policy from a dataset (not when resuming) and
    record the trained policy into a new one (`podracer.data.train_hooks`).
    With `--profile`, acting and learning run as two programs, timed apart
    (`podracer.anakin.profiled`), and the summary gets the time breakdown.
    """
    wall_start = time.perf_counter()
    run = configs["run"]
    data = configs.get("data", DataConfig())
    check_data_config(data, writes=parallel.is_main_process())
    resuming = check_resumable(run.run_dir, configs["checkpoint"], configs)
    profiler = make_profiler(configs.get("logging", LogConfig()), run.run_dir)
    env, network, layout, steps_per_call, num_calls, init, train, phases = build(
        configs, devices, profile=profiler is not None)
    measure = profiler.measure if profiler else no_measure
    prepare_run_dir(run.run_dir)
    checkpointer = Checkpointer(run.run_dir, configs["checkpoint"], configs)

    runner = init(jax.random.PRNGKey(run.seed))
    start_call, cloned = 0, {}
    if resuming:
        runner, meta = checkpointer.restore(runner)
        start_call = int(meta["calls"])
    else:  # a resumed run continues from its checkpoint, never from the dataset
        runner, cloned = warm_start(runner, data, env, network, configs["ppo"], run.seed)
    compile_start = time.perf_counter()
    if profiler:
        train = make_profiled_ppo_train(*compile_ppo_phases(*phases, runner),
                                        configs["anakin"].updates_per_call, measure)
    else:
        train = train.lower(runner).compile()
    compile_s = time.perf_counter() - compile_start

    every = configs["checkpoint"].checkpoint_every
    save_every_calls = math.ceil(every / steps_per_call) if every else 0
    main_process = parallel.is_main_process()
    logger = RunLogger(run.run_dir, num_calls * steps_per_call, enabled=main_process,
                       resume_steps=start_call * steps_per_call,
                       wandb_run=start_wandb(configs) if main_process else None)
    logger.compiled(compile_s)
    last_saved = start_call * steps_per_call if resuming else None
    if profiler:
        profiler.start()
    train_start = time.perf_counter()

    def record(call: int, metrics) -> None:
        row = _interval_metrics(metrics)
        env_steps = (call + 1) * steps_per_call
        if not row.pop("finite"):
            kept = "nothing was saved yet" if last_saved is None else \
                f"the last good checkpoint (env step {last_saved:,}) is kept"
            raise PodracerError(
                f"non-finite loss or parameters at update {(call + 1) * configs['anakin'].updates_per_call} "
                f"(env step {env_steps:,}); stopped, {kept}; lower --lr or --max-grad-norm")
        elapsed = time.perf_counter() - train_start
        row.update(env_steps=env_steps, sps=(call + 1 - start_call) * steps_per_call / elapsed)
        logger.log(row)

    try:
        with stop_on_signals() as stop:
            pending, stopping = None, False
            for call in range(start_call, num_calls):
                runner, metrics = train(runner)  # dispatched: the host logs while it runs
                if pending is not None:
                    with measure("logging"):
                        record(*pending)
                pending = (call, metrics)
                last = call + 1 == num_calls
                stopping = parallel.any_process(bool(stop))  # every process stops at the same call
                if last or stopping or (save_every_calls and (call + 1) % save_every_calls == 0):
                    with measure("logging"):
                        record(*pending)  # the NaN guard runs before anything is saved
                    pending = None
                    with measure("checkpoint"):
                        checkpointer.save((call + 1) * steps_per_call, runner, {"calls": call + 1})
                    last_saved = (call + 1) * steps_per_call
                if stopping:
                    break
            jax.block_until_ready(runner)
            train_s = time.perf_counter() - train_start
            profiled = {"profile": profiler.stop(NOTE)} if profiler else {}
    finally:
        # Whatever stopped the loop, a save already started is completed, never left half-written.
        checkpointer.wait()
        checkpointer.close()
    done_calls = call + 1 if num_calls > start_call else start_call
    recorded = {} if stopping or not parallel.is_main_process() else record_trained_policy(
        runner.train, data, env, network, configs["ppo"], run.seed)
    summary = logger.summary({
        "arch": "anakin", "algo": "ppo", "env": run.env,
        "env_steps": done_calls * steps_per_call,
        "sps": (done_calls - start_call) * steps_per_call / train_s if train_s > 0 else None,
        "episode_return_mean": logger.last_return,
        "updates": done_calls * configs["anakin"].updates_per_call,
        "devices": layout.num_devices,
        "compile_s": compile_s,
        "train_s": train_s,
        "resumed_from_env_steps": start_call * steps_per_call if resuming else None,
        "processes": jax.process_count(),
        # Every process must hold the same parameters; one hash per process proves it.
        "params_fingerprints": parallel.process_fingerprints(runner.train.params),
        **cloned, **recorded,
        "wall_s": time.perf_counter() - wall_start,
        **profiled,
        "config": config_record(used_configs(configs)),
    })
    if stopping:
        signum = stop.signal or signal.SIGTERM  # another process may have received it
        raise Interrupted(signum, f"stopped by signal {signum} at env step "
                                       f"{done_calls * steps_per_call:,}; checkpoint saved, "
                                       f"resume with --run-dir={run.run_dir}")
    return summary, runner
