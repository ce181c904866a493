"""Throughput of the linear kernels and of the GEMM shapes the models run, against NumPy's
own matmul and (where installed) torch.mm (printed, never asserted).

    python scripts/bench_kernels.py [--reps 50] [--gemm-only]
    python scripts/bench_kernels.py --blas-grid     # OpenBLAS (or oneMKL) against oneDNN's sgemm
    python scripts/bench_kernels.py --openblas-pair # numpy's OpenBLAS against SciPy's
    python scripts/bench_kernels.py --narrow        # beside oneMKL: few columns on OpenBLAS
    python scripts/bench_kernels.py --native-grid   # bf16 products: native against sgemm
    python scripts/bench_kernels.py --attention     # GPT-2's attention, fp32 and bf16 paths
    python scripts/bench_kernels.py --attention-blocks  # causal products: dense or in blocks
    python scripts/bench_kernels.py --vector-width  # the loop kernels at 512- and 256-bit
    python scripts/bench_kernels.py --norm          # the gradient norm at both models' sizes
    python scripts/bench_kernels.py --optimizer-cache  # AdamW, state hot or cold, 1 or 2 at once
    python scripts/bench_kernels.py --allreduce-pass   # shm all-reduce's last pass, fused or not

One thread (simdist pins it). Forward is 2*B*C*OC FLOP; backward twice that (dinp and
dweight). NumPy's reference runs the same three products with ``out=`` so neither side
allocates. The kernels call ``kernels.blas.gemm`` (oneMKL on Intel where installed, oneDNN
on AMD's AVX-512 kind where installed, else numpy's OpenBLAS or, where numpy has none,
SciPy's; ``SIMDIST_BLAS`` forces one), NumPy its own OpenBLAS, torch its oneMKL, so
differences are BLAS builds as much as call overhead. The GEMM table times each product by
the CPU time of this thread (best of ``--reps``), which a shared machine's load disturbs
less than wall time; run it once per ``SIMDIST_BLAS`` value to compare the libraries.
``--openblas-pair`` times the kernels' gemm on numpy's OpenBLAS and on SciPy's, alternating
call by call in one process (the measurement behind the default). ``--narrow`` (oneMKL
installed) times oneMKL's sgemm and numpy's OpenBLAS the same way on products with few
columns of C: the measurement behind ``on_openblas_narrow``.

``--blas-grid`` times OpenBLAS's sgemm (the kernels' gemm with ``SIMDIST_BLAS=openblas``;
with ``SIMDIST_BLAS=mkl``, oneMKL's, the Intel kind's default where the extra is installed)
and oneDNN's ``dnnl_sgemm`` (called through ctypes, about a microsecond more per call) on
every layout of a grid of shapes, and says which library ``SIMDIST_BLAS=onednn`` gives each
product (kernels/blas.py, ``on_onednn``): the measurement behind that rule.
``--native-grid`` times, on operands holding bf16 values, the kernels' gemm on the float32
BLAS and on the native bf16 kernel (oneMKL's or oneDNN's, packing included), alternating,
and says which one a bf16 run gives each shape: the measurement behind ``_NATIVE_MIN``
and ``_MKL_NATIVE_MIN_K``. ``--attention`` times GPT-2's attention kernels (gpt2-mini's
shape: batch 8, 128 positions, 4 heads of 64) in float32, in bf16 with every product on
the float32 BLAS, with the shape rule, and with every product on the native kernel, the
four alternating: the products in place, between the softmax passes, where
``_MKL_NATIVE_MIN_VOLUME`` comes from.
``--attention-blocks`` times the six products of a causal head (scores, P V and the four
of backward; 4 heads of 64 at 128 to 1024 positions) computed dense and in row blocks of
32, 64 and 128 that skip the blocks above the diagonal, alternating: the measurement behind
``CAUSAL_BLOCK`` in kernels/attention.py.
``--vector-width`` times the loop kernels of a gpt2-mini step (GELU, the layernorms,
attention, AdamW on 3.2M parameters) compiled as simdist compiles them (512-bit vectors on
AVX-512, kernels/_jit.py) and as LLVM's tuning for the host would (``NUMBA_CPU_FEATURES`` set
to the host's features), in child processes taking turns: the measurement behind
``_wide_vectors``. The features are part of numba's cache key, so each build runs its own
compiled code.
``--norm`` times the gradient norm's float64 sum of squares (``kernels.optim.sum_of_squares``,
its lanes in independent registers) at FC-MNIST's and gpt2-mini's parameter counts against a
one-chain float64 loop and numpy's float32 ``np.dot(x, x)``: the measurement behind
``LANES``.
``--optimizer-cache`` times AdamW (``kernels.optim.adamw_update``) at FC-MNIST's and
gpt2-mini's parameter counts with its four buffers hot, and with 4, 16 and 64 MiB of other
data streamed between calls (as a step's forward and backward stream theirs), in one
process and in two at once (two data-parallel ranks updating in lockstep on this machine's
two cores): medians of ``--reps`` calls, in child processes.
``--allreduce-pass`` times the shared-memory all-reduce's last pass over one rank's block of
the gradients at 2 ranks (half of FC-MNIST's and of gpt2-mini's parameters) as three passes
(``add_divide``, the copy into the peer's buffer, ``sum_of_squares``) and as the fused
``kernels.reduce.add_divide_store``, taking turns, with the buffers hot and with 16 MiB of
other data streamed between calls (as backward streams its own): medians of ``--reps``. As
the all-reduce runs them, the result goes back over the peer's values it has just read; in
one process, so the peer's buffer is not in another core's cache as it is in training
(there the fused pass saves more: performance.json's ``sync``).
"""

