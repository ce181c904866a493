"""The AIAYN Transformer: kernels, data, parity with ``torch.nn.Transformer``, runs.

Kernels: sinusoidal positions and label-smoothed cross-entropy against float64
references (their float64 and allocation contracts run in test_kernels.py over every
registered kernel). Data: word reversal keeps every byte; a TSV's bad lines fail naming
FILE:LINE. Model: loss and every gradient against ``torch.nn.Transformer`` plus the
shared scaled embedding, sinusoids and label smoothing built around it (float64, the
same weights; skipped without torch), then 10 AdamW steps; greedy decoding agrees with
teacher forcing on its own output. Runs: ZeRO 0/1/2 bit-identical at np 2, resume
identical, a TSV of the user's pairs, the loss falling within 100 steps, config errors
exit 2 without writing.
"""

import json
import math

import numpy as np
import pytest
from model_runs import assert_resume_identical, assert_zero_levels_identical, runner
from mpi_launch import run_mpi
from simdist.kernels import label_smoothing, linear_hf, positions

from simdist.arena import Layout
from simdist.config import ConfigError, OptimizerConfig
from simdist.data.bert import normalise
from simdist.data.text import load_corpus_bytes
from simdist.data.transformer import (
    EOS,
    NUM_SPECIAL,
    PAD,
    corpus_pairs,
    encode,
    read_tsv,
    reverse_words,
)
from simdist.models.base import GradientViews
from simdist.models.transformer import EMBED, Transformer, plan_models, resolve_config
from simdist.optim import Optimizer

F32 = np.float32


def rel(a, b) -> float:
    b = np.asarray(b, np.float64)
    return float(np.max(np.abs(np.asarray(a, np.float64) - b)) / np.max(np.abs(b)))


# ---------------------------------------------------------------- kernels
def test_sinusoid_table_is_the_papers():
    pe = np.zeros((50, 12), F32)
    positions.sinusoid_table(pe)
    pos, i = 37, 4  # dimensions 2i and 2i + 1
    angle = pos / 10000 ** (2 * i / 12)
    assert pe[pos, 2 * i] == F32(math.sin(angle)) and pe[pos, 2 * i + 1] == F32(math.cos(angle))
    odd = np.zeros((3, 5), F32)  # an odd width ends on a sine
    positions.sinusoid_table(odd)
    assert odd[2, 4] == F32(math.sin(2 / 10000 ** (4 / 5)))


def test_scaled_embedding_forward_and_backward():
    rng = np.random.default_rng(0)
    table = rng.standard_normal((7, 5)).astype(F32)
    pe = rng.standard_normal((4, 5)).astype(F32)
    ids = np.array([[1, 6, 1], [0, 2, 1]], np.int32)
    out = np.zeros((2, 3, 5), F32)
    positions.scaled_embedding_forward(out, ids, table, F32(3.0), pe)
    assert np.array_equal(out, table[ids] * F32(3.0) + pe[:3])
    d = rng.standard_normal(out.shape).astype(F32)
    grad = np.ones_like(table)
    positions.scaled_embedding_backward_accumulate(grad, d, ids, F32(3.0))
    ref = np.ones((7, 5))
    np.add.at(ref, ids.ravel(), 3.0 * d.reshape(-1, 5).astype(np.float64))
    assert np.abs(grad - ref).max() < 1e-5


def test_label_smoothed_cross_entropy_matches_float64():
    rng = np.random.default_rng(1)
    N, V, eps = 6, 11, 0.1
    logits = (rng.standard_normal((N, V)) * 4).astype(F32)
    t = rng.integers(0, V, N).astype(np.int32)
    t[2] = 0  # ignored (padding)
    losses, probs = np.zeros(N, F32), np.zeros((N, V), F32)
    label_smoothing.smoothed_cross_entropy_forward(losses, probs, logits, t, F32(eps), 0)
    x = logits.astype(np.float64)
    logp = x - x.max(1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(1, keepdims=True))
    target = np.full((N, V), eps / V)
    target[np.arange(N), t] += 1 - eps
    ref = -(target * logp).sum(1)
    ref[2] = 0.0
    assert np.abs(losses - ref).max() < 2e-6 * np.abs(ref).max()
    w = rng.random(N).astype(F32)
    d = np.zeros_like(probs)
    label_smoothing.smoothed_cross_entropy_backward(d, probs, t, w, F32(0.5), F32(eps))
    dref = (np.exp(logp) - target) * (0.5 * w[:, None])
    assert np.abs(d - dref).max() < 1e-6
    label_smoothing.smoothed_cross_entropy_backward(probs, probs, t, w, F32(0.5), F32(eps))
    assert np.array_equal(probs, d)  # in place, as the model calls it


