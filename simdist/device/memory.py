"""Accounted device memory with a simulated out-of-memory error.

Every buffer a rank owns is registered here under a category; the capacity comes from the
device profile, not from the host. ``allocate`` really allocates (``np.zeros``) and accounts
``nbytes`` exactly; ``reserve`` accounts without allocating (plan mode, and tensors the
simulation only pretends to hold, e.g. fp16 copies that the CPU run keeps in fp32). A
request that would exceed the capacity raises ``SimulatedOutOfMemoryError`` *before* any
host memory is touched, with the breakdown by category, the shortfall and a caller's hint.

This is a bump accounting model: no fragmentation, alignment or allocator caching overhead
(PyTorch's caching allocator would add some); the peak is the exact high-water mark of the
registered bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

# streaming_window: the weight and gradient slots of weight-streaming execution
# (simdist.streaming), the only parameter-sized memory such a device holds.
CATEGORIES = (
    "parameters",
    "gradients",
    "optimizer_state",
    "activations",
    "workspace",
    "buckets",
    "streaming_window",
)

Hint = str | Callable[[int], str] | None


def format_bytes(n: float) -> str:
    """Human-readable binary size, e.g. ``1.50 GiB``."""
    n = float(n)
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


class SimulatedOutOfMemoryError(MemoryError):
    """The simulated device would run out of memory; nothing was allocated."""

    def __init__(
        self,
        *,
        profile_name: str,
        capacity: int,
        in_use: dict[str, int],
        category: str,
        name: str,
        nbytes: int,
        hint: str = "",
    ) -> None:
        self.profile_name = profile_name
        self.capacity = capacity
        self.in_use = dict(in_use)
        self.category = category
        self.name = name
        self.nbytes = nbytes
        self.needed = sum(in_use.values()) + nbytes
        self.shortfall = self.needed - capacity
        self.hint = hint
        parts = [f"{c} {format_bytes(b)}" for c, b in in_use.items() if b]
        msg = (
            f"simulated out of memory on {profile_name}: allocating '{name}' "
            f"({category}, {format_bytes(nbytes)}) needs {format_bytes(self.needed)} "
            f"but the device has {format_bytes(capacity)} (short by {format_bytes(self.shortfall)})"
            f"\n  in use: {', '.join(parts) if parts else 'nothing'}"
            f" = {format_bytes(sum(in_use.values()))}"
        )
        if hint:
            msg += f"\n  hint: {hint}"
        super().__init__(msg)


class DeviceMemory:
    """Byte-exact accounting of one simulated device's memory, by category.

    ``hint`` (a string, or a callable taking the shortfall in bytes) is added to the
    out-of-memory message; a per-call ``hint`` overrides it.
    """

    def __init__(self, capacity_bytes: int, profile_name: str = "device", hint: Hint = None):
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self.capacity = int(capacity_bytes)
        self.profile_name = profile_name
        self.hint = hint
        self._entries: dict[str, tuple[str, int]] = {}  # name -> (category, nbytes)
        self._current = dict.fromkeys(CATEGORIES, 0)
        self._peak = dict.fromkeys(CATEGORIES, 0)
        self._peak_total = 0
        self._peak_breakdown = dict.fromkeys(CATEGORIES, 0)

    @classmethod
    def from_profile(cls, profile: Any, hint: Hint = None) -> DeviceMemory:
        return cls(profile.memory_bytes, profile.name, hint)

    # -- registering -------------------------------------------------------------------
    def allocate(
        self,
        category: str,
        name: str,
        shape: int | tuple[int, ...],
        dtype: Any = np.float32,
        hint: Hint = None,
    ) -> np.ndarray:
        """Account, then allocate zeros of ``shape``; raises before allocating on OOM."""
        shape_t = (shape,) if isinstance(shape, int | np.integer) else tuple(shape)
        nbytes = int(np.prod(shape_t, dtype=np.int64)) * np.dtype(dtype).itemsize
        self._account(category, name, nbytes, hint)
        try:
            return np.zeros(shape_t, dtype=dtype)
        except MemoryError:
            self.free(name)  # the host itself ran out: undo the accounting
            raise

    def reserve(self, category: str, name: str, nbytes: int, hint: Hint = None) -> None:
        """Account ``nbytes`` without allocating (plan mode, simulated-only tensors)."""
        self._account(category, name, int(nbytes), hint)

    def free(self, name: str) -> int:
        """Release ``name``; returns the bytes freed."""
        try:
            category, nbytes = self._entries.pop(name)
        except KeyError:
            raise KeyError(f"'{name}' is not allocated on {self.profile_name}") from None
        self._current[category] -= nbytes
        return nbytes

    def _account(self, category: str, name: str, nbytes: int, hint: Hint) -> None:
        if category not in self._current:
            raise ValueError(f"unknown memory category '{category}'; use one of {CATEGORIES}")
        if name in self._entries:
            raise ValueError(f"'{name}' is already allocated on {self.profile_name}")
        if nbytes < 0:
            raise ValueError(f"'{name}': negative size {nbytes}")
        if self.total + nbytes > self.capacity:
            shortfall = self.total + nbytes - self.capacity
            chosen = hint if hint is not None else self.hint
            text = chosen(shortfall) if callable(chosen) else (chosen or "")
            raise SimulatedOutOfMemoryError(
                profile_name=self.profile_name,
                capacity=self.capacity,
                in_use=dict(self._current),
                category=category,
                name=name,
                nbytes=nbytes,
                hint=text,
            )
        self._entries[name] = (category, nbytes)
        self._current[category] += nbytes
        self._peak[category] = max(self._peak[category], self._current[category])
        total = self.total
        if total > self._peak_total:
            self._peak_total = total
            self._peak_breakdown = dict(self._current)

    # -- queries -------------------------------------------------------------------------
    @property
    def total(self) -> int:
        return sum(self._current.values())

    @property
    def available(self) -> int:
        return self.capacity - self.total

    @property
    def current(self) -> dict[str, int]:
        """Bytes in use now, per category and ``total``."""
        return {**self._current, "total": self.total}

    @property
    def peak(self) -> dict[str, int]:
        """High-water marks: per category (each on its own) and ``total`` (of the sum)."""
        return {**self._peak, "total": self._peak_total}

    @property
    def peak_breakdown(self) -> dict[str, int]:
        """Per-category bytes at the moment the total peaked."""
        return dict(self._peak_breakdown)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def nbytes(self, name: str) -> int:
        return self._entries[name][1]

    def fits(self, nbytes: int) -> bool:
        """Would ``nbytes`` more fit now?"""
        return self.total + int(nbytes) <= self.capacity

    def what_would_fit(self, bytes_for: int | Callable[[int], int], upper: int = 1 << 30) -> int:
        """Largest ``n`` in [0, upper] whose ``bytes_for(n)`` fits on top of current use.

        ``bytes_for`` is bytes per unit (linear) or a non-decreasing function of ``n`` (e.g.
        activation bytes of batch ``n``). The loop uses it for hints like "batch 24 would fit".
        """
        if isinstance(bytes_for, int | np.integer):
            per = int(bytes_for)
            return upper if per <= 0 else max(0, min(upper, self.available // per))
        lo, hi = 0, upper
        if not self.fits(bytes_for(0)):
            return 0
        while lo < hi:  # binary search for the last n that fits
            mid = (lo + hi + 1) // 2
            if self.fits(bytes_for(mid)):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def reset_peak(self) -> None:
        self._peak = dict(self._current)
        self._peak_total = self.total
        self._peak_breakdown = dict(self._current)

    def summary(self) -> dict[str, Any]:
        """JSON-ready memory report for performance.json."""
        return {
            "profile": self.profile_name,
            "capacity_bytes": self.capacity,
            "current_bytes": self.current,
            "peak_bytes": self.peak,
            "peak_breakdown_bytes": self.peak_breakdown,
            "peak_utilization": self._peak_total / self.capacity,
        }
