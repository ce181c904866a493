"""Training throughput: simdist vs PyTorch eager and DDP (gloo), side by side in one run.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python scripts/bench_train.py \
        [--models fc_mnist,gpt2-mini,bert-mini,t5-mini,transformer-mini] [--json FILE] \
        [--no-torch] [--repeats 3]

Every measurement is a fresh process (one thread per process): simdist through
``mpiexec -n {1,2} python -m simdist.train``, PyTorch eager in one process (fused AdamW
and subnormals flushed to zero, as simdist's optimizers flush them: PyTorch at its fastest;
``--torch-keep-subnormals``: as PyTorch runs by default) and PyTorch DDP over gloo on 2
ranks, on the same model, batch and data, and the same optimizer step: PyTorch's AdamW
takes the preset's hyperparameters, and where the preset clips the gradient's global norm
(gpt2-mini, bert-mini, t5-mini, transformer-mini: ``max_gradient_norm: 1.0``) PyTorch clips
too (``torch.nn.utils.clip_grad_norm_``), as simdist's run does every step. The runs are
interleaved and repeated; the table shows the median of the repeats.

Both sides are timed the same two ways. ``samples/s`` (every ratio below uses it): the
global batch over the median step time, the steady state (simdist: performance.json's
``measured_step_time_median_s``, the slowest rank's step from its first input fetch to its
parameter gather; PyTorch: rank 0's steps after its untimed warm-up). ``whole run``: all
steps from the first one on, cold first steps included (simdist: performance.json's
``samples_per_sec``, summaries included; PyTorch: its warm-up steps counted too). The
whole-run figures of a short run weigh the first, cold steps heavily (first touch of every
buffer), on both sides.

The row "simdist ring" is simdist np 2 with ``collective_algorithm: ring`` (messages
through MPI) instead of "auto" (on one node: "shm", reading the peers' shared-memory
gradient buffers); the column "sync ms" is the gradient all-reduce's measured time per
step inside the loop (performance.json ``measured_phase_s.sync``, rank 0, median).

The row "2 x simdist np1" is the machine's ceiling for 2-rank data parallelism: two
single-rank simdist runs started together (one ``mpiexec -n 2``, each rank training alone on
MPI.COMM_SELF; they meet in one barrier just before their training loops and never
communicate), their samples/s added. ``ceiling_efficiency_np2`` = that sum / (2 x the solo
np 1 rate): what the shared cores, caches and memory bandwidth leave for ANY data-parallel
implementation; ``dp_vs_ceiling`` = simdist np 2 / that sum (1.0: communication and
synchronisation cost nothing). A synchronous step waits for the slower rank, and on a
virtual machine one core can run several per cent slower than the other for tens of seconds
(the row's ``independent_runs``: each repeat's two rates), so it also records twice the
slower run's rate: ``lockstep_ceiling_efficiency_np2`` = that / (2 x the solo rate), the
most any synchronous data parallelism could reach on those two cores with free
communication (an upper bound: per-step noise makes a lockstep pair slower still);
``dp_vs_lockstep_ceiling`` = simdist np 2 / that. Efficiencies are given as the ratio of
the medians and, as ``*_paired``, as the median of the ratios within each repeat (whose
runs ran back to back): on a shared virtual machine whose speed drifts by 10-20 % over tens
of seconds, the paired figure is the steadier one.

Also printed (and in the JSON's "machine"): the machine's load, the CPU model and the ISA
flags that decide which kernels BLAS and LLVM pick (AVX2, AVX-512, AVX512_BF16, AMX...), the
BLAS kernel in use (threadpoolctl) and the one simdist's kernels call (``kernels.blas``:
oneMKL on Intel where installed, oneDNN on AMD's AVX-512 kind where installed, else
OpenBLAS), and the single-core float32 GEMM rate
measured in this run, both NumPy's and the kernels' (the better of the two is the ceiling
for GPT-2's GFLOP/s, ``fraction_of_gemm_rate``).

The floor (``floor_rate``, measured before and after each model's runs, the faster kept):
every matrix product of the model's step timed alone with the kernels' BLAS, plus AdamW,
as ``floor_samples_per_sec``. ``floor_vs_torch_eager_np1`` is the most any implementation
calling this BLAS could reach against PyTorch eager (which calls it on the same products);
``simdist_vs_floor_np1`` is how close simdist's step comes to it.
Benchmarks run as on a user's machine: unset OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE
together in the command (never in tests or CI).

``--interleaved N`` (any of the models) measures differently, for a machine shared with
other jobs, where whole runs drift by 2x: one process builds simdist's model (forward,
backward, its AdamW) and the PyTorch twin (forward, backward, fused AdamW), both with the
preset's dropout, and alternates their training steps on batches of the same data N
times. It prints per-step wall times (min and median), the calling thread's CPU time per
step (median; both sides run on this one thread, so time spent descheduled by other jobs
is left out) and samples/s (tokens/s) of each, and the ratios PyTorch / simdist. simdist's
step there is the model and its optimizer only: a training run's per-step work around
them (the gradient norm and the agreement on it, the simulated device's records) is not
in it, so these ratios sit above the whole runs' by that work. PyTorch's subnormal flush
(below) is the thread's, so there it holds for simdist's side too.
"""

