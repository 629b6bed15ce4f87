"""The grant backlog: one FIFO ring of parked jobs and not-yet-started waiters.

The ring owns its entries and their `skipped_grants` counters; which entry is granted
next is the pure `policy.next_grant_index`. Depth may exceed the admission cap by one
between a park and the next promotion (a park never refuses), so the peak is cap+1.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable

from scheduler.request import Request
from scheduler.rules import GrantView, next_grant_index, overdue_indices


class EntryKind(enum.Enum):
    WAITING = "waiting"  # never started: its slice 0 runs at promotion
    PARKED = "parked"  # has a saved session: its next round runs at promotion


@dataclass
class BacklogEntry:
    request: Request
    kind: EntryKind
    arrival_seq: int  # ring join order; a park rejoins at the back
    skipped_grants: int = 0

    def view(self) -> GrantView:
        return GrantView(int(self.request.lane), self.arrival_seq, self.skipped_grants)


class GrantBacklog:
    def __init__(self, on_depth: Callable[[int], None] | None = None) -> None:
        """`on_depth(depth)` hears the depth after every change (the counters' gauge
        and peak), so no caller has to report it."""
        self._entries: list[BacklogEntry] = []
        self._next_seq = 0
        self._on_depth = on_depth or (lambda depth: None)

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[BacklogEntry]:
        """The entries, front first (a copy)."""
        return list(self._entries)

    def push(self, request: Request, kind: EntryKind) -> BacklogEntry:
        """Append at the back with `skipped_grants = 0`."""
        entry = BacklogEntry(request, kind, self._next_seq)
        self._next_seq += 1
        self._entries.append(entry)
        self._on_depth(len(self._entries))
        return entry

    def remove(self, request_id: str) -> BacklogEntry | None:
        for i, entry in enumerate(self._entries):
            if entry.request.request_id == request_id:
                removed = self._entries.pop(i)
                self._on_depth(len(self._entries))
                return removed
        return None

    def grant(
        self, skip_cap: int, eligible: Callable[[BacklogEntry], bool] | None = None
    ) -> tuple[BacklogEntry | None, bool]:
        """One grant decision among the `eligible` entries (default: all): remove and
        return the selected one, and whether the skip cap decided it. Every eligible
        entry left behind counts one more skip, whatever then happens to the selected
        one (cancelled, declined or run). (None, False) when no entry is eligible."""
        candidates = [e for e in self._entries if eligible is None or eligible(e)]
        if not candidates:
            return None, False
        views = [e.view() for e in candidates]
        escalated = bool(overdue_indices(views, skip_cap))
        selected = candidates[next_grant_index(views, skip_cap)]
        self._entries.remove(selected)
        for entry in candidates:
            if entry is not selected:
                entry.skipped_grants += 1
        self._on_depth(len(self._entries))
        return selected, escalated

    def snapshot(self) -> list[dict]:
        return [
            {
                "request_id": e.request.request_id,
                "lane": e.request.lane.name.lower(),
                "skipped_grants": e.skipped_grants,
                "kind": e.kind.value,
            }
            for e in self._entries
        ]
