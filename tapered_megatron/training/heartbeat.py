"""Per-rank heartbeats in the rendezvous store: which rank stopped responding.

Every rank runs a daemon thread that increments its own counter in the ``torch.distributed``
store (``tm/heartbeat/<rank>``) every ``period`` seconds. A rank waiting in a collective keeps
beating (collectives release the GIL); a rank that is stopped (SIGSTOP), killed, or stuck in
native code holding the GIL does not. Counters, not timestamps, so clocks of different nodes
never need to agree. A counter standing still for ``2.5 x period`` (a quarter of the collective
timeout where :func:`period_for` does not clamp) means its rank stopped responding. The rank is
named two ways:

* by the thread itself, before any collective gives up: rank 0 (the store's host) watches every
  other rank's counter, every other rank watches rank 0's (a store that does not answer counts
  as standing still). It prints the one line ``error: rank R: rank N stopped responding (...)``
  to stderr as soon as it notices, so the line is there even when the backend aborts the process
  instead of raising (NCCL's watchdog);
* by :meth:`Heartbeat.explain` after a collective failed or timed out (gloo raises): every
  surviving rank samples all counters and prints the line, unless its thread already did.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from datetime import timedelta
from typing import Any

_KEY = "tm/heartbeat/{}"
_STILL_PERIODS = 2.5  # a counter standing still this many periods: its rank stopped


def period_for(timeout_s: float) -> float:
    """The beat period for a collective timeout: a tenth of it, between 1 and 10 seconds."""
    return min(10.0, max(1.0, timeout_s / 10))


class Heartbeat:
    """Beats for ``rank`` in ``store`` (a ``torch.distributed.Store``) every ``period`` s, and
    watches the ranks :meth:`watched` names."""

    def __init__(self, store: Any, rank: int, world_size: int, period: float) -> None:
        self.store, self.rank, self.world_size, self.period = store, rank, world_size, period
        self.window = _STILL_PERIODS * period
        self.reported: set[int] = set()  # ranks a line already named (by the thread or explain)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._call: threading.Thread | None = None  # the thread's store calls, maybe still out

    def start(self) -> Heartbeat:
        """Beat once now (so every counter exists), then beat and watch in the background."""
        self.store.add(_KEY.format(self.rank), 1)
        store = self._thread_store()  # its client connects now, while every rank answers
        threading.Thread(target=self._run, args=(store,), name="heartbeat", daemon=True).start()
        return self

    def stop(self) -> None:
        """Stop beating and watching (the thread ends within one period)."""
        self._stop.set()

    def watched(self) -> list[int]:
        """The ranks this rank's thread watches: all others on rank 0, rank 0 elsewhere (one
        read per rank and period in all, whatever the world size)."""
        return list(range(1, self.world_size)) if self.rank == 0 else [0]

    def _thread_store(self) -> Any:
        """The store for the thread: its own client where the store can clone one."""
        try:
            return self.store.clone()
        except (AttributeError, RuntimeError):  # torch before Store.clone: share the store
            return self.store

    def _beat_and_read(self, store: Any) -> dict[int, int]:
        """Beat once; the counters of the watched ranks (``{}`` when the store does not answer).

        A stopped store host never answers (the store's timeout does not bound ``add``): the
        calls run on a daemon thread and count as no answer after a period, and no new call
        starts while one is still out."""
        if self._call is not None and self._call.is_alive():
            return {}
        box: list[dict[int, int]] = []

        def calls() -> None:
            with contextlib.suppress(Exception):  # the host went away: no answer
                store.add(_KEY.format(self.rank), 1)
                box.append({r: store.add(_KEY.format(r), 0) for r in self.watched()})

        self._call = threading.Thread(target=calls, name="heartbeat-store", daemon=True)
        self._call.start()
        self._call.join(self.period)
        return box[0] if box else {}

    def _run(self, store: Any) -> None:
        seen = {r: (-1, time.monotonic()) for r in self.watched()}  # count, when it last moved
        last = time.monotonic()
        while not self._stop.wait(self.period):
            now = time.monotonic()
            if now - last > 2 * self.period:  # this process did not run: nothing to judge by
                seen = {r: (c, now) for r, (c, _) in seen.items()}
            counts = self._beat_and_read(store)
            still = []
            for r, (count, since) in seen.items():
                if counts.get(r, count) != count:
                    seen[r] = (counts[r], now)
                    with self._lock:
                        self.reported.discard(r)  # it beats again
                elif now - since > self.window:
                    still.append(r)
            new = self._claim(still)
            if new and not self._stop.is_set():
                print(f"error: rank {self.rank}: {self.sentence(new)}", file=sys.stderr, flush=True)
            last = time.monotonic()

    def _claim(self, ranks: list[int]) -> list[int]:
        """The ranks of ``ranks`` no line named yet, marked as named."""
        with self._lock:
            new = [r for r in ranks if r not in self.reported]
            self.reported.update(new)
        return new

    def _counts(self) -> dict[int, int]:
        return {r: self.store.add(_KEY.format(r), 0) for r in range(self.world_size)}

    def unresponsive(self) -> list[int] | None:
        """Ranks (other than this one) whose heartbeat stopped; takes ``2.5 x period``.

        When the store itself does not answer, its host (rank 0) is the one that stopped:
        ``[0]`` on the other ranks, ``None`` on rank 0 (nothing known)."""
        self.store.set_timeout(timedelta(seconds=max(2.0, 2 * self.period)))
        try:
            before = self._counts()
            time.sleep(self.window)
            after = self._counts()
        except Exception:
            return [0] if self.rank != 0 else None
        return [r for r in range(self.world_size) if r != self.rank and after[r] == before[r]]

    def sentence(self, ranks: list[int]) -> str:
        """``rank(s) N stopped responding (...)``: the words every line naming them uses."""
        names = ", ".join(map(str, ranks))
        return (
            f"rank{'s' if len(ranks) > 1 else ''} {names} stopped responding (no heartbeat for "
            f"{self.window:.3g} s: stopped, killed or stuck holding the interpreter)"
        )

    def describe(self) -> str:
        """One sentence naming the ranks that stopped responding, or ``""`` if none did."""
        ranks = self.unresponsive()
        return self.sentence(ranks) if ranks else ""

    def explain(self, error: BaseException) -> bool:
        """After ``error`` ended a collective: print the one line naming the ranks that stopped
        responding, unless this heartbeat's thread already printed it for them. False when
        every rank still beats (the error is something else)."""
        ranks = self.unresponsive()
        if not ranks:
            return False
        new = self._claim(ranks)
        if new:
            first = (str(error).strip().splitlines() or [""])[0][:200]
            print(
                f"error: rank {self.rank}: {self.sentence(new)}; stopping "
                f"({type(error).__name__}: {first})",
                file=sys.stderr,
                flush=True,
            )
        return True
