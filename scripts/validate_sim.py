"""Validate simdist's models: against published measurements and against this machine.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python scripts/validate_sim.py \
        [--part published|measured|all] [--json FILE] [--plots DIR] [--nps 1,2,4]

Every prediction uses the shipped profiles and the general rules; nothing is tuned per case.
A row's ``rel_error`` is (predicted - measured) / measured.

Part 1, published: plan mode and the collective model against published figures, each with
its source. Targets: |rel_error| <= 15 % for each row, <= 10 % on average.

Part 2, measured: real training runs on this machine with ``runconfig.device_profile=host``
(the profile ``python -m simdist.calibrate`` wrote for it), FC-MNIST (default params) and
gpt2-mini (``--params gpt2_mini``) at np 1, 2, 4, each with the per-replica batch of its
preset; and both at 2 ranks in tensor-parallel batch mode (``--tensor-parallel 2``) and as a
2-stage 1F1B pipeline of 4 micro-batches (``--pipeline-parallel 2``), and gpt2-mini split in
tensor-parallel weight mode (``--tensor-parallel 2 --tensor-parallel-mode weight``, Megatron's
split; ``--no-parallel`` leaves these out). Every run's performance.json carries the
simulated step (``est_step_time_s``: the critical path of the per-step replay of the kernels
and collectives that ran) and the measured one (first input fetch to the end of the
parameter gather, slowest rank). Rows:

* ``step``: end to end, target <= 15 %. The simulated step models compute and
  communication; its ``other`` part is host time the device waits for in this synchronous
  loop (the input fetch and the loop's Python between the hooked calls), which is measured,
  not modelled: each row says how much of the prediction that is;
* ``compute``: forward + backward + optimizer at np 1 (no collectives), target <= 10 %,
  predicted from the same replay (``est_compute_s``), measured over the same calls
  (``measured_compute_s``);
* ``parallel step``: the same for the TP and PP runs, target <= 15 %; a pipeline's
  simulated step is ``simdist.sim.pp_schedule``'s plus its forward/backward phase's
  measured host time (input fetch, copies, Python between the kernels); weight mode's is
  the shard's kernels and the group's collectives (``simdist.sim.tp_schedule``);
* ``plan vs run``: for each weight-mode and pipeline run, ``python -m simdist.plan --tp 2
  --tp-mode weight`` (``--pp 2``) for the run's configuration (read from its params.yaml)
  against the run's ``est_step_time_s``, target <= 5 %. The weight-mode case runs
  without gradient clipping (``max_gradient_norm: null``): clipping's scaling pass runs
  only in steps whose norm exceeds the limit, which a plan cannot know. Both replay the
  same events through the same step model; the gap is the run's measured host time
  (``other``), which a plan cannot know (the row notes its share and the device part's
  own error);
* ``collective``: all-reduce, reduce-scatter and all-gather of 1, 4 and 16 MiB, ring, rhd
  and shm (on registered buffers, as training runs it), simdist's own collectives timed
  here as the loop runs them (``--collectives-worker`` under mpiexec: buffer just written,
  ranks start together, one call timed, slowest rank) against the schedule model on the
  host profile's ``intra`` link, target <= 10 %.

Which measurement. The profile is best-of-N (calibrate keeps each rate's best sample, so
that other processes on a shared machine do not lower it): it describes the machine when
nothing else runs. The measured side uses the same estimator: the best step over
``--repeats`` interleaved runs; for collectives each launch's best call, and of the
``--launches`` launches (odd, 3 by default) the one with the median error: one launch,
neither the better nor the worse of an even pair. The median is printed beside it: on
a loaded machine the gap between the two is the load, not the model. Nothing is rescaled.

Which profile. ``--profile`` (default: the shipped ``host``) or ``--calibrate``: calibrate
this machine first (written beside ``--json``) and predict every collective from the link
calibrate's probes (``simdist.calibrate.LinkProbe``: Sendrecv and p2p's reduce exchange,
or shm's peer loads, loads that add and stores, at each calibrate size that fits) measure
on that collective's own buffer, in rounds that take turns with its calls (latencies: a
tight loop first). On a virtual machine a buffer's rates depend on the pages under it
(transparent huge pages or 4 KiB ones; shared-memory windows never get huge pages) and on
the neighbours' load, which changes within seconds; only a calibration on the same
memory at the same time describes the machine a call ran on. The model still does the
rest: which steps, at which sizes, which primitive each step is, the call and fence
latencies. Each case's probes and calls are written to ``--json``'s ``*.links/``.

Across hosts. ``--hosts N`` runs only the collective rows, through
``scripts/multihost.py``: N network-namespace hosts, one rank each (root), ring and rhd
(shm needs one node), every case predicted from the probes run on its own buffer (the
probes' copies go between the hosts in 1 MiB pieces, as the collectives' do). ``--rate``
shapes the links with tc's token bucket, whose burst (4 ms at the rate) lets a call or a
probe that follows a pause run faster than the rate, so on a shaped link the rows score
the median call against the median of the per-round predictions.

The profile models one core per rank. Runs with more ranks than cores (np 4 on a 2-core
machine) time-share the cores: they are run and reported, flagged ``oversubscribed``, and
left out of the target summary, because they ran on a different machine (half a core per
device) than the profile describes. They run after the scored cases, not interleaved with
them, so their load does not leak into the scored measurements.

Sources of the published values: ``validate_published.py`` (part 1 lives there).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # validate_published beside it

import validate_published  # noqa: E402

from simdist.comm.partition import partition  # noqa: E402
from simdist.device import CostModel, load_profile  # noqa: E402
from simdist.device.profile import Link, parse_link  # noqa: E402
from simdist.device.schedule import schedule_time  # noqa: E402

# -- part 2: this machine ------------------------------------------------------------------

REPO = Path(__file__).resolve().parents[1]
MODELS_MEASURED = {  # case label -> (params preset, steps per run)
    "FC-MNIST": ("fc_mnist", 150),
    "gpt2-mini": ("gpt2_mini", 12),
}
# tensor (SambaFlow's batch mode) and pipeline parallelism at 2 ranks: case label ->
# (params preset, steps per run, ranks, train arguments); each keeps its preset's batch
# (TP: the group's batch divided over its 2 ranks; PP: 4 micro-batches of a quarter)
# weight mode and pipelines also get a plan-vs-run row; weight mode runs without clipping,
# whose scaling pass runs only when the gradient norm exceeds the limit (data-dependent: a
# plan cannot know it; the pipeline's step does not model that pass)
NO_CLIP = "--optimizer.max_gradient_norm=null"
PARALLEL_MEASURED = {
    "TP2 (batch) FC-MNIST": ("fc_mnist", 150, 2, ["--tensor-parallel=2"]),
    "TP2 (batch) gpt2-mini": ("gpt2_mini", 12, 2, ["--tensor-parallel=2"]),
    "PP2 1f1b FC-MNIST": ("fc_mnist", 150, 2, ["--pipeline-parallel=2",
                          "--optimizer.grad_accum_steps=4", "--train_input.batch_size=8"]),
    "PP2 1f1b gpt2-mini": ("gpt2_mini", 12, 2, ["--pipeline-parallel=2",
                           "--optimizer.grad_accum_steps=4", "--train_input.batch_size=2"]),
    "TP2 (weight) gpt2-mini": ("gpt2_mini", 12, 2, ["--tensor-parallel=2",
                               "--tensor-parallel-mode=weight", NO_CLIP]),
}  # fmt: skip
PLAN_VS_RUN_TARGET = 0.05  # plan mode against the run's own estimate (weight mode)
COMPUTE_PHASES = ("forward", "backward", "optimizer")
HOST_PROFILE = "host"  # --profile / --calibrate: the profile the measured part predicts with
PROBE_LINKS = False  # --calibrate: probe the link on each collective's buffer, between calls
HOSTS: tuple[int, str | None] | None = None  # --hosts N [--rate R]: (N, R) namespaced hosts
WORKER_CALLS: int | None = None  # timed calls per collectives case (None: COLL_CALLS)
KEEP_DIR: Path | None = None  # --calibrate --json F: the collectives launches go to F.links/


def _mpiexec() -> str:
    found = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which(
        "mpiexec"
    )
    if not found:
        raise SystemExit("mpiexec not found next to this python or on PATH")
    return found


def _launch(np_: int, args: list[str], timeout: float) -> subprocess.CompletedProcess:
    cmd = [_mpiexec(), "-n", str(np_), sys.executable, *args]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stdout}{out.stderr}")
    return out


def _launch_on_hosts(hosts: int, rate: str | None, args: list[str], timeout: float) -> None:
    """``args`` under MPI across ``hosts`` network-namespace hosts, one rank each
    (``scripts/multihost.py``: root; links shaped to ``rate`` where given)."""
    cmd = [sys.executable, str(REPO / "scripts" / "multihost.py"), "--hosts", str(hosts),
           "--timeout", str(timeout - 30), *(["--rate", rate] if rate else []),
           "--", sys.executable, *args]  # fmt: skip
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stdout}{out.stderr}")


def _train(
    preset: str, np_: int, steps: int, model_dir: Path, extra: list[str] | None = None
) -> dict:
    args = [
        "-m",
        "simdist.train",
        "--params",
        preset,
        f"--runconfig.device_profile={HOST_PROFILE}",
        "--runconfig.mode=train",
        f"--runconfig.max_steps={steps}",
        f"--runconfig.save_summary_steps={steps}",
        "--runconfig.save_checkpoints_steps=0",
        "--runconfig.trace_steps=0",
        "--runconfig.progress_bar=false",
        f"--runconfig.model_dir={model_dir}",
        *(extra or []),
    ]
    shutil.rmtree(model_dir, ignore_errors=True)
    _launch(np_, args, timeout=1800)
    return json.loads((model_dir / "performance.json").read_text())


def _row(
    case: str, kind: str, predicted: float, best: float, median: float, unit: str, **extra
) -> dict:
    """``measured`` is the best (the estimator calibrate uses); the median is kept beside it."""
    return {
        "case": case,
        "unit": unit,
        "predicted": predicted,
        "measured": best,
        "rel_error": (predicted - best) / best,
        "measured_median": median,
        "rel_error_median": (predicted - median) / median,
        "kind": kind,
        "part": "measured",
        **extra,
    }


def measured_training(nps: list[int], repeats: int, work: Path) -> list[dict]:
    """End-to-end and compute-alone rows from real training runs on the host profile."""
    cores = os.cpu_count() or 1
    runs: dict[tuple[str, int], list[dict]] = {}
    for rep in range(repeats):  # interleaved: a burst of load hits every case alike
        for label, (preset, steps) in MODELS_MEASURED.items():
            for np_ in nps:
                perf = _train(preset, np_, steps, work / f"{preset}-np{np_}")
                runs.setdefault((label, np_), []).append(perf)
                print(
                    f"  [{rep + 1}/{repeats}] {label} np {np_}: measured "
                    f"{1e3 * perf['measured_step_time_min_s']:.3f} ms best, "
                    f"{1e3 * perf['measured_step_time_median_s']:.3f} ms median; simulated "
                    f"{1e3 * perf['est_step_time_s']:.3f} ms per step",
                    flush=True,
                )
    rows = []
    for (label, np_), perfs in runs.items():
        flag = {"oversubscribed": np_ > cores, "cores": cores, "np": np_}
        est = perfs[0]["est_step_time_s"]  # the same in every run but for the measured input
        best = min(p["measured_step_time_min_s"] for p in perfs)
        median = min(p["measured_step_time_median_s"] for p in perfs)
        rows.append(
            _row(
                f"step {label} np {np_}",
                "step",
                1e3 * min(p["est_step_time_s"] for p in perfs),
                1e3 * best,
                1e3 * median,
                "ms",
                target=0.15,
                breakdown_ms={k: 1e3 * v for k, v in perfs[0]["est_step_time_breakdown_s"].items()},
                measured_share=perfs[0]["est_step_time_breakdown_s"]["other"]
                / perfs[0]["est_step_time_s"],
                est_spread=max(p["est_step_time_s"] for p in perfs) / est - 1,
                **flag,
            )
        )
        if np_ == 1:
            p0 = min(perfs, key=lambda p: p["measured_compute_s"]["min"])
            rows.append(
                _row(
                    f"compute {label} np 1 (fwd+bwd+opt)",
                    "compute",
                    1e3 * p0["est_compute_s"],
                    1e3 * p0["measured_compute_s"]["min"],
                    1e3 * min(p["measured_compute_s"]["median"] for p in perfs),
                    "ms",
                    target=0.10,
                    phases_ms={
                        k: [1e3 * p0["est_phase_s"].get(k, 0), 1e3 * p0["measured_phase_s"][k]]
                        for k in COMPUTE_PHASES
                    },
                    **flag,
                )
            )
    return rows


def measured_parallel(
    repeats: int, work: Path, cases: dict[str, tuple] | None = None
) -> list[dict]:
    """Step rows of tensor-parallel (batch and weight mode) and pipeline runs on the host
    profile, target 15 %, as the data-parallel ``step`` rows: the run's simulated step
    (``est_step_time_s``; batch mode: the data-parallel replay; weight mode: the shard's;
    pipelines: ``simdist.sim.pp_schedule``; all with their measured host time) against the
    best measured step (``measured_step_time_min_s``) over the runs. Each weight-mode and
    pipeline case adds a ``plan vs run`` row (``plan_vs_run_row``) after its step row."""
    cores = os.cpu_count() or 1
    cases = PARALLEL_MEASURED if cases is None else cases
    runs: dict[str, list[dict]] = {}
    for rep in range(repeats):
        for label, (preset, steps, np_, extra) in cases.items():
            perf = _train(preset, np_, steps, work / _slug(label), extra)
            runs.setdefault(label, []).append(perf)
            print(
                f"  [{rep + 1}/{repeats}] {label}: measured "
                f"{1e3 * perf['measured_step_time_min_s']:.3f} ms best; simulated "
                f"{1e3 * perf['est_step_time_s']:.3f} ms per step",
                flush=True,
            )
    rows = []
    for label, perfs in runs.items():
        np_ = cases[label][2]
        # a pipeline's phases (forward_backward, gradient_sync_exposed, ...), where it has
        # them; else compute / exposed_comm / other
        parts = perfs[0].get("est_step_phases_s") or perfs[0]["est_step_time_breakdown_s"]
        rows.append(
            _row(
                f"step {label} np {np_}",
                "parallel step",
                1e3 * min(p["est_step_time_s"] for p in perfs),
                1e3 * min(p["measured_step_time_min_s"] for p in perfs),
                1e3 * min(p["measured_step_time_median_s"] for p in perfs),
                "ms",
                target=0.15,
                breakdown_ms={k: 1e3 * v for k, v in parts.items()},
                measured_share=parts.get("other", 0.0) / perfs[0]["est_step_time_s"],
                oversubscribed=np_ > cores,
                cores=cores,
                np=np_,
            )
        )
        p0 = perfs[0]
        weight = p0.get("tensor_parallel_mode") == "weight" and p0["tensor_parallel"] > 1
        if weight or p0.get("pipeline_parallel", 1) > 1:
            rows.append(plan_vs_run_row(label, perfs, work / _slug(label), np_))
    return rows


def _slug(label: str) -> str:
    return label.replace(" ", "_").replace("(", "").replace(")", "")


def plan_for_run(model_dir: Path, np_: int):
    """Plan mode for the configuration a run wrote to its params.yaml (GPT-2 presets and
    FC-MNIST; tensor-parallel weight mode and pipelines)."""
    import yaml

    from simdist.plan import plan

    p = yaml.safe_load((model_dir / "params.yaml").read_text())
    r, opt, batch = p["runconfig"], p["optimizer"], p["train_input"]["batch_size"]
    model = p["model"].get("preset") or p["model"]["name"].replace("_", "-")
    return plan(
        model=model, devices=np_, profile=HOST_PROFILE, tp=r["tensor_parallel"],
        tp_mode=r["tensor_parallel_mode"], pp=r["pipeline_parallel"],
        pipeline_schedule=r["pipeline_schedule"], zero=r["zero_opt_level"],
        batch=batch * opt["grad_accum_steps"], micro_batch=batch, precision=r["precision"],
        optimizer="adam" if opt["optimizer_type"] == "adamw" else "sgd",
        algorithm=r["collective_algorithm"],
    )  # fmt: skip


def plan_vs_run_row(label: str, perfs: list[dict], model_dir: Path, np_: int) -> dict:
    """Plan mode's step for the run's configuration against the run's ``est_step_time_s``
    (best and median over the runs), target 5 %; ``device_rel_error``: against the run's
    simulated device time alone (``est_step_time_s`` less its measured ``other``)."""
    res = plan_for_run(model_dir, np_)
    ests = sorted(p["est_step_time_s"] for p in perfs)
    p0 = min(perfs, key=lambda p: p["est_step_time_s"])
    other = p0["est_step_time_breakdown_s"]["other"]
    device_err = res.step_s / (p0["est_step_time_s"] - other) - 1
    share = other / p0["est_step_time_s"]
    return _row(
        f"plan vs run {label} np {np_}",
        "plan vs run",
        1e3 * res.step_s,
        1e3 * ests[0],
        1e3 * ests[len(ests) // 2],
        "ms",
        target=PLAN_VS_RUN_TARGET,
        device_rel_error=device_err,
        host_share=share,
        source=f"run's estimate includes {100 * share:.1f} % measured host time; device "
        f"part {100 * device_err:+.4f} %",
        np=np_,
        plan_notes=res.notes,
    )


COLL_OPS = ("allreduce", "reduce_scatter", "allgather")
COLL_SIZES = (1 << 20, 4 << 20, 16 << 20)
COLL_CALLS = 60
COLL_ALGS = ("ring", "rhd", "shm")


def collectives_worker(out: str, probe_links: bool = False, calls: int = COLL_CALLS) -> int:
    """Under mpiexec: time simdist's collectives as the training loop runs them: the buffer
    has just been written (as backward writes the gradients), the ranks start together, one
    call is timed, its time is the slowest rank's. Best and median of N calls per case.

    ``probe_links``: also calibrate the link on each case's own buffer, interleaved with
    its calls (``simdist.calibrate.LinkProbe``: one round of the Sendrecv and reduce
    exchanges (an all-reduce's also of the Sendrecv right after a reduce, its second
    half), or of the shm loads, adds and stores, at every calibrate size that fits,
    next to each call, the two taking turns going first; the latencies in a tight loop
    first), every round's samples written with the case (``case_links`` makes one link
    per round).
    On a virtual machine a buffer's rates depend on the pages under it and on the
    neighbours' load, both of which change within one launch, so only a calibration on the
    same memory at the same time describes the machine the call ran on."""
    import numpy as np

    import simdist  # noqa: F401  (pins one thread per rank)
    from simdist.calibrate import (
        DIRECT_MODES,
        DIRECT_SIZES,
        MESSAGE_SIZES,
        REDUCE_SIZES,
        LinkProbe,
    )
    from simdist.comm import Collectives
    from simdist.comm.world import world

    comm = world()
    coll = Collectives(comm)
    # shm needs every rank on one node: across hosts only ring and rhd run
    algs = [a for a in COLL_ALGS if a != "shm" or coll.shared]
    keys = [(op, alg, n) for op in COLL_OPS for alg in algs for n in COLL_SIZES]
    # plain buffers are slices of one large array, as a model's gradients are of its flat
    # gradient buffer
    pool = np.zeros(max(COLL_SIZES) // 4, np.float32)
    bufs = {n: pool[: n // 4] for n in COLL_SIZES}
    # shm runs, as in training, on buffers registered with the collectives (shared memory)
    shared = {n: coll.buffer(n // 4) for n in COLL_SIZES}
    # the reduce probe runs on the collectives' own exchanger: the same scratch memory
    probe = LinkProbe(comm, coll.exchanger) if probe_links else None
    tiny = coll.buffer(16) if probe_links else None
    rows = []
    for op, alg, n in keys:  # one case at a time, as calibrate sweeps one size at a time
        buf = shared[n] if alg == "shm" else bufs[n]
        link: dict = {}
        rounds: dict = {}
        views = None
        if probe is not None:
            # latencies as calibrate takes them (best of a loop, not interleaved with the
            # large transfers: there the shm fence came out 1.5-4x what it costs inside the
            # calls), each right after the case's buffer is written, as its calls run: a
            # 16 MiB write evicts the calls' own Python and MPI state (their fixed costs
            # 2.5-7x the tight loop's on Zen 5); a 1 or 4 MiB one leaves them at 6-8 us
            lat = probe.latencies(coll, tiny, 50, written=buf)
            if alg == "shm":
                views = coll.peer_views(buf)
                kinds = dict.fromkeys(DIRECT_MODES, DIRECT_SIZES)
            else:
                kinds = {"sendrecv": MESSAGE_SIZES, "reduce": REDUCE_SIZES}
                if op == "allreduce":  # its second half, as it runs (LinkProbe.gather)
                    kinds["gather"] = REDUCE_SIZES
            rounds = {k: {s: [] for s in sizes if 2 * s <= n} for k, sizes in kinds.items()}
        window = []
        for i in range(3 + calls):  # 3 warm-up calls: scratch, rendezvous, first touch
            # probes and call take turns going first: neither always follows the other
            if probe is not None and i % 2 == 0:
                _probe_round(probe, rounds, buf, views, i >= 3)
            # freshly written, as gradients are after backward: by ordinary stores (numpy
            # fills zeros with memset, whose large stores can bypass the caches; the
            # probes write the same way)
            buf.fill(1.0)
            coll.barrier(algorithm="native")
            t0 = time.perf_counter()
            getattr(coll, op)(buf, algorithm=alg)
            dt = time.perf_counter() - t0
            if i >= 3:
                window.append(max(comm.allgather(dt)))
            if probe is not None and i % 2 == 1:
                _probe_round(probe, rounds, buf, views, i >= 3)
        if rounds:  # every round's samples: the parent predicts once per round
            link = {"latency": lat, "rounds": rounds}
        rows.append(
            {
                "op": op,
                "algorithm": alg,
                "np": comm.Get_size(),
                "bytes": n,
                "best_us": 1e6 * min(window),
                "median_us": 1e6 * float(np.median(window)),
                "calls_us": [round(1e6 * t, 2) for t in window],  # in order, for the record
                "link": link,
            }
        )
    if comm.Get_rank() == 0:
        Path(out).write_text(json.dumps(rows, indent=1))
    if probe is not None:
        probe.free()
    coll.free()
    return 0


def _probe_round(probe, rounds: dict, buf, views, count: bool) -> None:
    """One sample of each probe in ``rounds`` ({kind: {size: [seconds per round]}}) on
    ``buf`` (shm: ``views``, its ranks' views and fence), appended where ``count``."""
    for kind, sizes in rounds.items():
        for s in sizes:
            if kind == "sendrecv":
                t = probe.exchange(buf, s)
            elif kind == "reduce":
                t = probe.reduce(buf, s)
            elif kind == "gather":
                t = probe.gather(buf, s)
            else:
                t = probe.direct(*views, s, kind)
            if count:
                sizes[s].append(t)


def case_links(row: dict, base: Link) -> list[Link]:
    """The links a collectives case is predicted on: the profile's, or where the worker
    probed the case's own buffer, one per probe round, each made by calibrate's rules from
    that round's samples alone (shm: the direct part; the profile's add rate as γ, which
    the measured reducing rates make unused). One round's probes ran next to one call: their sum
    is compared with a call, not the best of each part with another."""
    from simdist.calibrate import DIRECT_MODES, direct_link, mpi_link, mpi_results

    probed = row.get("link") or {}
    if "rounds" not in probed:
        return [base]
    lat, rounds = probed["latency"], probed["rounds"]
    reduce_bw = 1.0 / base.gamma if base.gamma else 1e12

    def sample(kind: str, k: int) -> tuple[list[int], list[float]]:
        by_size = {int(s): v for s, v in rounds[kind].items()}  # JSON keys are strings
        sizes = sorted(by_size)
        return sizes, [by_size[s][k] for s in sizes]

    first = next(iter(rounds.values()))
    links = []
    for k in range(len(next(iter(first.values())))):
        if "copy" in rounds:
            sizes, _ = sample("copy", k)
            direct = {m: sample(m, k)[1] for m in DIRECT_MODES}
            direct.update(sizes=sizes, step=lat["step"])
            d = parse_link(direct_link(direct, reduce_bw), "intra.direct")
            links.append(dataclasses.replace(base, direct=d))
        else:
            sizes, sendrecv = sample("sendrecv", k)
            reduce_sizes, reduce = sample("reduce", k)
            gather = sample("gather", k)[1] if "gather" in rounds else None
            mpi = mpi_results(sizes, sendrecv, reduce_sizes, reduce, lat["call"], gather)
            links.append(parse_link(mpi_link(mpi, reduce_bw), "intra"))
    return links


def measured_collectives(nps: list[int], launches: int, work: Path) -> list[dict]:
    """Collectives of 1-16 MiB: measured (``collectives_worker``, launched ``launches`` times)
    vs the schedule model, as the training runs cost them.

    The link: the profile's ``intra`` link, or with ``--calibrate`` the link calibrate's
    probes measure on each case's own buffer between its calls (``collectives_worker``).
    Each launch gives its best call (and its median) and its own prediction; a row is the
    launch with the median relative error, and lists all."""
    cores = os.cpu_count() or 1
    base = CostModel(load_profile(HOST_PROFILE))
    rows = []
    for np_ in [n for n in nps if n > 1]:
        runs = []
        for k in range(max(1, launches)):
            out = work / f"collectives-np{np_}-{k}.json"
            args = [str(Path(__file__).resolve()), "--collectives-worker", str(out)]
            if PROBE_LINKS:
                args.append("--worker-probe")
            if WORKER_CALLS is not None:  # --worker-calls (tests: fewer)
                args += ["--worker-calls", str(WORKER_CALLS)]
            if HOSTS is not None:
                _launch_on_hosts(*HOSTS, args, 1800)
            else:
                _launch(np_, args, 1800)
            runs.append(json.loads(out.read_text()))
            if KEEP_DIR is not None:  # the cases and their probed links, for the record
                KEEP_DIR.mkdir(parents=True, exist_ok=True)
                shutil.copy(out, KEEP_DIR / out.name)
        for i, r in enumerate(runs[0]):
            n = r["bytes"]
            bounds = partition(n // 4, np_)
            blocks = [4 * int(x) for x in bounds[1:] - bounds[:-1]]
            # per launch: its prediction (on its link) against its best call; the row is
            # the launch with the median error (each side from one launch). On a shaped
            # link (--rate: tc's token bucket) medians on both sides: a call or probe after
            # a pause rides the bucket's burst past the rate (a 1 MiB all-gather's best
            # call took 1.6 ms where 512 KiB each way needs 4.2 ms at 1 Gbit/s), so the
            # best of either side measures the bucket, not the link
            shaped = HOSTS is not None and HOSTS[1] is not None
            pick = statistics.median if shaped else min
            pairs = []
            for x in runs:  # the best of its predictions, as of its calls
                links = case_links(x[i], base.link("intra", np_))
                preds = [schedule_time(r["op"], r["algorithm"], blocks, lk) for lk in links]
                measured = x[i]["median_us" if shaped else "best_us"]
                pairs.append((1e6 * pick(preds), measured, x[i]["median_us"]))
            pairs.sort(key=lambda t: (t[0] - t[1]) / t[1])
            pred, best, median = pairs[len(pairs) // 2]
            where = ""
            if HOSTS is not None:  # e.g. " (2 hosts, 1gbit)"
                where = f" ({HOSTS[0]} hosts{', ' + HOSTS[1] if HOSTS[1] else ''})"
            rows.append(
                _row(
                    f"{r['op']} {r['algorithm']} {n >> 20} MiB np {np_}{where}",
                    "collective",
                    pred,
                    best,
                    median,
                    "us",
                    target=0.10,
                    oversubscribed=np_ > cores,
                    cores=cores,
                    np=np_,
                    launches=[[round(v, 2) for v in t] for t in pairs],
                    link_probed=PROBE_LINKS,
                    **({"source": "shaped link: medians of calls and probes"} if shaped else {}),
                )
            )
    return rows


def calibrate_now(json_path: Path | None) -> str:
    """Calibrate this machine now (``simdist.calibrate`` under ``mpiexec -n 2``) and return
    the profile's path: beside ``json_path`` when given, else in a temporary directory."""
    out = (
        json_path.with_suffix(".host.yaml")
        if json_path
        else Path(tempfile.mkdtemp(prefix="validate_sim-")) / "host.yaml"
    )
    print(f"# calibrating this machine into {out} ...", flush=True)
    t0 = time.time()
    _launch(2, ["-m", "simdist.calibrate", "--repeats", "7", "--out", str(out.resolve())], 1800)
    print(f"# calibrated in {time.time() - t0:.0f} s", flush=True)
    return str(out.resolve())


def _plots(rows: list[dict], directory: Path) -> list[Path]:
    """Predicted vs measured, log-log, one panel per kind, the target band shaded; drawn by
    simdist.plots, which writes the plotted points beside the PNG as validate_sim.json."""
    from simdist.plots import MatplotlibMissing, Panel, Plot, Series, render

    panels = []
    for kind in dict.fromkeys(r["kind"] for r in rows):
        group = [r for r in rows if r["kind"] == kind]
        lo = min(min(r["predicted"], r["measured"]) for r in group) * 0.7
        hi = max(max(r["predicted"], r["measured"]) for r in group) * 1.4
        tgt = group[0].get("target", 0.15)
        xs = [lo, hi]
        panel = Panel(
            f"{kind} (band: ±{100 * tgt:.0f} %)",
            f"measured / published ({group[0]['unit']})",
            "predicted",
            xscale="log",
            yscale="log",
            xlim=(lo, hi),
            ylim=(lo, hi),
            legend=False,
        )
        panel.series.append(
            Series(
                "_target band", xs, [x * (1 - tgt) for x in xs], "band", [x * (1 + tgt) for x in xs]
            )
        )
        panel.series.append(Series("_exact", xs, xs, color="k"))
        for over, name, marker, color in (
            (False, "scored", "o", "C0"),
            (True, "oversubscribed", "x", "C3"),
        ):
            pts = [r for r in group if bool(r.get("oversubscribed")) == over]
            if pts:
                panel.series.append(
                    Series(
                        name,
                        [r["measured"] for r in pts],
                        [r["predicted"] for r in pts],
                        "points",
                        marker=marker,
                        color=color,
                        source="rows:measured,predicted",
                    )
                )
        panels.append(panel)
    plot = Plot("validate_sim", "", panels, cols=min(4, len(panels)), panel_size=(4.2, 4.2))
    try:
        png, _ = render(plot, directory, dpi=120)
    except MatplotlibMissing as e:
        print(f"(no plots: {e})")
        return []
    return [png]


def _print(rows: list[dict]) -> None:
    w = max(len(r["case"]) for r in rows)
    print(f"{'case':<{w}}  {'predicted':>11}  {'measured':>11}  unit  rel_error  (vs median)  note")
    for r in rows:
        tgt = r.get("target", 0.15)
        note = r.get("source", "")
        if "measured_share" in r:
            note = f"predicted includes {100 * r['measured_share']:.0f} % measured host time"
        if r.get("oversubscribed"):
            note = f"oversubscribed: {r['np']} ranks on {r['cores']} cores (not in targets)"
        elif abs(r["rel_error"]) > tgt:
            note = f"MISS (> {100 * tgt:.0f} %)" + ("; " + note if note else "")
        med = r.get("rel_error_median")
        med_text = f"({100 * med:+8.2f}%)" if med is not None else " " * 11
        print(
            f"{r['case']:<{w}}  {r['predicted']:11.4g}  {r['measured']:11.4g}  {r['unit']:<4}"
            f"  {100 * r['rel_error']:+8.2f}%  {med_text}  {note}"
        )
    print()
    groups: dict[str, list[dict]] = {}
    for r in rows:
        if not r.get("oversubscribed"):
            groups.setdefault(r["kind"], []).append(r)
    for name, group in groups.items():
        errs = [abs(r["rel_error"]) for r in group]
        tgt = group[0].get("target", 0.15)
        within = sum(e <= tgt for e in errs)
        print(
            f"{name:<36} {len(group):2d} cases: mean |rel_error| "
            f"{100 * sum(errs) / len(errs):5.2f} %, max {100 * max(errs):5.2f} %, "
            f"{within}/{len(group)} within {100 * tgt:.0f} %"
        )


def across_hosts(args: argparse.Namespace) -> int:
    """``--hosts N``: the collective rows across N namespaced hosts, one rank each."""
    global HOSTS, PROBE_LINKS, KEEP_DIR
    HOSTS, PROBE_LINKS = (args.hosts, args.rate), True
    if args.json:
        KEEP_DIR = Path(args.json).with_suffix(".links")
    print(
        f"# collectives across {args.hosts} hosts (link {args.rate or 'unshaped veth'}), "
        f"load average {os.getloadavg()[0]:.2f} at start",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="validate_sim-") as tmp:
        rows = measured_collectives([args.hosts], args.launches, Path(tmp))
    _print(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        epilog="Measured rows: step (np 1, 2, 4), compute (np 1), parallel step (2 ranks: "
        "TP2 batch mode FC-MNIST and gpt2-mini, PP2 1f1b both, TP2 weight mode gpt2-mini; "
        "target 15 %), plan vs run (each weight-mode and pipeline run against python -m "
        "simdist.plan --tp 2 --tp-mode weight / --pp 2 for its configuration, target 5 %), "
        "collective. Load on a shared machine shows as the gap between best and median; see "
        "the module docstring.",
    )
    ap.add_argument("--part", choices=("published", "measured", "all"), default="all")
    ap.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    ap.add_argument(
        "--plots",
        metavar="DIR",
        help="write validate_sim.png (and its data, validate_sim.json) there (matplotlib)",
    )
    ap.add_argument("--nps", default="1,2,4", help="world sizes of the measured part")
    ap.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="runs per training case (best kept)",
    )
    ap.add_argument(
        "--launches",
        type=int,
        default=3,
        help="launches of the collectives worker, odd: a row is the launch with the median "
        "error (each launch: its best call against its own probes' prediction)",
    )
    ap.add_argument("--no-collectives", action="store_true", help="skip the collective rows")
    ap.add_argument(
        "--no-parallel",
        action="store_true",
        help="skip the tensor-parallel (batch and weight mode) and pipeline rows (with "
        "their plan-vs-run rows; 2 ranks, after the np <= cores cases)",
    )
    ap.add_argument(
        "--profile",
        metavar="NAME|YAML",
        help="profile of the measured part (default: host, the shipped calibration)",
    )
    ap.add_argument(
        "--calibrate",
        action="store_true",
        help="first run `mpiexec -n 2 python -m simdist.calibrate` and predict with that "
        "profile (this machine as it is now; written next to --json as *.host.yaml); each "
        "collective is predicted from calibrate's link probes run on its own buffer, taking "
        "turns with its calls (kept in *.links/)",
    )
    ap.add_argument(
        "--hosts",
        type=int,
        metavar="N",
        help="the collective rows only, across N simulated hosts (network namespaces, one "
        "rank each, through scripts/multihost.py: needs root): ring and rhd (shm needs one "
        "node), each predicted from the link probes run on its own buffer between its calls",
    )
    ap.add_argument("--rate", help="with --hosts: shape each host's link, e.g. 1gbit")
    ap.add_argument("--collectives-worker", metavar="OUT", help=argparse.SUPPRESS)
    ap.add_argument("--worker-probe", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument(
        "--worker-calls",
        type=int,
        metavar="N",
        help=f"timed calls per collective case, each next to one probe round with --calibrate "
        f"(default {COLL_CALLS}): more calls, steadier best-of figures on a noisy machine",
    )
    ap.add_argument(
        "--combine",
        choices=("roofline", "sum"),
        help="diagnostic: override every profile's kernel-time rule (default: as shipped)",
    )
    args = ap.parse_args(argv)
    if args.collectives_worker:  # internal: run under mpiexec by measured_collectives
        calls = args.worker_calls or COLL_CALLS
        return collectives_worker(args.collectives_worker, args.worker_probe, calls)
    global WORKER_CALLS
    WORKER_CALLS = args.worker_calls
    if args.launches < 1 or args.launches % 2 == 0:
        ap.error(
            f"--launches {args.launches}: give an odd number >= 1 (a row is the launch with "
            "the median error, which an even count does not have)"
        )
    if args.rate and not args.hosts:
        ap.error("--rate shapes the links of --hosts; give --hosts N too")
    if args.hosts is not None:
        if args.hosts < 2:
            ap.error(f"--hosts {args.hosts}: needs 2 or more hosts")
        if os.geteuid() != 0:
            ap.error("--hosts needs root (scripts/multihost.py makes network namespaces)")
        return across_hosts(args)
    validate_published.COMBINE = args.combine
    rows: list[dict] = []
    if args.part in ("published", "all"):
        rows += validate_published.run()
    if args.part in ("measured", "all"):
        nps = [int(x) for x in args.nps.split(",") if x]
        env = {k: os.environ.get(k, "(unset)") for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")}
        global HOST_PROFILE, PROBE_LINKS, KEEP_DIR
        if args.calibrate:
            HOST_PROFILE = calibrate_now(Path(args.json) if args.json else None)
            PROBE_LINKS = True
            if args.json:
                KEEP_DIR = Path(args.json).with_suffix(".links")
        elif args.profile:
            HOST_PROFILE = args.profile
        prof = load_profile(HOST_PROFILE)
        print(
            f"# measured part: host profile {prof.sha256[:12]} ({prof.path}), {os.cpu_count()} "
            f"cores, load average {os.getloadavg()[0]:.2f} at start, {env}",
            flush=True,
        )
        t0 = time.time()
        with tempfile.TemporaryDirectory(prefix="validate_sim-") as tmp:
            work = Path(tmp)
            # Scored cases first: the oversubscribed ones keep the machine loaded for a while
            # after they end and must not run in between.
            cores = os.cpu_count() or 1
            for k, group in enumerate(
                ([n for n in nps if n <= cores], [n for n in nps if n > cores])
            ):
                if group:
                    rows += measured_training(group, args.repeats, work)
                    if not args.no_collectives:
                        rows += measured_collectives(group, args.launches, work)
                if k == 0 and not args.no_parallel:  # 2 ranks: scored where 2 cores exist
                    rows += measured_parallel(args.repeats, work)
        print(
            f"# measured part took {time.time() - t0:.0f} s; load average "
            f"{os.getloadavg()[0]:.2f} at the end",
            flush=True,
        )
    _print(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    if args.plots and rows:
        for path in _plots(rows, Path(args.plots)):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
