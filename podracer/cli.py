"""The command line: flags mapped onto the frozen config dataclasses, one dispatch.

Nothing below this module reads `sys.argv` or the environment. Flags are
generated from the dataclass fields (their docstrings are the help text), so a
new setting is one field. Precedence: dataclass default < preset for the
(arch, algo, env) triple < flag given on the command line.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import logging
import sys
import textwrap
import typing
from typing import Any, Sequence

from podracer import config as run_config
from podracer.anakin.loop import AnakinConfig
from podracer.checkpoint import CheckpointConfig
from podracer.data.config import DataConfig
from podracer.errors import Interrupted, PodracerError
from podracer.es.config import VARIANTS, ESConfig
from podracer.orchestrate import DistConfig
from podracer.presets import preset_for
from podracer.ppo.config import PPOConfig
from podracer.sebulba.config import SebulbaConfig

# Every config class the command line fills, by the name its section has in --help.
SECTIONS: dict[str, type] = {
    "run": run_config.RunConfig,
    "ppo": PPOConfig,
    "es": ESConfig,
    "anakin": AnakinConfig,
    "sebulba": SebulbaConfig,
    "optimizer": run_config.OptimConfig,
    "network": run_config.NetworkConfig,
    "checkpoint": CheckpointConfig,
    "distributed": DistConfig,
    "logging": run_config.LogConfig,
    "data": DataConfig,
}


class _Parser(argparse.ArgumentParser):
    """argparse, but a mistake is one line on stderr and exit status 2."""

    def error(self, message: str):
        raise PodracerError(f"{message} (see --help)")


def _field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings (the string literal under each field) of a dataclass."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, following in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)):
            docs[node.target.id] = " ".join(str(following.value.value).split())
    return docs


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _typed(kind):
    def parse(text: str):
        try:
            return kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind.__name__}, got {text!r}") from None
    parse.__name__ = kind.__name__
    return parse


def _add_fields(parser: argparse.ArgumentParser, sections: dict[str, type]) -> None:
    seen: set[str] = set()
    for section, cls in sections.items():
        group = parser.add_argument_group(section)
        docs = _field_docs(cls)
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            # A name shared by several sections (e.g. --num-envs for each
            # architecture) is one flag that fills every config that has it.
            if field.name in seen:
                continue
            seen.add(field.name)
            kind = hints[field.name]
            help_text = f"{docs.get(field.name, '')} (default: {field.default})"
            if kind is bool:
                group.add_argument(_flag(field.name), dest=field.name, default=None,
                                   action=argparse.BooleanOptionalAction, help=help_text)
            elif typing.get_origin(kind) is tuple:
                element = typing.get_args(kind)[0]
                group.add_argument(_flag(field.name), dest=field.name, default=None, nargs="+",
                                   type=_typed(element), metavar=element.__name__.upper(),
                                   help=help_text)
            else:
                choices = {"arch": run_config.ARCHS, "algo": run_config.ALGOS,
                           "variant": VARIANTS}.get(field.name)
                group.add_argument(_flag(field.name), dest=field.name, default=None,
                                   type=_typed(kind), choices=choices,
                                   metavar=kind.__name__.upper() if not choices else None,
                                   help=help_text)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python launch/tpu.py",
        description="Train with podracer. Runs on every device JAX sees (all TPU cores of a "
                    "TPU VM, forced CPU devices with --cpu-devices). Verbs: eval (score a run's "
                    "policy), up/status/down/list (TPU slices; see README).",
        allow_abbrev=False)
    _add_fields(parser, SECTIONS)
    return parser


def parse_section(cls: type, argv: Sequence[str], prog: str):
    """Parse `argv` into one config dataclass (for verbs such as `eval`)."""
    parser = _Parser(prog=prog, allow_abbrev=False)
    _add_fields(parser, {"options": cls})
    given = {k: v for k, v in vars(parser.parse_args(list(argv))).items() if v is not None}
    try:
        return cls(**given)
    except ValueError as err:
        raise PodracerError(str(err)) from None


def parse_configs(argv: Sequence[str]) -> dict[str, Any]:
    """Parse `argv` into one instance of each config class, keyed by section."""
    args = vars(build_parser().parse_args(list(argv)))
    given = {name: value for name, value in args.items() if value is not None}
    run_fields = {**{f.name: f.default for f in dataclasses.fields(run_config.RunConfig)}, **given}
    chosen = preset_for(run_fields["arch"], run_fields["algo"], run_fields["env"])
    values = {**chosen, **given}
    configs = {}
    for section, cls in SECTIONS.items():
        names = {field.name for field in dataclasses.fields(cls)}
        kwargs = {name: (tuple(value) if isinstance(value, list) else value)
                  for name, value in values.items() if name in names}
        try:
            configs[section] = cls(**kwargs)
        except ValueError as err:
            raise PodracerError(str(err)) from None
    return configs


def run(argv: Sequence[str]) -> dict:
    """Parse, configure JAX's devices, and run; returns the run's summary."""
    configs = parse_configs(argv)
    run_cfg: run_config.RunConfig = configs["run"]
    # Library chatter (orbax logs through absl) would break the one-line error
    # contract; everything a user must see is reported by podracer itself.
    logging.getLogger("absl").setLevel(logging.CRITICAL)
    if run_cfg.cpu_devices < 0:
        raise PodracerError(f"--cpu-devices must be >= 0, got {run_cfg.cpu_devices}")
    trainer = _trainer(run_cfg.arch, run_cfg.algo)
    if run_cfg.cpu_devices:
        import jax

        # Only effective before JAX's CPU backend starts, which nothing above has done.
        jax.config.update("jax_num_cpu_devices", run_cfg.cpu_devices)
    from podracer import orchestrate

    orchestrate.initialize(configs["distributed"])
    summary, _ = trainer(configs)
    return summary


def train(**flags) -> dict:
    """Train from Python with the launcher's flags as keywords; returns the summary.

        podracer.train(arch="anakin", algo="ppo", env="CartPole-v1", total_steps=100_000)

    Presets, validation and outputs are exactly those of `python launch/tpu.py`.
    """
    argv = []
    for name, value in flags.items():
        flag = _flag(name)
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, (tuple, list)):
            argv += [flag, *map(str, value)]
        else:
            argv.append(f"{flag}={value}")
    return run(argv)


def _trainer(arch: str, algo: str):
    """`train(configs) -> (summary, final state)` for an architecture and algorithm."""
    if (arch, algo) == ("anakin", "ppo"):
        from podracer.anakin.train import train_ppo

        return train_ppo
    if (arch, algo) == ("sebulba", "ppo"):
        from podracer.sebulba.train import train_ppo_from_configs

        return train_ppo_from_configs
    if (arch, algo) == ("anakin", "es"):
        from podracer.anakin.train_es import train_es

        return train_es
    if (arch, algo) == ("sebulba", "es"):
        from podracer.sebulba.train_es import train_es_from_configs

        return train_es_from_configs
    raise PodracerError(f"--arch={arch} --algo={algo} is not available; "
                        f"use --arch=anakin or --arch=sebulba with --algo=ppo or --algo=es")


# Launcher verbs handled by the TPU provisioner rather than by training.
PROVISION_VERBS = ("up", "status", "down", "list")


def _is_provision(argv: Sequence[str]) -> bool:
    return bool(argv) and argv[0] in PROVISION_VERBS or any(
        arg == "--tpu" or arg.startswith("--tpu=") for arg in argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: exit status 0, or 2 with one line on stderr for a user error."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if _is_provision(argv):
        from podracer.provision.cli import main as provision_main

        return provision_main(argv)
    try:
        if argv[:1] == ["eval"]:
            from podracer.evaluate import main as evaluate_main

            logging.getLogger("absl").setLevel(logging.CRITICAL)
            return evaluate_main(argv[1:])
        if parse_configs(argv)["distributed"].spawns:
            from podracer import orchestrate

            return orchestrate.spawn_local(argv, parse_configs(argv)["distributed"].num_processes)
        run(argv)
    except PodracerError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    except Interrupted as stop:
        print(f"{stop}", file=sys.stderr)
        return stop.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0