from __future__ import annotations

import simdist  # noqa: F401, I001  (first: pins one thread per process before numpy loads)

# isort: split
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from simdist.hostcpu import cpu_identity, cpu_info

REPO = Path(__file__).resolve().parents[1]
MPIEXEC = str(Path(sys.executable).parent / "mpiexec")

MODELS = {
    # name: (simdist params preset + overrides, per-rank batch, steps, tokens per sample)
    "fc_mnist": (["--params", "fc_mnist", "--train_input.batch_size=128"], 128, 300, 0),
    "gpt2-mini": (["--params", "gpt2_mini", "--train_input.batch_size=8"], 8, 30, 128),
    # the Hugging Face model (transformers) is the PyTorch side; tokens = input tokens
    "bert-mini": (["--params", "bert_mini", "--train_input.batch_size=8"], 8, 20, 128),
    "t5-mini": (["--params", "t5_mini", "--train_input.batch_size=8"], 8, 20, 128),
    # torch.nn.Transformer plus embeddings (hf_reference.TorchTransformer); 32 input tokens
    "transformer-mini": (
        ["--params", "transformer_mini", "--train_input.batch_size=8"],
        8,
        100,
        32,
    ),  # fmt: skip
}


def machine_info() -> dict:
    from simdist.kernels.blas import library

    try:
        from threadpoolctl import threadpool_info
    except ImportError:  # the bench extra is not installed: say so, measure anyway
        blas = ["unknown (threadpoolctl not installed: pip install -e .[bench])"]
    else:
        blas = [
            f"{p.get('internal_api')} {p.get('version')} {p.get('architecture')} "
            f"threads={p.get('num_threads')}"
            for p in threadpool_info()
            if p.get("user_api") == "blas"
        ]
    return {
        "host": socket.gethostname(),
        "cpus": os.cpu_count(),
        "loadavg": os.getloadavg(),
        "cpu": cpu_info(),
        "blas": blas,
        "kernels_blas": library(),
        "OPENBLAS_CORETYPE": os.environ.get("OPENBLAS_CORETYPE", "(unset)"),
    }


def gemm_gflops(n: int = 1024, reps: int = 5) -> tuple[float, float]:
    """Single-core float32 GEMM GFLOP/s, n^3, best of ``reps``: NumPy's np.dot and the
    kernels' ``blas.gemm`` (the BLAS simdist's kernels call)."""
    from simdist.kernels.blas import gemm

    a = np.random.default_rng(0).standard_normal((n, n), dtype=np.float32)
    out = np.empty_like(a)
    one, zero = np.float32(1.0), np.float32(0.0)
    rates = []
    for fn in (lambda: np.dot(a, a, out), lambda: gemm(a, a, out, one, zero)):
        fn()
        best = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t)
        rates.append(2 * n**3 / best / 1e9)
    return rates[0], rates[1]