import simdist  # noqa: F401  (one thread per process, before numpy loads)

# isort: split
import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable

import numba
import numpy as np
import scipy
from simdist.kernels.blas import BACKEND, gemm, library
from simdist.kernels.linear import linear_backward, linear_forward

F32 = np.float32


def best_seconds(fn: Callable[..., object], args: tuple, reps: int) -> float:
    fn(*args)  # compile / warm caches
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - t)
    return best


def numpy_forward(out, inp, weight, bias):
    np.matmul(inp, weight, out=out)
    out += bias


def numpy_backward(dinp, dweight, dbias, dout, inp, weight):
    np.matmul(dout, weight.T, out=dinp)
    np.matmul(inp.T, dout, out=dweight)
    dout.sum(axis=0, out=dbias)


def bench_shape(B: int, C: int, OC: int, reps: int) -> None:
    rng = np.random.default_rng(0)
    inp = rng.standard_normal((B, C)).astype(F32)
    weight = rng.standard_normal((C, OC)).astype(F32)
    bias = rng.standard_normal(OC).astype(F32)
    dout = rng.standard_normal((B, OC)).astype(F32)
    out, dinp = np.empty((B, OC), F32), np.empty_like(inp)
    dweight, dbias = np.empty_like(weight), np.empty_like(bias)
    flop = 2.0 * B * C * OC
    fwd_args = (out, inp, weight, bias)
    bwd_args = (dinp, dweight, dbias, dout, inp, weight)
    for name, f, kern, ref, args in [
        ("forward", flop, linear_forward, numpy_forward, fwd_args),
        ("backward", 2 * flop, linear_backward, numpy_backward, bwd_args),
    ]:
        k, n = best_seconds(kern, args, reps), best_seconds(ref, args, reps)
        print(f"{f'{B}x{C}x{OC}':>16} {name:>9} {f / k / 1e9:12.1f} {f / n / 1e9:11.1f}")


# (name, m, k, n, layout): FC-MNIST at batch 128, gpt2-mini at B*T = 1024, one attention head
GEMM_SHAPES = [
    ("fc1 forward", 128, 784, 512, "nn"),
    ("fc2 forward", 128, 512, 512, "nn"),
    ("fc2 dinput", 128, 512, 512, "nt"),
    ("fc2 dweight", 512, 128, 512, "tn"),
    ("fc1 dweight", 784, 128, 512, "tn"),
    ("gpt2 c_attn", 1024, 256, 768, "nn"),
    ("gpt2 c_fc", 1024, 256, 1024, "nn"),
    ("gpt2 mlp c_proj", 1024, 1024, 256, "nn"),
    ("gpt2 c_fc dinput", 1024, 1024, 256, "nt"),
    ("gpt2 c_fc dweight", 256, 1024, 1024, "tn"),
    ("gpt2 lm_head", 1024, 256, 256, "nt"),
    ("attention q k^T", 128, 64, 128, "nt"),
    ("attention p v", 128, 128, 64, "nn"),
    ("square 1024", 1024, 1024, 1024, "nn"),
]


def cpu_seconds(fn: Callable[[], object], reps: int, inner: int = 10) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.thread_time()
        for _ in range(inner):
            fn()
        best = min(best, (time.thread_time() - t) / inner)
    return best


def bench_gemm_shapes(reps: int) -> None:
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        torch = None
    rng = np.random.default_rng(0)
    one, zero = F32(1.0), F32(0.0)
    print(f"\n{'GEMM m x k x n':>34} {'kernels':>8} {'numpy':>7} {'torch':>7}  GFLOP/s (CPU time)")
    for name, m, k, n, layout in GEMM_SHAPES:
        a = rng.standard_normal((m, k) if layout[0] == "n" else (k, m), dtype=F32)
        b = rng.standard_normal((k, n) if layout[1] == "n" else (n, k), dtype=F32)
        a = a if layout[0] == "n" else a.T  # a transposed view, as the kernels pass it
        b = b if layout[1] == "n" else b.T
        out = np.empty((m, n), F32)
        flop = 2.0 * m * k * n
        calls = [
            lambda a=a, b=b, out=out: gemm(a, b, out, one, zero),
            lambda a=a, b=b, out=out: np.matmul(a, b, out=out),
        ]
        if torch is not None:
            ta, tb, to = torch.from_numpy(a), torch.from_numpy(b), torch.from_numpy(out)
            calls.append(lambda ta=ta, tb=tb, to=to: torch.mm(ta, tb, out=to))
        rates = [flop / cpu_seconds(fn, reps) / 1e9 for fn in calls]
        cells = " ".join(f"{r:7.1f}" for r in rates)
        print(f"{name:>17} {f'{m}x{k}x{n} {layout}':>16} {cells}")


