"""Per-rank heartbeats in the rendezvous store: which rank stopped responding.

Every rank runs a daemon thread that increments its own counter in the ``torch.distributed``
store (``tm/heartbeat/<rank>``) every ``period`` seconds. A rank waiting in a collective keeps
beating (collectives release the GIL); a rank that is stopped (SIGSTOP), killed, or stuck in
native code holding the GIL does not. When a collective fails or times out, the surviving ranks
call :meth:`Heartbeat.unresponsive`: it samples every counter twice, ``2.5 x period`` apart, and
returns the ranks whose counter did not move. Counters, not timestamps, so clocks of different
nodes never need to agree.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

_KEY = "tm/heartbeat/{}"


def period_for(timeout_s: float) -> float:
    """The beat period for a collective timeout: a tenth of it, between 1 and 10 seconds."""
    return min(10.0, max(1.0, timeout_s / 10))


class Heartbeat:
    """Beats for ``rank`` in ``store`` (a ``torch.distributed.Store``) every ``period`` s."""

    def __init__(self, store: Any, rank: int, world_size: int, period: float) -> None:
        self.store, self.rank, self.world_size, self.period = store, rank, world_size, period
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        """Beat once now (so every counter exists), then keep beating in the background."""
        self.store.add(_KEY.format(self.rank), 1)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop beating (the thread ends within one period)."""
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self.store.add(_KEY.format(self.rank), 1)
            except Exception:  # the store's host went away: nothing left to report to
                return

    def _counts(self) -> dict[int, int]:
        return {r: self.store.add(_KEY.format(r), 0) for r in range(self.world_size)}

    def unresponsive(self) -> list[int] | None:
        """Ranks (other than this one) whose heartbeat stopped; takes ``2.5 x period``.

        When the store itself does not answer, its host (rank 0) is the one that stopped:
        ``[0]`` on the other ranks, ``None`` on rank 0 (nothing known)."""
        self.store.set_timeout(timedelta(seconds=max(2.0, 2 * self.period)))
        try:
            before = self._counts()
            time.sleep(2.5 * self.period)
            after = self._counts()
        except Exception:
            return [0] if self.rank != 0 else None
        return [r for r in range(self.world_size) if r != self.rank and after[r] == before[r]]

    def describe(self) -> str:
        """One sentence naming the ranks that stopped responding, or ``""`` if none did."""
        ranks = self.unresponsive()
        if not ranks:
            return ""
        names = ", ".join(map(str, ranks))
        return (
            f"rank{'s' if len(ranks) > 1 else ''} {names} stopped responding (no heartbeat for "
            f"{2.5 * self.period:.0f} s: stopped, killed or stuck holding the interpreter)"
        )