def floor_rate(model: str, reps: int = 5) -> dict:
    """The step's products and its optimizer alone, as fast as this BLAS runs them.

    Every matrix product of a step (``kernel_costs``: the simulated device's list, with
    each product's shape, layout and count) is timed with the kernels' ``blas.gemm`` on
    its own operands, and AdamW over the parameter count, each the best of ``reps``; their
    sum is the floor of the step. PyTorch calls the same BLAS on the same products and runs
    the same AdamW, so ``floor / PyTorch eager`` bounds what ANY rewrite of the rest (the
    elementwise passes, the framework) can reach against it on this machine. Best-of times
    in a warm cache make the floor optimistic, which keeps the bound honest.
    """
    from bench_kernels import best_seconds  # scripts/, beside this one
    from simdist.kernels.blas import gemm
    from simdist.kernels.optim import adamw_update

    from simdist.config import load_params
    from simdist.models import build_model

    args, batch, *_ = MODELS[model]
    net = build_model(load_params(args).model)
    rng = np.random.default_rng(0)
    one, zero = np.float32(1.0), np.float32(0.0)

    def operand(rows: int, cols: int, transposed: bool) -> np.ndarray:
        if transposed:  # handed to BLAS as a transpose flag, as the kernels do
            return rng.standard_normal((cols, rows), dtype=np.float32).T
        return rng.standard_normal((rows, cols), dtype=np.float32)

    seconds: dict[tuple, float] = {}
    gemm_s = 0.0
    for k in net.kernel_costs(batch, None):
        if k.kind != "matmul":
            continue
        if k.shape not in seconds:
            m, kk, n, layout = k.shape
            a, b = operand(m, kk, layout == "tn"), operand(kk, n, layout == "nt")
            c = np.empty((m, n), np.float32)
            seconds[k.shape] = best_seconds(gemm, (a, b, c, one, zero), reps)
        gemm_s += k.count * seconds[k.shape]
    numel = sum(int(np.prod(s.shape)) for s in net.parameter_specs())
    p, g = (
        rng.standard_normal(numel, dtype=np.float32),
        rng.standard_normal(numel, dtype=np.float32),
    )
    m1, m2 = np.zeros(numel, np.float32), np.zeros(numel, np.float32)
    # every model here trains with AdamW (its presets); its cost does not depend on the
    # hyperparameters
    adamw_s = best_seconds(adamw_update, (p, g, m1, m2, 1e-3, 0.9, 0.999, 1e-8, 0.0, 1), reps)
    return {
        "floor_gemm_ms": round(1e3 * gemm_s, 3),
        "floor_adamw_ms": round(1e3 * adamw_s, 3),
        "floor_samples_per_sec": round(batch / (gemm_s + adamw_s), 1),
    }


def simdist_args(model: str, steps: int, model_dir: str) -> list[str]:
    args, *_ = MODELS[model]
    return [
        *args,
        f"--runconfig.max_steps={steps}",
        "--runconfig.mode=train",
        "--runconfig.save_checkpoints_steps=0",
        f"--runconfig.save_summary_steps={steps}",
        "--runconfig.progress_bar=false",
        f"--runconfig.model_dir={model_dir}",
    ]


def steady_rate(perf: dict) -> float:
    """samples/s of a simdist run's median step (its performance.json)."""
    return perf["global_batch_size"] / perf["measured_step_time_median_s"]


def run_simdist(
    model: str, np_: int, steps: int, algorithm: str = "auto"
) -> tuple[float, float, float]:
    """samples/s (median step; whole run) and the gradient sync's measured time per step
    (median, rank 0, seconds)."""
    with tempfile.TemporaryDirectory() as d:
        cmd = [MPIEXEC, "-n", str(np_), sys.executable, "-m", "mpi4py", "-m", "simdist.train"]
        cmd += simdist_args(model, steps, f"{d}/run")
        cmd.append(f"--runconfig.collective_algorithm={algorithm}")
        out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
        if out.returncode:
            raise RuntimeError(f"simdist failed:\n{out.stdout}\n{out.stderr}")
        perf = json.loads(Path(d, "run", "performance.json").read_text())
        sync = perf.get("measured_phase_s", {}).get("sync", 0.0)
        return steady_rate(perf), perf["samples_per_sec"], sync


def run_independent(model: str, steps: int) -> tuple[float, float, list[float]]:
    """Two single-rank simdist runs at once, no communication between them: the sum of
    their samples/s (median step; whole run), and each one's (median step).
    Divided by twice a solo run's, the sum is the most any data-parallel implementation
    could reach on this machine (shared cores, caches, memory bandwidth), and twice the
    slower the most a synchronous one could (its every step waits for the slower rank)."""
    with tempfile.TemporaryDirectory() as d:
        cmd = [MPIEXEC, "-n", "2", sys.executable, "-m", "mpi4py", __file__]
        cmd += ["--independent", model, "--steps", str(steps), "--dir", d]
        out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
        if out.returncode:
            raise RuntimeError(f"independent runs failed:\n{out.stdout}\n{out.stderr}")
        perfs = [json.loads(Path(d, f"run{r}", "performance.json").read_text()) for r in (0, 1)]
        rates = [steady_rate(p) for p in perfs]
        return sum(rates), sum(p["samples_per_sec"] for p in perfs), rates


def independent_worker(model: str, steps: int, d: str) -> int:
    """One of two processes launched together: a whole single-rank simdist run on
    MPI.COMM_SELF. The two meet once in a COMM_WORLD barrier right before their training
    loops start (so the loops run side by side) and never communicate otherwise."""
    from mpi4py import MPI
    from simdist.kernels.registry import warm_all

    import simdist.run
    import simdist.train

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    for r in range(comm.Get_size()):  # one at a time: rank 0 may fill numba's cache
        if r == rank:
            warm_all()
        comm.Barrier()
    simdist.run.world = simdist.train.world = lambda: MPI.COMM_SELF
    start = simdist.run.Run.start_training

    def start_together(self) -> None:
        comm.Barrier()
        start(self)

    simdist.run.Run.start_training = start_together
    return simdist.train.main(simdist_args(model, steps, f"{d}/run{rank}"))


