"""The simulated accelerator inside a real training run: device time per step (issue #5).

Each rank owns a ``RankDevice`` (``create_device``, in ``Run.__init__``): a device profile
(``runconfig.device_profile``), its accounted memory (``simdist.memplan``), cost model and
virtual clock, and the real placement of the ranks (``simdist.comm.topology``), which sets
the link class of the gradient collectives: ``intra`` when every rank shares one node,
``inter`` otherwise.

How the loop is instrumented. ``attach(run)`` (end of ``Run.build``) wraps calls the loop
already makes, on the objects it makes them on, so ``simdist/train.py`` is unchanged:

===========================  =============================================================
hook                         recorded
===========================  =============================================================
``run.data.train_batch``     measured input time (the loop fetches synchronously: with
                             the loop's own host time between hooked calls it is the
                             step's ``other`` time; also the input-bottleneck check)
``model.forward``            the input's shape -> ``model.kernel_costs(B, T)``: every kernel
``model.backward``           call of forward / backward with its FLOPs, bytes and the
                             points where a gradient group is finished
``run.accumulate_gradients`` the copy / add over the gradient buffer (accumulation)
``sync.reduce_gradients``    span; the gradient collectives inside it
``run.gradient_norm``        sum of squares of the owned slice where not handed in
``run.optimizer.step``       one AdamW / SGD pass over the range it updates (clipping's
                             scale applied in it: one multiply an element more)
``sync.gather_parameters``   span and its all-gather; the step ends when it returns
``run.coll`` = ``sync.coll`` every collective: op, resolved algorithm, block bytes per rank,
                             host staging (``reduce_on_device: false`` really copies through
                             a host buffer, which is not device memory)
===========================  =============================================================

At the end of each step the records are replayed on the rank's ``VirtualClock`` by
``simdist.sim.step.StepModel``, the step-time model plan mode also uses: kernels through the
profile's roofline, collectives through ``simdist.device.collective`` (the schedule of the
algorithm that ran, on the real block sizes, over the placement's link), and the overlap
rules (ZeRO-2's per-group reduce-scatters overlap the rest of the backward; everything else
is exposed) are described there.

``finish`` (collective, from ``Run.finish_training``) gathers every rank's per-step times:
the step's simulated time is its critical path, the slowest rank; writes
``model_dir/timeline.json`` (Chrome trace, first ``runconfig.trace_steps`` steps, one
process per rank, simulated tracks aligned step by step on the critical path) and returns
the performance.json fields.
"""

from __future__ import annotations

import array
import dataclasses
import functools
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from simdist.comm import partition
from simdist.comm.topology import Placement, placement
from simdist.device import Device, write_chrome_trace
from simdist.device.collective import STAGED_OPS, Network
from simdist.device.estimate import est_fields, memory_fields
from simdist.device.profile import DeviceProfile
from simdist.memplan import scratch_bytes, setup_for

from .step import COMPUTE_PHASES, Coll, Span, StepModel, compute_dtype

INPUT_BOTTLENECK_SHARE = 0.10  # input fetch above this share of the measured step: flagged
TIMELINE = "timeline.json"


# ----------------------------------------------------------------------------- the device
@dataclass
class RankDevice:
    """One rank's simulated accelerator and where the rank really runs."""

    device: Device
    placement: Placement
    dtype: str
    notes: list[str] = field(default_factory=list)

    @property
    def memory(self):
        return self.device.memory

    @property
    def clock(self):
        return self.device.clock

    @property
    def cost(self):
        return self.device.cost

    @property
    def profile(self):
        return self.device.profile


def create_device(
    prof: DeviceProfile, comm, place: Placement | None = None, half: str | None = None
) -> RankDevice:
    """This rank's device with the profile the run loaded (collective unless ``place``, the
    ranks' placement, is given).

    The profile's ``devices_per_node`` becomes the real number of ranks per node, so an
    inter-node ring is costed with the placement that actually runs."""
    if place is None:
        place = placement(comm)
    prof = dataclasses.replace(prof, devices_per_node=place.max_ranks_per_node)
    dtype, notes = compute_dtype(prof, half)  # half: a mixed-precision run's format
    return RankDevice(Device.create(prof, comm.Get_rank(), dtype=dtype), place, dtype, notes)