def bench_openblas_pair(reps: int) -> None:
    """The kernels' gemm on numpy's OpenBLAS (ILP64) against SciPy's, the models' shapes,
    alternating the two (one process: the mode word picks the library per call)."""
    from simdist.kernels import blas

    if not blas._BASE_MODE.value & blas.SGEMM_ILP64:
        raise SystemExit("--openblas-pair needs SIMDIST_BLAS=openblas and numpy's own OpenBLAS")
    rng = np.random.default_rng(0)
    one, zero = F32(1.0), F32(0.0)
    base = blas._MODE.value
    print(f"\n{'GEMM m x k x n':>34} {'numpy':>7} {'SciPy':>7} {'ratio':>6}  GFLOP/s (CPU time)")
    for name, m, k, n, layout in GEMM_SHAPES:
        a = rng.standard_normal((m, k) if layout[0] == "n" else (k, m), dtype=F32)
        b = rng.standard_normal((k, n) if layout[1] == "n" else (n, k), dtype=F32)
        a = a if layout[0] == "n" else a.T
        b = b if layout[1] == "n" else b.T
        out = np.empty((m, n), F32)
        best = [float("inf")] * 2
        for _ in range(reps):
            for i, mode in enumerate((base, base & ~blas.SGEMM_ILP64)):
                blas._MODE.value = mode
                call = lambda a=a, b=b, out=out: gemm(a, b, out, one, zero)  # noqa: E731
                best[i] = min(best[i], cpu_seconds(call, 1))
        blas._MODE.value = base
        rates = [2.0 * m * k * n / t / 1e9 for t in best]
        print(
            f"{name:>17} {f'{m}x{k}x{n} {layout}':>16} {rates[0]:7.1f} {rates[1]:7.1f} "
            f"{rates[0] / rates[1]:6.2f}"
        )


NARROW_GRID = [  # (m, k, n): classifiers' products (10 classes, 2 labels) and the crossover
    (128, 512, 10), (512, 128, 10), (128, 10, 512), (1024, 256, 10), (784, 128, 10),
    (128, 512, 2), (512, 128, 2), (8, 256, 2), (128, 512, 8), (128, 512, 15), (128, 512, 16),
    (128, 512, 24), (128, 512, 32),
]  # fmt: skip


def bench_mkl_narrow(reps: int) -> None:
    """Beside oneMKL: the kernels' gemm on oneMKL and on numpy's OpenBLAS, alternating call
    by call (the SGEMM_NARROW bit off and forced on), on products with few columns of C or
    few inner terms, every layout but A^T B^T, CPU time: the measurement behind
    ``blas.on_openblas_narrow``."""
    from simdist.kernels import blas

    if BACKEND != "mkl" or not blas._BASE_MODE.value & blas.SGEMM_NARROW:
        raise SystemExit("--narrow needs oneMKL (SIMDIST_BLAS=mkl) and numpy's own OpenBLAS")
    rng = np.random.default_rng(0)
    one, zero = F32(1.0), F32(0.0)
    base = blas._MODE.value
    # the rule reads n alone: the OpenBLAS side is timed as a 1-column rule would route it
    modes = {"oneMKL": base & ~blas.SGEMM_NARROW, "OpenBLAS": base | blas.SGEMM_ILP64}
    print(f"{'m x k x n op':>20} {'oneMKL':>8} {'OpenBLAS':>9} {'ratio':>6}  us; rule")
    for m, k, n in NARROW_GRID:
        for layout in ("nn", "nt", "tn"):
            a = rng.standard_normal((m, k) if layout[0] == "n" else (k, m), dtype=F32)
            b = rng.standard_normal((k, n) if layout[1] == "n" else (n, k), dtype=F32)
            a = a if layout[0] == "n" else a.T
            b = b if layout[1] == "n" else b.T
            out = np.empty((m, n), F32)
            call = lambda a=a, b=b, out=out: gemm(a, b, out, one, zero)  # noqa: E731
            best = dict.fromkeys(modes, float("inf"))
            try:
                for _ in range(reps):
                    for name, mode in modes.items():
                        blas._MODE.value = mode
                        best[name] = min(best[name], cpu_seconds(call, 1))
            finally:
                blas._MODE.value = base
            mkl, ob = best["oneMKL"], best["OpenBLAS"]
            rule = "OpenBLAS" if blas.on_openblas_narrow(n) else "oneMKL"
            print(
                f"{f'{m}x{k}x{n} {layout}':>20} {1e6 * mkl:8.1f} {1e6 * ob:9.1f} "
                f"{mkl / ob:6.2f}  {rule}"
            )


BLAS_GRID = [  # (m, k, n): attention heads, the models' layers, FC-MNIST's, the classifiers
    (64, 64, 64), (128, 64, 128), (128, 128, 64), (64, 128, 128), (16, 256, 256),
    (32, 784, 512), (128, 784, 512), (128, 512, 512), (128, 512, 10), (10, 128, 512),
    (1024, 256, 10), (1024, 256, 256), (1024, 256, 768), (1024, 256, 1024), (1024, 1024, 256),
    (256, 1024, 768), (768, 1024, 256),
]  # fmt: skip


