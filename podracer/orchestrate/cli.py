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
import difflib
import importlib.util
import inspect
import json
import logging
import os
import sys
import textwrap
import time
import typing
from typing import Any, NamedTuple, Sequence

from podracer import config as run_config
from podracer.anakin.loop import AnakinConfig
from podracer.bounds import bound_of
from podracer.session.checkpoint import CheckpointConfig, check_resumable, config_record
from podracer.data.config import DataConfig
from podracer.errors import Interrupted, PodracerError
from podracer.es.config import VARIANTS, ESConfig
from podracer.orchestrate.distributed import DistConfig
from podracer.presets import preset_for
from podracer.ppo.config import PPOConfig
from podracer.sebulba.config import SebulbaConfig
from podracer.session import signals
from podracer.session.run_dir import (RunDirState, finished_message, latest_checkpoint_steps,
                                      link_latest, new_run_name, prepare_run_dir, unlink_new_run)

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
    """argparse, but a mistake is one line on stderr and exit status 2, with a suggestion."""

    def error(self, message: str):
        raise PodracerError(f"{message} (see --help)")

    def parse_args(self, args=None, namespace=None):
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            self.error(self._unknown(extra[0]))
        return parsed

    def _unknown(self, arg: str) -> str:
        flag = arg.split("=", 1)[0]
        if not flag.startswith("-"):
            return f"unexpected argument {arg!r}: every setting is a --flag"
        known = [option for action in self._actions for option in action.option_strings
                 if option.startswith("--")]
        close = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]}?" if close else ""
        return f"unknown flag {flag}{hint}"


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


def _shown(value: Any) -> str:
    if isinstance(value, tuple):
        return " ".join(map(str, value))
    return repr(value) if value == "" else str(value)


def _help_text(field: dataclasses.Field, doc: str, preset: dict[str, Any],
               triple: str) -> str:
    default = _shown(field.default)
    if field.name in preset and preset[field.name] != field.default:
        default = f"{_shown(preset[field.name])} for {triple}; {default} otherwise"
    bound = bound_of(field)
    rule = f"; must be {bound.describe()}" if bound else ""
    if field.name == "run_dir":
        return doc  # its default is explained in words
    return f"{doc} (default: {default}{rule})"


def _add_fields(parser: argparse.ArgumentParser, sections: dict[str, type],
                preset: dict[str, Any] | None = None, pair: tuple[str, str] | None = None,
                triple: str = "") -> None:
    preset = preset or {}
    used = run_config.USES.get(pair, tuple(sections)) if pair else tuple(sections)
    # A name shared by several sections (e.g. --num-envs for each architecture)
    # is one flag that fills every config that has it; its help is that of the
    # section the pair reads.
    host: dict[str, str] = {}
    for section, cls in sorted(sections.items(), key=lambda item: item[0] not in used):
        for field in dataclasses.fields(cls):
            host.setdefault(field.name, section)
    for section, cls in sections.items():
        title = section if section in used else \
            f"{section} (not used by --arch={pair[0]} --algo={pair[1]})"
        group = parser.add_argument_group(title)
        docs = _field_docs(cls)
        hints = typing.get_type_hints(cls)
        for field in dataclasses.fields(cls):
            if host[field.name] != section:
                continue
            kind = hints[field.name]
            help_text = _help_text(field, docs.get(field.name, ""), preset, triple)
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


def _triple(argv: Sequence[str]) -> tuple[str, str, str]:
    """--arch, --algo and --env as given (else their defaults), before the full parse."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    defaults = run_config.RunConfig()
    for name in ("arch", "algo", "env"):
        parser.add_argument(_flag(name), dest=name, default=getattr(defaults, name))
    known, _ = parser.parse_known_args(list(argv))
    return known.arch, known.algo, known.env


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The training parser; its help shows the defaults of the triple `argv` names."""
    arch, algo, env = _triple(argv)
    parser = _Parser(
        prog="podracer",
        description="Train with podracer (also: python launch/tpu.py). Runs on every device JAX "
                    "sees (all TPU cores of a TPU VM, forced CPU devices with --cpu-devices). "
                    "Defaults below are those of the --arch/--algo/--env given (a preset per "
                    "triple). Verbs: eval (score a run's policy), up/status/down/list (TPU "
                    "slices; see README).",
        allow_abbrev=False)
    parser.add_argument("--print-config", action="store_true", default=None,
                        help="print the resolved settings (defaults, preset and flags) and exit")
    _add_fields(parser, SECTIONS, preset_for(arch, algo, env), (arch, algo),
                f"--arch={arch} --algo={algo} --env={env}")
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


