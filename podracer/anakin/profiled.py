"""Anakin in profile mode: the one program split into phases that the host times apart.

Production Anakin fuses acting and learning into one jitted program per
`updates_per_call` updates, so the host cannot see inside it. Profile mode
compiles each phase as its own program (an agent: acting, learning, the same
steps the fused program runs (`podracer.anakin.loop.make_programs`); ES names them
evaluating the population and `tell`, and adds evaluating the mean parameters), runs them one after
the other and waits for each, so `measure` times each phase. The computation is
the same; steps/s in profile mode are not the production figure (a host round
trip and a device sync between phases, no fusion across them).
"""

from __future__ import annotations

from typing import Callable

import jax
import numpy as np

from podracer.protocol import parallel

NOTE = ("Anakin profile mode splits the one jitted program into separately compiled phases "
        "and waits for each; its steps/s are not the production figure")

Measure = Callable[[str], object]  # `Profiler.measure`


def stack_metrics(rows: list[dict]) -> dict:
    """Per-update metrics on the host, stacked as the fused program stacks them."""
    rows = [parallel.to_host(row) for row in rows]
    return jax.tree.map(lambda *values: np.stack(values), *rows)


def compile_agent_phases(act, learn, runner):
    """Ahead-of-time compiled `act` and `learn` (`loop.Programs`) for `runner`'s shapes."""
    act_lowered = act.lower(runner)
    _, experience = act_lowered.out_info
    return act_lowered.compile(), learn.lower(runner.train, experience).compile()


def make_profiled_train(act, learn, updates_per_call: int, measure: Measure,
                        names: tuple[str, str] = ("acting", "learning")) -> Callable:
    """`train(runner) -> (runner, metrics)` like `loop.Programs.train`, each phase timed on its own
    under `names` (ES: "evaluate", the population's episodes, and "tell")."""

    def train(runner):
        rows = []
        for _ in range(updates_per_call):
            with measure(names[0]):
                runner, experience = jax.block_until_ready(act(runner))
            with measure(names[1]):
                train_state, metrics = jax.block_until_ready(learn(runner.train, experience))
            runner = runner._replace(train=train_state)
            rows.append(metrics)
        with measure("metrics_to_host"):
            return runner, stack_metrics(rows)

    return train
