"""Run directories that are local paths or `gs://bucket/path` URLs, through `etils.epath`.

A run's outputs take either kind of directory without special cases:

- checkpoints: orbax (tensorstore for the arrays, `epath` for the rest) takes a
  `gs://` directory itself;
- small files read or written whole (`summary.json`, the resume check, plots):
  the functions here (`exists`, `read_text`, `write_text`, ...), on `epath`,
  which reaches `gs://` through fsspec's `gcsfs` (TensorFlow's gfile where
  TensorFlow is installed);
- files that libraries write only to a local disk, or that grow by appends
  (TensorBoard events from tensorboardX, the `jax.profiler` trace,
  `metrics.jsonl`: Cloud Storage objects cannot be appended to): `Staging`
  writes them into a local directory and `sync()` copies what changed to the
  run directory. For a local run directory the staging directory is the run
  directory itself and `sync()` does nothing;
- whole directories that libraries read or write only on a local disk (RLDS
  datasets: array_record files): `upload_tree` after writing them locally,
  `downloaded` (a temporary local copy) before reading them.

Credentials and endpoints are those of the libraries (Application Default
Credentials; `STORAGE_EMULATOR_HOST` and `TENSORSTORE_GCS_HTTP_URL` where the
libraries document them); nothing here chooses either.
"""

from __future__ import annotations

import contextlib
import errno
import os
import posixpath
import shutil
import tempfile
import threading
import uuid
from typing import Iterable, Iterator

from podracer.errors import PodracerError

REMOTE_SCHEME = "gs://"
EXTRA = "gcs"  # the optional dependency that brings gcsfs


def is_remote(path: str) -> bool:
    """Whether `path` is a URL (`gs://...`) rather than a local path."""
    return "://" in os.fspath(path)


def check(path: str) -> None:
    """Refuse, in one line, a run directory podracer cannot write: another scheme, or `gs://`
    without the `gcs` extra. Local paths pass."""
    path = os.fspath(path)
    if not is_remote(path):
        return
    if not path.startswith(REMOTE_SCHEME) or not path[len(REMOTE_SCHEME):].split("/")[0]:
        raise PodracerError(f"{path} is neither a local directory nor gs://BUCKET/PATH; "
                            f"pass one of those")
    try:
        import gcsfs  # noqa: F401  (epath reaches gs:// through it)
    except ImportError:
        raise PodracerError(f"{path} needs the optional '{EXTRA}' dependency (gcsfs); "
                            f"pip install 'podracer-rl[{EXTRA}]'") from None


def _path(path: str):
    from etils import epath

    check(path)
    return epath.Path(path)


def join(base: str, *names: str) -> str:
    """`base/name/...`; a URL stays a URL (`os.path` would turn `gs://b` into `gs:/b`)."""
    if is_remote(base):
        return posixpath.join(base, *names)
    return os.path.join(base, *names)


def name(path: str) -> str:
    """The last component of a directory's path: `gs://b/runs/x/` -> `x`."""
    path = os.fspath(path)
    if is_remote(path):
        return posixpath.basename(path.rstrip("/"))
    return os.path.basename(os.path.abspath(path))


def _fresh(path: str):
    """`path`'s epath Path, any listing cached for it or its parents dropped first.

    gcsfs caches directory listings and answers later questions from them, so a
    file another process (a TPU worker, another host) wrote since would stay
    unseen; every read here asks the bucket.
    """
    target = _path(path)
    if is_remote(path):
        from etils.epath import backend

        backend.fsspec_backend.fs(os.fspath(path)).invalidate_cache(os.fspath(path))
    return target


def exists(path: str) -> bool:
    return _fresh(path).exists()


def isdir(path: str) -> bool:
    return _fresh(path).is_dir()


def read_text(path: str) -> str:
    return _fresh(path).read_text()


def listdir(path: str) -> list[str]:
    """The names in the directory `path`, sorted; [] if there is none."""
    folder = _fresh(path)
    if not folder.is_dir():
        return []
    return sorted(child.name for child in folder.iterdir())


