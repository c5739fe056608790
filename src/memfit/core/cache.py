"""Measured profiles and traced chain profiles cached as JSON in the platform's user cache folder
(platformdirs if installed, else ~/.cache/memfit; MEMFIT_CACHE_DIR overrides)."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any


def cache_dir() -> Path:
    override = os.environ.get("MEMFIT_CACHE_DIR")
    if override:
        return Path(override)
    try:
        import platformdirs

        return Path(platformdirs.user_cache_dir("memfit"))
    except ImportError:
        return Path.home() / ".cache" / "memfit"


def key_path(key: dict[str, Any], kind: str = "profiles") -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return cache_dir() / kind / f"{digest}.json"


def load(key: dict[str, Any], kind: str = "profiles") -> dict[str, Any] | None:
    path = key_path(key, kind)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data if data.get("key") == key else None


def store(key: dict[str, Any], payload: dict[str, Any], kind: str = "profiles") -> Path:
    path = key_path(key, kind)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")  # concurrent writers each replace atomically
    tmp.write_text(json.dumps({"key": key, **payload}, indent=1))
    tmp.replace(path)
    return path
