"""Dataset settings of a training run: record one after it, warm-start from one before it."""

from __future__ import annotations

import dataclasses

from podracer.bounds import NON_NEGATIVE, POSITIVE, bounded, check_bounds


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """RLDS datasets (tensorflow-datasets, array_record; needs `pip install -e ".[data]"`)."""

    record_dataset: str = ""
    """After training, record --record-episodes episodes of the trained policy into this new (or
    empty) directory; may be gs://BUCKET/PATH (written locally, then uploaded)."""
    record_episodes: int = bounded(10, POSITIVE)
    """Episodes to record with --record-dataset."""
    record_deterministic: bool = False
    """Record the policy's most likely action instead of a sampled one."""
    init_from_dataset: str = ""
    """Before training, clone the policy from the RLDS dataset in this directory (behaviour cloning);
    may be gs://BUCKET/PATH."""
    bc_steps: int = bounded(2000, POSITIVE)
    """Behaviour-cloning updates for --init-from-dataset."""
    bc_batch_size: int = bounded(256, POSITIVE)
    """Demonstrated steps per behaviour-cloning update."""
    bc_lr: float = bounded(1e-3, POSITIVE)
    """Adam learning rate of behaviour cloning."""
    bc_value_coef: float = bounded(0.5, NON_NEGATIVE)
    """Weight of fitting the value head to the dataset's discounted returns during cloning."""

    def __post_init__(self):
        check_bounds(self)