def bench_blas_grid(reps: int) -> None:
    """The kernels' gemm (OpenBLAS or oneMKL) against oneDNN's dnnl_sgemm on BLAS_GRID,
    CPU time."""
    import ctypes
    import glob
    import sys

    from simdist.kernels import blas

    libs = sorted(glob.glob(os.path.join(sys.prefix, "lib", "libdnnl.so*")))
    if BACKEND not in ("openblas", "mkl") or not libs:
        raise SystemExit(
            "--blas-grid needs SIMDIST_BLAS=openblas or mkl and oneDNN installed "
            "(pip install onednn-cpu-gomp)"
        )
    f = ctypes.CDLL(libs[0]).dnnl_sgemm
    c = ctypes
    f.argtypes = [c.c_char, c.c_char] + [c.c_int64] * 3 + [c.c_float, c.c_void_p, c.c_int64]
    f.argtypes += [c.c_void_p, c.c_int64, c.c_float, c.c_void_p, c.c_int64]
    rng = np.random.default_rng(0)
    one, zero = F32(1.0), F32(0.0)
    name = "oneMKL" if BACKEND == "mkl" else "OpenBLAS"
    print(f"{'m x k x n op':>20} {name:>9} {'oneDNN':>8} {'ratio':>6}  onednn rule")
    for m, k, n in BLAS_GRID:
        for layout in ("nn", "nt", "tn", "tt"):
            a = rng.standard_normal((m, k) if layout[0] == "n" else (k, m), dtype=F32)
            b = rng.standard_normal((k, n) if layout[1] == "n" else (n, k), dtype=F32)
            av, bv = (a if layout[0] == "n" else a.T), (b if layout[1] == "n" else b.T)
            out = np.empty((m, n), F32)
            ta, tb = layout[0].upper().encode(), layout[1].upper().encode()
            args = (ta, tb, m, n, k, 1.0, a.ctypes.data, a.shape[1], b.ctypes.data, b.shape[1])
            args += (0.0, out.ctypes.data, n)
            flop = 2.0 * m * k * n
            call = lambda av=av, bv=bv, out=out: gemm(av, bv, out, one, zero)  # noqa: E731
            ob = flop / cpu_seconds(call, reps) / 1e9
            dn = flop / cpu_seconds(lambda args=args: f(*args), reps) / 1e9
            rule = blas.on_onednn(k, n, layout[0] == "t", layout[1] == "t")
            print(
                f"{f'{m}x{k}x{n} {layout}':>20} {ob:9.1f} {dn:8.1f} {dn / ob:6.2f}  "
                f"{'oneDNN' if rule else 'OpenBLAS'}"
            )


NATIVE_GRID = [  # (m, k, n, layout): attention heads, the models' layers, classifiers
    (128, 128, 64, "nn"), (128, 128, 64, "tn"), (128, 64, 128, "nt"), (128, 32, 128, "nt"),
    (128, 64, 64, "nn"), (128, 32, 32, "nn"), (128, 128, 16, "nn"), (128, 16, 128, "nt"),
    (64, 64, 64, "nn"), (16, 256, 256, "nn"), (32, 256, 256, "nn"), (96, 64, 10, "nn"),
    (128, 512, 10, "nn"), (128, 10, 512, "nt"), (512, 128, 10, "tn"), (128, 784, 512, "nn"),
    (128, 512, 512, "nn"), (512, 128, 512, "tn"), (1024, 256, 768, "nn"),
    (1024, 1024, 256, "nn"), (1024, 768, 256, "nt"), (256, 1024, 1024, "tn"),
]  # fmt: skip


def bench_native_grid(reps: int) -> None:
    """bf16 products: the float32 BLAS against the native kernel, CPU time, alternating."""
    from simdist.kernels import blas
    from simdist.kernels.half import BF16, round_half

    if blas.NATIVE_BF16 is None:
        raise SystemExit("--native-grid needs a native bf16 kernel (the mkl or onednn extra)")
    rng = np.random.default_rng(0)
    one, zero = F32(1.0), F32(0.0)
    name = {"mkl": "oneMKL", "onednn": "oneDNN"}[blas.NATIVE_BF16]
    print(f"{'m x k x n op':>20} {'sgemm':>8} {name:>8} {'ratio':>6}  bf16 runs take")
    for m, k, n, layout in NATIVE_GRID:
        a = rng.standard_normal((m, k) if layout[0] == "n" else (k, m), dtype=F32)
        b = rng.standard_normal((k, n) if layout[1] == "n" else (n, k), dtype=F32)
        round_half(a.reshape(-1), BF16)
        round_half(b.reshape(-1), BF16)
        av, bv = (a if layout[0] == "n" else a.T), (b if layout[1] == "n" else b.T)
        out = np.empty((m, n), F32)
        blas.half_operands(BF16)
        native = blas._MODE.value
        blas.half_operands(None)

        def on_sgemm(av=av, bv=bv, out=out):  # the float32 BLAS on the halves
            gemm(av, bv, out, one, zero)

        def on_native(av=av, bv=bv, out=out, mode=native):
            blas.gemm_native(av, bv, out, one, zero, mode)

        calls = (on_sgemm, on_native)
        best = [float("inf")] * 2
        for _ in range(reps):  # alternate, so drifting load hits both alike
            for i, call in enumerate(calls):
                best[i] = min(best[i], cpu_seconds(call, 1))
        taken = blas.takes_native(native, m, k, n)
        flop = 2.0 * m * k * n
        rates = [flop / t / 1e9 for t in best]
        print(
            f"{f'{m}x{k}x{n} {layout}':>20} {rates[0]:8.1f} {rates[1]:8.1f} "
            f"{rates[1] / rates[0]:6.2f}  {name if taken else 'sgemm'}"
        )


