"""Dataset settings of a training run: record one after it, warm-start from one before it."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """RLDS datasets (tensorflow-datasets, array_record; needs `pip install 'podracer[data]'`)."""

    record_dataset: str = ""
    """After training, record --record-episodes episodes of the trained policy into this new
    directory."""
    record_episodes: int = 10
    """Episodes to record with --record-dataset."""
    record_deterministic: bool = False
    """Record the policy's most likely action instead of a sampled one."""
    init_from_dataset: str = ""
    """Before training, clone the policy from the RLDS dataset in this directory (behaviour cloning)."""
    bc_steps: int = 2000
    """Behaviour-cloning updates for --init-from-dataset."""
    bc_batch_size: int = 256
    """Demonstrated steps per behaviour-cloning update."""
    bc_lr: float = 1e-3
    """Adam learning rate of behaviour cloning."""
    bc_value_coef: float = 0.5
    """Weight of fitting the value head to the dataset's discounted returns during cloning."""

    def __post_init__(self):
        for name in ("record_episodes", "bc_steps", "bc_batch_size"):
            if getattr(self, name) <= 0:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} must be positive, got {getattr(self, name)}")
        if self.bc_lr <= 0 or self.bc_value_coef < 0:
            raise ValueError("--bc-lr must be > 0 and --bc-value-coef >= 0")