# ----------------------------------------------------------------------------- records
class RecordingCollectives:
    """``Collectives`` as the loop sees it once attached: same calls, recorded; with
    ``staged`` the float32 collectives copy their buffer into a host buffer, run there and
    copy the result back (what host-staged gradient reduction does)."""

    STAGED_OPS = STAGED_OPS

    def __init__(self, inner, sim: Simulation, staged: bool, host_elements: int):
        self._inner = inner
        self._sim = sim
        self.staged = staged
        # host memory, deliberately not through the device allocator
        self.host_buffer = np.zeros(host_elements if staged else 0, np.float32)
        self._block_sizes: dict[tuple, tuple[Any, tuple[int, ...]]] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _resolve(self, op: str, buf: np.ndarray, algorithm: str | None) -> str:
        req = algorithm or self._inner.algorithm
        if req != "auto":
            return req
        return self._inner.choose(op, 4 * buf.size, self._inner.registered(buf))

    def _blocks(self, n: int, bounds) -> tuple[int, ...]:
        """Each rank's block in bytes. Remembered for the default partition and for bounds
        arrays that cannot change (read-only, as the layout's): the same few calls run every
        step, and a dozen small NumPy operations between the step's kernels cost 30-50 us
        there (measured in FC-MNIST's step, against 7 us in a loop of their own)."""
        elem = 2 if self._inner.exchanger.half else 4  # a half-precision wire: 16-bit words
        fixed = bounds is None or (isinstance(bounds, np.ndarray) and not bounds.flags.writeable)
        key = (n, elem, None if bounds is None else id(bounds))
        if fixed:
            hit = self._block_sizes.get(key)
            if hit is not None and hit[0] is bounds:
                return hit[1]
        b = partition(n, self._inner.world) if bounds is None else np.asarray(bounds)
        sizes = tuple(int(x) for x in elem * np.diff(b))
        if fixed:  # the array is held, so its id names it while it is cached
            self._block_sizes[key] = (bounds, sizes)
        return sizes

    def _host(self, n: int) -> np.ndarray:
        if self.host_buffer.size < n:
            self.host_buffer = np.zeros(n, np.float32)
        return self.host_buffer[:n]

    def allreduce(
        self, buf, *, average: bool = False, algorithm: str | None = None, sumsq: bool = False
    ) -> float | None:
        t0 = time.perf_counter()
        if self.staged and buf.size:
            host = self._host(buf.size)
            np.copyto(host, buf)
            partial = self._inner.allreduce(host, average=average, algorithm=algorithm, sumsq=sumsq)
            np.copyto(buf, host)
        else:
            partial = self._inner.allreduce(buf, average=average, algorithm=algorithm, sumsq=sumsq)
        alg = self._resolve("allreduce", buf, algorithm)
        self._sim.collective("allreduce", alg, self._blocks(buf.size, None), self.staged, t0)
        return partial

    def reduce_scatter(
        self, buf, *, bounds=None, average: bool = False, algorithm: str | None = None
    ) -> np.ndarray:
        t0 = time.perf_counter()
        if self.staged and buf.size:
            b = partition(buf.size, self._inner.world) if bounds is None else bounds
            host = self._host(buf.size)
            np.copyto(host, buf)
            mine = self._inner.reduce_scatter(host, bounds=b, average=average, algorithm=algorithm)
            lo = int(b[self._inner.rank])
            view = buf[lo : lo + mine.size]
            np.copyto(view, mine)
        else:
            view = self._inner.reduce_scatter(
                buf, bounds=bounds, average=average, algorithm=algorithm
            )
        alg = self._resolve("reduce_scatter", buf, algorithm)
        self._sim.collective("reduce_scatter", alg, self._blocks(buf.size, bounds), self.staged, t0)
        return view

    def allgather(self, buf, *, bounds=None, algorithm: str | None = None) -> None:
        t0 = time.perf_counter()
        if self.staged and buf.size:
            b = partition(buf.size, self._inner.world) if bounds is None else bounds
            host = self._host(buf.size)
            r = self._inner.rank
            lo, hi = int(b[r]), int(b[r + 1])
            np.copyto(host[lo:hi], buf[lo:hi])  # only this rank's block is valid on entry
            self._inner.allgather(host, bounds=b, algorithm=algorithm)
            np.copyto(buf, host)
        else:
            self._inner.allgather(buf, bounds=bounds, algorithm=algorithm)
        alg = self._resolve("allgather", buf, algorithm)
        self._sim.collective("allgather", alg, self._blocks(buf.size, bounds), self.staged, t0)

    def broadcast(self, buf, root: int = 0, *, algorithm: str | None = None) -> None:
        t0 = time.perf_counter()
        self._inner.broadcast(buf, root, algorithm=algorithm)
        alg = self._resolve("broadcast", buf, algorithm)
        self._sim.collective("broadcast", alg, (4 * buf.size,), False, t0)

    def barrier(self, *, algorithm: str | None = None) -> None:
        t0 = time.perf_counter()
        self._inner.barrier(algorithm=algorithm)
        self._sim.collective("barrier", algorithm or "rhd", (0,), False, t0)

    def allreduce_scalars(self, values: np.ndarray) -> np.ndarray:
        t0 = time.perf_counter()
        out = self._inner.allreduce_scalars(values)
        n = 8 * np.asarray(values).size
        self._sim.collective("allreduce_scalars", "native", (n,) * self._inner.world, False, t0)
        return out


