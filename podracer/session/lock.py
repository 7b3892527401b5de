"""One writer per run directory: a lock for a local one, a lease for `gs://`.

Two runs writing one directory would interleave their checkpoints and tear
`metrics.jsonl`, so the command line takes the run directory before it writes
anything there, and a second run is refused in one line that names the holder
(host, process id, start time). On several processes only process 0 holds it.

- Local: `RUN_DIR/run.lock`, locked with `flock`, which the operating system
  releases when the holder dies, however it dies. The file says who holds it;
  a lock file whose holder is gone is taken over with a one-line notice.
- `gs://`: an object `RUN_DIR/run.lock` written only if absent (Cloud Storage's
  `ifGenerationMatch=0` precondition) and renewed every `RENEW_S` by
  rewriting it at the generation this process last wrote. A lease not renewed
  for `LEASE_S`, or one of a process no longer running on this host, is stale:
  it is replaced at its generation, so of two runs taking it over at once one
  wins. This needs `google-cloud-storage` (the `gcs` extra).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import sys
import threading
import time
from typing import NamedTuple

from podracer.errors import PodracerError
from podracer import storage

LOCK_NAME = "run.lock"
LEASE_S = 60.0
RENEW_S = 15.0


class Holder(NamedTuple):
    host: str
    pid: int
    started: float  # seconds since the epoch

    @classmethod
    def me(cls) -> "Holder":
        return cls(socket.gethostname(), os.getpid(), time.time())

    @classmethod
    def parse(cls, text: str) -> "Holder | None":
        try:
            record = json.loads(text)
            return cls(str(record["host"]), int(record["pid"]), float(record["started"]))
        except (ValueError, KeyError, TypeError):
            return None  # empty (a holder that died while writing it) or not ours

    def text(self) -> str:
        return json.dumps(self._asdict())

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"host {self.host}, pid {self.pid}, started {when}"

    def gone(self) -> bool:
        """Whether this holder is a process of this host that no longer runs."""
        if self.host != socket.gethostname():
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # another user's live process
            return False
        return False


def _refusal(run_dir: str, holder: Holder | None) -> PodracerError:
    who = holder.describe() if holder else "another process"
    return PodracerError(f"--run-dir={run_dir} is in use by another run ({who}); wait for it to end "
                         f"or stop it, or pass another --run-dir")


def _took_over(run_dir: str, holder: Holder, why: str) -> None:
    print(f"taking over --run-dir={run_dir} from a run that {why} ({holder.describe()})",
          file=sys.stderr, flush=True)


class LocalLock:
    """`RUN_DIR/run.lock`, held with `flock` while this object is open."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir
        self.path = os.path.join(run_dir, LOCK_NAME)
        try:
            os.makedirs(run_dir, exist_ok=True)
            self._fd = self._open_locked()
        except OSError as err:
            raise PodracerError(f"cannot write to --run-dir={run_dir} ({err.strerror}); "
                                f"pass a directory you can write to") from None
        previous = Holder.parse(os.pread(self._fd, 4096, 0).decode(errors="replace"))
        if previous is not None:
            _took_over(run_dir, previous, "ended without releasing it")
        mine = Holder.me().text().encode()
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, mine, 0)

    def _open_locked(self) -> int:
        import fcntl

        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = Holder.parse(os.pread(fd, 4096, 0).decode(errors="replace"))
                os.close(fd)
                raise _refusal(self.run_dir, holder) from None
            # The holder removes the file as it releases it: a lock on a removed file is no lock.
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                return fd
            os.close(fd)

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            os.remove(self.path)
        os.close(self._fd)
        self._fd = None


class Lease:
    """`RUN_DIR/run.lock` in a bucket, renewed by a daemon thread while this object is open."""

    def __init__(self, run_dir: str):
        from google.api_core import exceptions

        self.run_dir = run_dir
        self._precondition = exceptions.PreconditionFailed
        self._blob = _blob(storage.join(run_dir, LOCK_NAME))
        self._holder = Holder.me()
        self._generation = self._take(exceptions)
        self._stop = threading.Event()
        self._renewing = threading.Thread(target=self._renew, name="podracer-lease", daemon=True)
        self._renewing.start()

    def _take(self, exceptions) -> int:
        try:
            return self._write(0)
        except self._precondition:
            pass
        except exceptions.GoogleAPICallError as err:
            detail = ("no such bucket" if isinstance(err, exceptions.NotFound) else
                      "permission denied" if isinstance(err, exceptions.Forbidden) else err.message)
            raise PodracerError(f"cannot write to --run-dir={self.run_dir} ({detail}); pass a bucket and path "
                                f"you can write to (and check your Google Cloud credentials)") from None
        try:  # held, or was: whose, and since when was it renewed?
            self._blob.reload()
            holder = Holder.parse(self._blob.download_as_text(if_generation_match=self._blob.generation))
            generation, renewed = self._blob.generation, self._blob.updated
        except (exceptions.NotFound, self._precondition):  # released or renewed meanwhile: look again
            return self._take(exceptions)
        age = (datetime.datetime.now(datetime.timezone.utc) - renewed).total_seconds()
        if holder is not None and age < LEASE_S and not holder.gone():
            raise _refusal(self.run_dir, holder)
        try:
            taken = self._write(generation)
        except self._precondition:  # another run took it over first
            self._blob.reload()
            raise _refusal(self.run_dir, Holder.parse(self._blob.download_as_text())) from None
        if holder is not None:
            _took_over(self.run_dir, holder, "is no longer running" if holder.gone()
                       else f"has not renewed its lease for {age:.0f} s")
        return taken

    def _write(self, generation: int) -> int:
        self._blob.upload_from_string(self._holder.text(), content_type="application/json",
                                      if_generation_match=generation)
        return self._blob.generation

    def _renew(self) -> None:
        while not self._stop.wait(RENEW_S):
            try:
                self._generation = self._write(self._generation)
            except self._precondition:
                print(f"warning: the lease on --run-dir={self.run_dir} was taken over by another run; "
                      f"stop one of them", file=sys.stderr, flush=True)
                return
            except Exception:  # noqa: BLE001 - a failed renewal is retried at the next one
                continue

    def release(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._renewing.join(timeout=RENEW_S)  # a renewal in flight: its generation is the one to delete
        with contextlib.suppress(Exception):  # a lease left behind goes stale by itself
            self._blob.delete(if_generation_match=self._generation)


def _blob(url: str):
    """The google-cloud-storage object at `gs://bucket/name` (credentials and endpoint: the library's)."""
    try:
        from google.cloud import storage as gcs
    except ImportError:
        raise PodracerError(f"--run-dir={url.rsplit('/', 1)[0]} needs google-cloud-storage; "
                            f"pip install 'podracer-rl[{storage.EXTRA}]'") from None
    bucket, _, name = url[len(storage.REMOTE_SCHEME):].partition("/")
    try:
        client = gcs.Client()
    except Exception as err:  # noqa: BLE001 - no credentials, no project: google-auth's many types
        raise PodracerError(f"cannot reach Cloud Storage for {url} ({storage.failure(err)}); check your "
                            f"Google Cloud credentials (gcloud auth application-default login)") from None
    return client.bucket(bucket).blob(name)


def acquire(run_dir: str) -> LocalLock | Lease:
    """Hold `run_dir` for this run (see the module's docstring); `release()` when the run ends."""
    return Lease(run_dir) if storage.is_remote(run_dir) else LocalLock(run_dir)