def run_torch(model: str, np_: int, steps: int) -> tuple[float, float]:
    """samples/s of PyTorch (median step; whole run)."""
    cmd = [sys.executable, __file__, "--worker", model, "--steps", str(steps)]
    env = dict(os.environ)
    if np_ > 1:
        with socket.socket() as s:  # a free loopback port for gloo's rendezvous
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        cmd = [MPIEXEC, "-n", str(np_), *cmd]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env, timeout=1800)
    if out.returncode:
        raise RuntimeError(f"torch worker failed:\n{out.stdout}\n{out.stderr}")
    rates = json.loads(out.stdout.strip().splitlines()[-1])
    return rates["samples_per_sec"], rates["run_samples_per_sec"]


def mlp_sizes() -> list[int]:
    """FC-MNIST's layer sizes, as its preset sets them (the PyTorch twin's)."""
    from simdist.config import load_params

    m = load_params(MODELS["fc_mnist"][0]).model
    return [m.input_size, *m.hidden_sizes, m.num_classes]


def torch_threads_and_subnormals(torch) -> None:
    """One thread, and subnormals flushed to zero as simdist's optimizers flush them
    (kernels/optim.py): PyTorch at its fastest. By default PyTorch keeps them, and from
    about 1,000 FC-MNIST steps on its AdamW slows down 5x on the subnormal exp_avg of
    weights whose gradient stays 0; ``--torch-keep-subnormals`` measures it that way."""
    torch.set_num_threads(1)
    torch.set_flush_denormal(os.environ.get("BENCH_TORCH_SUBNORMALS") != "keep")


def torch_optimizer(model: str, net):
    """PyTorch's side of the preset's optimizer step: fused AdamW with its hyperparameters
    (the learning rate's schedule aside, which costs nothing), and the gradient clipping it
    asks for as a callable to run before the update (a no-op where it clips nothing)."""
    import torch

    from simdist.config import load_params

    o = load_params(MODELS[model][0]).optimizer
    if o.optimizer_type != "adamw":
        raise SystemExit(f"bench_train: {model}'s preset trains with {o.optimizer_type}, not AdamW")
    lr = o.learning_rate if isinstance(o.learning_rate, int | float) else 1e-3  # a schedule
    opt = torch.optim.AdamW(
        net.parameters(), lr=lr, betas=(o.beta1, o.beta2), eps=o.eps,
        weight_decay=o.weight_decay, fused=True,
    )  # fmt: skip
    if o.max_gradient_norm is None:
        return opt, lambda: None
    params = [p for p in net.parameters() if p.requires_grad]
    return opt, lambda: torch.nn.utils.clip_grad_norm_(params, o.max_gradient_norm)


