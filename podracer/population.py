"""Populations: many agents in one compiled program, and the statistics to report them.

A population is `--num-seeds` seeds crossed with the settings of every
`--sweep NAME=V1,V2,...`: their grid, or with `--sweep-as-given` the lists read
side by side (the i-th value of each makes setting i), or `--num-samples`
settings drawn from the sweeps' distributions (`podracer.sampling`). Settings major, seeds
minor: agent `i` has the setting `i // num_seeds` and the seed `--seed + i % num_seeds`. Every agent owns its
key, parameters, optimizer state and environments; the architecture vmaps
them in one program. A swept setting must be one that can vary without
recompiling (`SWEEPABLE`): it becomes a traced per-agent scalar, carried with
the agents' state, and the algorithm's config and optimizer are rebuilt from
it inside the traced step (`with_values`). With `--pbt` the agents' settings
and states change during the run (`podracer.pbt`); `Agent.settings` are the
ones each agent starts with.

The statistics follow Agarwal et al. 2021 ("Deep RL at the edge of the
statistical precipice", the rliable recommendations): the interquartile mean
(IQM) and 95% stratified bootstrap confidence intervals, strata being the
settings (seeds are resampled within each setting), in plain numpy.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
import typing
from typing import TYPE_CHECKING, Any, NamedTuple, Sequence

import numpy as np

from podracer import sampling
from podracer.algorithms import ALGORITHMS
from podracer.bounds import NON_NEGATIVE, POSITIVE, SEED, Bound, bounded, check_bounds
from podracer.errors import PodracerError

if TYPE_CHECKING:  # the command line's run spec, built above this layer
    from podracer.orchestrate.spec import RunSpec


@dataclasses.dataclass(frozen=True)
class PopulationConfig:
    """Many agents trained at once by one compiled program (Anakin only: Sebulba's actor threads serve one learner)."""

    num_seeds: int = bounded(1, POSITIVE)
    """Independent agents per setting, seeds --seed, --seed+1, ...: each has its own key, parameters, optimizer state and environments, and trains --total-steps steps of its own; all of them are vmapped in one compiled program (Anakin PPO, IMPALA and ES; Sebulba refuses it)."""
    sweep: tuple[str, ...] = ()
    """NAME=V1,V2,... (repeatable; NAME is the flag without its dashes): a hyperparameter that varies over the population without recompiling, crossed as a grid with the other sweeps (or paired with them, --sweep-as-given) and with the seeds; or a distribution to draw --num-samples settings from (NAME=loguniform:LOW:HIGH, uniform:LOW:HIGH, choice:A,B,C). Every learning agent: lr, max-grad-norm, adam-eps, and its own (PPO: ent-coef, vf-coef, gamma, clip-eps, gae-lambda; IMPALA: ent-coef, vf-coef, gamma, vtrace-lambda, rho-bar, c-bar, pg-rho-bar; the others' are listed by the error a wrong NAME gets); ES: sigma, es-lr, weight-decay. Settings that change shapes or code (network size, --num-envs) are refused."""

    sweep_as_given: bool = False
    """Pair the --sweep lists instead of crossing them: the i-th value of every list makes the i-th setting (e.g. --sweep lr=1e-3,3e-4 --sweep ent-coef=0.01,0 is two settings, not four); every list has the same length."""

    num_samples: int = bounded(0, NON_NEGATIVE)
    """Draw this many settings from the --sweep spaces instead of crossing them, from --seed (the same command draws the same settings): NAME=loguniform:LOW:HIGH, uniform:LOW:HIGH, choice:A,B,C, or a plain list V1,V2 (a choice); each setting with --num-seeds seeds. 0: the grid."""
    pbt: bool = False
    """Population-based training (Jaderberg et al. 2017) inside the compiled program: every --pbt-interval updates the agents are ranked by their mean episode return over the interval; the worst --pbt-fraction copy the parameters, optimizer state and settings of agents drawn from the best --pbt-fraction, then perturb each swept setting (times --pbt-perturb or its inverse, or drawn anew from its --sweep values with probability --pbt-resample), within the setting's range. Needs a --sweep and two agents or more; Anakin learning agents (not ES)."""
    pbt_interval: int = bounded(20, POSITIVE)
    """Updates between two PBT rankings; a ranking happens at the end of the call (--updates-per-call updates) in which its interval ends."""
    pbt_fraction: float = bounded(0.25, Bound(0, 0.5, low_open=True))
    """The share of agents replaced at each PBT ranking (the worst), and the share they copy from (the best): at least one agent each."""
    pbt_perturb: float = bounded(1.25, Bound(1, low_open=True))
    """PBT multiplies a copied setting by this factor or its inverse, at even odds (1.25: x1.25 or x0.8)."""
    pbt_resample: float = bounded(0.25, Bound(0, 1))
    """The probability that PBT draws a copied setting anew from its --sweep values or distribution instead of perturbing it."""

    def __post_init__(self):
        check_bounds(self)


# What can vary per agent inside one program, by algorithm: flag name -> (section, field).
_OPTIMIZER = {"lr": ("optimizer", "lr"), "max_grad_norm": ("optimizer", "max_grad_norm"),
              "adam_eps": ("optimizer", "adam_eps")}
SWEEPABLE: dict[str, dict[str, tuple[str, str]]] = {
    **{name: {**_OPTIMIZER, **{field: (name, field) for field in algo.sweepable}}
       for name, algo in ALGORITHMS.items()},
    "es": {"sigma": ("es", "sigma"), "es_lr": ("es", "es_lr"), "weight_decay": ("es", "weight_decay")},
}


class Agent(NamedTuple):
    index: int
    seed: int
    settings: dict[str, float]  # swept field name -> value (empty without --sweep)


def _flag(name: str) -> str:
    return name.replace("_", "-")


def parse_sweeps(sweeps: Sequence[str], configs: RunSpec) -> dict[str, sampling.Space]:
    """`--sweep` spaces by field name (a list, or a distribution: `podracer.sampling`), each value
    checked against its setting's range; one-line errors."""
    algo = configs.run.algo
    allowed = SWEEPABLE.get(algo, {})
    names = ", ".join(_flag(n) for n in allowed)
    out: dict[str, sampling.Space] = {}
    for spec in sweeps:
        name, sep, values = spec.partition("=")
        field = name.strip().lstrip("-").replace("-", "_")
        if not sep or not field or not values.strip():
            raise PodracerError(f"--sweep {spec!r} is not NAME=V1,V2,...; e.g. --sweep lr=1e-4,3e-4")
        if field not in allowed:
            used = any(field in {f.name for f in dataclasses.fields(cfg)}
                       for cfg in configs.recorded().values())
            known = any(field in {f.name for f in dataclasses.fields(cfg)} for cfg in configs.sections().values())
            why = ("it changes the compiled program's shapes or code, so it cannot vary inside one "
                   "population; run one population per value" if used else
                   f"not a setting of --algo={algo}" if known else "no such setting")
            raise PodracerError(f"--sweep {_flag(field)}: {why}; --algo={algo} sweeps {names}")
        if field in out:
            raise PodracerError(f"--sweep {_flag(field)} is given twice; list every value in one --sweep")
        section, attr = allowed[field]
        kind = typing.get_type_hints(type(configs.section(section)))[attr]
        distribution, values = sampling.split_kind(_flag(field), values)
        parsed = []
        for text in values.split(":" if distribution in ("uniform", "loguniform") else ","):
            try:
                value = kind(text.strip())
                dataclasses.replace(configs.section(section), **{attr: value})  # its range, its checks
            except ValueError as err:
                detail = str(err) if "must" in str(err) else f"expected {kind.__name__}, got {text.strip()!r}"
                raise PodracerError(f"--sweep {_flag(field)}: {detail}") from None
            parsed.append(value)
        out[field] = sampling.space_of(_flag(field), distribution, parsed)
    return out


def settings_of(spaces: dict[str, sampling.Space], population: "PopulationConfig",
                seed: int) -> list[dict[str, float]]:
    """The population's settings: `--num-samples` draws from the sweeps' spaces, else the grid of
    the sweeps' lists (first sweep slowest), or with `--sweep-as-given` the lists side by side."""
    if not spaces:
        return [{}]
    drawn = [_flag(n) for n, space in spaces.items() if space.kind != "list"]
    if population.num_samples:
        if population.sweep_as_given:
            raise PodracerError("--num-samples draws each setting, --sweep-as-given pairs listed ones; "
                                "drop one of them")
        return sampling.draw_settings(spaces, population.num_samples, seed)
    if drawn:
        raise PodracerError(f"--sweep {drawn[0]} is a distribution: say how many settings to draw "
                            f"with --num-samples=N")
    sweeps = {name: list(space.values) for name, space in spaces.items()}
    as_given = population.sweep_as_given
    if not as_given:
        for name, values in sweeps.items():
            repeated = sorted({value for value in values if values.count(value) > 1})
            if repeated:
                raise PodracerError(f"--sweep {_flag(name)} lists {', '.join(map(str, repeated))} more than once: "
                                    f"those agents would be identical, not seeds; list each value once "
                                    f"(--num-seeds gives each setting several seeds)")
        return [dict(zip(sweeps, values)) for values in itertools.product(*sweeps.values())]
    lengths = {name: len(values) for name, values in sweeps.items()}
    if len(set(lengths.values())) > 1:
        given = ", ".join(f"{_flag(n)} has {k}" for n, k in lengths.items())
        raise PodracerError(f"--sweep-as-given pairs the i-th values of every --sweep, so every list needs "
                            f"the same length ({given}); give equal lists or drop --sweep-as-given for the grid")
    settings = [dict(zip(sweeps, values)) for values in zip(*sweeps.values())]
    for i, setting in enumerate(settings):
        if setting in settings[:i]:
            raise PodracerError(f"--sweep-as-given makes the setting {setting_label(setting)} twice (settings "
                                f"{settings.index(setting)} and {i}): those agents would be identical, not "
                                f"seeds; change one value (--num-seeds gives each setting several seeds)")
    return settings


def agents(configs: RunSpec) -> list[Agent]:
    """Every agent of the run: each setting (`settings_of`) with every seed."""
    population = configs.population
    spaces = parse_sweeps(population.sweep, configs)
    seed = configs.run.seed
    if seed + population.num_seeds - 1 > SEED.high:
        raise PodracerError(f"--seed={seed} with --num-seeds={population.num_seeds} takes seeds past "
                            f"{SEED.high} (the 32 bits of a JAX key); lower --seed")
    settings = settings_of(spaces, population, seed)
    members = [Agent(i * population.num_seeds + s, seed + s, setting)
               for i, setting in enumerate(settings) for s in range(population.num_seeds)]
    _check_pbt(population, configs.run.algo, len(members))
    return members


def _check_pbt(population: "PopulationConfig", algo: str, num_agents: int) -> None:
    """`--pbt` needs agents to rank and settings to perturb; one-line errors."""
    if population.num_samples and not population.sweep:
        raise PodracerError("--num-samples draws settings from --sweep distributions, and none is given; "
                            "add --sweep NAME=loguniform:LOW:HIGH (or uniform:, choice:)")
    if not population.pbt:
        return
    if algo not in ALGORITHMS:
        raise PodracerError(f"--pbt trains learning agents (--algo={' or --algo='.join(ALGORITHMS)}); "
                            f"--algo={algo} has none: drop --pbt")
    if not population.sweep:
        raise PodracerError("--pbt perturbs the swept settings, and none is swept; add --sweep NAME=... "
                            "(e.g. --sweep lr=loguniform:1e-4:1e-2 --num-samples=8)")
    if num_agents < 2:
        raise PodracerError("--pbt ranks agents against each other, and this population has one; "
                            "add --num-seeds=N or more --sweep values (or --num-samples=N)")


def is_population(configs: RunSpec) -> bool:
    population = configs.population
    return population.num_seeds > 1 or bool(population.sweep)


def hyperparameters(members: list[Agent]) -> dict[str, np.ndarray]:
    """The swept settings as per-agent float32 arrays [A]: what the program carries and traces."""
    names = members[0].settings.keys()
    return {name: np.asarray([m.settings[name] for m in members], np.float32) for name in names}


def with_values(config: Any, values: dict[str, Any]) -> Any:
    """A copy of a frozen config dataclass with some fields replaced by (traced) values.

    Skips `__post_init__`: its range checks were made on the concrete values
    (`parse_sweeps`) and cannot run on tracers.
    """
    if not values:
        return config
    config = copy.copy(config)
    for name, value in values.items():
        object.__setattr__(config, name, value)
    return config


def configs_for(configs: RunSpec, hparams: dict[str, Any]) -> RunSpec:
    """`configs` with each section's swept fields set to `hparams` (traced scalars inside the program)."""
    allowed = SWEEPABLE.get(configs.run.algo, {})
    by_section: dict[str, dict[str, Any]] = {}
    for name, value in hparams.items():
        section, attr = allowed[name]
        by_section.setdefault(section, {})[attr] = value
    return configs.with_sections({name: with_values(configs.section(name), values)
                                  for name, values in by_section.items()})


def check_agents(num_agents: int, mesh_size: int) -> bool:
    """Whether agents are split over the mesh's devices (a multiple of them) or replicated."""
    return num_agents > 1 and mesh_size > 1 and num_agents % mesh_size == 0


# -- statistics (Agarwal et al. 2021), in numpy


def iqm(scores: np.ndarray) -> float:
    """Interquartile mean: the mean of the middle 50% of the scores (trimmed 25% each side)."""
    scores = np.sort(np.asarray(scores, float).ravel())
    n = len(scores)
    if n == 0:
        return float("nan")
    # scipy.stats.trim_mean(scores, 0.25): int(0.25 * n) cut from each end.
    cut = int(0.25 * n)
    return float(np.mean(scores[cut:n - cut]))


def _iqm_rows(samples: np.ndarray) -> np.ndarray:
    """`iqm` of each row of [reps, n]."""
    n = samples.shape[1]
    cut = int(0.25 * n)
    return np.sort(samples, axis=1)[:, cut:n - cut].mean(axis=1)


def stratified_bootstrap_ci(scores: np.ndarray, strata: np.ndarray, reps: int = 2000,
                            confidence: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the IQM, resampling runs within each stratum.

    `strata[i]` labels run `i` (here: its setting); each replicate draws, in
    every stratum, as many runs as it has, with replacement (rliable's
    `StratifiedBootstrap` with one task per setting).
    """
    scores, strata = np.asarray(scores, float), np.asarray(strata)
    rng = np.random.default_rng(seed)
    groups = [np.flatnonzero(strata == s) for s in np.unique(strata)]
    picked = np.concatenate([g[rng.integers(0, len(g), size=(reps, len(g)))] for g in groups], axis=1)
    stats = _iqm_rows(scores[picked])
    alpha = (1 - confidence) / 2
    return float(np.quantile(stats, alpha)), float(np.quantile(stats, 1 - alpha))


def aggregate(scores: Sequence[float | None], strata: Sequence[int]) -> dict[str, Any]:
    """Mean, IQM and the IQM's 95% stratified bootstrap CI of the agents that have a score."""
    have = [i for i, s in enumerate(scores) if s is not None and math.isfinite(s)]
    if not have:
        return {"mean": None, "iqm": None, "iqm_ci": None}
    values = np.asarray([scores[i] for i in have], float)
    low, high = stratified_bootstrap_ci(values, np.asarray(strata)[have])
    return {"mean": float(values.mean()), "iqm": iqm(values), "iqm_ci": [low, high]}


def setting_label(settings: dict[str, float]) -> str:
    return " ".join(f"{_flag(k)}={v:g}" for k, v in settings.items()) or "(one setting)"


def ranked_settings(members: list[Agent], scores: Sequence[float | None]) -> list[dict[str, Any]]:
    """One entry per setting, best IQM first: its settings, seeds, mean, IQM and CI over its seeds."""
    by_setting: dict[str, list[int]] = {}
    for member in members:
        by_setting.setdefault(setting_label(member.settings), []).append(member.index)
    ranked = []
    for label, indices in by_setting.items():
        stats = aggregate([scores[i] for i in indices], [0] * len(indices))
        ranked.append({"setting": label, "settings": members[indices[0]].settings,
                       "agents": indices, **stats})
    ranked.sort(key=lambda e: -math.inf if e["iqm"] is None else e["iqm"], reverse=True)
    for rank, entry in enumerate(ranked, 1):
        entry["rank"] = rank
    return ranked


def format_ranking(ranked: list[dict[str, Any]], what: str, pbt: bool = False) -> str:
    """The final table: settings ranked by the IQM of `what` over their seeds (with `pbt`, the
    settings the agents started with, which PBT then changed)."""
    width = max(len("setting"), *(len(e["setting"]) for e in ranked))
    num = lambda v: f"{v:>9.2f}" if v is not None else f"{'-':>9}"
    started = (" by the settings they started with (PBT changed them: summary.json's pbt has each agent's "
               "final settings)") if pbt else ""
    lines = [f"population ranked by the IQM of {what} over each setting's seeds (95% stratified bootstrap CI)"
             f"{started}",
             f"  rank  {'setting':<{width}}  seeds       mean        IQM  CI"]
    for e in ranked:
        ci = f"[{e['iqm_ci'][0]:.2f}, {e['iqm_ci'][1]:.2f}]" if e["iqm_ci"] else "-"
        lines.append(f"  {e['rank']:>4}  {e['setting']:<{width}}  {len(e['agents']):>5}  {num(e['mean'])}  "
                     f"{num(e['iqm'])}  {ci}")
    return "\n".join(lines) + "\n"
