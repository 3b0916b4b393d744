"""cbserve's cache folder: `$CBSERVE_CACHE_DIR`, else `~/.cache/cbserve` (converted models, built kernels)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("CBSERVE_CACHE_DIR") or Path.home() / ".cache" / "cbserve")