def torch_worker(model: str, steps: int) -> None:
    """One PyTorch process (DDP when launched by mpiexec); prints samples/s as JSON: of
    the median step after the warm-up, and of all steps (warm-up included)."""
    import torch

    from simdist.testing.torch_reference import TorchGPT2, TorchMLP

    torch_threads_and_subnormals(torch)
    rank = int(os.environ.get("PMI_RANK", 0))
    world = int(os.environ.get("PMI_SIZE", 1))
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    rng = np.random.default_rng(rank)
    if model == "fc_mnist":
        from simdist.data.mnist import load_mnist

        m = load_mnist()
        x_all, y_all = torch.from_numpy(m.x_train), torch.from_numpy(m.y_train).long()
        net, batch = TorchMLP(mlp_sizes()), MODELS[model][1]

        def batch_at(i):
            idx = torch.from_numpy(rng.integers(0, len(x_all), batch))
            return x_all[idx], y_all[idx]
    elif model in ("bert-mini", "t5-mini", "transformer-mini"):
        net, batch_at = _hf_model_and_batches(model, rng)
        batch = MODELS[model][1]
    else:
        from simdist.data.text import load_text_tokens
        from simdist.models.gpt2 import PRESETS

        cfg = PRESETS[model]
        tokens = torch.from_numpy(load_text_tokens(None)[0].astype(np.int64))
        net, batch, T = TorchGPT2(cfg), MODELS[model][1], cfg.block_size

        def batch_at(i):
            starts = rng.integers(0, len(tokens) - T - 1, batch)
            x = torch.stack([tokens[s : s + T] for s in starts])
            y = torch.stack([tokens[s + 1 : s + T + 1] for s in starts])
            return x, y

    if world > 1:
        net = torch.nn.parallel.DistributedDataParallel(net)
    net.train()  # Hugging Face models: dropout on, as simdist's presets train
    opt, clip = torch_optimizer(model, net)
    warm = max(3, steps // 10)
    if world > 1:
        torch.distributed.barrier()
    walls = []
    t_first = time.perf_counter()
    for i in range(warm + steps):
        t = time.perf_counter()
        x, y = batch_at(i)
        opt.zero_grad(set_to_none=True)
        out = net(**x) if isinstance(x, dict) else net(x, y)
        (out.loss if hasattr(out, "loss") else out).backward()
        clip()
        opt.step()
        walls.append(time.perf_counter() - t)
    if world > 1:
        torch.distributed.barrier()
    elapsed = time.perf_counter() - t_first
    if world > 1:
        # Left to the interpreter's exit, gloo's teardown now and then destroys a joinable
        # thread ("terminate called without an active exception") and the launch fails.
        torch.distributed.destroy_process_group()
    if rank == 0:
        median = statistics.median(walls[warm:])
        rates = {
            "samples_per_sec": batch * world / median,
            "run_samples_per_sec": (warm + steps) * batch * world / elapsed,
        }
        print(json.dumps(rates))
    if world > 1:
        # Even after destroy_process_group, gloo's teardown at interpreter exit still
        # aborted a DDP worker now and then (exit 6, "terminate called without an active
        # exception") after its results were printed, failing the whole benchmark; the
        # work is done, so leave without the interpreter's teardown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _hf_model_and_batches(model: str, rng: np.random.Generator):
    """The Hugging Face twin of simdist's preset (its dropout too) and a function giving
    step i's batch as the model's keyword arguments, from simdist's own data pipeline
    (the AIAYN Transformer: ``torch.nn.Transformer`` plus embeddings, positional (x, y))."""
    import torch

    from simdist.config import load_params
    from simdist.data.text import load_corpus_bytes
    from simdist.testing import hf_reference as hf

    batch = MODELS[model][1]
    if model in ("fc_mnist", "gpt2-mini"):  # simdist's own PyTorch references
        from simdist.data.datasets import build_dataset
        from simdist.models.gpt2 import PRESETS
        from simdist.testing.torch_reference import TorchGPT2, TorchMLP

        params = load_params(MODELS[model][0])
        data = build_dataset(params, batch)
        net = TorchMLP(mlp_sizes()) if model == "fc_mnist" else TorchGPT2(PRESETS[model])

        def batch_at(i):  # positional (x, y): the net computes its own loss
            x, y = data.train_batch(rng.integers(0, data.num_train, batch))
            return torch.from_numpy(np.array(x)), torch.from_numpy(np.array(y, np.int64))

        return net, batch_at
    if model == "bert-mini":
        from simdist.data.bert import BertData
        from simdist.models.bert import build_bert

        cfg = build_bert(load_params(["--params", "bert_mini"]).model).config
        net = hf.hf_bert(cfg, dropout=cfg.hidden_dropout_prob)
        P = cfg.max_predictions_per_seq
        data = BertData(load_corpus_bytes(), cfg.max_seq_length, P, batch, "")
        to_inputs = lambda x, y: hf.bert_inputs(x, y, P)  # noqa: E731
    elif model == "transformer-mini":
        from simdist.data.transformer import build_transformer_data
        from simdist.models.transformer import build_transformer

        params = load_params(["--params", "transformer_mini"])
        cfg = build_transformer(params.model).config
        net = hf.TorchTransformer(cfg, dropout=cfg.dropout)
        data = build_transformer_data(params, batch)

        def to_inputs(x, y):  # positional (x, y): the net computes its own loss
            return torch.from_numpy(x.copy()), torch.from_numpy(y.copy())

        def batch_at(i):
            return to_inputs(*data.train_batch(rng.integers(0, data.num_train, batch)))

        return net, batch_at
    else:
        from simdist.data.t5 import T5Data
        from simdist.models.t5 import build_t5

        cfg = build_t5(load_params(["--params", "t5_mini"]).model).config
        net = hf.hf_t5(cfg, dropout=cfg.dropout_rate)
        data = T5Data(load_corpus_bytes(), cfg.max_seq_length, batch, "")
        to_inputs = lambda x, y: hf.t5_inputs(x, y, cfg.max_seq_length)  # noqa: E731

    def batch_at(i):
        x, y = data.train_batch(rng.integers(0, data.num_train, batch))
        return to_inputs(x, y), None

    return net, batch_at


def interleaved(model: str, steps: int) -> dict:
    """simdist's and PyTorch's training steps alternated in this process (see the module
    docstring): per-step seconds, min and median, and tokens/s at the minimum."""
    import torch

    from simdist.arena import Layout
    from simdist.config import load_params
    from simdist.data.datasets import build_dataset
    from simdist.models import build_model
    from simdist.models.base import GradientViews
    from simdist.optim import Optimizer

    torch_threads_and_subnormals(torch)
    args, batch, _, tokens = MODELS[model]
    params = load_params(args)
    net, batch_at = _hf_model_and_batches(model, np.random.default_rng(0))
    net.train()
    topt = torch.optim.AdamW(net.parameters(), lr=1e-3, fused=True)
    sd = build_model(params.model)
    layout = Layout(sd.parameter_specs(), world=1)
    pflat, gflat = np.zeros(layout.padded, np.float32), np.zeros(layout.padded, np.float32)
    pviews, gviews = layout.views(pflat), GradientViews(layout.views(gflat))
    sd.init_parameters(pviews, np.random.default_rng(0))
    sd.allocate(batch)
    step_no = [0]
    if hasattr(sd, "bind_step"):
        sd.bind_step(1, lambda: step_no[0])
    opt = Optimizer(
        params.optimizer, layout, 0, layout.padded, lambda k, n, size: np.zeros(size, np.float32)
    )
    data = build_dataset(params, batch)
    rng = np.random.default_rng(1)
    wall: dict[str, list[float]] = {"simdist": [], "torch": []}
    cpu: dict[str, list[float]] = {"simdist": [], "torch": []}
    for i in range(3 + steps):  # 3 warm-up steps each, not timed
        x, y = data.train_batch(rng.integers(0, data.num_train, batch))
        t, c = time.perf_counter(), time.thread_time()
        sd.forward(pviews, x, y)
        sd.backward(pviews, gviews, 1.0 / batch)
        step_no[0] += 1
        opt.step(pflat, gflat, step_no[0], 1e-3)
        t1, c1 = time.perf_counter(), time.thread_time()
        tx, ty = batch_at(i)
        t2, c2 = time.perf_counter(), time.thread_time()
        topt.zero_grad(set_to_none=True)
        out = net(**tx) if isinstance(tx, dict) else net(tx, ty)
        (out.loss if hasattr(out, "loss") else out).backward()
        topt.step()
        t3, c3 = time.perf_counter(), time.thread_time()
        if i >= 3:
            wall["simdist"].append(t1 - t)
            wall["torch"].append(t3 - t2)
            cpu["simdist"].append(c1 - c)
            cpu["torch"].append(c3 - c2)
    row = {"model": model, "batch": batch, "steps": steps}
    for impl in wall:
        row[f"{impl}_step_ms_min"] = round(1e3 * min(wall[impl]), 2)
        row[f"{impl}_step_ms_median"] = round(1e3 * statistics.median(wall[impl]), 2)
        row[f"{impl}_cpu_ms_median"] = round(1e3 * statistics.median(cpu[impl]), 2)
        row[f"{impl}_samples_per_sec_at_min"] = round(batch / min(wall[impl]), 1)
        if tokens:
            row[f"{impl}_tokens_per_sec_at_min"] = round(batch * tokens / min(wall[impl]), 1)
    row["ratio_at_min"] = round(min(wall["torch"]) / min(wall["simdist"]), 3)
    row["ratio_at_median"] = round(
        statistics.median(wall["torch"]) / statistics.median(wall["simdist"]), 3
    )
    row["ratio_cpu_median"] = round(
        statistics.median(cpu["torch"]) / statistics.median(cpu["simdist"]), 3
    )
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="fc_mnist,gpt2-mini")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--plots", type=Path, help="write bench_train.png (+ .json) here")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=0, help="override the per-model step count")
    ap.add_argument(
        "--precision", help="bf16 / fp16: mixed-precision speed instead (bench_precision.py)"
    )
    ap.add_argument(
        "--interleaved", type=int, default=0, metavar="N",
        help="alternate N simdist / PyTorch steps in one process (see the docstring)",
    )  # fmt: skip
    ap.add_argument(
        "--torch-keep-subnormals", action="store_true",
        help="PyTorch as by default (subnormals kept) instead of at its fastest (flushed)",
    )  # fmt: skip
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--independent", help=argparse.SUPPRESS)
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.torch_keep_subnormals:  # read by the PyTorch workers this process starts
        os.environ["BENCH_TORCH_SUBNORMALS"] = "keep"
    if args.worker:
        torch_worker(args.worker, args.steps)
        return 0
    if args.independent:
        return independent_worker(args.independent, args.steps, args.dir)
    if args.precision:  # fp32 vs bf16 / fp16, simdist and PyTorch autocast, side by side
        from bench_precision import main as precision_main

        forward = ["--models", args.models, "--repeats", str(args.repeats)]
        forward += ["--steps", str(args.steps)] + (["--no-torch"] if args.no_torch else [])
        return precision_main(forward + (["--json", str(args.json)] if args.json else []))

    info = machine_info()
    if args.interleaved:
        print(f"# machine: {info}")
        rows = [interleaved(m, args.interleaved) for m in args.models.split(",")]
        for r in rows:
            print("  ".join(f"{k}={v}" for k, v in r.items()))
        if args.json:
            args.json.write_text(json.dumps({"machine": info, "interleaved": rows}, indent=1))
        return 0
    cpu = info["cpu"]
    print(f"# cpu: {cpu_identity(cpu)}; ISA: {' '.join(cpu['isa']) or '-'}")
    print(f"# machine: {info}")
    gemm_np, gemm_kernels = gemm_gflops()
    gemm = max(gemm_np, gemm_kernels)  # the ceiling: the faster BLAS on this machine
    print(
        f"# single-core float32 GEMM (1024^3, best of 5): numpy {gemm_np:.1f}, "
        f"kernels ({info['kernels_blas']}) {gemm_kernels:.1f} GFLOP/s"
    )
    have_torch = not args.no_torch
    if have_torch:
        try:
            import torch  # noqa: F401
        except ImportError:
            have_torch = False
            print("# torch not installed: PyTorch reference rows skipped")
    rows = []
    for model in args.models.split(","):
        _, batch, steps, tokens = MODELS[model]
        steps = args.steps or steps
        impls = [("simdist", 1), ("simdist", 2), ("simdist ring", 2), ("2 x simdist np1", 2)]
        if have_torch:
            impls += [("torch-eager", 1), ("torch-ddp-gloo", 2)]
        samples: dict[tuple[str, int], list[float]] = {k: [] for k in impls}
        whole: dict[tuple[str, int], list[float]] = {k: [] for k in impls}
        syncs: dict[tuple[str, int], list[float]] = {k: [] for k in impls}
        pairs: list[list[float]] = []  # each repeat's two independent runs
        floors = [floor_rate(model)]  # the step's products and AdamW alone, before and after
        for _ in range(args.repeats):  # interleaved, so load drifts hit every impl alike
            for impl, n in impls:
                if impl.startswith("simdist"):
                    alg = "ring" if impl.endswith("ring") else "auto"
                    sps, run_sps, sync = run_simdist(model, n, steps, alg)
                    syncs[(impl, n)].append(sync)
                elif impl.startswith("2 x"):
                    sps, run_sps, rates = run_independent(model, steps)
                    pairs.append(rates)
                else:
                    sps, run_sps = run_torch(model, n, steps)
                samples[(impl, n)].append(sps)
                whole[(impl, n)].append(run_sps)
        floors.append(floor_rate(model))
        floor = max(floors, key=lambda f: f["floor_samples_per_sec"])  # the faster: optimistic
        for (impl, n), values in samples.items():
            sps = statistics.median(values)
            row = {
                "impl": impl,
                "model": model,
                "np": n,
                "batch": batch,
                "samples_per_sec": round(sps, 2),
                "runs": [round(v, 2) for v in values],
                "run_samples_per_sec": round(statistics.median(whole[(impl, n)]), 2),
            }
            if tokens:
                row["tokens_per_sec"] = round(sps * tokens, 1)
            if syncs[(impl, n)]:  # gradient all-reduce inside the loop, ms per step
                row["sync_ms"] = round(1e3 * statistics.median(syncs[(impl, n)]), 3)
            if impl.startswith("2 x") and pairs:  # twice the slower: a synchronous pair's bound
                row["independent_runs"] = [[round(v, 2) for v in two] for two in pairs]
                slower = statistics.median(2 * min(two) for two in pairs)
                row["lockstep_samples_per_sec"] = round(slower, 2)
            if (impl, n) == ("simdist", 1):
                row.update(floor)
            rows.append(row)
    summary = summarize(rows, gemm)
    print_table(rows, summary)
    result = {
        "machine": info,
        "gemm_gflops": gemm,
        "gemm_gflops_numpy": gemm_np,
        "gemm_gflops_kernels": gemm_kernels,
        "rows": rows,
        "summary": summary,
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    if args.plots:
        from bench_plots import write_plots  # scripts/bench_plots.py, beside this script

        write_plots(result, args.plots)
    return 0


def summarize(rows: list[dict], gemm: float) -> list[dict]:
    out = []
    by = {(r["impl"], r["model"], r["np"]): r["samples_per_sec"] for r in rows}
    whole = {(r["impl"], r["model"], r["np"]): r.get("run_samples_per_sec") for r in rows}
    runs = {(r["impl"], r["model"], r["np"]): r["runs"] for r in rows}
    floors = {r["model"]: r["floor_samples_per_sec"] for r in rows if "floor_samples_per_sec" in r}
    lockstep = {
        r["model"]: r["lockstep_samples_per_sec"] for r in rows if "lockstep_samples_per_sec" in r
    }

    def paired(model: str, impl: str) -> float:
        """Median over the repeats of (``impl`` at np 2) / (2 x simdist at np 1) within each
        repeat: its runs ran back to back, so a slow drift of the machine's speed cancels."""
        pairs = zip(runs[(impl, model, 2)], runs[("simdist", model, 1)], strict=True)
        return round(statistics.median(n2 / (2 * n1) for n2, n1 in pairs), 3)

    for model in dict.fromkeys(r["model"] for r in rows):
        s1, s2 = by.get(("simdist", model, 1)), by.get(("simdist", model, 2))
        entry = {"model": model, "dp_efficiency_np2": round(s2 / (2 * s1), 3)}
        entry["dp_efficiency_np2_paired"] = paired(model, "simdist")
        if ("simdist ring", model, 2) in by:  # the message-passing ring instead of shm
            entry["dp_efficiency_np2_ring"] = round(by[("simdist ring", model, 2)] / (2 * s1), 3)
        both = by.get(("2 x simdist np1", model, 2))
        if both:  # two independent single-rank runs at once: the machine's own limit
            entry["ceiling_efficiency_np2"] = round(both / (2 * s1), 3)
            entry["ceiling_efficiency_np2_paired"] = paired(model, "2 x simdist np1")
            entry["dp_vs_ceiling"] = round(s2 / both, 3)
            slower = lockstep.get(model)
            if slower:  # twice the slower run: the bound for a synchronous pair
                entry["lockstep_ceiling_efficiency_np2"] = round(slower / (2 * s1), 3)
                entry["dp_vs_lockstep_ceiling"] = round(s2 / slower, 3)
        if ("torch-eager", model, 1) in by:
            entry["vs_torch_eager_np1"] = round(s1 / by[("torch-eager", model, 1)], 3)
            entry["vs_torch_eager_np1_whole_run"] = round(
                whole[("simdist", model, 1)] / whole[("torch-eager", model, 1)], 3
            )
            entry["vs_torch_ddp_np2"] = round(s2 / by[("torch-ddp-gloo", model, 2)], 3)
            t1, t2 = by[("torch-eager", model, 1)], by[("torch-ddp-gloo", model, 2)]
            entry["torch_ddp_efficiency_np2"] = round(t2 / (2 * t1), 3)
            if model in floors:  # the most any implementation on this BLAS could reach
                entry["floor_vs_torch_eager_np1"] = round(floors[model] / t1, 3)
        if model in floors:
            entry["simdist_vs_floor_np1"] = round(s1 / floors[model], 3)
        if model.startswith("gpt2"):
            from simdist.models.gpt2 import PRESETS, flops_per_sample

            gflops = s1 * flops_per_sample(PRESETS[model]) / 1e9
            entry["simdist_gflops_np1"] = round(gflops, 1)
            entry["fraction_of_gemm_rate"] = round(gflops / gemm, 3)
        out.append(entry)
    return out


def print_table(rows: list[dict], summary: list[dict]) -> None:
    print(
        f"\n{'impl':<16}{'model':<11}{'np':>3}{'batch':>7}{'samples/s':>12}{'tokens/s':>11}"
        f"{'sync ms':>9}{'whole run':>11}  runs (samples/s of the median step)"
    )
    for r in rows:
        tok = f"{r['tokens_per_sec']:>11.0f}" if "tokens_per_sec" in r else f"{'':>11}"
        sync = f"{r['sync_ms']:>9.3f}" if "sync_ms" in r else f"{'':>9}"
        print(
            f"{r['impl']:<16}{r['model']:<11}{r['np']:>3}{r['batch']:>7}"
            f"{r['samples_per_sec']:>12.1f}{tok}{sync}{r['run_samples_per_sec']:>11.1f}"
            f"  {r['runs']}"
        )
    print()
    for s in summary:
        print("  ".join(f"{k}={v}" for k, v in s.items()))


if __name__ == "__main__":
    sys.exit(main())