def bench_attention(reps: int, B: int = 8, T: int = 128, C: int = 256, NH: int = 4) -> None:
    """attention_forward / attention_backward on each product path, wall time, alternating."""
    from simdist.kernels import blas
    from simdist.kernels.attention import attention_backward, attention_forward
    from simdist.kernels.half import BF16, round_half

    rng = np.random.default_rng(0)
    qkv = rng.standard_normal((B, T, 3 * C), dtype=F32)
    dout = rng.standard_normal((B, T, C), dtype=F32)
    round_half(qkv.reshape(-1), BF16)
    round_half(dout.reshape(-1), BF16)
    out, att = np.zeros((B, T, C), F32), np.zeros((B, NH, T, T), F32)
    dqkv, ds = np.zeros_like(qkv), np.zeros((T, T), F32)
    paths = {
        "fp32": lambda: blas.half_operands(None),
        "bf16 on sgemm": lambda: blas.half_operands(BF16, native=False),
        "bf16, shape rule": lambda: blas.half_operands(BF16),
        "bf16, all native": lambda: blas.half_operands(BF16, every_shape=True),
    }
    if blas.NATIVE_BF16 is None:
        paths = dict(list(paths.items())[:2])
    best = {name: [float("inf")] * 2 for name in paths}
    for _ in range(reps):
        for name, select in paths.items():
            select()
            for i, call in enumerate(
                (
                    lambda: attention_forward(out, att, qkv, NH),
                    lambda: attention_backward(dqkv, dout, qkv, att, ds, NH),
                )
            ):
                call()
                t = time.perf_counter()
                call()
                best[name][i] = min(best[name][i], time.perf_counter() - t)
    blas.half_operands(None)
    print(f"attention, batch {B}, {T} positions, {NH} heads of {C // NH}: ms (best of {reps})")
    for name, (fwd, bwd) in best.items():
        print(f"{name:>18}  forward {1e3 * fwd:6.2f}  backward {1e3 * bwd:6.2f}")


def bench_attention_blocks(reps: int, NH: int = 4, hs: int = 64) -> None:
    """The products of causal heads, dense (block 0) and in row blocks, wall time, alternating."""
    from simdist.kernels.attention import _product, _product_bt, _product_t

    rng = np.random.default_rng(0)
    one = F32(1.0)
    blocks = (0, 32, 64, 128)
    print(f"causal attention products, {NH} heads of {hs}: ms per layer (best of {reps})")
    names = " ".join(f"{'dense' if b == 0 else f'block {b}':>9}" for b in blocks)
    print(f"{'positions':>9} {names}   dense / block 64")
    for T in (128, 256, 512, 1024):
        q, k, v, dy, dq, dk, dv, y = (rng.standard_normal((NH, T, hs), dtype=F32) for _ in range(8))
        pr = np.tril(rng.random((NH, T, T), dtype=F32))  # zero above the diagonal, as the
        ds = np.tril(rng.random((NH, T, T), dtype=F32))  # kernels' softmax leaves them
        scores, dp = np.zeros_like(pr), np.zeros_like(ds)

        def layer(h: int, q=q, k=k, v=v, dy=dy, dq=dq, dk=dk, dv=dv, y=y, pr=pr, ds=ds,
                  scores=scores, dp=dp) -> None:  # fmt: skip
            for i in range(NH):
                _product_bt(q[i], k[i], scores[i], h, one)  # S = Q K^T
                _product(pr[i], v[i], y[i], h, one)  # Y = P V
                _product_bt(dy[i], v[i], dp[i], h, one)  # dP = dY V^T
                _product_t(pr[i], dy[i], dv[i], h, one)  # dV = P^T dY
                _product(ds[i], k[i], dq[i], h, one)  # dQ = dS K
                _product_t(ds[i], q[i], dk[i], h, one)  # dK = dS^T Q

        best = {b: float("inf") for b in blocks if b == 0 or 2 * b <= T}
        for _ in range(reps):
            for b in best:
                t = time.perf_counter()
                layer(b)
                best[b] = min(best[b], time.perf_counter() - t)
        cells = " ".join(f"{1e3 * best[b]:9.3f}" if b in best else f"{'-':>9}" for b in blocks)
        print(f"{T:>9} {cells}   {best[0] / best[64]:.2f}x")


