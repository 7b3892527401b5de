"""Anakin's host loop, the same for every algorithm: dispatch a call, log the last, save, stop.

An Anakin run is a sequence of calls of one jitted `step(runner) -> (runner,
metrics)` (PPO: `updates_per_call` updates; ES: `generations_per_call`
generations). The host dispatches call c + 1 before it reads call c's metrics,
so logging overlaps the device's work; it saves every `--checkpoint-every`
env steps (whole calls), at the end and on a signal, and every process stops
after the same call.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, NamedTuple

import jax

from podracer.protocol import parallel
from podracer.session.session import RunSession


class Calls(NamedTuple):
    """Where a run's calls start and end, and how many env steps each is."""

    start: int  # calls already made (a resumed run's checkpoint)
    total: int
    steps_per_call: int


class Init(NamedTuple):
    """A run's jitted `init` and the arguments it takes for a seed key (a population's: its agents')."""

    program: Any  # jitted
    inputs: Callable[[Any], tuple]  # key -> the program's arguments

    def __call__(self, key) -> Any:
        return self.program(*self.inputs(key))

    @classmethod
    def of_key(cls, program) -> "Init":
        return cls(program, lambda key: (key,))


class Program(NamedTuple):
    """What a pair builds before anything runs: its environment, network and jitted functions."""

    env: Any
    network: Any  # the actor-critic (PPO) or the policy whose parameters evolve (ES)
    layout: Any  # sizes derived from the config and the mesh
    calls: Calls  # `start` 0: the session knows whether it resumes
    init: Init  # `init(key) -> runner`
    step: Any  # jitted `step(runner) -> (runner, metrics)`: one call
    phases: Any  # the step's phases as separate programs, to profile; else None


def open_with_programs(session: RunSession, built: Program, seed: int) -> tuple[Any, dict, Any, float]:
    """Compile `init` and (unless profiling) `step` side by side, then open the run from `init`'s state.

    Returns the state to start from (restored, when resuming), the checkpoint's
    meta, the compiled step (None when profiling: its phases compile instead)
    and the seconds spent compiling.
    """
    init_args = built.init.inputs(jax.random.PRNGKey(seed))
    start = time.perf_counter()
    init, step = session.compiled_init_and_step(built.init.program, init_args,
                                                None if session.profiler else built.step)
    compile_s = time.perf_counter() - start
    state, meta = session.open(init(*init_args))
    return state, meta, step, compile_s


class Outcome(NamedTuple):
    runner: Any
    calls: int  # calls made in all, those before a resume included
    stopped: bool  # a signal ended the run before its last call


def run_calls(session: RunSession, step: Callable, runner: Any, calls: Calls,
              record: Callable[[int, Any], None], profile_note: str | None = None) -> Outcome:
    """Run `step` from call `calls.start` to `calls.total`; `record(call, metrics)` logs a call.

    `record` runs before a save that follows its call, so a NaN guard in it
    stops the run before a non-finite state is written.
    """
    every = session.checkpoint.checkpoint_every
    save_every = math.ceil(every / calls.steps_per_call) if every else 0

    def log(call: int, metrics) -> None:
        with session.measure("logging"):
            record(call, metrics)

    done, stopping = calls.start, False
    with session.training(profile_note) as stop:
        pending = None
        for call in range(calls.start, calls.total):
            runner, metrics = step(runner)  # dispatched: the host logs the last call meanwhile
            if pending is not None:
                log(*pending)
            pending = (call, metrics)
            done = call + 1
            stopping = parallel.any_process(bool(stop))  # every process stops at the same call
            if done == calls.total or stopping or (save_every and done % save_every == 0):
                log(*pending)
                pending = None
                session.save(done * calls.steps_per_call, runner, {"calls": done})
            if stopping:
                break
        jax.block_until_ready(runner)
    return Outcome(runner, done, stopping)