def test_linear_backward_accumulate_adds_the_input_gradient():
    rng = np.random.default_rng(2)
    x, w = rng.standard_normal((4, 3)).astype(F32), rng.standard_normal((5, 3)).astype(F32)
    dy = rng.standard_normal((4, 5)).astype(F32)
    dx, dw, db = np.zeros_like(x), np.zeros_like(w), np.zeros(5, F32)
    linear_hf.linear_hf_backward(dx, dw, db, dy, x, w)
    acc, dw2, db2 = np.ones_like(x), np.full_like(w, 9), np.full(5, 9, F32)
    linear_hf.linear_hf_backward_accumulate(acc, dw2, db2, dy, x, w)
    assert np.allclose(acc, dx + 1, atol=1e-6)
    assert np.array_equal(dw2, dw) and np.array_equal(db2, db)


# ---------------------------------------------------------------- data
def test_word_reversal_keeps_every_byte_and_needs_the_source():
    assert reverse_words(b"she had been") == b"been had she"
    assert reverse_words(b" ab  c") == b"c  ab "  # empty words keep their spaces
    text = normalise(load_corpus_bytes())[:20000]
    pairs = corpus_pairs(text, 31)
    assert len(pairs) == len(text) // 31
    for src, tgt in pairs:
        assert len(src) == len(tgt) == 31 and sorted(src) == sorted(tgt)
    # the task is not the identity: almost no target equals its source
    assert sum(s == t for s, t in pairs) < 0.02 * len(pairs)
    x, y = encode(pairs[:3], 32, 32, 100, 2)
    assert x[0, 31] == EOS and y[0, 31] == EOS and x[0, 0] == pairs[0][0][0] + NUM_SPECIAL
    assert list(x[:, 32]) == [100, 101, 102] and list(x[:, 33]) == [1, 1, 0]


def test_tsv_pairs_and_errors_name_file_and_line(tmp_path):
    f = tmp_path / "pairs.tsv"
    f.write_bytes(b"hello\tbonjour\r\n\nthe cat\tle chat\n")
    assert read_tsv(str(f), 8, 8) == [(b"hello", b"bonjour"), (b"the cat", b"le chat")]
    cases = [
        (b"a\tb\nno tab here\n", ":2: expected source<TAB>target, found 0 tabs"),
        (b"a\tb\tc\n", ":1: expected source<TAB>target, found 2 tabs"),
        (b"a\tb\n\tb\n", ":2: empty source"),
        (b"a\tb\nx\t123456789\n", ":2: target of 9 bytes does not fit model.target_length"),
    ]
    for text, message in cases:
        f.write_bytes(text)
        with pytest.raises(ConfigError, match=str(f).replace(".", r"\.") + message):
            read_tsv(str(f), 8, 8)


# ---------------------------------------------------------------- model
def _tiny(**kw) -> object:
    base = dict(num_encoder_layers=2, num_decoder_layers=2, d_model=32, nhead=4,
                dim_feedforward=64, max_seq_length=20, target_length=16, dropout=0.0)  # fmt: skip
    return resolve_config("transformer-mini", **{**base, **kw})


def _model(cfg, B, seed=0):
    model = Transformer(cfg)
    layout = Layout(model.parameter_specs(), 1)
    pflat, gflat = np.zeros(layout.padded, F32), np.zeros(layout.padded, F32)
    params, grads = layout.views(pflat), GradientViews(layout.views(gflat))
    rng = np.random.default_rng(seed)
    model.init_parameters(params, rng)
    for spec in model.parameter_specs():
        if len(spec.shape) == 1:  # non-trivial norms and biases
            params[spec.name] += rng.standard_normal(spec.shape).astype(F32) * 0.2
    model.allocate(B)
    return model, layout, pflat, gflat, params, grads


