"""Entries by key in one versioned JSON file: what a replica measured, kept across restarts.

An unreadable, corrupt or other-version file reads as empty (measure again), never as an
error: such a cache only saves work. A write replaces the file atomically, so a reader
sees the old file or the new one, never half of one.
"""

from __future__ import annotations

import json
import os
import tempfile


class KeyedStore:
    def __init__(self, path: str, version: int, section: str) -> None:
        """`{"version": version, section: {key: entry}}` at `path`."""
        self.path = path
        self.version = version
        self.section = section

    def _read_all(self) -> dict[str, dict]:
        try:
            with open(self.path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict) or data.get("version") != self.version:
            return {}
        entries = data.get(self.section)
        return entries if isinstance(entries, dict) else {}

    def load(self, key: str) -> dict | None:
        entry = self._read_all().get(key)
        return entry if isinstance(entry, dict) else None

    def save(self, key: str, entry: dict) -> None:
        entries = self._read_all()
        entries[key] = entry
        directory = os.path.dirname(self.path)
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(self.path)}.", dir=directory)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump({"version": self.version, self.section: entries}, f, indent=2, sort_keys=True)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
