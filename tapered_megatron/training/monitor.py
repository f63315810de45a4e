"""What the training loop watches and writes, apart from the step itself: its cadence (log,
evaluate, save, stop), the logging window's loss and throughput, the run's health (non-finite
steps in a row, loss spikes), the per-iteration metrics file and the exit signal that stops every
rank at the same iteration."""

from __future__ import annotations

import json
import math
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from tapered_megatron.config import Config


@dataclass(frozen=True)
class Cadence:
    """When the loop logs, evaluates, saves and stops (iterations count from 1)."""

    iters: int
    log_every: int
    eval_every: int  # 0: never
    save_every: int  # 0: only at the end
    exit_every: int  # 0: never

    @classmethod
    def of(cls, cfg: Config, can_eval: bool = True) -> Cadence:
        """The cadence of ``cfg`` (no evaluation when there is no validation data)."""
        tr = cfg.train
        ev = cfg.eval.interval if can_eval else 0
        return cls(tr.iters, cfg.logging.interval, ev, tr.save_interval, tr.exit_interval)

    def _at(self, every: int, it: int) -> bool:
        return every > 0 and it % every == 0

    def log(self, it: int) -> bool:
        """Log a line after iteration ``it``: every ``logging.interval`` and at the end."""
        return self._at(self.log_every, it) or it == self.iters

    def evaluate(self, it: int) -> bool:
        """Evaluate: every ``eval.interval`` and at the end (never when it is 0)."""
        return self.eval_every > 0 and (self._at(self.eval_every, it) or it == self.iters)

    def stop(self, it: int) -> bool:
        """Stop early (after saving): at multiples of ``train.exit_interval`` before the end."""
        return self._at(self.exit_every, it) and it < self.iters

    def save(self, it: int) -> bool:
        """Checkpoint: every ``train.save_interval``, at the end and before an early stop."""
        return self._at(self.save_every, it) or it == self.iters or self._at(self.exit_every, it)


class Window:
    """Loss, time and tokens accumulated over one logging interval."""

    def __init__(self, tokens_per_iter: int) -> None:
        self.tokens_per_iter = tokens_per_iter
        self.iters, self.counted, self.loss, self.seconds = 0, 0, 0.0, 0.0

    def add(self, loss: float, seconds: float, counted: bool = True) -> None:
        """One iteration; a skipped one (``counted=False``) adds time but not its loss."""
        self.iters += 1
        self.counted += counted
        self.loss += loss if counted else 0.0
        self.seconds += seconds

    @property
    def mean_loss(self) -> float:
        return self.loss / self.counted if self.counted else math.nan

    def take(self) -> tuple[int, float]:
        """(tokens, seconds) of the interval; starts the next one."""
        out = (self.tokens_per_iter * self.iters, self.seconds)
        self.iters, self.counted, self.loss, self.seconds = 0, 0, 0.0, 0.0
        return out


class Health:
    """Skipped (non-finite) steps in a row and loss spikes against a running mean."""

    def __init__(self, max_skipped: int, spike_factor: float, window: int = 50) -> None:
        self.max_skipped, self.spike_factor = max_skipped, spike_factor
        self.in_a_row = 0
        self.recent: deque[float] = deque(maxlen=window)

    def update(
        self, it: int, loss: float, skipped: bool, consumed: int, batch: int
    ) -> tuple[str, str]:
        """``(note, stop)``: a line to log ("" if none) and why to stop ("" to go on)."""
        if skipped:
            self.in_a_row += 1
            note = (
                f"iteration {it}: loss {loss:.4g} or gradients not finite: step skipped (no "
                f"optimizer or learning-rate update); samples {consumed - batch}-{consumed - 1} "
                f"are consumed and not trained on ({self.in_a_row} skipped in a row, "
                f"train.max_skipped_steps={self.max_skipped})"
            )
            stop = ""
            if self.in_a_row >= self.max_skipped:
                stop = (
                    f"{self.in_a_row} consecutive steps with non-finite loss or gradients "
                    f"(train.max_skipped_steps={self.max_skipped}) at iteration {it}: stopped "
                    "without saving; the last complete checkpoint is intact (lower train.lr, "
                    "check the data, then --resume auto)"
                )
            return note, stop
        self.in_a_row = 0
        note = ""
        if self.spike_factor > 0 and len(self.recent) >= 10:
            mean = sum(self.recent) / len(self.recent)
            if loss > self.spike_factor * mean:
                note = (
                    f"iteration {it}: loss spike {loss:.4g} > train.loss_spike_factor "
                    f"{self.spike_factor:g} x running mean {mean:.4g} "
                    f"(last {len(self.recent)} iterations)"
                )
        self.recent.append(loss)
        return note, ""


class MetricsFile:
    """Append-only JSON lines, one per iteration (rank 0; disabled when ``path`` is empty)."""

    def __init__(self, path: str) -> None:
        self.f = None
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self.f = open(path, "a")  # noqa: SIM115 - kept open for the whole run

    def write(self, record: dict[str, Any]) -> None:
        if self.f is not None:
            self.f.write(json.dumps(record) + "\n")
            self.f.flush()

    def close(self) -> None:
        if self.f is not None:
            self.f.close()


class ExitSignal:
    """Notes ``signal_name`` (``train.exit_signal``) and says, collectively, whether any rank
    got it, so every rank stops at the same iteration boundary (Megatron's exit signal
    handler). Without a name it installs nothing and costs nothing."""

    def __init__(self, signal_name: str, device: str) -> None:
        import signal

        self.device, self.seen = device, False
        self.armed = bool(signal_name)
        if self.armed:
            signal.signal(getattr(signal, signal_name), self._note)

    def _note(self, *_: Any) -> None:
        self.seen = True

    def received(self) -> bool:
        """Whether any rank has received the signal (a one-element all-reduce when armed)."""
        if not self.armed:
            return False
        flag = torch.tensor(float(self.seen), device=self.device)
        if dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
