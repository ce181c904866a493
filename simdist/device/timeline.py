"""Chrome trace-event timeline (loads in Perfetto and chrome://tracing).

Rank 0 writes one file after gathering every rank's ``VirtualClock.events``; this module
takes that list of per-rank event lists and does no MPI itself. Format: the JSON object form
``{"traceEvents": [...]}`` of the Trace Event Format (Google, "Trace Event Format" doc):
complete events ``ph: "X"`` with ``ts``/``dur`` in microseconds, ``pid`` = rank, ``tid`` =
track, plus ``ph: "M"`` metadata naming processes and threads.

Tracks per rank: measured host wall time (tid 1), simulated compute stream (tid 2, which
also shows exposed waits and "other" time), simulated communication stream (tid 3). The
measured and simulated tracks share an axis but not a clock: simulated time starts at 0 at
the clock's creation, measured time at the clock's creation wall time.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

TRACKS = {"measured": 1, "compute": 2, "comm": 3}
TRACK_NAMES = {
    1: "measured (host wall clock)",
    2: "simulated compute",
    3: "simulated communication",
}


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, bool | str) or value is None:
        return value
    try:
        return float(value) if not isinstance(value, int) else value
    except (TypeError, ValueError):
        return str(value)


def chrome_trace(
    per_rank_events: Sequence[Sequence[dict[str, Any]]],
    *,
    rank_labels: Sequence[str] | None = None,
    metadata: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Build the trace object from ``per_rank_events[rank]`` = a clock's ``events`` list."""
    events: list[dict[str, Any]] = []
    for rank, rank_events in enumerate(per_rank_events):
        label = rank_labels[rank] if rank_labels else f"rank {rank}"
        events.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": label}})
        events.append(
            {"ph": "M", "name": "process_sort_index", "pid": rank, "args": {"sort_index": rank}}
        )
        for tid, tname in TRACK_NAMES.items():
            events.append(
                {"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": tname}}
            )
        for ev in rank_events:
            track = ev.get("track", "compute")
            if track not in TRACKS:
                raise ValueError(f"rank {rank}: unknown track {track!r}; use {sorted(TRACKS)}")
            events.append(
                {
                    "ph": "X",
                    "name": str(ev["name"]),
                    "cat": str(ev.get("cat", track)),
                    "pid": rank,
                    "tid": TRACKS[track],
                    "ts": float(ev["start"]) * 1e6,
                    "dur": max(0.0, float(ev["dur"])) * 1e6,
                    "args": _jsonable(ev.get("args", {})),
                }
            )
    trace: dict[str, Any] = {"traceEvents": events, "displayTimeUnit": "ms"}
    if metadata:
        trace["otherData"] = _jsonable(metadata)
    return trace


def write_chrome_trace(
    path: str | Path,
    per_rank_events: Sequence[Sequence[dict[str, Any]]],
    *,
    rank_labels: Sequence[str] | None = None,
    metadata: dict[str, Any] | None = None,
) -> Path:
    """Write the trace JSON (validated first) and return its path."""
    trace = chrome_trace(per_rank_events, rank_labels=rank_labels, metadata=metadata)
    validate_chrome_trace(trace)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(trace, separators=(",", ":"), allow_nan=False))
    tmp.replace(path)  # atomic: a reader never sees half a trace
    return path


def validate_chrome_trace(trace: dict[str, Any]) -> None:
    """Raise ``ValueError`` unless ``trace`` is a well-formed JSON-object trace."""
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise ValueError("a trace is an object with a 'traceEvents' list")
    json.dumps(trace, allow_nan=False)  # strict JSON: no NaN/Infinity, no numpy objects
    for i, ev in enumerate(trace["traceEvents"]):
        ph = ev.get("ph")
        if ph == "M":
            if not {"name", "pid", "args"} <= ev.keys():
                raise ValueError(f"event {i}: metadata needs name, pid, args")
        elif ph == "X":
            missing = {"name", "pid", "tid", "ts", "dur"} - ev.keys()
            if missing:
                raise ValueError(f"event {i}: complete event lacks {sorted(missing)}")
            if not all(isinstance(ev[k], int | float) for k in ("ts", "dur", "pid", "tid")):
                raise ValueError(f"event {i}: ts, dur, pid and tid must be numbers")
            if ev["dur"] < 0 or ev["ts"] != ev["ts"]:
                raise ValueError(f"event {i}: negative duration or NaN timestamp")
        else:
            raise ValueError(f"event {i}: unsupported phase {ph!r} (this writer emits X and M)")
