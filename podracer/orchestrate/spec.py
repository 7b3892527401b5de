"""A run, resolved and checked once: one frozen value with a typed attribute per section.

The command line (`podracer.orchestrate.parse`) builds a `RunSpec` from the
defaults, the (arch, algo, env) preset and the flags, checks it, and hands it
down: the architectures' drivers read the sections they run with
(`spec.anakin`, `spec.agent`, ...), the session the run's directory,
checkpoint, logging and dataset sections and the record of the rest.

`agent` is the algorithm's own section (`podracer.ppo.PPOConfig`,
`podracer.es.ESConfig`, ...); on the command line, in `--print-config` and in
checkpoints it keeps its algorithm's name (`ppo`, `es`, ...).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from podracer import config as run_config
from podracer.algorithms import ALGORITHMS
from podracer.anakin.loop import AnakinConfig
from podracer.data.config import DataConfig
from podracer.es.config import ESConfig
from podracer.orchestrate.distributed import DistConfig
from podracer.population import PopulationConfig
from podracer.sebulba.config import SebulbaConfig
from podracer.session.checkpoint import CheckpointConfig

# Every section the command line fills, by its name in --help, in that order; the
# algorithms' sections are alternatives, of which a run holds its own as `agent`.
ALGORITHM_SECTIONS: dict[str, type] = {**{name: algo.config for name, algo in ALGORITHMS.items()}, "es": ESConfig}
SECTIONS: dict[str, type] = {
    "run": run_config.RunConfig,
    **ALGORITHM_SECTIONS,
    "anakin": AnakinConfig,
    "sebulba": SebulbaConfig,
    "optimizer": run_config.OptimConfig,
    "network": run_config.NetworkConfig,
    "checkpoint": CheckpointConfig,
    "distributed": DistConfig,
    "logging": run_config.LogConfig,
    "data": DataConfig,
    "population": PopulationConfig,
}


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """Every setting of one run; sections left out get their defaults (`agent`: `run.algo`'s)."""

    run: run_config.RunConfig = dataclasses.field(default_factory=run_config.RunConfig)
    agent: Any = None
    """The algorithm's section: `ALGORITHM_SECTIONS[run.algo]`."""
    anakin: AnakinConfig = dataclasses.field(default_factory=AnakinConfig)
    sebulba: SebulbaConfig = dataclasses.field(default_factory=SebulbaConfig)
    optimizer: run_config.OptimConfig = dataclasses.field(default_factory=run_config.OptimConfig)
    network: run_config.NetworkConfig = dataclasses.field(default_factory=run_config.NetworkConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    distributed: DistConfig = dataclasses.field(default_factory=DistConfig)
    logging: run_config.LogConfig = dataclasses.field(default_factory=run_config.LogConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    population: PopulationConfig = dataclasses.field(default_factory=PopulationConfig)

    def __post_init__(self):
        if self.agent is None:
            object.__setattr__(self, "agent", ALGORITHM_SECTIONS[self.run.algo]())

    @property
    def architecture(self) -> AnakinConfig | SebulbaConfig:
        """The section of the run's architecture (`run.arch`)."""
        return getattr(self, self.run.arch)

    def section(self, name: str) -> Any:
        """A section by its command-line name (the algorithm's own name for `agent`)."""
        return self.agent if name == self.run.algo else getattr(self, name)

    def with_sections(self, sections: dict[str, Any]) -> RunSpec:
        """A copy with some sections, named as on the command line, replaced."""
        return dataclasses.replace(self, **{("agent" if name == self.run.algo else name): value
                                            for name, value in sections.items()})

    def replace(self, **changes: Any) -> RunSpec:
        return dataclasses.replace(self, **changes)

    def sections(self) -> dict[str, Any]:
        """Every section by its command-line name, in `SECTIONS`' order."""
        return {name: self.section(name) for name in SECTIONS
                if name not in ALGORITHM_SECTIONS or name == self.run.algo}

    def used(self) -> dict[str, Any]:
        """The sections the (arch, algo) pair reads (`podracer.config.USES`), in order."""
        pair = (self.run.arch, self.run.algo)
        return {name: cfg for name, cfg in self.sections().items() if name in run_config.USES[pair]}

    def recorded(self) -> dict[str, Any]:
        """What a checkpoint and summary.json record: the used sections, the population only when
        there is one (a run of one agent records none, as before populations)."""
        return {name: cfg for name, cfg in self.used().items()
                if not (name == "population" and not (cfg.num_seeds > 1 or cfg.sweep))}
