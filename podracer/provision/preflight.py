"""The training flags, checked on this machine before a slice is paid for.

Every worker runs `python launch/tpu.py <training flags> --run-dir=RUN_DIR`,
joined to the others by `--coordinator`, `--num-processes` and `--process-id`.
A mistake in those flags would fail on every worker only after the slice is
up and billed, so they go through the trainer's own parser first
(`podracer.orchestrate.parse.parse`: unknown flags, ranges, flags the pair does
not use, `--wandb` without its package), and the environment id through the
check the trainer makes before it builds anything.

The provisioner's flags are a fixed set; every other flag is a training flag.
A flag that is neither gets one line with the closest name from both sets, so
`--zonee=us-central2-b` is told `did you mean --zone (a provisioner flag)?`
rather than being handed to the workers.
"""

from __future__ import annotations

import difflib
from typing import Iterable, Sequence

from podracer.errors import PodracerError
from podracer.provision.slices import SliceShape
from podracer.orchestrate.spec import RunSpec

# What the slice decides for itself: every worker is one process of the run;
# the worker program joins them (`podracer.provision.worker`).
SET_BY_THE_SLICE = ("--distributed", "--num-processes", "--coordinator", "--process-id")


def _name(arg: str) -> str:
    return arg.split("=", 1)[0]


def suggestion(flag: str, provisioner_flags: Iterable[str],
               training_flags: Iterable[str] = ()) -> str:
    """`; did you mean --zone (a provisioner flag)?` for the closest known flag, or ""."""
    owner = {name: "a training flag" for name in training_flags}
    owner.update({name: "a provisioner flag" for name in provisioner_flags})
    close = difflib.get_close_matches(_name(flag), list(owner), n=1, cutoff=0.6)
    return f"; did you mean {close[0]} ({owner[close[0]]})?" if close else ""


def unknown_flag(flag: str, provisioner_flags: Iterable[str],
                 training_flags: Iterable[str] = ()) -> str:
    """`unknown flag --zonee; did you mean --zone (a provisioner flag)?`, one line."""
    hint = suggestion(flag, provisioner_flags, training_flags)
    if hint:
        return f"unknown flag {_name(flag)}{hint}"
    return (f"unknown flag {_name(flag)}, neither a provisioner flag nor a training flag; see "
            "`python launch/tpu.py up --help` and `python launch/tpu.py --help`")


def training_flag_names(training_flags: Sequence[str]) -> list[str]:
    """Every `--flag` the trainer's parser knows (its `--help` for the same --arch/--algo/--env)."""
    from podracer.orchestrate.parse import build_parser

    parser = build_parser(list(training_flags))
    return [option for action in parser._actions for option in action.option_strings
            if option.startswith("--")]


def check_training_flags(training_flags: Sequence[str], provisioner_flags: Iterable[str]) -> None:
    """Raises `PodracerError` (one line) for anything the workers' trainer would refuse."""
    from podracer.orchestrate.parse import parse

    known = training_flag_names(training_flags)
    for arg in training_flags:
        if arg.startswith("--") and _name(arg) not in known:
            raise PodracerError(unknown_flag(arg, provisioner_flags, known))
        if _name(arg) in SET_BY_THE_SLICE:
            raise PodracerError(f"{_name(arg)} is set by the slice (every worker is one process "
                                "of the run, joined to the others by the worker); drop it")
    run = parse(training_flags).configs.run
    check_env(run.arch, run.env)


def check_env(arch: str, env: str) -> None:
    """The environment id is one the architecture can run, as the trainer checks it."""
    if arch == "anakin":
        from podracer.envs.jax_envs import make_env

        make_env(env)
    else:
        from podracer.sebulba.envs import env_spec

        env_spec(env)


def check_layout(training_flags: Sequence[str], shape: SliceShape) -> None:
    """The run's layout on the slice's hosts and devices, as the workers' trainer will check it.

    Sebulba: every host's actor/learner split and the environment (or ES member)
    counts over every actor thread of every host. Anakin: the environments, ES
    members or a population's agents over every device of the slice. Refused in
    one line that names the slice and the fix, before anything is paid for.
    """
    from podracer.orchestrate.parse import parse

    configs = parse(training_flags).configs
    try:
        _check_layout(configs, shape)
    except PodracerError as error:
        raise PodracerError(f"on {shape.describe()}: {error}") from None


def _check_layout(configs: RunSpec, shape: SliceShape) -> None:
    from podracer import population

    run = configs.run
    recurrent = configs.network.network != "mlp"
    if run.arch == "sebulba":
        from podracer.sebulba.config import make_layout, split_devices

        # Only the number of each host's devices matters here, not the devices.
        split = split_devices(configs.sebulba, list(range(shape.devices_per_host)))
        if run.algo == "es":
            from podracer.sebulba.train_es import make_es_layout

            make_es_layout(configs.agent, configs.sebulba, split, shape.hosts)
        else:
            make_layout(configs.sebulba, configs.agent, split, shape.hosts, recurrent)
    elif run.algo == "es":
        from podracer.es.agent import members_per_device

        members_per_device(configs.agent, shape.devices)
    else:
        from podracer.anakin.loop import make_layout as anakin_layout

        sharded = population.check_agents(len(population.agents(configs)), shape.devices)
        anakin_layout(configs.anakin, configs.agent, shape.devices, recurrent, sharded)