def time_loop_kernels(reps: int) -> dict[str, float]:
    """Best wall time (ms) of each loop kernel at gpt2-mini's shapes (batch 8 x 128)."""
    from simdist.kernels.attention import attention_backward, attention_forward
    from simdist.kernels.gelu import gelu_backward, gelu_forward
    from simdist.kernels.layernorm import (
        layernorm_backward_accumulate,
        residual_layernorm_forward,
    )
    from simdist.kernels.optim import adamw_update

    rng = np.random.default_rng(0)
    N, C, NH, B, T = 1024, 256, 4, 8, 128
    x4 = rng.standard_normal(4 * N * C, dtype=F32)
    y4, d4 = np.empty_like(x4), np.empty_like(x4)
    a, b = rng.standard_normal((N, C), dtype=F32), rng.standard_normal((N, C), dtype=F32)
    res, out, din = np.empty_like(a), np.empty_like(a), np.zeros_like(a)
    mean, rstd = np.empty(N, F32), np.empty(N, F32)
    w, bias, dw, db = (
        rng.random(C, dtype=F32),
        rng.random(C, dtype=F32),
        np.empty(C, F32),
        np.empty(C, F32),
    )
    qkv = rng.standard_normal((B, T, 3 * C), dtype=F32)
    aout, att = np.empty((B, T, C), F32), np.empty((B, NH, T, T), F32)
    dqkv, ds = np.empty_like(qkv), np.empty((T, T), F32)
    n = 3_200_000
    p, g = rng.standard_normal(n, dtype=F32), rng.standard_normal(n, dtype=F32)
    m, v = np.zeros(n, F32), np.zeros(n, F32)
    calls = {
        "gelu_forward": lambda: gelu_forward(y4, x4),
        "gelu_backward": lambda: gelu_backward(d4, x4, y4),
        "residual_layernorm_forward": lambda: residual_layernorm_forward(
            res, out, mean, rstd, a, b, w, bias
        ),
        "layernorm_backward_accumulate": lambda: layernorm_backward_accumulate(
            din, dw, db, out, res, w, mean, rstd
        ),
        "attention_forward": lambda: attention_forward(aout, att, qkv, NH),
        "attention_backward": lambda: attention_backward(dqkv, aout, qkv, att, ds, NH),
        "adamw_update": lambda: adamw_update(p, g, m, v, 1e-4, 0.9, 0.999, 1e-8, 0.0, 1),
    }
    return {name: 1e3 * best_seconds(call, (), reps) for name, call in calls.items()}


def bench_vector_width(reps: int, rounds: int = 5) -> None:
    """The loop kernels at simdist's vector width and at LLVM's default, in turns."""
    import llvmlite.binding as llvm

    features = llvm.get_host_cpu_features()
    if not features.get("avx512f"):
        print("no AVX-512 on this CPU: both builds would be the same; nothing to compare")
        return
    builds = {
        "512-bit (simdist)": {},
        "LLVM default": {"NUMBA_CPU_FEATURES": features.flatten()},
    }
    best: dict[str, dict[str, float]] = {name: {} for name in builds}
    for _ in range(rounds):
        for name, extra in builds.items():
            env = {k: val for k, val in os.environ.items() if k != "NUMBA_CPU_FEATURES"}
            child = subprocess.run(
                [sys.executable, __file__, "--loop-kernels-json", "--reps", str(reps)],
                env={**env, **extra},
                capture_output=True,
                text=True,
                check=True,
            )
            for kernel, ms in json.loads(child.stdout.splitlines()[-1]).items():
                best[name][kernel] = min(best[name].get(kernel, float("inf")), ms)
    wide, default = best.values()
    print(f"loop kernels, ms (best of {rounds} x {reps}); LLVM default / 512-bit")
    print(f"{'kernel':>30} {'512-bit':>9} {'default':>9} {'ratio':>6}")
    for kernel in wide:
        print(
            f"{kernel:>30} {wide[kernel]:9.3f} {default[kernel]:9.3f} "
            f"{default[kernel] / wide[kernel]:6.2f}"
        )
    print(
        f"{'sum':>30} {sum(wide.values()):9.3f} {sum(default.values()):9.3f} "
        f"{sum(default.values()) / sum(wide.values()):6.2f}"
    )


def parameter_count(preset: str) -> int:
    """The number of parameters of a packaged params preset's model."""
    from simdist.config import load_params
    from simdist.models import build_model

    model = build_model(load_params(["--params", preset]).model)
    return sum(spec.numel for spec in model.parameter_specs())


def bench_gradient_norm(reps: int) -> None:
    """The gradient norm's float64 sum of squares at the two models' parameter counts.

    Side by side with numpy's float32 dot product (BLAS sdot: float32 accumulation, so
    cheaper and less exact; the rate a library reaches on the same bytes) and a one-chain
    float64 loop (each add waits for the one before: the latency bound lanes remove).
    """
    from simdist.kernels.optim import sum_of_squares

    @numba.njit(cache=False)
    def one_chain(x):
        total = 0.0
        for i in range(x.size):
            total += np.float64(x[i]) * np.float64(x[i])
        return total

    print(f"gradient norm, us (best of {reps}); one chain and sdot / simdist")
    print(
        f"{'model':>10} {'params':>10} {'simdist':>9} {'one chain':>10} {'np.dot f32':>11}"
        f" {'chain/sd':>9} {'sdot/sd':>8}"
    )
    rng = np.random.default_rng(0)
    for preset in ("fc_mnist", "gpt2_mini"):
        n = parameter_count(preset)
        x = rng.standard_normal(n).astype(F32)
        ours = 1e6 * best_seconds(sum_of_squares, (x,), reps)
        chain = 1e6 * best_seconds(one_chain, (x,), reps)
        sdot = 1e6 * best_seconds(np.dot, (x, x), reps)
        print(
            f"{preset:>10} {n:>10,} {ours:9.1f} {chain:10.1f} {sdot:11.1f}"
            f" {chain / ours:9.2f} {sdot / ours:8.2f}"
        )


