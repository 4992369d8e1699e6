"""Writes to a batch part only from its driver: the one fence of every store whose parts several
processes drive (replicas on PostgreSQL, workers on one SQLite file).

A driver claims a part at an epoch; a write goes through while the part's row names this driver
at that epoch, or while no live driver holds it and this one's claim is not stale (a cancel from
anywhere). Each store reads the row its own way; the decision is made here."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .locked import locked
from .store import JobStore, LeaseLost

FENCED = ("mark_submitting", "mark_submitted", "set_remote_status", "finish_part", "reroute")


def fence(row: Sequence[Any] | None, part_id: str, driver: str, claims: dict[str, int],
          now: float) -> None:
    """``row``: the part's (owner, epoch, lease_until), None when it has no claim row. Raise
    ``LeaseLost`` (and forget the claim) unless this driver may write."""
    if row is None:
        return
    owner, epoch, until = row
    mine = claims.get(part_id)
    if owner == driver and epoch == mine:
        return
    # a claim of ours at an older epoch: another driver has claimed the part since (even if it
    # has handed it back or let it lapse), so this write is stale
    if (mine is None or mine == epoch) and (owner is None or until is None or until < now):
        return
    claims.pop(part_id, None)
    raise LeaseLost(part_id)


def fence_writes(cls: type[JobStore], who: str) -> None:
    """Make each of ``cls``'s part writes one transaction that first calls ``cls._fence``."""
    for name in FENCED:
        setattr(cls, name, _fenced(name, who))


def _fenced(name: str, who: str) -> Callable[..., Any]:
    plain = getattr(JobStore, name)

    @locked
    def method(self: Any, part_id: str, *args: Any) -> Any:
        with self._tx():
            self._fence(part_id)
            return plain(self, part_id, *args)

    method.__name__ = name
    method.__doc__ = f"{plain.__doc__ or name}; only while this {who} holds the part's epoch."
    return method
