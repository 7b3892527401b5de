"""Sebulba's thread set, the same for every algorithm: actor threads and a learner, stopped together.

The main thread starts the actors and the learner inside the run session's
training block and waits for them there, where signal handlers run: a signal
sets the session's flag, which the learner polls (it saves, and on several
processes stops after the same update as the others); a failure in any thread
stops all of them and is re-raised here.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

from podracer.sebulba.control import Control, wait_for_threads
from podracer.session.session import RunSession


def actor_thread(control: Control, body: Callable[[Any], None], record: Any, actor_id: int,
                 name: str) -> threading.Thread:
    """A daemon thread running `body(record)`, its failure reported through `control`."""
    return threading.Thread(target=control.guard(body, f"actor thread {actor_id}"), args=(record,),
                            name=f"{name}-{actor_id}", daemon=True)


def run_threads(session: RunSession, control: Control, actors: Sequence[threading.Thread],
                learn: Callable[[], Any], name: str) -> Any:
    """Run `actors` and a learner thread running `learn()`; returns what `learn` returned.

    None if the learner did not finish (another thread failed: that failure is
    raised instead). `learn` reads `session.stop` to notice a signal.
    """
    result: list = []
    learner = threading.Thread(target=control.guard(lambda: result.append(learn()), "learner thread"),
                               name=name, daemon=True)
    with session.training():
        for thread in (*actors, learner):
            thread.start()
        wait_for_threads(control, learner, actors)
    return result[0] if result else None