class Parsed(NamedTuple):
    """A command line, resolved: one config per section, and where each value came from."""

    configs: dict[str, Any]
    given: dict[str, Any]  # flags on the command line, by field name
    preset: dict[str, Any]  # the triple's preset
    print_config: bool

    @property
    def pair(self) -> tuple[str, str]:
        return self.configs["run"].arch, self.configs["run"].algo

    def used(self) -> dict[str, Any]:
        """The configs the pair reads, in section order."""
        return {name: cfg for name, cfg in self.configs.items() if name in run_config.USES[self.pair]}

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
                origin = "given" if field.name in self.given else "preset"
                out.append(f"{_flag(field.name)}={_shown(value)} ({origin})")
        return list(dict.fromkeys(out))  # a flag shared by two sections once


def parse(argv: Sequence[str]) -> Parsed:
    """Parse and check `argv` (everything that needs no devices and no compilation)."""
    args = vars(build_parser(argv).parse_args(list(argv)))
    print_config = bool(args.pop("print_config"))
    given = {name: value for name, value in args.items() if value is not None}
    run_fields = {**{f.name: f.default for f in dataclasses.fields(run_config.RunConfig)}, **given}
    pair = (run_fields["arch"], run_fields["algo"])
    _refuse_unused(given, pair)
    chosen = preset_for(run_fields["arch"], run_fields["algo"], run_fields["env"])
    values = {**chosen, **given}
    if not values.get("run_dir"):
        values["run_dir"] = new_run_name(*pair, run_fields["env"], time.time())
    configs = {}
    for section, cls in SECTIONS.items():
        names = {field.name for field in dataclasses.fields(cls)}
        kwargs = {name: (tuple(value) if isinstance(value, list) else value)
                  for name, value in values.items() if name in names}
        try:
            configs[section] = cls(**kwargs)
        except ValueError as err:
            raise PodracerError(str(err)) from None
    if configs["logging"].wandb and importlib.util.find_spec("wandb") is None:
        raise PodracerError("--wandb needs the wandb package; pip install wandb, or drop --wandb")
    return Parsed(configs, given, chosen, print_config)


def _refuse_unused(given: dict[str, Any], pair: tuple[str, str]) -> None:
    """A flag the (arch, algo) pair would ignore is an error, never a silent no-op."""
    ignored = run_config.IGNORES.get(pair, {})
    for name in given:
        sections = [section for section, cls in SECTIONS.items()
                    if name in {field.name for field in dataclasses.fields(cls)}]
        if not any(section in run_config.USES[pair] for section in sections):
            raise PodracerError(f"{_flag(name)} is a {sections[0]} setting, which --arch={pair[0]} "
                                f"--algo={pair[1]} does not use; drop it")
        if name in ignored:
            raise PodracerError(f"{_flag(name)} does not apply to --arch={pair[0]} --algo={pair[1]} "
                                f"({ignored[name]}); drop it")


def parse_configs(argv: Sequence[str]) -> dict[str, Any]:
    """Parse `argv` into one instance of each config class, keyed by section."""
    return parse(argv).configs


def config_text(parsed: Parsed) -> str:
    """The resolved settings the pair reads, as JSON by section (what `--print-config` prints)."""
    return json.dumps(config_record(parsed.used()), indent=2)


