"""The cache of built checkpoint folders: build once, publish atomically, reuse.

Owns a build's fingerprint (a short hash of everything the build depends on),
the completion marker that carries it, and `ensure_built`: return a finished
folder at once, else build into a temporary sibling, mark it, and rename it
into place. The checkpoint makers (make_proxy.py, make_dense.py) decide what
is built and under which fingerprint; this file only keeps the results.

Must never: leave a half-built folder where a finished one is expected (the
marker is written last, into the temporary folder, before the rename), or
replace a finished build of the same fingerprint that another process
published first.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tinyengine.tools.smollm2 import default_cache_dir

MARKER_NAME = ".tinyengine-complete.json"


def fingerprint(*parts: Any) -> str:
    """A short stable hash of JSON-able build inputs."""
    blob = json.dumps(list(parts), sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def is_complete(folder: str | os.PathLike[str], fingerprint: str | None = None) -> bool:
    """True when `folder` holds a finished build (of this exact build, when
    a fingerprint is given)."""
    try:
        info = json.loads((Path(folder) / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return False
    return fingerprint is None or info.get("fingerprint") == fingerprint


def ensure_built(
    folder_name: str,
    fingerprint: str,
    build: Callable[[Path], object],
    info: dict[str, Any],
    cache_dir: str | None = None,
) -> str:
    """The path of a finished folder `folder_name` under `cache_dir`
    ($TINYENGINE_CACHE or ~/.cache/tinyengine): returned at once when its
    marker carries `fingerprint`, else `build(tmp)` fills a temporary sibling
    that is then marked (`info` + timing) and renamed into place."""
    root = Path(cache_dir or default_cache_dir()).expanduser()
    folder = root / folder_name
    if is_complete(folder, fingerprint):
        return str(folder)
    root.mkdir(parents=True, exist_ok=True)
    # A sibling temp folder keeps the final rename on one filesystem (atomic).
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder_name}.building-", dir=root))
    try:
        start = time.perf_counter()
        build(tmp)
        marker = {
            "fingerprint": fingerprint,
            **info,
            "build_seconds": round(time.perf_counter() - start, 1),
        }
        tmp.chmod(0o755)  # mkdtemp makes it owner-only; a cache is for everyone
        text = json.dumps(marker, indent=2, ensure_ascii=False) + "\n"
        (tmp / MARKER_NAME).write_text(text, encoding="utf-8")
        _publish(tmp, folder, fingerprint)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return str(folder)


def _publish(tmp: Path, folder: Path, fingerprint: str) -> None:
    """Move a finished build into place; if another process finished the same
    build first, keep theirs. A stale or unfinished folder is replaced."""
    if folder.exists() and not is_complete(folder, fingerprint):
        shutil.rmtree(folder)
    try:
        os.rename(tmp, folder)
    except OSError:
        if not is_complete(folder, fingerprint):
            raise
