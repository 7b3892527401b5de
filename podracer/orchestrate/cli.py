"""Training from the command line: parse, join the processes, say what will run, dispatch to a pair.

`podracer.command` hands it every command that is not `eval` or the TPU's.

Nothing below this package reads `sys.argv` or the environment.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from typing import Callable, Sequence

from podracer import config as run_config
from podracer.algorithms import ALGORITHMS
from podracer import population
from podracer.errors import Interrupted, PodracerError
from podracer.orchestrate.flags import flag_name
from podracer.orchestrate import preflight
from podracer.orchestrate.parse import Parsed, config_text, parse, parse_configs, triple
from podracer.orchestrate.plan import rounding_note
from podracer import storage
from podracer.session import heartbeat, lock, signals, startup
from podracer.session.checkpoint import check_resumable, config_record
from podracer.session.run_dir import (RunDirState, agreed_checkpoint_steps, disk_full_is_one_line,
                                      finished_message, finished_summary, link_latest, prepare_run_dir,
                                      unlink_new_run)
from podracer.orchestrate.spec import RunSpec

__all__ = ["main", "parse", "parse_configs", "run", "train"]


def run(argv: Sequence[str], parsed: Parsed | None = None, started: float | None = None) -> dict:
    """Parse, configure JAX's devices, and run; returns the run's summary.

    `started` (seconds since the epoch; default: now) is where the summary's
    `time_to_first_step_s` counts from: the process's start, from the command line.
    """
    startup.begin(time.time() if started is None else started)
    parsed = parsed or parse(argv)
    configs = parsed.configs
    run_cfg: run_config.RunConfig = configs.run
    storage.check(run_cfg.run_dir)  # gs:// needs its optional dependency: say so before anything starts
    # Library chatter (orbax logs through absl) would break the one-line error
    # contract; everything a user must see is reported by podracer itself.
    logging.getLogger("absl").setLevel(logging.CRITICAL)
    trainer = _trainer(run_cfg.arch, run_cfg.algo)
    one_process = not configs.distributed.coordinator and configs.distributed.distributed == "off"
    split = process_wide_jax_settings(run_cfg, default_cpu_devices(configs, usable_cores())
                                      if one_process else 1)
    from podracer.orchestrate import distributed as orchestrate

    orchestrate.initialize(configs.distributed)
    configs = configs.replace(run=_agreed_run_dir(run_cfg, "run_dir" not in parsed.given))
    parsed = parsed._replace(configs=configs)
    run_dir = configs.run.run_dir
    state = _run_dir_state(configs)
    main_process = _is_main_process()
    if state.finished:
        summary = finished_summary(run_dir)
        if main_process:
            print(finished_message(run_dir, state), flush=True)
        return summary
    _check_env(configs.run)
    preflight.check(configs, main_process)
    signals.set_stop_timeout(configs.checkpoint.stop_timeout_s)
    if state.resumes:
        signals.set_nothing_saved(
            f"the checkpoint at env step {state.checkpoint_steps:,} in {run_dir} is untouched")
    new_dir = not state.resumes and not storage.exists(run_dir)
    # One writer per run directory, taken before anything is written there.
    held = lock.acquire(run_dir) if main_process else None
    signals.release_before_exit(held.release if held else None)
    previous_latest = None
    if "run_dir" not in parsed.given and main_process:
        prepare_run_dir(run_dir)
        previous_latest = link_latest(run_dir)
    if main_process:
        print(first_line(parsed, state, split), flush=True)
        heartbeat.begin(f"compiling {_what_compiles(configs)}")  # ended when training starts
    from podracer.data.train_hooks import HOOKS
    from podracer.session.session import handing

    try:
        with handing(HOOKS), disk_full_is_one_line(run_dir):
            summary, _ = trainer(configs)
    except PodracerError:
        if new_dir and main_process:  # refused while building: leave no empty run behind
            held.release()
            unlink_new_run(run_dir, previous_latest)
        raise
    finally:
        heartbeat.end()
        signals.release_before_exit(None)
        if held:
            held.release()
    return summary


def _what_compiles(configs: RunSpec) -> str:
    run = configs.run
    agents = (f", {len(population.agents(configs))} agents in one program"
              if population.is_population(configs) else "")
    return f"the training program of {run.arch} {run.algo} on {run.env}{agents}"


def first_line(parsed: Parsed, state: RunDirState, cpu_split: int = 0) -> str:
    """What will run: the pair, the devices, the run directory, fresh or resumed, non-defaults.

    `cpu_split`: the CPU devices `default_cpu_devices` gave the run (0: none), said with why.
    """
    import jax

    run_cfg = parsed.configs.run
    devices = jax.devices()
    processes = f" over {jax.process_count()} processes" if jax.process_count() > 1 else ""
    where = (f"resuming {run_cfg.run_dir} from env step {state.checkpoint_steps:,}" if state.resumes
             else f"new run in {run_cfg.run_dir}")
    rounded = rounding_note(parsed.configs)
    where += f"; {rounded}" if rounded else ""
    changed = parsed.differences()
    settings = f"; not defaults: {' '.join(changed)}" if changed else "; default settings"
    why = (f" (one per core, each running its share of the {_split_units(parsed.configs)}; "
           f"--cpu-devices=1 keeps one)" if cpu_split > 1 and devices[0].platform == "cpu" else "")
    return (f"podracer {run_cfg.arch} {run_cfg.algo} on {run_cfg.env}, {len(devices)} "
            f"{devices[0].platform} device{'s' if len(devices) > 1 else ''}{why}{processes}; "
            f"{where}{settings}")


def default_cpu_devices(configs: RunSpec, cores: int) -> int:
    """CPU devices for a one-process run without `--cpu-devices`, on a machine with `cores` CPUs.

    One per core, up to the largest count that splits the run into independent
    shares: a population's agents (Anakin PPO or IMPALA), or an ES generation's
    antithetic pairs (Anakin ES); 1 otherwise. XLA:CPU runs a program's many
    small kernels mostly one at a time, so on two cores one device training 16
    CartPole agents in a vmap kept about 1.4 cores busy (195-218k aggregate
    steps/s); as two devices of 8 agents, the halves run side by side with no
    collective between them (379-456k, 2 cores busy). One agent's environments stay on one
    device: split, its gradients are averaged every minibatch, which took 3x
    as long on two CPU devices. Only the CPU backend is split; an accelerator's
    devices are what they are.
    """
    run = configs.run
    if run.arch != "anakin":
        return 1
    if run.algo == "es":
        units = configs.agent.population // 2
    elif population.is_population(configs):
        units = len(population.agents(configs))
    else:
        return 1
    return max(n for n in range(1, max(cores, 1) + 1) if units % n == 0)


def usable_cores() -> int:
    """CPUs this process may run on (its affinity where the OS has one, as on Linux; else all)."""
    affinity = getattr(os, "sched_getaffinity", None)  # absent on macOS and Windows
    return len(affinity(0)) if affinity else os.cpu_count() or 1


def _split_units(configs: RunSpec) -> str:
    return "generation's member pairs" if configs.run.algo == "es" else "population's agents"


def process_wide_jax_settings(run_cfg: run_config.RunConfig, cpu_devices_by_default: int = 1) -> int:
    """JAX settings for the whole process, made here and only here, before its backend starts.

    `--compile-cache` (or its default) points JAX's persistent compilation
    cache at a directory (`podracer.orchestrate.compile_cache`). `--cpu-devices`
    splits the CPU into that many devices; without it, into
    `cpu_devices_by_default` (`default_cpu_devices`) where nothing else chose a
    count first (`jax_num_cpu_devices`, XLA_FLAGS' host device count, a backend
    already started); returns the count it set so (0: none). Sebulba executes
    CPU computations on the thread that calls them (`jax_cpu_enable_async_dispatch` off): every
    Sebulba thread waits for its own computation at once (an actor needs its
    actions, the learner its metrics), so handing each small policy call to
    XLA's worker threads only adds a thread wake-up per environment step; on a
    2-core CPU, inline execution measured 15-35% more steps/s.
    """
    import jax

    from podracer.orchestrate import compile_cache

    path, origin = compile_cache.resolve(run_cfg.compile_cache, run_cfg.run_dir, os.environ)
    compile_cache.configure(compile_cache.prepare(path, origin))
    if run_cfg.arch == "sebulba":
        jax.config.update("jax_cpu_enable_async_dispatch", False)
    if run_cfg.cpu_devices:
        jax.config.update("jax_num_cpu_devices", run_cfg.cpu_devices)
        return 0
    chosen_elsewhere = (jax.config.jax_num_cpu_devices != -1
                        or "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""))
    if cpu_devices_by_default <= 1 or chosen_elsewhere:
        return 0
    try:
        jax.config.update("jax_num_cpu_devices", cpu_devices_by_default)
    except RuntimeError:  # JAX's backend is running already (a notebook, a test process): keep its devices
        return 0
    return cpu_devices_by_default


def _agreed_run_dir(run_cfg: run_config.RunConfig, named_here: bool) -> run_config.RunConfig:
    """On several processes, every process takes process 0's new run directory."""
    import jax

    if not named_here or jax.process_count() == 1:
        return run_cfg
    import numpy as np
    from jax.experimental import multihost_utils

    name = np.frombuffer(run_cfg.run_dir.encode().ljust(1024, b"\0"), np.uint8)
    agreed = multihost_utils.broadcast_one_to_all(name)
    return dataclasses.replace(run_cfg, run_dir=bytes(np.asarray(agreed)).rstrip(b"\0").decode())


