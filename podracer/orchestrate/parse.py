"""The training command line: flags onto one config per section, checked before anything runs.

Precedence: dataclass default < preset for the (arch, algo, env) triple < flag
given on the command line. Everything that needs no devices and no
compilation is checked here: ranges, flags the (arch, algo) pair does not read,
`--wandb` without its package.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import time
from typing import Any, NamedTuple, Sequence

from podracer import config as run_config
from podracer.algorithms import ALGORITHMS
from podracer.errors import PodracerError
from podracer.orchestrate.flags import Parser, add_fields, flag_name, shown
from podracer.orchestrate.spec import ALGORITHM_SECTIONS, SECTIONS, RunSpec
from podracer import population
from podracer.presets import preset_for
from podracer.version import __version__
from podracer.session.checkpoint import config_record
from podracer.session.run_dir import new_run_name



def triple(argv: Sequence[str]) -> tuple[str, str, str]:
    """--arch, --algo and --env as given (else their defaults), before the full parse."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    defaults = run_config.RunConfig()
    for name in ("arch", "algo", "env"):
        parser.add_argument(flag_name(name), dest=name, default=getattr(defaults, name))
    known, _ = parser.parse_known_args(list(argv))
    return known.arch, known.algo, known.env


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The training parser; its help shows the defaults of the triple `argv` names."""
    arch, algo, env = triple(argv)
    parser = Parser(
        prog="podracer",
        description="Train with podracer (also: python launch/tpu.py). Runs on every device JAX "
                    "sees (all TPU cores of a TPU VM, forced CPU devices with --cpu-devices). "
                    "Defaults below are those of the --arch/--algo/--env given (a preset per "
                    "triple). Verbs: eval (score a run's policy), plot (draw runs' curves), "
                    "up/status/logs/attach/down/list (TPU slices; see the docs' TPU page).",
        allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"podracer {__version__}")
    parser.add_argument("--print-config", action="store_true", default=None,
                        help="print the resolved settings (defaults, preset and flags) and exit")
    add_fields(parser, SECTIONS, preset_for(arch, algo, env), (arch, algo),
                f"--arch={arch} --algo={algo} --env={env}")
    return parser


class Parsed(NamedTuple):
    """A command line, resolved: one config per section, and where each value came from."""

    configs: RunSpec
    given: dict[str, Any]  # flags on the command line, by field name
    preset: dict[str, Any]  # the triple's preset
    print_config: bool

    @property
    def pair(self) -> tuple[str, str]:
        return self.configs.run.arch, self.configs.run.algo

    def used(self) -> dict[str, Any]:
        """The sections the pair reads, in order."""
        return self.configs.used()

    def differences(self) -> list[str]:
        """`--flag=value (given|preset)` for each setting the pair reads that is not its default."""
        ignored = run_config.IGNORES.get(self.pair, {})
        out = []
        for section, cfg in self.used().items():
            for field in dataclasses.fields(cfg):
                value = getattr(cfg, field.name)
                if field.name in ignored or field.name in ("arch", "algo", "env", "run_dir") \
                        or value == field.default:
                    continue
                origin = ("given" if field.name in self.given else "preset" if field.name in self.preset
                          else "from the run")  # an algorithm's `settle`
                out.append(f"{flag_name(field.name)}={shown(value)} ({origin})")
        return list(dict.fromkeys(out))  # a flag shared by two sections once


def parse(argv: Sequence[str]) -> Parsed:
    """Parse and check `argv` (everything that needs no devices and no compilation)."""
    args = vars(build_parser(argv).parse_args(list(argv)))
    print_config = bool(args.pop("print_config"))
    given = {name: value for name, value in args.items() if value is not None}
    run_fields = {**{f.name: f.default for f in dataclasses.fields(run_config.RunConfig)}, **given}
    pair = (run_fields["arch"], run_fields["algo"])
    if pair[1] in ALGORITHMS and pair[0] not in ALGORITHMS[pair[1]].archs:
        archs = " or ".join(f"--arch={arch}" for arch in ALGORITHMS[pair[1]].archs)
        raise PodracerError(f"--algo={pair[1]} runs on {archs}, not --arch={pair[0]}; use {archs}")
    _refuse_unused(given, pair)
    chosen = preset_for(run_fields["arch"], run_fields["algo"], run_fields["env"])
    values = {**chosen, **given}
    if not values.get("run_dir"):
        values["run_dir"] = new_run_name(*pair, run_fields["env"], time.time())
    sections = {}
    for section, cls in SECTIONS.items():
        if section != pair[1] and section in ALGORITHM_SECTIONS:
            continue  # another algorithm's: every flag given for it was refused above
        names = {field.name for field in dataclasses.fields(cls)}
        kwargs = {name: (tuple(value) if isinstance(value, list) else value)
                  for name, value in values.items() if name in names}
        try:
            sections[section] = cls(**kwargs)
        except ValueError as err:
            raise PodracerError(str(err)) from None
    configs = RunSpec(**{("agent" if name == pair[1] else name): cfg for name, cfg in sections.items()})
    _refuse_recurrent(configs)
    algo = ALGORITHMS.get(configs.run.algo)
    if algo is not None and algo.settle is not None:
        configs = configs.replace(agent=algo.settle(configs))
    population.agents(configs)  # a bad --sweep is one line, before anything runs
    if configs.population.sweep_as_given and not configs.population.sweep:
        raise PodracerError("--sweep-as-given pairs the values of --sweep lists, and none is given; "
                            "add --sweep NAME=V1,V2,... or drop --sweep-as-given")
    tuning = [name for name in ("pbt_interval", "pbt_fraction", "pbt_perturb", "pbt_resample") if name in given]
    if tuning and not configs.population.pbt:
        raise PodracerError(f"{flag_name(tuning[0])} tunes population-based training, which is off; "
                            f"add --pbt or drop it")
    if configs.population.pbt and configs.logging.profile:
        raise PodracerError("--profile times acting and learning as separate programs, which have no "
                            "place for --pbt's ranking; profile the population without --pbt")
    data = configs.data
    if population.is_population(configs) and (data.record_dataset or data.init_from_dataset):
        flag = "--record-dataset" if data.record_dataset else "--init-from-dataset"
        raise PodracerError(f"{flag} works with one agent, not a population (--num-seeds, --sweep); "
                            f"record one agent's policy from a run of its own")
    if configs.logging.wandb and importlib.util.find_spec("wandb") is None:
        raise PodracerError("--wandb needs the wandb package; pip install wandb, or drop --wandb")
    return Parsed(configs, given, chosen, print_config)


def _refuse_unused(given: dict[str, Any], pair: tuple[str, str]) -> None:
    """A flag the (arch, algo) pair would ignore is an error, never a silent no-op."""
    ignored = run_config.IGNORES.get(pair, {})
    for name in given:
        sections = [section for section, cls in SECTIONS.items()
                    if name in {field.name for field in dataclasses.fields(cls)}]
        if sections == ["population"] and pair[0] == "sebulba":
            raise PodracerError(f"{flag_name(name)}: populations train on --arch=anakin only (Sebulba's actor "
                                f"threads and envpool batches act for one learner's policy; start one "
                                f"Sebulba run per seed); drop it or use --arch=anakin")
        if not any(section in run_config.USES[pair] for section in sections):
            article = "an" if sections[0][0] in "aeiou" else "a"
            raise PodracerError(f"{flag_name(name)} is {article} {sections[0]} setting, which --arch={pair[0]} "
                                f"--algo={pair[1]} does not use; drop it")
        if name in ignored:
            raise PodracerError(f"{flag_name(name)} does not apply to --arch={pair[0]} --algo={pair[1]} "
                                f"({ignored[name]}); drop it")


def _refuse_recurrent(configs: RunSpec) -> None:
    """A recurrent network trains with PPO, and records or clones no datasets (their policies are feed-forward)."""
    network, algo, data = configs.network.network, configs.run.algo, configs.data
    if network == "mlp":
        return
    if algo != "ppo":
        raise PodracerError(f"--network={network} trains with --algo=ppo only; use --network=mlp with "
                            f"--algo={algo}")
    for flag, value in (("record_dataset", data.record_dataset), ("init_from_dataset", data.init_from_dataset)):
        if value:
            raise PodracerError(f"{flag_name(flag)} records and clones feed-forward policies; "
                                f"drop it or use --network=mlp")


def parse_configs(argv: Sequence[str]) -> RunSpec:
    """Parse and check `argv` into the run's `RunSpec`."""
    return parse(argv).configs


def config_text(parsed: Parsed) -> str:
    """The resolved settings the pair reads, as JSON by section (what `--print-config` prints)."""
    return json.dumps(config_record(parsed.used()), indent=2)