def write_text(path: str, text: str) -> None:
    """Replace the file at `path` with `text`; a reader never sees it half-written.

    A Cloud Storage object is replaced whole by one upload; a local file is
    written beside and renamed over the old one.
    """
    if is_remote(path):
        _path(path).write_text(text)
        return
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def probe_writable(run_dir: str, flag: str = "--run-dir") -> None:
    """Create `run_dir` (locally, with parents) and prove it can be written; one-line error
    (naming the option `flag` that gave it) if not.

    Cloud Storage has no directories: a `gs://` directory is proved by
    writing and deleting an object in it, which also proves the bucket exists
    (nothing creates buckets).
    """
    probe = join(run_dir, f".write-test-{uuid.uuid4().hex[:12]}")  # one per process
    if not is_remote(run_dir):
        try:
            os.makedirs(run_dir, exist_ok=True)
            _create_and_remove(probe)
        except OSError as err:
            raise PodracerError(f"cannot write to {flag}={run_dir} ({err.strerror}); "
                                f"pass a directory you can write to") from None
        return
    target = _path(probe)
    try:
        target.write_text("")
        target.unlink()
    except Exception as err:  # noqa: BLE001 - gcsfs raises OSError subclasses and HTTP errors
        raise PodracerError(f"cannot write to {flag}={run_dir} ({failure(err)}); pass a bucket and "
                            f"path you can write to (and check your Google Cloud credentials)") from None


def probe_creatable(path: str, flag: str) -> None:
    """Prove that the local file or directory `path` (and its missing parents) can be created,
    leaving nothing behind; one-line error naming the option `flag` that gave it if not.

    A file is created and removed in the nearest directory that exists, so a
    path under a file, on a read-only disk or in a directory without write
    permission is refused before anything runs. (`gs://` paths: `probe_writable`.)
    """
    folder = os.path.abspath(path)
    if not os.path.isdir(folder):
        folder = os.path.dirname(folder)
    while not os.path.lexists(folder):
        folder = os.path.dirname(folder)
    try:
        _create_and_remove(os.path.join(folder, f".write-test-{uuid.uuid4().hex[:12]}"))
    except OSError as err:
        raise PodracerError(f"cannot write {flag}={path} ({err.strerror}: {folder}); "
                            f"pass a path you can write to") from None


def _create_and_remove(local_path: str) -> None:
    with open(local_path, "w"):
        pass
    os.remove(local_path)


def disk_full(err: BaseException | None) -> str | None:
    """The system's words when `err`, or an error that led to it, is a full disk or quota; else None.

    Python raises OSError(ENOSPC); tensorstore (orbax's arrays) a ValueError
    that quotes the system's message.
    """
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return os.strerror(err.errno)
        for words in (os.strerror(errno.ENOSPC), os.strerror(errno.EDQUOT)):
            if words in str(err):
                return words
        err = err.__cause__ or err.__context__
    return None


def failure(err: BaseException) -> str:
    """What went wrong in a Cloud Storage call, in a few words (gcsfs raises OSError subclasses
    and HTTP errors whose text is often a URL)."""
    if isinstance(err, FileNotFoundError):
        return "no such bucket"
    if isinstance(err, PermissionError):
        return "permission denied"
    return f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0]}"


