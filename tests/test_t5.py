"""T5's kernels, data, model and training runs (parity with Hugging Face: test_t5_parity.py).

Kernels: RMS norm, the relative-position buckets and bias, cross-attention with a bias
against float64 references and central differences; the float64 and allocation contracts.
Data: span corruption loses nothing. Model: gradients against central differences with
dropout on (tied ReLU and untied gated-GELU). Runs: ZeRO 0/1/2 bit-identical at a given N,
resume identical to an uninterrupted run, config errors exit 2 without writing.
"""

import json
import math

import numpy as np
import pytest
from kernel_checks import central_fd, float64_ops, nrt_allocations
from model_runs import assert_resume_identical, assert_zero_levels_identical, runner
from mpi_launch import run_mpi
from simdist.kernels import attention, linear_nobias, relpos, rmsnorm

from simdist.arena import Layout
from simdist.data.t5 import EOS, NUM_SPECIAL, PAD, T5Data, make_examples, sentinel
from simdist.data.text import load_corpus_bytes
from simdist.models.base import GradientViews
from simdist.models.t5 import T5, plan_models, resolve_config
from simdist.models.t5_shapes import span_lengths

F32 = np.float32


# ---------------------------------------------------------------- kernels
def test_rmsnorm_matches_float64_and_central_differences():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 37)).astype(F32) * 3
    w = rng.standard_normal(37).astype(F32)
    out, r = np.zeros_like(x), np.zeros(5, F32)
    rmsnorm.rmsnorm_forward(out, r, x, w, F32(1e-6))
    x64 = x.astype(np.float64)

    def ref(z):
        z = z.reshape(x.shape)
        return z / np.sqrt((z * z).mean(-1, keepdims=True) + 1e-6) * w

    assert np.abs(out - ref(x64)).max() < 2e-6 * np.abs(out).max()
    g = rng.standard_normal(x.shape).astype(F32)
    dx, dw = np.full_like(x, 7.0), np.zeros_like(w)
    rmsnorm.rmsnorm_backward(dx, dw, g, x, w, r)
    fd = central_fd(lambda z: float((ref(z) * g).sum()), x64.ravel()).reshape(x.shape)
    assert np.abs(dx - fd).max() / np.abs(fd).max() < 1e-4
    dw_ref = (g * x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + 1e-6)).sum(0)
    assert np.abs(dw - dw_ref).max() / np.abs(dw_ref).max() < 1e-5
    acc = np.ones_like(x)
    rmsnorm.rmsnorm_backward_accumulate(acc, dw, g, x, w, r)
    assert np.allclose(acc, dx + 1, atol=1e-6)


def _bucket_ref(rel: int, bidirectional: bool, nb: int, md: int) -> int:
    """Hugging Face's bucketing in plain Python (float32 logarithm, as PyTorch)."""
    b = 0
    if bidirectional:
        nb //= 2
        b += nb if rel > 0 else 0
        rel = abs(rel)
    else:
        rel = -min(rel, 0)
    me = nb // 2
    if rel < me:
        return b + rel
    v = F32(np.log(F32(rel) / F32(me))) / F32(math.log(md / me)) * F32(nb - me)
    return b + min(me + int(v), nb - 1)


@pytest.mark.parametrize("bidirectional", [True, False])
def test_relpos_buckets_match_hugging_face(bidirectional):
    out = np.zeros((300, 300), np.int32)
    relpos.relpos_buckets(out, bidirectional, 32, *relpos.bucket_args(32, 128, bidirectional))
    offsets = np.arange(300)[None, :] - np.arange(300)[:, None]
    ref = {o: _bucket_ref(int(o), bidirectional, 32, 128) for o in range(-299, 300)}
    assert all(out[t, j] == ref[offsets[t, j]] for t in (0, 17, 299) for j in range(300))
    try:
        import torch
        from transformers.models.t5.modeling_t5 import T5Attention
    except ImportError:
        return
    hf = T5Attention._relative_position_bucket(
        torch.from_numpy(offsets), bidirectional=bidirectional, num_buckets=32, max_distance=128
    )
    assert np.array_equal(out, hf.numpy())


def test_relpos_bias_forward_and_backward_use_one_table():
    rng = np.random.default_rng(1)
    buckets = np.zeros((6, 9), np.int32)
    relpos.relpos_buckets(buckets, True, 8, *relpos.bucket_args(8, 16, True))
    table = rng.standard_normal((8, 3)).astype(F32)
    bias = np.zeros((3, 6, 9), F32)
    relpos.relpos_bias_forward(bias, table, buckets)
    assert np.array_equal(bias, table[buckets].transpose(2, 0, 1))
    dbias = rng.standard_normal(bias.shape).astype(F32)
    dtable = np.full_like(table, np.nan)
    relpos.relpos_bias_backward(dtable, dbias, buckets)
    ref = np.zeros((8, 3))
    np.add.at(ref, buckets, dbias.transpose(1, 2, 0).astype(np.float64))
    assert np.abs(dtable - ref).max() < 1e-5


