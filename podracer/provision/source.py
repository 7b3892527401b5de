"""Which podracer the workers install, and which launcher they run.

The workers should run the code that started the slice: the checked-out commit
of a git checkout with a remote they can fetch. Anything else needs
`--install-spec`. The launcher file itself is not part of the package, so the
startup script carries a copy of it.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from podracer.errors import PodracerError

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_LAUNCHER = REPO_ROOT / "launch" / "tpu.py"


def read_launcher(path: Path) -> str:
    try:
        return path.read_text()
    except OSError as error:
        raise PodracerError(
            f"cannot read the launcher {path} ({error.strerror}); run from a podracer "
            "checkout or pass --launcher=PATH") from None


def public_git_url(url: str) -> str | None:
    """An https URL a fresh TPU worker can fetch, without any user name or token in it.

    `git@github.com:o/r.git` and `ssh://git@github.com/o/r.git` become
    `https://github.com/o/r.git`; a local path gives None (workers cannot reach it).
    """
    url = url.strip()
    scp_like = re.fullmatch(r"(?:[\w.-]+@)?([\w.-]+\.[\w.-]+):(?!/)(.+)", url)
    if scp_like:
        return f"https://{scp_like.group(1)}/{scp_like.group(2)}"
    parts = urlsplit(url)
    if parts.scheme not in ("https", "http", "ssh", "git") or not parts.hostname:
        return None
    host = parts.hostname + (f":{parts.port}" if parts.port and parts.scheme != "ssh" else "")
    return urlunsplit(("https", host, parts.path, "", ""))


def _git(root: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True,
                              text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


# The distribution's name (the import package is `podracer`; that name on PyPI is
# another project's, so nothing here ever asks an index for it).
DISTRIBUTION = "podracer-rl"


def default_install_spec(root: Path = REPO_ROOT) -> tuple[str, list[str]]:
    """The pip requirement for the code running now, and notes for the user."""
    commit = _git(root, "rev-parse", "HEAD")
    remote = _git(root, "remote", "get-url", "origin")
    url = public_git_url(remote) if remote else None
    if not (commit and url):
        raise PodracerError(
            "the workers cannot install this code: it is not a git checkout with an `origin` "
            "remote they can fetch; run from one (its commit pushed), or pass --install-spec=REQ")
    notes = [f"workers install commit {commit[:12]} from {url}; it must be pushed there"]
    if _git(root, "status", "--porcelain", "--untracked-files=no"):
        notes.append("your uncommitted changes are not on the workers; commit and push "
                     "them, or pass --install-spec")
    return f"{DISTRIBUTION} @ git+{url}@{commit}", notes
