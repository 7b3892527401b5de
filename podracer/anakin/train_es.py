"""Host driver for Anakin ES: build, restore, compile, call, log, checkpoint."""

from __future__ import annotations

import math
import signal
import time
from typing import Any

import jax
import numpy as np

from podracer.protocol import parallel
from podracer.anakin.env import make_env
from podracer.anakin.es import make_anakin_es, make_anakin_es_phases, make_es_layout
from podracer.anakin.profiled import NOTE, compile_es_phases, make_profiled_es_step
from podracer.session.checkpoint import Checkpointer, check_resumable, config_record, stop_on_signals
from podracer.config import LogConfig, used_configs
from podracer.errors import Interrupted
from podracer.session.logger import RunLogger, start_wandb
from podracer.networks import make_policy_network
from podracer.session.run_dir import prepare_run_dir
from podracer.session.profile import make_profiler, no_measure


def es_row(metrics) -> dict:
    """One call's ES metrics (stacked over its generations) as one log row."""
    metrics = parallel.to_host(metrics)
    row = {"mean_params_return": float(metrics.pop("mean_params_return"))}
    row["episode_return_mean"] = float(np.mean(metrics["fitness_mean"]))
    row["episode_return_max"] = float(np.max(metrics.pop("fitness_max")))
    row["episode_return_min"] = float(np.min(metrics.pop("fitness_min")))
    row.update({key: float(np.mean(value)) for key, value in metrics.items()})
    return row


def build(configs: dict[str, Any], devices=None, profile: bool = False):
    """Environment, sizes, the jitted `init`/`step` and, to profile, the step's phases."""
    run, es_config, net = configs["run"], configs["es"], configs["network"]
    env = make_env(run.env)
    mesh = parallel.make_mesh(devices)
    layout = make_es_layout(es_config, env, mesh)
    steps_per_call = layout.steps_per_generation * es_config.generations_per_call
    num_calls = max(1, math.ceil(run.total_steps / steps_per_call))
    policy = make_policy_network(env.spec.obs_shape, env.spec.action_dim, env.spec.discrete,
                                 net.hidden, net.activation)
    init, step = make_anakin_es(env, policy, es_config, mesh)
    phases = make_anakin_es_phases(env, policy, es_config, mesh) if profile else None
    return layout, steps_per_call, num_calls, init, step, phases


def train_es(configs: dict[str, Any], devices=None):
    """Train a policy with evolution strategies on Anakin; returns (summary, final runner).

    `configs` maps section names to config dataclasses (`run`, `es`, `network`,
    `checkpoint`, `logging`), as `podracer.orchestrate.cli.parse_configs` returns them. A run
    directory with a checkpoint resumes from it.

    `env_steps` counts the steps the population simulates (`population *
    episodes_per_member * horizon` per generation, steps after an episode's end
    included: they are computed and masked); the evaluation episodes of the mean
    parameters are extra and not counted. `episode_return_mean` is the mean
    fitness of the population over the call's generations, `mean_params_return`
    the return of the mean parameters after the call. With `--profile`, the
    step's phases run as separate programs, timed apart
    (`podracer.anakin.profiled`), and the summary gets the time breakdown.
    """
    wall_start = time.perf_counter()
    run, es_config = configs["run"], configs["es"]
    resuming = check_resumable(run.run_dir, configs["checkpoint"], configs)
    profiler = make_profiler(configs.get("logging", LogConfig()), run.run_dir)
    layout, steps_per_call, num_calls, init, step, phases = build(configs, devices,
                                                                  profile=profiler is not None)
    measure = profiler.measure if profiler else no_measure
    prepare_run_dir(run.run_dir)
    checkpointer = Checkpointer(run.run_dir, configs["checkpoint"], configs)

    runner = init(jax.random.PRNGKey(run.seed))
    start_call = 0
    if resuming:
        runner, meta = checkpointer.restore(runner)
        start_call = int(meta["calls"])
    compile_start = time.perf_counter()
    if profiler:
        step = make_profiled_es_step(compile_es_phases(phases, runner), measure)
    else:
        step = step.lower(runner).compile()
    compile_s = time.perf_counter() - compile_start

    every = configs["checkpoint"].checkpoint_every
    save_every_calls = math.ceil(every / steps_per_call) if every else 0
    main_process = parallel.is_main_process()
    logger = RunLogger(run.run_dir, num_calls * steps_per_call, enabled=main_process,
                       resume_steps=start_call * steps_per_call,
                       wandb_run=start_wandb(configs) if main_process else None)
    logger.compiled(compile_s)
    last_row: dict = {}
    if profiler:
        profiler.start()
    train_start = time.perf_counter()

    def record(call: int, metrics) -> None:
        row = es_row(metrics)
        done = call + 1 - start_call
        elapsed = time.perf_counter() - train_start
        generations = (call + 1) * es_config.generations_per_call
        row.update(env_steps=(call + 1) * steps_per_call, generations=generations,
                   sps=done * steps_per_call / elapsed,
                   generations_per_s=done * es_config.generations_per_call / elapsed)
        logger.log(row)
        last_row.update(row)

    try:
        with stop_on_signals() as stop:
            pending, stopping, call = None, False, start_call - 1
            for call in range(start_call, num_calls):
                runner, metrics = step(runner)  # dispatched: the host logs while it runs
                if pending is not None:
                    with measure("logging"):
                        record(*pending)
                pending = (call, metrics)
                last = call + 1 == num_calls
                stopping = parallel.any_process(bool(stop))  # every process stops at the same call
                if last or stopping or (save_every_calls and (call + 1) % save_every_calls == 0):
                    with measure("logging"):
                        record(*pending)
                    pending = None
                    with measure("checkpoint"):
                        checkpointer.save((call + 1) * steps_per_call, runner, {"calls": call + 1})
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
    new_calls = done_calls - start_call
    summary = logger.summary({
        "arch": "anakin", "algo": "es", "variant": es_config.variant, "env": run.env,
        "env_steps": done_calls * steps_per_call,
        "sps": new_calls * steps_per_call / train_s if train_s > 0 and new_calls else None,
        "episode_return_mean": last_row.get("episode_return_mean"),
        "mean_params_return": last_row.get("mean_params_return"),
        "generations": done_calls * es_config.generations_per_call,
        "generations_per_s": (new_calls * es_config.generations_per_call / train_s
                              if train_s > 0 and new_calls else None),
        "population": es_config.population,
        "horizon": layout.horizon,
        "num_params": int(runner.strategy.mean.shape[0]),
        "devices": layout.num_devices,
        "compile_s": compile_s,
        "train_s": train_s,
        "resumed_from_env_steps": start_call * steps_per_call if resuming else None,
        "processes": jax.process_count(),
        # Every process must hold the same mean parameters; one hash per process proves it.
        "params_fingerprints": parallel.process_fingerprints(runner.strategy.mean),
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
