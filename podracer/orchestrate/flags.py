"""Command-line flags generated from config dataclasses: one field, one flag, its docstring the help.

A field's attribute docstring (the string literal under it) is its help text,
its default and its declared range (`podracer.bounds`) are shown with it, and a
mistake is one line with a suggestion (`did you mean --total-steps?`).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import functools
import inspect
import typing
from typing import Any, Sequence

from podracer import config as run_config
from podracer.bounds import bound_of
from podracer.errors import PodracerError
from podracer.es.config import VARIANTS


class Parser(argparse.ArgumentParser):
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
    return _module_field_docs(inspect.getsourcefile(cls)).get(cls.__name__, {})


@functools.lru_cache(maxsize=None)
def _module_field_docs(path: str) -> dict[str, dict[str, str]]:
    """Field docstrings of every top-level class in one source file, read and parsed once.

    (`inspect.getsource` per class parsed the whole file again for each: 0.1-0.2 s
    of every start-up.)
    """
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    classes = {}
    for cls in tree.body:
        if not isinstance(cls, ast.ClassDef):
            continue
        docs = classes[cls.name] = {}
        for node, following in zip(cls.body, cls.body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)):
                docs[node.target.id] = " ".join(str(following.value.value).split())
    return classes


# Tuple flags that may be given several times, each adding its values (`--sweep A=1,2 --sweep B=3,4`).
REPEATABLE = frozenset({"sweep"})


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def _typed(kind):
    def parse(text: str):
        try:
            return kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {kind.__name__}, got {text!r}") from None
    parse.__name__ = kind.__name__
    return parse


def shown(value: Any) -> str:
    if isinstance(value, tuple):
        return " ".join(map(str, value))
    return repr(value) if value == "" else str(value)


def _help_text(field: dataclasses.Field, doc: str, preset: dict[str, Any],
               triple: str) -> str:
    default = shown(field.default)
    if field.name in preset and preset[field.name] != field.default:
        default = f"{shown(preset[field.name])} for {triple}; {default} otherwise"
    bound = bound_of(field)
    rule = f"; must be {bound.describe()}" if bound else ""
    if field.name in ("run_dir", "compile_cache"):
        return doc  # its default is explained in words
    return f"{doc} (default: {default}{rule})"


def add_fields(parser: argparse.ArgumentParser, sections: dict[str, type],
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
                group.add_argument(flag_name(field.name), dest=field.name, default=None,
                                   action=argparse.BooleanOptionalAction, help=help_text)
            elif typing.get_origin(kind) is tuple:
                element = typing.get_args(kind)[0]
                group.add_argument(flag_name(field.name), dest=field.name, default=None, nargs="+",
                                   type=_typed(element), metavar=element.__name__.upper(),
                                   help=help_text,
                                   # repeatable flags gather every use; the others keep the last
                                   action="extend" if field.name in REPEATABLE else "store")
            else:
                choices = {"arch": run_config.ARCHS, "algo": run_config.ALGOS,
                           "variant": VARIANTS}.get(field.name)
                group.add_argument(flag_name(field.name), dest=field.name, default=None,
                                   type=_typed(kind), choices=choices,
                                   metavar=kind.__name__.upper() if not choices else None,
                                   help=help_text)


def parse_section(cls: type, argv: Sequence[str], prog: str):
    """Parse `argv` into one config dataclass (for verbs such as `eval`: `prog` "podracer eval").

    Its flags are listed under the verb's name, below argparse's own "options" (`--help`).
    """
    parser = Parser(prog=prog, allow_abbrev=False)
    add_fields(parser, {prog.split()[-1]: cls})
    given = {k: v for k, v in vars(parser.parse_args(list(argv))).items() if v is not None}
    try:
        return cls(**given)
    except ValueError as err:
        raise PodracerError(str(err)) from None
