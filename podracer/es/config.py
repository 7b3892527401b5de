"""ES settings: one frozen dataclass, and the strategy it describes.

Nothing here knows about devices or environments; the architecture splits the
population over its devices and picks the episode horizon.
"""

from __future__ import annotations

import dataclasses

import optax

from podracer.bounds import NON_NEGATIVE, POSITIVE, Bound, bounded, check_bounds

from podracer.es.ars import make_ars
from podracer.es.openai_es import make_openai_es
from podracer.es.strategy import Strategy

VARIANTS = ("openai", "ars_v1", "ars_v2")


@dataclasses.dataclass(frozen=True)
class ESConfig:
    """Evolution strategies: OpenAI-ES (Salimans et al. 2017) or ARS (Mania et al. 2018).

    Fitness, the mean return of a member's episodes, is maximised. The policy is
    the deterministic MLP of `podracer.networks.make_policy_network`, sized by
    the network section (`--hidden`, `--activation`).
    """

    variant: str = "openai"
    """openai (Adam on the search gradient), ars_v1 (ARS) or ars_v2 (ARS with online observation normalisation)."""
    population: int = bounded(64, Bound(2))
    """Members per generation, even (antithetic pairs: for ARS, twice the directions); split evenly over every device (Anakin) or actor thread (Sebulba)."""
    sigma: float = bounded(0.05, POSITIVE)
    """Standard deviation of the parameter perturbations (ARS's exploration noise nu)."""
    es_lr: float = bounded(0.03, POSITIVE)
    """OpenAI-ES: Adam's learning rate on the search gradient. ARS: the step size alpha. (--lr is PPO's optimiser.)"""
    top_directions: int = bounded(0, NON_NEGATIVE)
    """ARS only: directions kept for the update (b); 0 keeps all of them."""
    weight_decay: float = bounded(0.0, NON_NEGATIVE)
    """OpenAI-ES only: L2 coefficient on the mean parameters."""
    low_rank: int = bounded(0, NON_NEGATIVE)
    """OpenAI-ES only: 0 perturbs every weight matrix with full-rank Gaussian noise (the paper's); r > 0 with a rank-r product of Gaussian factors (EGGROLL-style, a different search distribution), which Anakin applies to all members at the cost of one shared matrix product per layer."""
    episodes_per_member: int = bounded(1, POSITIVE)
    """Episodes each member is evaluated on; its fitness is their mean return."""
    horizon: int = bounded(0, NON_NEGATIVE)
    """Anakin: environment steps per evaluation episode (0: the environment's own time limit)."""
    generations_per_call: int = bounded(10, POSITIVE)
    """Anakin: generations fused into one jitted call; the host syncs (and logs) between calls."""
    eval_episodes: int = bounded(16, POSITIVE)
    """Episodes the mean parameters are evaluated on after each call (Anakin) or in each generation (Sebulba): mean_params_return."""

    def __post_init__(self):
        if self.variant not in VARIANTS:
            raise ValueError(f"--variant must be one of {', '.join(VARIANTS)}, got {self.variant!r}")
        check_bounds(self)
        if self.population % 2:
            raise ValueError(f"--population must be even (antithetic pairs), got {self.population}")
        if self.variant == "openai" and self.top_directions:
            raise ValueError("--top-directions applies to the ARS variants only; "
                             "drop it or choose --variant=ars_v1 or ars_v2")
        if self.variant != "openai" and self.weight_decay:
            raise ValueError("--weight-decay applies to --variant=openai only; drop it for ARS")
        if self.variant != "openai" and self.low_rank:
            raise ValueError("--low-rank applies to --variant=openai only; drop it for ARS")
        if self.top_directions > self.population // 2:
            raise ValueError(f"--top-directions must be at most --population / 2 = "
                             f"{self.population // 2}, got {self.top_directions}")

    @property
    def normalize_observations(self) -> bool:
        """ARS V2 reads observations through running statistics; the others read them raw."""
        return self.variant == "ars_v2"


def make_strategy(config: ESConfig, param_shapes=None) -> Strategy:
    """The `init / ask / tell` strategy `config` describes (fitness maximised).

    `param_shapes`: the policy's parameter shapes in `ravel_pytree` order,
    needed for `low_rank` noise.
    """
    if config.variant == "openai":
        return make_openai_es(config.population, config.sigma, optax.adam(config.es_lr),
                              config.weight_decay, config.low_rank, param_shapes)
    directions = config.population // 2
    return make_ars(directions, config.top_directions or directions, config.es_lr, config.sigma)