def optimizer_cache_child(n: int, junk_mib: int, reps: int) -> float:
    """Median us of AdamW over n elements, ``junk_mib`` MiB streamed before each call."""
    from simdist.kernels.optim import adamw_update

    rng = np.random.default_rng(0)
    p, g, m = (rng.standard_normal(n, dtype=F32) for _ in range(3))
    v = np.abs(rng.standard_normal(n, dtype=F32))
    junk = np.zeros(junk_mib << 18, F32)  # MiB of float32
    adamw_update(p, g, m, v, 1e-3, 0.9, 0.999, 1e-8, 0.01, 1)  # compiled, pages touched
    times = []
    for step in range(2, reps + 2):
        junk += F32(1.0)  # read and write: the cache now holds this, not AdamW's buffers
        g += F32(0.0)  # the gradient is hot, as backward has just written it
        t = time.perf_counter()
        adamw_update(p, g, m, v, 1e-3, 0.9, 0.999, 1e-8, 0.01, step)
        times.append(time.perf_counter() - t)
    return 1e6 * float(np.median(times))


def bench_optimizer_cache(reps: int) -> None:
    """AdamW with its state hot or pushed out of cache, one process or two at once."""

    def child(n: int, junk: int) -> subprocess.Popen:
        cmd = [sys.executable, __file__, "--optimizer-cache-child", str(n), str(junk)]
        return subprocess.Popen(cmd + ["--reps", str(reps)], stdout=subprocess.PIPE, text=True)

    print(f"AdamW, us (median of {reps}); other data streamed between calls; two = two at once")
    print(f"{'model':>10} {'params':>10} {'MiB':>4} {'one':>8} {'two':>8} {'two/one':>8}")
    for preset in ("fc_mnist", "gpt2_mini"):
        n = parameter_count(preset)
        for junk in (0, 4, 16, 64):
            one = float(child(n, junk).communicate()[0])
            pair = [child(n, junk) for _ in range(2)]
            two = max(float(c.communicate()[0]) for c in pair)  # lockstep waits for the slower
            print(f"{preset:>10} {n:>10,} {junk:>4} {one:8.1f} {two:8.1f} {two / one:8.2f}")


def bench_row_reductions(reps: int, N: int = 1024, C: int = 256) -> None:
    """rowops' lane reductions against the eight scalar partial sums they replaced (kept
    here as the reference), on gpt2-mini's layernorm rows (1024 x 256), and the layernorm
    kernels that call them."""
    from simdist.kernels import layernorm
    from simdist.kernels.rowops import row_dot_dev, row_sq_dev, row_sum

    @numba.njit(cache=False, error_model="numpy")
    def eight_partials_sum(x, n):
        s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = F32(0.0)
        i = 0
        while i + 8 <= n:
            s0 += x[i]
            s1 += x[i + 1]
            s2 += x[i + 2]
            s3 += x[i + 3]
            s4 += x[i + 4]
            s5 += x[i + 5]
            s6 += x[i + 6]
            s7 += x[i + 7]
            i += 8
        while i < n:
            s0 += x[i]
            i += 1
        return ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))

    def over_rows(reduce):
        @numba.njit(cache=False, error_model="numpy")
        def run(x):
            total = F32(0.0)
            for r in range(x.shape[0]):
                total += reduce(x[r], x.shape[1])
            return total

        return run

    @numba.njit(cache=False, error_model="numpy")
    def lanes_sq_dev(x):
        total = F32(0.0)
        for r in range(x.shape[0]):
            total += row_sq_dev(x[r], F32(0.5), x.shape[1])
        return total

    @numba.njit(cache=False, error_model="numpy")
    def lanes_dot_dev(x):
        total = F32(0.0)
        for r in range(x.shape[0]):
            total += row_dot_dev(x[r], x[r], x[r], F32(0.5), x.shape[1])
        return total

    rng = np.random.default_rng(0)
    x = rng.standard_normal((N, C)).astype(F32)
    print(f"row reductions, us per {N} rows of {C} (best of {reps}; 1 MiB, cache-resident)")
    lanes = 1e6 * best_seconds(over_rows(row_sum), (x,), reps)
    eight = 1e6 * best_seconds(over_rows(eight_partials_sum), (x,), reps)
    print(
        f"  row_sum      lanes {lanes:8.1f}   eight scalar partials {eight:8.1f}   "
        f"{eight / lanes:5.2f}x"
    )
    print(f"  row_sq_dev   lanes {1e6 * best_seconds(lanes_sq_dev, (x,), reps):8.1f}")
    print(f"  row_dot_dev  lanes {1e6 * best_seconds(lanes_dot_dev, (x,), reps):8.1f}")
    w, b = rng.standard_normal(C).astype(F32), rng.standard_normal(C).astype(F32)
    out, d, g = np.empty_like(x), np.zeros_like(x), rng.standard_normal((N, C)).astype(F32)
    m, s = np.empty(N, F32), np.empty(N, F32)
    dw, db = np.empty_like(w), np.empty_like(b)
    fwd = 1e6 * best_seconds(layernorm.layernorm_forward, (out, m, s, x, w, b), reps)
    bwd = 1e6 * best_seconds(
        layernorm.layernorm_backward_accumulate, (d, dw, db, g, x, w, m, s), reps
    )
    print(f"  layernorm_forward {fwd:8.1f}   layernorm_backward_accumulate {bwd:8.1f}")


