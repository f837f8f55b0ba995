"""Contiguous ranges of a fixed-size BPF array handed out and taken back: each file's table rows, each
process's mappings (agent/bpf/unwind.h). First fit over a sorted free list, neighbours merged on free."""

from __future__ import annotations

from bisect import bisect_left


class RangeAllocator:
    """Ranges of [0, capacity). Not thread-safe: its owner serializes calls."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self._starts: list[int] = [0]  # free ranges, sorted by start, never adjacent
        self._sizes: list[int] = [capacity]
        self.used = 0

    def alloc(self, n: int) -> int | None:
        """The start of a free range of n entries, now taken; None when no free range is that long."""
        if n < 1:
            raise ValueError(f"a range holds at least one entry, got {n}")
        for i, size in enumerate(self._sizes):
            if size >= n:
                start = self._starts[i]
                if size == n:
                    del self._starts[i], self._sizes[i]
                else:
                    self._starts[i] += n
                    self._sizes[i] -= n
                self.used += n
                return start
        return None

    def free(self, start: int, n: int) -> None:
        """Give back [start, start + n), which alloc handed out."""
        i = bisect_left(self._starts, start)
        overlaps_next = i < len(self._starts) and self._starts[i] < start + n
        overlaps_prev = i > 0 and self._starts[i - 1] + self._sizes[i - 1] > start
        if overlaps_next or overlaps_prev or start < 0 or start + n > self.capacity:
            raise ValueError(f"range [{start}, {start + n}) is not one that was handed out")
        self.used -= n
        after = i < len(self._starts) and self._starts[i] == start + n
        before = i > 0 and self._starts[i - 1] + self._sizes[i - 1] == start
        if before and after:
            self._sizes[i - 1] += n + self._sizes[i]
            del self._starts[i], self._sizes[i]
        elif before:
            self._sizes[i - 1] += n
        elif after:
            self._starts[i] = start
            self._sizes[i] += n
        else:
            self._starts.insert(i, start)
            self._sizes.insert(i, n)

    @property
    def largest_free(self) -> int:
        return max(self._sizes, default=0)