def _batch(cfg, B, rng):
    """Random pairs of varied lengths: source padding (the key masks) and target padding
    (ignored labels) both present."""
    Te, Td = cfg.max_seq_length, cfg.target_length
    x, y = np.zeros((B, Te + 2), np.int32), np.zeros((B, Td), np.int32)
    for b in range(B):
        ls, lt = rng.integers(1, Te), rng.integers(1, Td)
        x[b, :ls], x[b, ls] = rng.integers(NUM_SPECIAL, 259, ls), EOS
        y[b, :lt], y[b, lt] = rng.integers(NUM_SPECIAL, 259, lt), EOS
    x[:, Te] = np.arange(B)
    return x, y


def test_kernel_costs_cover_the_gradient_groups_and_plan_shapes():
    from simdist.sim.plan_shapes import MODELS

    for cfg in (resolve_config("transformer-mini"), _tiny(dropout=0.1)):
        model = Transformer(cfg)
        costs = model.kernel_costs(2)
        assert [k.done for k in costs if k.done] == [g.names for g in model.gradient_groups()]
        matmul = sum(k.flops * k.count for k in costs if k.kind == "matmul")
        assert matmul == 2 * model.flops_per_sample()
        assert model.activation_bytes(2) > model.activation_bytes(1) > 0
    shapes = plan_models()
    assert set(shapes) == {"transformer-mini", "transformer-base", "transformer-big"}
    for name, shape in shapes.items():  # the shipped shape files count what simdist allocates
        assert MODELS[name].param_count() == shape["param_count"], name
    # the paper's table 3 reports 65M and 213M (its vocabulary is approximate)
    assert shapes["transformer-base"]["param_count"] == 63_084_544
    assert shapes["transformer-big"]["param_count"] == 214_249_472


def test_dropout_masks_depend_on_seed_step_and_sample_only():
    cfg = _tiny(dropout=0.1)
    model, _, _, _, params, _ = _model(cfg, 4)
    x, y = _batch(cfg, 4, np.random.default_rng(3))
    model.bind_step(5, lambda: 7)
    a = model.forward(params, x, y)
    assert model.forward(params, x, y) == a  # deterministic
    model.bind_step(5, lambda: 8)
    assert model.forward(params, x, y) != a  # a new step, new masks
    # a sample's loss is the same in a batch of its own (the masks hash its index)
    model.bind_step(5, lambda: 7)
    model.forward(params, x, y)
    whole = model._sample_losses(model._saved).copy()
    assert model.forward(params, x[2:3], y[2:3]) == pytest.approx(whole[2], rel=1e-5)