def bench_allreduce_pass(reps: int) -> None:
    """The shm all-reduce's last pass over one rank's block at 2 ranks: three passes against
    the fused kernel (the same bits), taking turns, hot and with 16 MiB streamed between."""
    from simdist.kernels.optim import LANES, sum_of_squares
    from simdist.kernels.reduce import add_divide, add_divide_store

    def three(acc, peer, lanes):
        add_divide(acc, peer, F32(2))
        np.copyto(peer, acc)
        return sum_of_squares(acc)

    def fused(acc, peer, lanes):
        return add_divide_store(acc, peer, F32(2), peer, lanes)

    print(f"shm all-reduce's last pass, us (median of {reps}); 2 ranks' block of each model")
    print(f"{'model':>10} {'block':>10} {'streamed':>9} {'3 passes':>9} {'fused':>8} {'ratio':>6}")
    rng = np.random.default_rng(0)
    junk = np.zeros(16 << 18, F32)  # 16 MiB
    for preset in ("fc_mnist", "gpt2_mini"):
        n = parameter_count(preset) // 2
        acc, peer = (rng.standard_normal(n, dtype=F32) for _ in range(2))
        lanes = np.zeros(LANES)
        for cold in (False, True):
            times: dict[str, list[float]] = {"three": [], "fused": []}
            for i in range(2 * reps + 2):
                name, fn = ("three", three) if i % 2 == 0 else ("fused", fused)
                if cold:
                    junk += F32(1.0)
                np.copyto(acc, peer)  # written just before, as backward writes the gradients
                t = time.perf_counter()
                fn(acc, peer, lanes)
                if i >= 2:  # one untimed call each first (compile, first touch)
                    times[name].append(time.perf_counter() - t)
            a, b = (1e6 * float(np.median(times[k])) for k in ("three", "fused"))
            label = "16 MiB" if cold else "none"
            print(f"{preset:>10} {n:>10,} {label:>9} {a:9.1f} {b:8.1f} {a / b:6.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--gemm-only", action="store_true")
    parser.add_argument("--blas-grid", action="store_true", help="OpenBLAS against oneDNN")
    parser.add_argument(
        "--openblas-pair", action="store_true", help="numpy's OpenBLAS against SciPy's"
    )
    parser.add_argument(
        "--native-grid", action="store_true", help="bf16 products: native against sgemm"
    )
    parser.add_argument(
        "--attention", action="store_true", help="GPT-2's attention on each product path"
    )
    parser.add_argument(
        "--attention-blocks", action="store_true", help="causal products: dense or in blocks"
    )
    parser.add_argument(
        "--vector-width", action="store_true", help="loop kernels at 512- and 256-bit"
    )
    parser.add_argument(
        "--norm", action="store_true", help="the gradient norm at FC-MNIST and gpt2-mini sizes"
    )
    parser.add_argument(
        "--rows", action="store_true", help="row reductions: lanes against eight partials"
    )
    parser.add_argument(
        "--narrow", action="store_true", help="beside oneMKL: narrow products on OpenBLAS"
    )
    parser.add_argument(
        "--optimizer-cache", action="store_true", help="AdamW, state hot or cold, 1 or 2 at once"
    )
    parser.add_argument(
        "--allreduce-pass", action="store_true", help="the shm all-reduce's last pass, fused or not"
    )
    parser.add_argument("--loop-kernels-json", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--optimizer-cache-child", nargs=2, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    reps = args.reps
    if args.loop_kernels_json:  # a --vector-width child
        print(json.dumps(time_loop_kernels(reps)))
        return
    if args.optimizer_cache_child:  # an --optimizer-cache child
        print(optimizer_cache_child(*args.optimizer_cache_child, reps))
        return
    from simdist.hostcpu import cpu_identity, cpu_info

    cpu = cpu_info()
    print(
        f"{platform.processor() or platform.machine()}, affinity {len(os.sched_getaffinity(0))}"
        f" cores; numba {numba.__version__}, numpy {np.__version__}, scipy {scipy.__version__};"
        f" best of {reps}; load {os.getloadavg()[0]:.2f}"
    )
    print(f"cpu: {cpu_identity(cpu)}; ISA: {' '.join(cpu['isa'])}; kernels' BLAS: {library()}")
    if args.blas_grid:
        bench_blas_grid(max(3, reps // 10))
        return
    if args.openblas_pair:
        bench_openblas_pair(reps)
        return
    if args.narrow:
        bench_mkl_narrow(reps)
        return
    if args.native_grid:
        bench_native_grid(max(3, reps // 10))
        return
    if args.attention:
        bench_attention(max(3, reps // 2))
        return
    if args.attention_blocks:
        bench_attention_blocks(max(3, reps // 2))
        return
    if args.rows:
        bench_row_reductions(reps)
        return
    if args.norm:
        bench_gradient_norm(reps)
        return
    if args.optimizer_cache:
        bench_optimizer_cache(reps)
        return
    if args.allreduce_pass:
        bench_allreduce_pass(reps)
        return
    if args.vector_width:
        bench_vector_width(max(3, reps // 5))
        return
    if not args.gemm_only:
        print(f"{'B x C x OC':>16} {'op':>9} {'kernel GF/s':>12} {'numpy GF/s':>11}")
        for B, C, OC in [(128, 784, 512), (128, 512, 512)]:
            bench_shape(B, C, OC, reps)
    bench_gemm_shapes(max(3, reps // 10))


if __name__ == "__main__":
    main()
