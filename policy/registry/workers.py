"""Thread-parallel map for shard and chunk work.

Threads, not processes: zstd, hashlib and numpy's array loops release the GIL, so encode, decode
and hashing of separate chunks run on every core without copying tensors between processes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import TypeVar

from tqdm import tqdm

T = TypeVar("T")
R = TypeVar("R")


def resolve_workers(workers: int) -> int:
    """``0`` means one thread per core."""
    return workers if workers > 0 else (os.cpu_count() or 1)


def pmap(fn: Callable[[T], R], items: Sequence[T], workers: int, *, desc: str | None = None,
         progress: bool = False) -> list[R]:
    """``[fn(x) for x in items]`` on ``workers`` threads, in order; the first exception is raised."""
    bar = None
    if progress and items:
        bar = tqdm(total=len(items), desc=desc, unit="item", leave=False)
    try:
        if workers <= 1 or len(items) <= 1:
            out = []
            for x in items:
                out.append(fn(x))
                if bar is not None:
                    bar.update()
            return out
        with ThreadPoolExecutor(max_workers=min(workers, len(items))) as pool:
            futures = [pool.submit(fn, x) for x in items]
            if bar is not None:
                for f in futures:
                    f.add_done_callback(lambda _f: bar.update())
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            for f in futures:
                if f.done() and f.exception() is not None:
                    for other in futures:
                        other.cancel()
                    raise f.exception()  # type: ignore[misc]
            return [f.result() for f in futures]
    finally:
        if bar is not None:
            bar.close()