# ----------------------------------------------------------------------------- simulation
class Simulation:
    """Per-step device time of one rank; see the module docstring."""

    def __init__(self, run: Any, rdev: RankDevice):
        r = run.params.runconfig
        self.run = run
        self.rdev = rdev
        self.clock = rdev.clock
        self.cost = rdev.cost
        self.profile = rdev.profile
        self.dtype = rdev.dtype
        self.notes = list(rdev.notes)
        self.world, self.rank = run.world, run.rank
        self.level = run.zero_level
        self.trace_steps = r.trace_steps
        self.staged = not r.reduce_on_device
        self.link_class = rdev.placement.link_class()
        place = rdev.placement
        net = Network(
            self.world,
            self.rank,
            self.link_class,
            tuple(tuple(place.members(m)) for m in range(place.num_nodes)),
        )
        # the one step-time model (plan mode builds the same from shapes)
        self.model = StepModel(
            self.clock,
            self.cost,
            self.dtype,
            net,
            self.level,
            run.sync.partition,
            run.model.kernel_costs,
            self.notes,
            elem_bytes=run.precision.weight_bytes if hasattr(run, "precision") else 4,
        )
        self._records: list[Span | Coll] = []
        self._open = False
        self._phase: str | None = None
        self._step_t0 = 0.0
        self._first = True
        self.rows: list[tuple[float, float, float, float, float]] = []  # per step
        self.input_s = 0.0
        self.host_s = 0.0
        self.measured_s = 0.0
        self.walls = array.array("d")  # measured seconds per step (first fetch .. gather)
        self.compute_walls = array.array("d")  # measured forward + backward + optimizer
        self.phase_steps: dict[str, array.array] = {}  # span kind -> measured s per step
        self.phase_est: dict[str, float] = {}  # span kind -> simulated seconds, summed
        self.traced: list[tuple[int, int, float]] = []  # (event lo, event hi, sim start)

    # -- recording ----------------------------------------------------------------------
    def collective(self, op: str, algorithm: str, blocks, staged: bool, t0: float) -> None:
        if self._open:
            staged = staged and op in STAGED_OPS
            self._records.append(
                Coll(op, algorithm, tuple(blocks), staged, self._phase, t0, time.perf_counter())
            )

    def _begin(self) -> None:
        if not self._open:
            self._open = True
            self._records = []
            now = time.perf_counter()
            self._step_t0 = now
            if self._first:  # measured and simulated time both start at the first step
                self._first = False
                self.clock.wall_origin = now

    def hook(self, obj: Any, attr: str, kind: str, info=None, ends_step: bool = False) -> None:
        """Wrap ``obj.attr`` (an instance attribute shadows the method) with a span."""
        fn = getattr(obj, attr)
        sim = self

        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            sim._begin()
            outer, sim._phase = sim._phase, kind
            t0 = time.perf_counter()
            try:
                result = fn(*args, **kwargs)
            finally:
                sim._phase = outer
            extra = info(args, kwargs, result) if info else {}
            sim._records.append(Span(kind, t0, time.perf_counter(), extra))
            if ends_step:
                sim.end_step()
            return result

        setattr(obj, attr, wrapped)

    # -- the step -----------------------------------------------------------------------
    def end_step(self) -> None:
        """Replay this step's records on the clock (called when gather_parameters returns)."""
        if not self._open:
            return
        self._open = False
        now = time.perf_counter()
        step = len(self.rows)
        detail = step < self.trace_steps
        clock = self.clock
        first_event = len(clock.events)
        sim_start = clock.now
        played = self.model.play(self._records, detail)
        # the loop's own host work between the hooked calls (Python, the per-step check)
        host = max(0.0, (now - self._step_t0) - played.hooked_s)
        summary = self.model.close(host, played)
        self.host_s += host
        for kind, seconds in played.est.items():
            self._add(self.phase_est, kind, seconds)
        self.rows.append(
            (
                summary.total_s,
                summary.compute_s,
                summary.exposed_comm_s,
                summary.other_s,
                summary.overlapped_comm_s,
            )
        )
        self.input_s += played.input_s
        self.measured_s += now - self._step_t0
        self.walls.append(now - self._step_t0)
        self.compute_walls.append(sum(played.measured.get(k, 0.0) for k in COMPUTE_PHASES))
        for kind, seconds in played.measured.items():
            self.phase_steps.setdefault(kind, array.array("d")).append(seconds)
        if detail:
            self.traced.append((first_event, len(clock.events), sim_start))
        self._records = []

    @staticmethod
    def _add(table: dict[str, float], key: str, seconds: float) -> None:
        table[key] = table.get(key, 0.0) + seconds

    # -- the end ------------------------------------------------------------------------
    def finish(self, model_dir, global_batch: int) -> dict[str, Any] | None:
        """Collective: critical path, timeline (rank 0 writes), performance.json fields."""
        comm = self.run.comm
        rows = np.asarray(self.rows, np.float64).reshape(-1, 5)
        mine = {
            "rows": rows,
            "walls": np.asarray(self.walls, np.float64),
            "compute_walls": np.asarray(self.compute_walls, np.float64),
            "input_s": self.input_s,
            "host_s": self.host_s,
            "measured_s": self.measured_s,
            "memory": self.rdev.memory.summary(),
            "notes": self.notes,
            "phase_measured": {k: float(np.median(v)) for k, v in self.phase_steps.items()},
            "phase_est": self.phase_est,
        }
        every = comm.allgather(mine)  # a few floats per step and rank
        table = np.stack([e["rows"] for e in every])  # (ranks, steps, 5)
        steps = table.shape[1]
        crit = table[:, :, 0].argmax(axis=0) if steps else np.zeros(0, int)
        picked = table[crit, np.arange(steps)] if steps else np.zeros((0, 5))
        step_totals = picked[:, 0]
        starts = np.concatenate([[0.0], np.cumsum(step_totals)])
        self._write_timeline(comm, model_dir, table, starts)
        if self.rank != 0 or not steps:
            return None
        est = float(step_totals.mean())
        parts = picked.mean(axis=0)
        walls = np.stack([e["walls"] for e in every]).max(axis=0)  # slowest rank per step
        shares = [e["input_s"] / e["measured_s"] if e["measured_s"] > 0 else 0.0 for e in every]
        notes = list(dict.fromkeys(n for e in every for n in e["notes"]))
        prof = self.profile

        def per_step(table: dict[str, float]) -> dict[str, float]:
            return {k: v / steps for k, v in table.items()}

        return {
            **est_fields(
                prof,
                global_batch,
                est,
                {"compute": parts[1], "exposed_comm": parts[2], "other": parts[3]},
            ),
            # other = host time the device waits for, measured: the input fetch and the
            # loop's own work between the hooked calls (rank 0, mean per step)
            "est_other_breakdown_s": {
                "input": every[0]["input_s"] / steps,
                "host": every[0]["host_s"] / steps,
            },
            # (the clock accumulates duration - exposed: round-off below 1 fs is zero)
            "est_overlapped_comm_s": float(parts[4]) if parts[4] > 1e-15 else 0.0,
            "est_step_time_s_by_rank": [float(x) for x in table[:, :, 0].mean(axis=1)],
            # per rank, the simulated device alone (mean per step; the measured "other"
            # left out): compute and exposed communication. Ranks differ where their
            # events do (ZeRO slices of unequal content), whatever the host's noise
            "est_device_breakdown_s_by_rank": [
                {"compute": float(c), "exposed_comm": float(e)}
                for c, e in zip(
                    table[:, :, 1].mean(axis=1), table[:, :, 2].mean(axis=1), strict=True
                )
            ],
            # the same steps measured: first input fetch to the end of the parameter gather
            # (summaries and checkpoints, which step_time_s includes, left out), slowest rank
            "measured_step_time_s": float(walls.mean()),
            "measured_step_time_median_s": float(np.median(walls)),
            "measured_step_time_min_s": float(walls.min()),
            # per hooked phase, rank 0: measured (median over steps) and what the device
            # model gives for the same calls (mean per step); compute alone = forward +
            # backward + optimizer, per step (median and best: the profile is best-of-N)
            "measured_phase_s": every[0]["phase_measured"],
            "est_phase_s": per_step(every[0]["phase_est"]),
            "measured_compute_s": {
                "median": float(np.median(every[0]["compute_walls"])),
                "min": float(every[0]["compute_walls"].min()),
            },
            "est_compute_s": sum(
                per_step(every[0]["phase_est"]).get(k, 0.0) for k in COMPUTE_PHASES
            ),
            "input_time_share": max(shares),
            "input_bottleneck_threshold": INPUT_BOTTLENECK_SHARE,
            "suspected_input_bottleneck": max(shares) > INPUT_BOTTLENECK_SHARE,
            **memory_fields([e["memory"] for e in every], prof.memory_bytes),
            "simulation": {
                "dtype": self.dtype,
                "link_class": self.link_class,
                "nodes": self.rdev.placement.num_nodes,
                "ranks_per_node": list(self.rdev.placement.ranks_per_node),
                "reduce_on_device": not self.staged,
                "memory_plan_matches": bool(self.run.memory.plan_matches()),
                "other_is": "measured host time: input fetch + the loop between hooked calls",
                "profile_unknown": list(prof.unknown),
                "notes": notes,
                "timeline": TIMELINE if self.trace_steps else None,
            },
        }

    def _write_timeline(self, comm, model_dir, table: np.ndarray, starts: np.ndarray) -> None:
        """Shift each traced step of this rank to the critical-path start, then gather."""
        steps = table.shape[1]
        traced = min(self.trace_steps, steps)
        if not traced:
            return
        events: list[dict[str, Any]] = []
        ev = self.clock.events
        covered = 0
        for k, (lo, hi, sim_start) in enumerate(self.traced[:traced]):
            shift = starts[k] - sim_start
            for e in ev[covered:lo]:  # measured spans recorded before this step's replay
                events.append(e)
            for e in ev[lo:hi]:
                if e["track"] == "measured":
                    events.append(e)
                else:
                    events.append({**e, "start": e["start"] + shift})
            mine = table[self.rank, k, 0]
            slowest = starts[k + 1] - starts[k]
            if slowest > mine:
                events.append(
                    {
                        "name": "wait for the slowest rank",
                        "cat": "idle",
                        "track": "compute",
                        "start": starts[k] + mine,
                        "dur": slowest - mine,
                        "args": {},
                    }
                )
            covered = hi
        gathered = comm.gather(events, root=0)
        if self.rank == 0:
            prof = self.profile
            write_chrome_trace(
                model_dir / TIMELINE,
                gathered,
                rank_labels=[f"rank {r} ({prof.name})" for r in range(self.world)],
                metadata={
                    "profile": prof.name,
                    "profile_sha256": prof.sha256,
                    "steps_traced": traced,
                    "note": "simulated tracks: each step starts when the slowest rank finished "
                    "the previous one; measured track: host wall time since the first step",
                },
            )