def test_greedy_decoding_agrees_with_teacher_forcing():
    """Greedy decoding (position by position, each a forward over the stages with the
    tokens so far, the later positions masked out by causality) is the model: fed the same
    previous tokens, its argmax at every position is the teacher-forced forward's; and
    greedy decoding is that argmax fed back."""
    cfg = _tiny()
    model, _, _, _, params, _ = _model(cfg, 3, seed=4)
    x, y = _batch(cfg, 3, np.random.default_rng(5))
    y[:, -1] = 7  # a target without padding: every position is compared
    for b in range(3):
        src = x[b, : cfg.max_seq_length]
        step = model.greedy_decode(params, src, forced=y[b])
        model.evaluate(params, x[b : b + 1], y[b : b + 1])
        full = model._views[1].logits.argmax(axis=1)
        assert np.array_equal(step, full) and len(set(full.tolist())) > 2, (step, full)
        dec = model.greedy_decode(params, src)
        n = int(np.flatnonzero(dec == EOS)[0]) + 1 if EOS in dec else len(dec)
        assert np.array_equal(model.greedy_decode(params, src, forced=dec)[:n], dec[:n])
    # evaluate scores the flagged sample's exact match: its own decode is a match
    # (and every real token of it right); against other targets it scores their real
    # tokens only: one token changed, then the second half padded away
    for key in ("exact_match", "greedy_token_accuracy"):
        model.extra_eval[key][:] = [0.0, 0.0]
    flagged = x[:1].copy()
    flagged[0, -1] = 1
    dec = model.greedy_decode(params, x[0, : cfg.max_seq_length])
    pad = cfg.pad_token_id
    model.evaluate(params, flagged, dec[None])
    real = float(np.count_nonzero(dec != pad))
    assert model.extra_eval["exact_match"] == [1.0, 1.0]
    assert model.extra_eval["greedy_token_accuracy"] == [real, real]
    off = dec.copy()
    i = int(np.flatnonzero(dec != pad)[0])
    off[i] = dec[i] + 1 if dec[i] + 1 < cfg.vocab_size else dec[i] - 1  # another real token
    model.evaluate(params, flagged, off[None])
    assert model.extra_eval["exact_match"] == [1.0, 2.0]
    assert model.extra_eval["greedy_token_accuracy"] == [2 * real - 1, 2 * real]
    short = dec.copy()
    short[len(dec) // 2 :] = pad
    kept = float(np.count_nonzero(short != pad))
    model.evaluate(params, flagged, short[None])
    right = float(np.count_nonzero((dec == short) & (short != pad)))  # the kept tokens
    assert right == kept
    assert model.extra_eval["greedy_token_accuracy"] == [2 * real - 1 + kept, 2 * real + kept]


# ---------------------------------------------------------------- parity with PyTorch
def _torch_loss(torch, net, E, x, y, cfg):
    """``nn.Transformer`` plus what simdist puts around it: the shared table scaled by
    sqrt(d_model) with sinusoids in, the same table out, label smoothing, per-sample means."""
    Te, Td, D = cfg.max_seq_length, cfg.target_length, cfg.d_model
    pe = np.zeros((max(Te, Td), D), F32)
    positions.sinusoid_table(pe)
    pe = torch.tensor(pe, dtype=E.dtype)
    src, tgt = torch.tensor(x[:, :Te]).long(), torch.tensor(y).long()
    dec_in = torch.cat([torch.ones_like(tgt[:, :1]), tgt[:, :-1]], 1)
    scale = math.sqrt(D)
    pad = src == PAD
    out = net(E[src] * scale + pe[:Te], E[dec_in] * scale + pe[:Td],
              tgt_mask=net.generate_square_subsequent_mask(Td, dtype=E.dtype),
              src_key_padding_mask=pad, memory_key_padding_mask=pad)  # fmt: skip
    logits = out @ E.T
    tok = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), reduction="none",
        label_smoothing=cfg.label_smoothing, ignore_index=PAD,
    ).reshape(tgt.shape)  # fmt: skip
    return (tok.sum(1) / (tgt != PAD).sum(1)).mean()


def _torch_twin(torch, cfg, params, dtype):
    net = torch.nn.Transformer(
        cfg.d_model, cfg.nhead, cfg.num_encoder_layers, cfg.num_decoder_layers,
        cfg.dim_feedforward, dropout=0.0, batch_first=True, dtype=dtype,
    )  # fmt: skip
    net.load_state_dict({k: torch.tensor(params[k]) for k in net.state_dict()})
    net.train()  # the reference path: no fused inference kernels, padding as given
    E = torch.tensor(params[EMBED], dtype=dtype, requires_grad=True)
    named = dict(net.named_parameters())
    named[EMBED] = E
    return net, E, named


def test_loss_and_every_gradient_match_torch_transformer():
    torch = pytest.importorskip("torch")
    cfg = _tiny()
    B = 4
    model, _, _, _, params, grads = _model(cfg, B)
    x, y = _batch(cfg, B, np.random.default_rng(6))
    for g in grads.values():
        g.fill(np.nan)  # backward must overwrite every gradient
    loss = model.forward(params, x, y)
    model.backward(params, grads, 1.0 / B)
    net, E, named = _torch_twin(torch, cfg, params, torch.float64)
    ref = _torch_loss(torch, net, E, x, y, cfg)
    ref.backward()
    assert abs(loss - ref.item()) / ref.item() < 1e-6, (loss, ref.item())
    assert set(named) == set(grads)
    errs = {n: rel(grads[n], p.grad.numpy()) for n, p in named.items()}
    worst = max(errs, key=errs.get)
    print(f"\nloss {loss:.7f} vs {ref.item():.7f}; worst {worst} rel err {errs[worst]:.2e}")
    assert errs[worst] < 1e-4, {k: v for k, v in errs.items() if v >= 1e-4}


