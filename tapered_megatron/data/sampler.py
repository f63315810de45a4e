"""Megatron's pretraining batch sampler: consecutive global batches, resumable by sample count."""

from __future__ import annotations

from collections.abc import Iterator


class PretrainingSampler:
    """Yields this data-parallel rank's micro-batches of dataset indices, in order.

    Global batch ``j`` (of ``micro_batch_size * dp_size`` samples) is indices
    ``consumed + j*g .. consumed + (j+1)*g``; rank ``r`` takes slice ``[r*mbs, (r+1)*mbs)``. The
    order of samples is the dataset's (seeded, rank-independent), so any dp layout sees the same
    global stream, and a run restarted with ``consumed_samples=k`` continues exactly where an
    uninterrupted run would be after ``k`` samples. An incomplete last global batch is dropped
    unless ``drop_last=False``. Use as ``DataLoader(ds, batch_sampler=sampler)``.
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        dp_rank: int,
        dp_size: int,
        drop_last: bool = True,
    ):
        if total_samples <= 0:
            raise ValueError(f"total_samples must be positive, got {total_samples}")
        if not 0 <= consumed_samples <= total_samples:
            raise ValueError(f"consumed_samples {consumed_samples} not in [0, {total_samples}]")
        if micro_batch_size <= 0 or dp_size <= 0 or not 0 <= dp_rank < dp_size:
            raise ValueError(
                f"bad micro_batch_size={micro_batch_size}, dp_rank={dp_rank}, dp_size={dp_size}"
            )
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.drop_last = drop_last

    @property
    def global_micro_batch(self) -> int:
        return self.micro_batch_size * self.dp_size

    def __len__(self) -> int:
        """Micro-batches this rank will yield."""
        remaining = self.total_samples - self.consumed_samples
        full, rest = divmod(remaining, self.global_micro_batch)
        return full + int(not self.drop_last and rest > self.dp_rank * self.micro_batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        g, lo = self.global_micro_batch, self.dp_rank * self.micro_batch_size
        start = self.consumed_samples
        while start + g <= self.total_samples:
            yield list(range(start + lo, start + lo + self.micro_batch_size))
            start += g
        if not self.drop_last and start + lo < self.total_samples:
            yield list(
                range(start + lo, min(start + lo + self.micro_batch_size, self.total_samples))
            )
