"""Shared bench helpers: timing, the readable table and the final JSON line."""

from __future__ import annotations

import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# XLA:CPU's concurrency-optimized scheduler (jaxlib 0.10.2) can leave a program
# waiting forever with every thread idle: the single-file PPO's vmap of 2 or 16
# seeds hung in most runs on an AVX-512 x86-64 here and always finished without
# it. Every bench turns it off, for podracer and its peers alike, before JAX starts.
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_cpu_enable_concurrency_optimized_scheduler=false"]).strip()


def timed(fn, *args):
    """(result, seconds) with every output ready."""
    import jax

    start = time.perf_counter()
    out = fn(*args)
    jax.block_until_ready(out)
    return out, time.perf_counter() - start


def machine() -> str:
    import jax

    return f"{platform.machine()} {os.cpu_count()} cpus, jax {jax.__version__}, {jax.devices()[0].platform}"


def report(title: str, rows: list[tuple[str, ...]], header: tuple[str, ...], result: dict) -> None:
    """Print a table, then `result` as the last line (one JSON object)."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    print(f"{title}  ({machine()})")
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)))
    print(json.dumps(result))