def test_ten_adamw_steps_match_torch():
    torch = pytest.importorskip("torch")
    cfg = _tiny()
    B = 4
    model, layout, pflat, gflat, params, grads = _model(cfg, B, seed=7)
    net, E, named = _torch_twin(torch, cfg, params, torch.float32)
    ocfg = OptimizerConfig(learning_rate=1e-3, weight_decay=0.01, beta2=0.98, eps=1e-9)
    opt = Optimizer(ocfg, layout, 0, layout.padded, lambda kind, name, n: np.zeros(n, np.float32))
    decay = [p for p in named.values() if p.dim() >= 2]
    no_decay = [p for p in named.values() if p.dim() < 2]
    topt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
        lr=1e-3, betas=(0.9, 0.98), eps=1e-9, foreach=False,
    )  # fmt: skip
    rng = np.random.default_rng(8)
    losses = []
    for step in range(10):
        x, y = _batch(cfg, B, rng)
        loss = model.forward(params, x, y)
        model.backward(params, grads, 1.0 / B)
        opt.step(pflat, gflat, step + 1, ocfg.learning_rate)
        topt.zero_grad()
        tl = _torch_loss(torch, net, E, x, y, cfg)
        tl.backward()
        topt.step()
        losses.append((loss, tl.item()))
    worst = max(abs(a - b) / abs(b) for a, b in losses)
    print("\n" + "\n".join(f"step {i + 1}: {a:.6f} vs {b:.6f}" for i, (a, b) in enumerate(losses)))
    print(f"worst relative difference {worst:.2e}")
    assert losses[-1][0] < losses[0][0]  # it learns
    assert worst < 1e-4, losses


# ---------------------------------------------------------------- runs
TINY = [
    "--params=transformer_mini",
    "--model.num_encoder_layers=2",
    "--model.num_decoder_layers=2",
    "--model.d_model=64",
    "--model.nhead=4",
    "--model.dim_feedforward=128",
    "--model.max_seq_length=24",
    "--model.target_length=24",
    "--model.greedy_eval_samples=8",
    "--train_input.batch_size=null",
    "--train_input.global_batch_size=16",
    "--runconfig.save_summary_steps=2",
    "--runconfig.progress_bar=false",
    "--eval_input.batch_size=256",
]

_train = runner(TINY)


def test_zero_levels_are_bit_identical(tmp_path):
    assert_zero_levels_identical(_train, tmp_path, 2)


def test_resume_is_bitwise_identical_and_eval_reports_greedy_exact_match(tmp_path):
    assert_resume_identical(_train, tmp_path, "--zero_opt_level=1")
    ev = json.loads((tmp_path / "res" / "eval.json").read_text())
    for key in ("accuracy", "token_accuracy", "exact_match"):
        assert 0 <= ev[key] <= 1, ev
    assert ev["accuracy"] == pytest.approx(ev["token_accuracy"]) and 0 < ev["loss"] < 10, ev
    perf = json.loads((tmp_path / "res" / "performance.json").read_text())
    assert perf["est_compute_s"] > 0 and perf["est_step_time_s"] > 0, perf


def test_trains_on_a_users_tsv_and_the_loss_falls(tmp_path):
    """The user's pairs (here: each word's letters reversed, 300 lines) train at np 2; the
    held-out tail is evaluated, padding excluded from every per-token figure."""
    rng = np.random.default_rng(9)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", np.uint8)
    lines = []
    for _ in range(300):
        words = [bytes(rng.choice(letters, rng.integers(1, 6))) for _ in range(rng.integers(1, 4))]
        src = b" ".join(words)
        lines.append(src + b"\t" + b" ".join(w[::-1] for w in words))
    f = tmp_path / "pairs.tsv"
    f.write_bytes(b"\n".join(lines) + b"\n")
    d = tmp_path / "tsv"
    out = _train(2, d, f"--train_input.data_dir={f}", "--runconfig.max_steps=40",
                 "--optimizer.learning_rate=0.003", "--model.dropout=0.0")  # fmt: skip
    assert f"data: {f}" in out.stdout
    losses = [float(s.split("loss = ")[1].split(",")[0]) for s in out.stdout.splitlines()
              if s.startswith("global_step")]  # fmt: skip
    assert losses[-1] < 0.8 * losses[0], losses
    ev = json.loads((d / "eval.json").read_text())
    assert ev["eval_samples"] == 30 and ev["accuracy"] == pytest.approx(ev["token_accuracy"])