def _run_dir_state(configs: RunSpec) -> RunDirState:
    """New, resumable (its config checked) or finished; refuses a checkpoint of another config.

    Process 0 decides for every process (`agreed_checkpoint_steps`): the
    processes cannot disagree on resuming or starting, nor on the step.
    """
    run_cfg = configs.run
    steps = agreed_checkpoint_steps(run_cfg.run_dir)
    if steps is not None:
        check_resumable(run_cfg.run_dir, steps, configs.checkpoint, config_record(configs.recorded()))
    return RunDirState(steps, run_cfg.total_steps)


def _check_env(run_cfg: run_config.RunConfig) -> None:
    """An environment id the architecture cannot run, or whose actions the algorithm cannot take, is
    refused before anything is built."""
    if run_cfg.arch == "anakin":
        from podracer.envs.jax_envs import make_env

        spec = make_env(run_cfg.env).spec
    else:
        from podracer.sebulba.envs import env_spec

        spec = env_spec(run_cfg.env)
    if run_cfg.algo in ALGORITHMS:
        ALGORITHMS[run_cfg.algo].check_env(spec, run_cfg.env)


def _is_main_process() -> bool:
    import jax

    return jax.process_index() == 0


def train(**flags) -> dict:
    """Train from Python with the launcher's flags as keywords; returns the summary.

        podracer.train(arch="anakin", algo="ppo", env="CartPole-v1", total_steps=100_000)

    Presets, validation and outputs are exactly those of `python launch/tpu.py`.
    """
    argv = []
    for name, value in flags.items():
        flag = flag_name(name)
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, (tuple, list)):
            argv += [flag, *map(str, value)]
        else:
            argv.append(f"{flag}={value}")
    return run(argv)