def attach(run: Any) -> Simulation:
    """Install the hooks on a built ``Run`` and account the last device tensors."""
    rdev: RankDevice = run.device
    sim = Simulation(run, rdev)
    # tensors the run holds but does not allocate through run.memory
    setup = setup_for(run)
    if setup.input_bytes_per_sample:
        run.memory.reserve(
            "activations", "input.batch", setup.input_bytes_per_sample * run.micro_batch
        )
    scratch = scratch_bytes(setup, run.layout)
    if scratch:
        run.coll.reserve_scratch(scratch)
        run.memory.reserve("workspace", "collectives.scratch", scratch)

    # what the step keeps resident: on profiles whose memory efficiency is keyed by it (a
    # CPU's caches, which the ranks of a node share), a kernel's operands come from as far
    # away as this many bytes reach
    place = rdev.placement
    sim.cost.working_set = float(run.memory.device_memory.total) * len(place.members(place.node))
    coll = RecordingCollectives(run.coll, sim, sim.staged, run.layout.padded)
    run.coll = coll
    run.sync.coll = coll
    opt = run.params.optimizer
    max_norm = opt.max_gradient_norm

    def shape_of(args, kwargs, result) -> dict[str, Any]:
        x = args[1]
        seq = int(x.shape[1]) if x.ndim == 2 and x.dtype.kind in "iu" else None
        return {"shape": (int(x.shape[0]), seq)}

    def accumulate_info(args, kwargs, result) -> dict[str, Any]:
        if run.micro_grads is None:
            return {}
        return {"elements": int(run.grads.size), "first": args[0] == 0}

    def clip_info(args, kwargs, result) -> dict[str, Any]:
        sumsq = kwargs.get("sumsq", args[1] if len(args) > 1 else None)
        # a sum of squares handed in was computed outside the hooks (the loop's per-step
        # check): its time is in the measured host time, so only clip's own is modelled.
        # The scaling itself runs in the optimizer's pass (its info says so).
        return {"norm": sumsq is None and max_norm is not None}

    def optimizer_info(args, kwargs, result) -> dict[str, Any]:
        grad_scale = kwargs.get("grad_scale", args[4] if len(args) > 4 else 1.0)
        return {
            "elements": int(args[0].size),
            "type": opt.optimizer_type,
            "scaled": grad_scale != 1.0,  # clipping's multiply, in the same pass
        }

    sim.hook(run.data, "train_batch", "input")
    sim.hook(run.model, "forward", "forward", shape_of)
    sim.hook(run.model, "backward", "backward")
    sim.hook(run, "accumulate_gradients", "accumulate", accumulate_info)

    def sync_info(args, kwargs, result) -> dict[str, Any]:
        return {"sumsq": result[1] is not None}  # took this rank's sum of squares on the way

    sim.hook(run.sync, "reduce_gradients", "sync", sync_info)
    sim.hook(run, "gradient_norm", "clip", clip_info)
    sim.hook(run.optimizer, "step", "optimizer", optimizer_info)
    sim.hook(run.sync, "gather_parameters", "gather", ends_step=True)
    return sim


__all__ = [
    "INPUT_BOTTLENECK_SHARE",
    "RankDevice",
    "RecordingCollectives",
    "Simulation",
    "attach",
    "compute_dtype",
    "create_device",
]