@pytest.mark.parametrize(
    "flag,key",
    [
        ("--model.vocab_size=200", "model.vocab_size"),  # the data uses 259 ids
        ("--model.d_model=30", "model.d_model"),  # not a multiple of nhead
        ("--model.dropout=1.5", "model.dropout"),
        ("--model.block_size=64", "model.block_size"),  # a GPT-2 (decoder-only) key
        ("--train_input.data_dir=pairs.txt", "train_input.data_dir"),
    ],
)
def test_config_errors_exit_2_and_write_nothing(tmp_path, flag, key):
    d = tmp_path / "bad"
    out = run_mpi(1, ["-m", "simdist.train", *TINY, f"--runconfig.model_dir={d}", flag], 120)
    assert out.returncode == 2, out.stdout
    assert key in out.stdout, out.stdout
    assert not d.exists()


def test_a_malformed_tsv_line_exits_2_naming_file_and_line(tmp_path):
    f = tmp_path / "pairs.tsv"
    f.write_text("a\tb\nc\td\n" + "x" * 40 + "\ty\n")
    d = tmp_path / "bad"
    cmd = [
        "-m",
        "simdist.train",
        *TINY,
        f"--runconfig.model_dir={d}",
        f"--train_input.data_dir={f}",
    ]
    out = run_mpi(1, cmd, 120)
    assert out.returncode == 2, out.stdout
    assert f"{f}:3: source of 40 bytes does not fit model.max_seq_length" in out.stdout
    assert not d.exists()


def test_interop_round_trip_with_torch_transformer(tmp_path):
    """A ``torch.nn.Transformer`` state dict plus ``embedding.weight`` (safetensors) imports
    as a simdist checkpoint with exactly the model's parameters, and exports back to the
    same tensors, which load into ``nn.Transformer`` strictly."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    import h5py
    from safetensors.numpy import load_file, save_file

    from simdist import interop

    cfg = _tiny()
    net = torch.nn.Transformer(cfg.d_model, cfg.nhead, cfg.num_encoder_layers,
                               cfg.num_decoder_layers, cfg.dim_feedforward,
                               batch_first=True)  # fmt: skip
    state = {k: v.numpy() for k, v in net.state_dict().items()}
    state[EMBED] = np.random.default_rng(0).standard_normal((259, cfg.d_model)).astype(F32)
    save_file(state, str(tmp_path / "t.safetensors"))
    interop.import_(tmp_path / "t.safetensors", tmp_path / "t.h5", "transformer")
    with h5py.File(tmp_path / "t.h5") as f:
        names = set(f["model"])
    assert names == {s.name for s in Transformer(cfg).parameter_specs()}
    back = load_file(str(interop.export(tmp_path / "t.h5", tmp_path / "out.safetensors")))
    assert back.keys() == state.keys()
    assert all(np.array_equal(back[k], v) for k, v in state.items())
    back.pop(EMBED)
    net.load_state_dict({k: torch.from_numpy(v) for k, v in back.items()}, strict=True)


def test_simulated_oom_names_the_activations(tmp_path):
    from test_simulate import toy_profile

    d = tmp_path / "oom"
    prof = toy_profile(tmp_path, capacity_gb=0.03)  # model states 22 MiB + an 18 MiB arena
    cmd = ["-m", "simdist.train", "--params=transformer_mini", f"--profile={prof}"]
    out = run_mpi(1, [*cmd, f"--runconfig.model_dir={d}", "--runconfig.max_steps=1"], 120)
    assert out.returncode == 2, out.stdout
    assert "simulated out of memory on toy" in out.stdout and "activations" in out.stdout
    assert not d.exists()