def _trainer(arch: str, algo: str):
    """`train(configs) -> (summary, final state)` for an architecture and algorithm."""
    if arch == "anakin" and algo in ALGORITHMS:
        from podracer.anakin.train import train_agent

        return train_agent
    if arch == "sebulba" and algo in ALGORITHMS and "sebulba" in ALGORITHMS[algo].archs:
        from podracer.sebulba.train import train_agent

        return train_agent
    if (arch, algo) == ("anakin", "es"):
        from podracer.anakin.train_es import train_es

        return train_es
    if (arch, algo) == ("sebulba", "es"):
        from podracer.sebulba.train_es import train_es

        return train_es
    runs_on = [name for name, entry in ALGORITHMS.items() if arch in entry.archs] + ["es"]
    raise PodracerError(f"--arch={arch} --algo={algo} is not available; use --algo="
                        f"{' or --algo='.join(runs_on)} with --arch={arch}, or --arch=anakin")


def main(argv: Sequence[str] | None = None) -> int:
    """Train: exit status 0, or 2 with one line on stderr for a user error.

    Without `argv`, the process's own command line: the run's start-up is
    counted from the process's start. (`podracer.command.main` hands the
    other verbs, `eval` and the TPU's, to their own commands.)
    """
    entry = argv is None
    argv = sys.argv[1:] if entry else list(argv)
    status = exit_status(lambda: _train(argv, entry))
    late = signals.late_signal()
    if status == 0 and late:
        print(f"stopped by signal {late} while the results were written; they are complete",
              file=sys.stderr)
        return 128 + late
    return status


def exit_status(command: Callable[[], int]) -> int:
    """`command()`'s exit status; a user error, a stop or Ctrl-C is one line on stderr and its status."""
    try:
        return command()
    except PodracerError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    except Interrupted as stop:
        print(f"{stop}", file=sys.stderr)
        return stop.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _train(argv: list[str], entry: bool) -> int:
    if {"-h", "--help"} & set(argv) and any(a == "--env" or a.startswith("--env=") for a in argv):
        arch, _, env = triple(argv)  # help shows that environment's defaults: it must be one
        if arch in run_config.ARCHS:
            _check_env(run_config.RunConfig(arch=arch, env=env))
    parsed = parse(argv)
    if parsed.print_config:
        print(config_text(parsed))
        return 0
    distributed = parsed.configs.distributed
    if distributed.spawns:
        from podracer.orchestrate import distributed as orchestrate

        # Every process writes to the same run directory: name it once, here.
        named = [a for a in argv if not (a == "--print-config")]
        if "run_dir" not in parsed.given:
            named.append(f"--run-dir={parsed.configs.run.run_dir}")
        return orchestrate.spawn_local(named, distributed.num_processes)
    # Until training starts a signal ends the run at once (compilation cannot be
    # interrupted from Python); then the training loop saves and stops.
    with signals.exit_at_once_until_training():
        run(argv, parsed, started=startup.process_start_time() if entry else None)
    return 0