def run(argv: Sequence[str], parsed: Parsed | None = None) -> dict:
    """Parse, configure JAX's devices, and run; returns the run's summary."""
    parsed = parsed or parse(argv)
    configs = parsed.configs
    run_cfg: run_config.RunConfig = configs["run"]
    # Library chatter (orbax logs through absl) would break the one-line error
    # contract; everything a user must see is reported by podracer itself.
    logging.getLogger("absl").setLevel(logging.CRITICAL)
    trainer = _trainer(run_cfg.arch, run_cfg.algo)
    _process_wide_jax_settings(run_cfg)
    from podracer.orchestrate import distributed as orchestrate

    orchestrate.initialize(configs["distributed"])
    configs = {**configs, "run": _agreed_run_dir(run_cfg, "run_dir" not in parsed.given)}
    parsed = parsed._replace(configs=configs)
    run_dir = configs["run"].run_dir
    state = _run_dir_state(configs)
    main_process = _is_main_process()
    if state.finished:
        if main_process:
            print(finished_message(run_dir, state), flush=True)
        summary_path = os.path.join(run_dir, "summary.json")
        return json.load(open(summary_path)) if os.path.exists(summary_path) else {}
    _check_env(configs["run"])
    if state.resumes:
        signals.set_nothing_saved(
            f"the checkpoint at env step {state.checkpoint_steps:,} in {run_dir} is untouched")
    new_dir = not state.resumes and not os.path.exists(run_dir)
    previous_latest = None
    if "run_dir" not in parsed.given and main_process:
        prepare_run_dir(run_dir)
        previous_latest = link_latest(run_dir)
    if main_process:
        print(first_line(parsed, state), flush=True)
        print("compiling the training program (the first progress line follows it)", flush=True)
    try:
        summary, _ = trainer(configs)
    except PodracerError:
        if new_dir and main_process:  # refused while building: leave no empty run behind
            unlink_new_run(run_dir, previous_latest)
        raise
    return summary


def first_line(parsed: Parsed, state: RunDirState) -> str:
    """What will run: the pair, the devices, the run directory, fresh or resumed, non-defaults."""
    import jax

    run_cfg = parsed.configs["run"]
    devices = jax.devices()
    processes = f" over {jax.process_count()} processes" if jax.process_count() > 1 else ""
    where = (f"resuming {run_cfg.run_dir} from env step {state.checkpoint_steps:,}" if state.resumes
             else f"new run in {run_cfg.run_dir}")
    changed = parsed.differences()
    settings = f"; not defaults: {' '.join(changed)}" if changed else "; default settings"
    return (f"podracer {run_cfg.arch} {run_cfg.algo} on {run_cfg.env}, {len(devices)} "
            f"{devices[0].platform} device{'s' if len(devices) > 1 else ''}{processes}; "
            f"{where}{settings}")


def _process_wide_jax_settings(run_cfg: run_config.RunConfig) -> None:
    """JAX settings for the whole process, made here, before its backend starts."""
    import jax

    if run_cfg.cpu_devices:
        jax.config.update("jax_num_cpu_devices", run_cfg.cpu_devices)
    if run_cfg.arch == "sebulba":
        from podracer.sebulba.train import run_cpu_work_inline

        run_cpu_work_inline()


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


def _run_dir_state(configs: dict[str, Any]) -> RunDirState:
    """New, resumable (its config checked) or finished; refuses a checkpoint of another config."""
    run_cfg = configs["run"]
    steps = latest_checkpoint_steps(run_cfg.run_dir)
    if steps is not None:
        check_resumable(run_cfg.run_dir, configs["checkpoint"], configs)
    return RunDirState(steps, run_cfg.total_steps)


def _check_env(run_cfg: run_config.RunConfig) -> None:
    """An environment id the architecture cannot run is refused before anything is built."""
    if run_cfg.arch == "anakin":
        from podracer.anakin.env import make_env

        make_env(run_cfg.env)
    else:
        from podracer.sebulba.envs import env_spec

        env_spec(run_cfg.env)


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
        from podracer.sebulba.train_es import train_es

        return train_es
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
        parsed = parse(argv)
        if parsed.print_config:
            print(config_text(parsed))
            return 0
        distributed = parsed.configs["distributed"]
        if distributed.spawns:
            from podracer.orchestrate import distributed as orchestrate

            # Every process writes to the same run directory: name it once, here.
            named = [a for a in argv if not (a == "--print-config")]
            if "run_dir" not in parsed.given:
                named.append(f"--run-dir={parsed.configs['run'].run_dir}")
            return orchestrate.spawn_local(named, distributed.num_processes)
        # Until training starts a signal ends the run at once (compilation cannot be
        # interrupted from Python); then the training loop saves and stops.
        signals.exit_at_once_until_training()
        run(argv, parsed)
    except PodracerError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    except Interrupted as stop:
        print(f"{stop}", file=sys.stderr)
        return stop.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    late = signals.late_signal()
    if late:
        print(f"stopped by signal {late} while the results were written; they are complete",
              file=sys.stderr)
        return 128 + late
    return 0