def _attend_ref(q, k, v, keep, n_head, bias):
    """float64 cross-attention with an additive bias and unscaled scores (T5)."""
    B, Tq, C = q.shape
    Tk, hs = k.shape[1], C // n_head
    qh = q.reshape(B, Tq, n_head, hs).transpose(0, 2, 1, 3)
    kh = k.reshape(B, Tk, n_head, hs).transpose(0, 2, 1, 3)
    vh = v.reshape(B, Tk, n_head, hs).transpose(0, 2, 1, 3)
    s = qh @ kh.transpose(0, 1, 3, 2) + bias[None]
    s = np.where(keep[:, None, None, :] > 0, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return (p @ vh).transpose(0, 2, 1, 3).reshape(B, Tq, C), p


def test_cross_attention_with_bias_matches_float64_and_central_differences():
    """One mha kernel serves cross-attention: Tq != Tk, T5's scale 1 and bias; the scores'
    gradient summed over the batch lands in dbias (added to what it holds)."""
    rng = np.random.default_rng(2)
    B, Tq, Tk, NH, hs = 2, 5, 7, 2, 3
    C = NH * hs
    q = rng.standard_normal((B, Tq, C)).astype(F32)
    k, v = (rng.standard_normal((B, Tk, C)).astype(F32) for _ in range(2))
    bias = rng.standard_normal((NH, Tq, Tk)).astype(F32)
    keep = np.ones((B, Tk), F32)
    keep[1, -2:] = 0
    scratch, ds = np.zeros((7, Tk, hs), F32), np.zeros((Tq, Tk), F32)
    out, att = np.zeros_like(q), np.zeros((B, NH, Tq, Tk), F32)
    keys = np.zeros(B, np.uint64)
    one, zero = F32(1.0), F32(0.0)
    attention.mha_attend_forward(
        out, att, q, k, v, keep, scratch, ds, NH, False, keys, 0, zero, one, bias, True
    )
    args64 = [a.astype(np.float64) for a in (q, k, v, bias)]
    ref, p = _attend_ref(*args64[:3], keep, NH, args64[3])
    assert np.abs(out - ref).max() < 1e-5 and np.abs(att - p).max() < 1e-6
    dout = rng.standard_normal(out.shape).astype(F32)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    dbias = np.ones_like(bias)  # accumulates onto this
    attention.mha_attend_backward(
        dq, dk, dv, dbias, dout, q, k, v, att, scratch, ds, NH, False, keys, 0, zero, one, True
    )
    for which, got in ((0, dq), (1, dk), (2, dv), (3, dbias - 1)):

        def f(z, which=which):
            a = list(args64)
            a[which] = z.reshape(a[which].shape)
            y = _attend_ref(a[0], a[1], a[2], keep, NH, a[3])[0]
            return float((y * dout).sum())

        fd = central_fd(f, args64[which].ravel()).reshape(got.shape)
        assert np.abs(got - fd).max() / np.abs(fd).max() < 1e-4, which


def _warm_new():
    for mod in (rmsnorm, relpos, linear_nobias, attention):
        mod._warm()


def test_new_kernels_do_no_float64_work_and_allocate_nothing():
    _warm_new()
    names = {
        rmsnorm: ["rmsnorm_forward", "rmsnorm_backward", "rmsnorm_backward_accumulate"],
        relpos: ["relpos_buckets", "relpos_bias_forward", "relpos_bias_backward"],
        linear_nobias: [
            "linear_nobias_forward", "linear_nobias_backward",
            "linear_nobias_backward_accumulate", "token_embedding_forward",
            "token_embedding_backward_accumulate", "scale_forward", "gate_forward",
            "gate_backward",
        ],
        attention: ["mha_attend_forward", "mha_attend_backward"],
    }  # fmt: skip
    for mod, fns in names.items():
        for fn in fns:
            for sig, lines in float64_ops(getattr(mod, fn)).items():
                assert "float64" not in sig, (fn, sig)
                assert not lines, f"{fn}{sig}:\n" + "\n".join(lines[:10])
    x, w = np.ones((8, 16), F32), np.ones((5, 16), F32)
    y, r = np.zeros((8, 5), F32), np.zeros(8, F32)
    ids = np.arange(8, dtype=np.int32) % 5
    buckets = np.zeros((4, 6), np.int32)
    bias, table = np.zeros((2, 4, 6), F32), np.ones((32, 2), F32)
    calls = [
        (rmsnorm.rmsnorm_forward, (x.copy(), r, x, x[0], F32(1e-6))),
        (rmsnorm.rmsnorm_backward_accumulate, (x.copy(), x[0].copy(), x, x, x[0], r)),
        (relpos.relpos_buckets, (buckets, True, 32, *relpos.bucket_args(32, 128, True))),
        (relpos.relpos_bias_forward, (bias, table, buckets)),
        (relpos.relpos_bias_backward, (table, bias, buckets)),
        (linear_nobias.linear_nobias_forward, (y, x, w)),
        (linear_nobias.linear_nobias_backward_accumulate, (x.copy(), w.copy(), y, x, w)),
        (linear_nobias.token_embedding_backward_accumulate, (w.copy(), x, ids[:8] % 5)),
        (linear_nobias.gate_backward, (x.ravel().copy(), x.ravel().copy(), x.ravel(),
                                       x.ravel(), x.ravel())),
    ]  # fmt: skip
    for fn, args in calls:
        assert nrt_allocations(fn, *args) == 0, fn.__name__


# ---------------------------------------------------------------- data
def test_span_corruption_loses_nothing():
    """Inputs and targets interleave back into the raw bytes; lengths are T5's."""
    text = load_corpus_bytes()[:20000]
    Te = 64
    raw, noise, spans, Td = span_lengths(Te)
    assert (raw, noise, spans, Td) == (70, 10, 3, 14)
    assert span_lengths(512) == (568, 85, 28, 114)  # T5's own figures for 512 inputs
    x, y = make_examples(text, Te, 5)
    ids = np.frombuffer(text, np.uint8).astype(np.int32) + NUM_SPECIAL
    for i in (0, 1, len(x) - 1):
        src, tgt = list(x[i, :Te]), list(y[i])
        assert tgt[-1] == EOS and x[i, Te] == i
        rebuilt = []
        for tok in src:
            if tok == EOS:
                break
            if tok >= sentinel(99):  # a sentinel: the span it stands for, from the targets
                k = sentinel(0) - tok
                a = tgt.index(tok) + 1
                b = tgt.index(sentinel(k + 1)) if k + 1 < spans else len(tgt) - 1
                rebuilt += tgt[a:b]
            else:
                rebuilt.append(tok)
        assert rebuilt == list(ids[i * raw : (i + 1) * raw])
        assert all(t == PAD for t in src[src.index(EOS) + 1 :])


# ---------------------------------------------------------------- model
def _tiny(drop=0.1, **kw):
    values = dict(
        num_layers=2, num_decoder_layers=2, num_heads=2, d_model=16, d_kv=8, d_ff=24,
        vocab_size=359, relative_attention_num_buckets=8, relative_attention_max_distance=16,
        n_positions=64, max_seq_length=24, dropout_rate=drop,
    )  # fmt: skip
    return resolve_config(None, **(values | kw))


def _model(cfg, B, seed=0):
    model = T5(cfg)
    layout = Layout(model.parameter_specs(), 1)
    pflat = np.zeros(layout.padded, F32)
    gflat = np.zeros(layout.padded, F32)
    params, grads = layout.views(pflat), GradientViews(layout.views(gflat))
    rng = np.random.default_rng(seed)
    model.init_parameters(params, rng)
    for spec in model.parameter_specs():
        if len(spec.shape) == 1:  # non-trivial norms
            params[spec.name] += rng.standard_normal(spec.shape).astype(F32) * 0.2
    model.allocate(B)
    data = T5Data(load_corpus_bytes()[:50000], cfg.max_seq_length, B, "")
    x, y = data.train_batch(np.arange(B) * 3)
    x = x.copy()
    x[1, cfg.max_seq_length - 2 : cfg.max_seq_length] = PAD  # some padding
    return model, params, grads, x, y.copy()


@pytest.mark.parametrize("tied", [True, False])
def test_model_gradients_with_dropout_match_central_differences(tied):
    """Directional derivatives of the loss along random directions, per parameter tensor,
    with dropout on (the masks are a fixed function of seed, step and sample), tied and
    untied head. The FFN is gated-GELU here: central differences across ReLU kinks are
    unreliable (some ReLU input lies within any usable step of 0); the ReLU FFN's
    gradients are checked against Hugging Face in test_t5_parity.py, and its dropout runs
    through the same code as the gated one's."""
    cfg = _tiny(feed_forward_proj="gated-gelu", tie_word_embeddings=tied)
    B = 3
    model, params, grads, x, y = _model(cfg, B)
    model.bind_step(5, lambda: 17)
    model.forward(params, x, y)
    for g in grads.values():
        g.fill(np.nan)  # backward must overwrite every gradient
    model.backward(params, grads, 1.0 / B)
    rng = np.random.default_rng(1)
    for name in params:
        d = rng.standard_normal(params[name].shape).astype(F32)
        base = params[name].copy()
        h = 1e-2 * float(np.abs(base).max() or 1.0) / float(np.abs(d).max())

        def loss_at(s, name=name, base=base, d=d, h=h):
            params[name][...] = base + F32(s * h) * d
            return model.forward(params, x, y)

        fd = (loss_at(1) - loss_at(-1)) / (2 * h)
        params[name][...] = base
        an = float((grads[name].astype(np.float64) * d).sum())
        # 5e-4: the float32 loss's rounding over 2h (measured up to ~3e-4 at this step)
        assert abs(an - fd) <= 2e-2 * abs(fd) + 5e-4, (name, an, fd)


def test_dropout_depends_on_step_and_is_off_in_eval():
    model, params, _, x, y = _model(_tiny(), 2)
    step = [3]
    model.bind_step(1, lambda: step[0])
    a = model.forward(params, x, y)
    b = model.forward(params, x, y)
    step[0] = 4
    c = model.forward(params, x, y)
    assert a == b and a != c
    nodrop, _, _, _, _ = _model(_tiny(0.0), 2)
    assert model.evaluate(params, x, y) == nodrop.evaluate(params, x, y)


def test_kernel_costs_cover_the_gradient_groups_and_plan_shapes():
    for cfg in (resolve_config("t5-mini"), _tiny(feed_forward_proj="gated-gelu")):
        model = T5(cfg)
        costs = model.kernel_costs(2)
        done = [k.done for k in costs if k.done]
        assert done == [g.names for g in model.gradient_groups()]
        matmul = sum(k.flops * k.count for k in costs if k.kind == "matmul")
        assert matmul == 2 * model.flops_per_sample()
        assert model.activation_bytes(2) > 0
    shapes = plan_models()
    # Hugging Face's t5-small and t5-base parameter counts (shared embedding counted once)
    assert shapes["t5-small"]["param_count"] == 60_506_624
    assert shapes["t5-base"]["param_count"] == 222_903_552


# ---------------------------------------------------------------- runs
TINY_T5 = [
    "--params=t5_mini",
    "--model.num_layers=2",
    "--model.num_decoder_layers=2",
    "--model.d_model=64",
    "--model.d_kv=16",
    "--model.d_ff=128",
    "--model.max_seq_length=32",
    "--train_input.batch_size=null",
    "--train_input.global_batch_size=12",
    "--runconfig.save_summary_steps=2",
    "--runconfig.progress_bar=false",
    "--eval_input.batch_size=64",
]


_train = runner(TINY_T5)


@pytest.mark.parametrize("n", [2, 3])
def test_zero_levels_are_bit_identical(tmp_path, n):
    assert_zero_levels_identical(_train, tmp_path, n)


def test_resume_is_bitwise_identical_and_eval_reports_denoising(tmp_path):
    assert_resume_identical(_train, tmp_path, "--zero_opt_level=2")
    ev = json.loads((tmp_path / "res" / "eval.json").read_text())
    assert 0 <= ev["accuracy"] <= 1 and 0 < ev["loss"] < 10, ev  # per target token
    perf = json.loads((tmp_path / "res" / "performance.json").read_text())
    assert perf["est_compute_s"] > 0 and perf["est_step_time_s"] > 0, perf
    assert (tmp_path / "res" / "timeline.json").is_file()


@pytest.mark.parametrize(
    "flag,key",
    [
        ("--model.vocab_size=300", "model.vocab_size"),  # the data uses 359 ids
        ("--model.max_seq_length=1000", "model.max_seq_length"),  # n_positions is 512
        ("--model.dropout_rate=1.5", "model.dropout_rate"),
        ("--model.block_size=64", "model.block_size"),  # a GPT-2 (decoder-only) key
        ("--model.feed_forward_proj=swish", "model.feed_forward_proj"),
    ],
)
def test_config_errors_exit_2_and_write_nothing(tmp_path, flag, key):
    d = tmp_path / "bad"
    cmd = ["-m", "simdist.train", *TINY_T5, f"--runconfig.model_dir={d}", flag]
    out = run_mpi(1, cmd, timeout=120)
    assert out.returncode == 2, out.stdout
    assert key in out.stdout, out.stdout
    assert not d.exists()


def test_simulated_oom_names_the_activations(tmp_path):
    from test_simulate import toy_profile

    d = tmp_path / "oom"
    prof = toy_profile(tmp_path, capacity_gb=0.05)  # t5-mini's arena alone is 121 MiB
    cmd = ["-m", "simdist.train", "--params=t5_mini", f"--profile={prof}"]
    out = run_mpi(1, [*cmd, f"--runconfig.model_dir={d}", "--runconfig.max_steps=1"], 120)
    assert out.returncode == 2, out.stdout
    assert "simulated out of memory on toy" in out.stdout and "activations" in out.stdout
    assert not d.exists()