def upload(local: str, remote: str) -> None:
    """Copy the local file `local` to `remote` (a URL), replacing it."""
    with open(local, "rb") as src, _path(remote).open("wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)


def glob(base: str, pattern: str) -> list[str]:
    """The paths under the directory `base` that match `pattern` (`*/name`), sorted."""
    found = (os.fspath(match) for match in _fresh(base).glob(pattern))
    if is_remote(base):  # gcsfs gives bucket/path: put the scheme back
        found = (match if is_remote(match) else REMOTE_SCHEME + match for match in found)
    return sorted(found)


def upload_tree(local: str, remote: str, last: Iterable[str] = ()) -> int:
    """Copy every file under the local directory `local` to the same relative path under
    `remote` (a URL); returns the count.

    Files named in `last` go after all others, so that a reader that looks for
    them (a dataset's `dataset_info.json`) never finds a copy cut short.
    """
    last = set(last)
    files = _files_under(local, ".")
    files.sort(key=lambda relative: os.path.basename(relative) in last)
    for relative in files:
        upload(os.path.join(local, relative),
               join(remote, *os.path.normpath(relative).split(os.sep)))
    return len(files)


def download_tree(remote: str, local: str) -> int:
    """Copy every object under `remote` (a URL) to the same relative path under the local
    directory `local`; returns the count."""
    count = 0
    for child in _fresh(remote).iterdir():
        target = os.path.join(local, child.name)
        if child.is_dir():
            count += download_tree(join(remote, child.name), target)
            continue
        os.makedirs(local, exist_ok=True)
        with child.open("rb") as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        count += 1
    return count


@contextlib.contextmanager
def downloaded(path: str, prefix: str = "podracer-download-") -> Iterator[str]:
    """A local directory holding what is under the directory `path`: `path` itself when it
    is local; for a URL a temporary copy (in `tempfile`'s directory: `TMPDIR`),
    removed when the block ends."""
    if not is_remote(path):
        yield path
        return
    local = tempfile.mkdtemp(prefix=prefix)
    try:
        download_tree(path, local)
        yield local
    finally:
        shutil.rmtree(local, ignore_errors=True)


class Staging:
    """A local directory for files written locally and published to the run directory by `sync()`.

    For a local run directory `local` is the run directory and `sync()` does
    nothing. For a `gs://` one, `local` is a new temporary directory (made on
    first use); `sync()` uploads each file that changed since it last did, to
    the same relative path under the run directory; `close()` removes it.
    """

    def __init__(self, run_dir: str):
        self.run_dir = run_dir
        self.remote = is_remote(run_dir)
        self._local: str | None = None if self.remote else run_dir
        self._uploaded: dict[str, tuple[int, int]] = {}  # relative path -> (size, mtime_ns) sent
        self._lock = threading.Lock()

    @property
    def local(self) -> str:
        """The local directory to write into."""
        if self._local is None:
            self._local = tempfile.mkdtemp(prefix="podracer-staging-")
        return self._local

    def path(self, *names: str) -> str:
        """Where to write `RUN_DIR/names...` locally."""
        return os.path.join(self.local, *names)

    def published(self, local_path: str | None) -> str | None:
        """The run-directory path that `sync()` gives the local file `local_path`."""
        if local_path is None or not self.remote:
            return local_path
        relative = os.path.relpath(local_path, self.local)
        return self.run_dir if relative == "." else join(self.run_dir, *relative.split(os.sep))

    def sync(self, names: Iterable[str] | None = None) -> int:
        """Upload what changed under `names` (top-level entries; all by default); returns the count."""
        if not self.remote or self._local is None:
            return 0
        with self._lock:
            tops = list(names) if names is not None else sorted(os.listdir(self._local))
            sent = 0
            for top in tops:
                for relative in _files_under(self._local, top):
                    stat = os.stat(os.path.join(self._local, relative))
                    if self._uploaded.get(relative) == (stat.st_size, stat.st_mtime_ns):
                        continue
                    upload(os.path.join(self._local, relative), join(self.run_dir, *relative.split(os.sep)))
                    self._uploaded[relative] = (stat.st_size, stat.st_mtime_ns)
                    sent += 1
            return sent

    def close(self) -> None:
        """Remove a temporary staging directory (after its last `sync()`)."""
        if self.remote and self._local is not None:
            shutil.rmtree(self._local, ignore_errors=True)
            self._local = None
            self._uploaded.clear()


def _files_under(root: str, top: str) -> list[str]:
    """Relative paths of the files at or under `root/top`."""
    start = os.path.join(root, top)
    if os.path.isfile(start):
        return [top]
    found = []
    for folder, _, files in os.walk(start):
        found += [os.path.relpath(os.path.join(folder, f), root) for f in sorted(files)]
    return found
