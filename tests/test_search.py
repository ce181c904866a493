"""Plan mode's model shape files, the layout search and the scaling table (issue 21)."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

from simdist.plan import MODELS, PlanConfig, Planner, main
from simdist.sim.plan_shapes import ShapeError, load_shape, shape_files
from simdist.sim.search import SearchSpace, enumerate_configs, search

LLAMA2_7B = """\
# Llama-2-7B's shapes (Touvron et al. 2023; HF meta-llama/Llama-2-7b-hf config)
layers: 32
hidden: 4096
heads: 32
ffn: 11008
ffn_kind: gated
vocab: 32000
seq_len: 4096
tied_embeddings: false
position: rotary
norm: rmsnorm
attn_bias: false
mlp_bias: false
"""

T5_BASE = """\
encoder_layers: 12
decoder_layers: 12
hidden: 768
heads: 12
ffn: 3072
vocab: 32128
seq_len: 512
position: relative
norm: rmsnorm
attn_bias: false
mlp_bias: false
"""


# -- model shape files -----------------------------------------------------------------------


def test_presets_are_shipped_shape_files():
    files = shape_files()
    assert set(files) == set(MODELS)
    for name in files:
        assert load_shape(name) == MODELS[name]
    # an override makes a new spec (and a new name); the preset itself is unchanged
    small = load_shape("gpt2", {"layers": 2})
    assert small.n_layer == 2 and small.name == "gpt2+layers=2"
    assert MODELS["gpt2"].n_layer == 12


def test_presets_of_the_models_simdist_trains_count_their_parameters():
    """bert-* and t5-* shape files count exactly what simdist's BERT and T5 allocate (their
    shapes modules), so plan mode sizes the model a run trains."""
    from simdist.models.bert_shapes import plan_models as bert_models
    from simdist.models.t5_shapes import plan_models as t5_models

    shapes = {**bert_models(), **t5_models()}
    assert set(shapes) == {"bert-mini", "bert-base", "bert-large", "t5-mini", "t5-small", "t5-base"}
    for name, shape in shapes.items():
        assert MODELS[name].param_count() == shape["param_count"], name
    assert MODELS["t5-base"].cross_layers == 12 and MODELS["bert-large"].cross_layers == 0


def test_user_shapes_count_published_parameters(tmp_path):
    """Exact parameter counts of published models from their shapes alone: Llama-2-7B
    (gated FFN, RMSNorm, untied, rotary), Mistral-7B (the same with 8 KV heads and d_ff
    14336) and T5-base (encoder-decoder, relative position bias, tied)."""
    llama = tmp_path / "llama2-7b.yaml"
    llama.write_text(LLAMA2_7B)
    assert load_shape(str(llama)).param_count() == 6_738_415_616  # HF model card
    mistral = load_shape(str(llama), {"kv_heads": 8, "ffn": 14336})
    assert mistral.param_count() == 7_241_732_096  # HF mistralai/Mistral-7B-v0.1
    t5 = tmp_path / "t5-base.yaml"
    t5.write_text(T5_BASE)
    spec = load_shape(str(t5))
    assert (spec.n_layer, spec.cross_layers) == (24, 12)
    assert spec.param_count() == 222_903_552  # HF t5-base


def test_user_yaml_planned_end_to_end(tmp_path, capsys):
    f = tmp_path / "llama2-7b.yaml"
    f.write_text(LLAMA2_7B)
    args = ["--model", str(f), "--devices", "8", "--tp", "2", "--zero", "1", "--batch", "4",
            "--micro-batch", "1", "--recompute", "selective", "--json"]  # fmt: skip
    assert main(args) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["model"] == "llama2-7b" and r["params"] == 6_738_415_616 and r["fits"]
    assert r["step_s"] > 0 and r["breakdown_s"]["tp_comm"] > 0
    # a gated FFN has 3 matrices: the model FLOPs follow the shapes (6 per parameter of the
    # GEMMs, + attention), so they exceed the 2-matrix GELU model of the same widths
    gelu = main([*args[:-1], "--model.ffn_kind=gelu", "--json"])
    assert gelu == 0
    g = json.loads(capsys.readouterr().out)
    assert g["model_flops_per_step"] < r["model_flops_per_step"]
    assert g["params"] == r["params"] - 32 * 4096 * 11008
    # GQA narrows K/V: fewer parameters, smaller QKV GEMM, less activation memory
    assert main([*args[:-1], "--model.kv_heads=8", "--json"]) == 0
    q = json.loads(capsys.readouterr().out)
    assert q["params"] < r["params"]
    assert q["memory_bytes"]["activations"] < r["memory_bytes"]["activations"]
    assert q["breakdown_s"]["forward_compute"] < r["breakdown_s"]["forward_compute"]


def test_encoder_decoder_plans_its_cross_attention(tmp_path):
    f = tmp_path / "t5.yaml"
    f.write_text(T5_BASE)
    kw = dict(devices=2, batch=8, micro_batch=4)
    ed = Planner(PlanConfig(model=str(f), **kw)).run()
    enc_only = Planner(
        PlanConfig(model=str(f), model_overrides={"decoder_layers": 0, "encoder_layers": 24}, **kw)
    ).run()
    assert ed.fits and enc_only.fits
    assert ed.params - enc_only.params == 12 * (768 + 4 * 768 * 768) + 768 + 32 * 12
    assert ed.breakdown_s["forward_compute"] > enc_only.breakdown_s["forward_compute"]
    assert ed.memory_bytes["activations"] > enc_only.memory_bytes["activations"]
    assert any("encoder-decoder" in n for n in ed.notes)


@pytest.mark.parametrize(
    ("text", "override", "where", "what"),
    [
        ("layers: 2\nhiddn: 64\nheads: 2\nvocab: 10\nseq_len: 8\n", None, ":2:",
         "hiddn: unknown key (did you mean hidden?)"),
        ("layers: 2\nhidden: 64\nheads: 2\nvocab: 10\nseq_len: 8\nheads: 4\n", None, ":6:",
         "duplicate key heads"),
        ("layers: 2\nhidden: 64\nheads: 2\nvocab: ten\nseq_len: 8\n", None, ":4:",
         "vocab: expected int"),
        ("layers: 2\nhidden: 64\nheads: 2\nvocab: 10\nseq_len: 8\n", "--model.heads=3",
         "--model.heads=3", "hidden (64) must be a multiple of heads (3)"),
        ("layers: 2\nhidden: 64\nheads: 2\nvocab: 10\nseq_len: 8\nffn_kind: relu\n", None,
         ":6:", "ffn_kind: expected gelu or gated"),
        ("layers: 2\nhidden: 64\nheads: 2\nvocab: 10\n", None, "m.yaml", "seq_len: missing"),
    ],
)  # fmt: skip
def test_shape_errors_name_the_key_and_where(tmp_path, capsys, text, override, where, what):
    f = tmp_path / "m.yaml"
    f.write_text(text)
    assert main(["--model", str(f), *([override] if override else [])]) == 2
    err = capsys.readouterr().err
    assert what in err and where in err, err
    with pytest.raises(ShapeError):
        load_shape(str(f), {"heads": 3} if override else None)


def test_unknown_model_and_missing_file(capsys, tmp_path):
    assert main(["--model", "nope"]) == 2
    assert "unknown model 'nope'" in capsys.readouterr().err
    assert main(["--model", str(tmp_path / "absent.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err


# -- search ------------------------------------------------------------------------------------


def test_search_numbers_are_the_planners():
    """Every configuration a search ranks has exactly the numbers ``python -m simdist.plan``
    gives it (the search reuses one planner per precision with memoised layer costs)."""
    r = search("gpt2-large", 16, "a100-80gb", SearchSpace(global_batch=64), progress=False)
    fit = r.fitting
    assert len(fit) > 50 and r.evaluated > len(fit) // 2
    rng = random.Random(21)
    for c in fit[:5] + rng.sample(fit, 25) + [x for x in r.candidates if not x.fits][:5]:
        if c.pruned:
            continue
        res = Planner(PlanConfig(model="gpt2-large", devices=16, profile="a100-80gb", tp=c.tp,
                                 pp=c.pp, interleave=c.interleave, zero=c.zero,
                                 batch=64 // c.dp, micro_batch=c.micro_batch,
                                 recompute=c.recompute, sequence_parallel=c.sequence_parallel,
                                 precision=c.precision)).run()  # fmt: skip
        assert res.step_s == c.step_s and res.total_bytes == c.total_bytes, c
        assert res.fits == c.fits and res.breakdown_s == c.breakdown_s
    steps = [c.time_per_sample for c in fit]
    assert steps == sorted(steps)


def test_search_respects_the_rules_and_constraints():
    spec = MODELS["gpt3-175b"]
    space = SearchSpace(global_batch=1536, max_tp=4, max_micro_batch=8)
    cfgs = enumerate_configs(spec, 1024, space, devices_per_node=8)
    assert cfgs
    for c in cfgs:
        assert c["tp"] * c["pp"] * c["dp"] == 1024 and c["tp"] <= 4
        assert spec.n_layer % c["pp"] == 0 and 1536 % c["dp"] == 0
        assert c["micro_batch"] <= 8 and c["batch"] % c["micro_batch"] == 0
        assert c["zero"] <= 1 or c["pp"] == 1
        assert not c["sequence_parallel"] or c["tp"] > 1
        m = c["batch"] // c["micro_batch"]
        assert c["interleave"] == 1 or (c["pp"] > 1 and m % c["pp"] == 0)
    fixed = SearchSpace(global_batch=1536, tp=8, recompute="full", sequence_parallel=False)
    for c in enumerate_configs(spec, 1024, fixed, devices_per_node=8):
        assert (c["tp"], c["recompute"], c["sequence_parallel"]) == (8, "full", False)
    r = search("gpt3-175b", 64, "a100-80gb", SearchSpace(global_batch=64), progress=False)
    assert all(c.total_bytes <= r.capacity_bytes for c in r.fitting)
    assert all(not c.fits for c in r.candidates if c.pruned)


def test_fp32_is_searched_on_request_where_half_precision_is_faster():
    gpu = search("gpt2-mini", 2, "a100-80gb", SearchSpace(global_batch=8), progress=False)
    assert {c.precision for c in gpu.candidates} == {"mixed"}
    fp32 = search("gpt2-mini", 2, "a100-80gb", SearchSpace(global_batch=8, precision="fp32"),
                  progress=False)  # fmt: skip
    assert {c.precision for c in fp32.candidates} == {"fp32"} and fp32.fitting
    # fp32 data parallel is the run's own step (simdist.sim.step), as in a single plan
    c = next(c for c in fp32.fitting if c.recompute == "none" and c.tp == c.pp == 1)
    res = Planner(PlanConfig(model="gpt2-mini", devices=2, zero=c.zero, batch=8 // c.dp,
                             micro_batch=c.micro_batch, precision="fp32")).run()  # fmt: skip
    assert res.step_s == c.step_s and any("simdist's own" in n for n in res.notes)


def test_search_cli_prints_why_and_json_has_all(capsys):
    args = ["--model", "gpt2-xl", "--devices", "32", "--global-batch", "256", "--search"]
    assert main([*args, "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "ranked by predicted time per sample" in out and "why:" in out
    assert "#1 " in out and "headroom" in out and "what changing one choice" in out
    assert main([*args, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert len(d["configurations"]) == d["considered"] > 500
    best = d["configurations"][0]
    assert best["fits"] and best["global_batch"] == 256 and best["rank"] == 1
    assert best["config"]["devices"] == 32 and best["config"]["batch"] * best["dp"] == 256
    assert sum(best["parts_s"].values()) == pytest.approx(best["step_s"], rel=1e-9)


def test_scaling_table_states_its_kind(capsys):
    args = ["--model", "gpt3-175b", "--devices", "8,64,512"]
    assert main([*args, "--global-batch", "512"]) == 0
    out = capsys.readouterr().out
    assert "strong (fixed global batch)" in out and "no configuration fits" in out
    assert main([*args, "--batch", "2", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["scaling"].startswith("weak")
    assert [s["global_batch"] for s in d["sizes"]] == [16, 128, 1024]
    assert d["sizes"][0]["configurations"] == [] and d["sizes"][2]["configurations"][0]["fits"]


SEARCH_SIZES = (64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144,
                8192, 12288)  # fmt: skip


def test_search_covers_1e5_configurations():
    """Issue 21's search of 10^5 configurations: Megatron's 22B at 16 sizes from 64 to
    12,288 devices, global batch 3072. Its speed (target: under 10 CPU seconds) is a
    benchmark, ``scripts/bench_search.py``, not a timed assertion."""
    n = evaluated = 0
    for d in SEARCH_SIZES:
        r = search("megatron-22b", d, "a100-80gb", SearchSpace(global_batch=3072), progress=False)
        n, evaluated = n + r.considered, evaluated + r.evaluated
    assert n > 100_000 and evaluated > 100_000


# -- model validation: Narayanan et al. 2021 -------------------------------------------------


def _eq3_flops(batch: int, s: int = 2048, layers: int = 96, h: int = 12288, v: int = 51200):
    """Narayanan et al. 2021 eq. (3): FLOPs per iteration with full activation recompute."""
    return 96 * batch * s * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))


# The published figure: GPT-3 175B on 1,024 A100-80GB at global batch 1,536 trains at 140
# teraFLOP/s per GPU (Narayanan et al. 2021, arXiv 2104.04473, §5.1's training-time
# estimate; 45 % of the 312 TF peak), in eq. (3)'s accounting (which counts the full
# recompute). The search is held to what that Megatron-LM ran: fp16, full recompute, no
# sequence parallelism, no ZeRO, no overlap of the gradient all-reduce.
NARAYANAN_175B_TFLOPS = 140.0


@pytest.mark.xfail(
    strict=True,
    reason="model-validation gap, not met: the analytic model predicts 180-190 TF/GPU for "
    "the search's top-10 and 160.5 TF/GPU for the published TP8 PP16 layout (+15 % over 140), "
    "while it is within 1.2-6.1 % of Korthikanti et al. 2022 Table 5 and 11.5 % fast on "
    "Narayanan's own data-parallel 1.7B row: the residual is the 2021 stack's per-device "
    "compute; the term-by-term table is in README (python scripts/validate_published.py).",
)
def test_gpt3_175b_on_1024_a100_within_10_percent_of_narayanan():
    space = SearchSpace(global_batch=1536, recompute="full", sequence_parallel=False, zero=0,
                        precision="mixed")  # fmt: skip
    base = PlanConfig(overlap=False)
    r = search("gpt3-175b", 1024, "a100-80gb", space, base, progress=False)
    top = r.fitting[:10]
    assert top
    tflops = [c.tflops(1024, hardware=True) for c in top]
    assert tflops == pytest.approx([_eq3_flops(1536) / (c.step_s * 1024) / 1e12 for c in top])
    close = [t for t in tflops if abs(t / NARAYANAN_175B_TFLOPS - 1) <= 0.10]
    assert close, f"top-10 predicted TF/GPU {[round(t) for t in tflops]} vs 140"


def test_gpt3_175b_search_states_step_memory_and_time():
    """What the validation case reports, whatever its accuracy: the published layout (TP8
    PP16, dp 8) is among the configurations that fit, and the search states step time,
    memory and its own run time."""
    space = SearchSpace(global_batch=1536, recompute="full", sequence_parallel=False, zero=0,
                        precision="mixed")  # fmt: skip
    r = search("gpt3-175b", 1024, "a100-80gb", space, PlanConfig(overlap=False), progress=False)
    pub = [c for c in r.fitting if (c.tp, c.pp, c.dp) == (8, 16, 8)]
    assert pub and r.best is not None and r.seconds > 0
    assert r.best.step_s > 0 and 0 < r.best.total_bytes <= r.capacity_bytes
    eq3 = [_eq3_flops(1536) / (c.step_s * 1024) / 1e12 for c in pub]
    assert all(100 < t < 250 for t in eq3)  # sane: between 32 % and 80 % of peak
    d = dataclasses.asdict(r.space)
    assert d["global_batch"] == 1536


def test_every_micro_batch_adds_its_weight_gradients_into_the_buffer():
    """Megatron's DDP hook (main_grad.add_) after every micro-batch: 3e bytes per parameter
    of the TP rank's layers, inside backward_compute; with ZeRO-3 only the rank's 1/dp shard;
    and the mixed-precision optimizer's fp32-master passes (20 bytes per parameter more)."""
    from simdist.device import CostModel, load_profile
    from simdist.plan import transformer_layer_ops

    prof = load_profile("a100-80gb")
    cost = CostModel(prof, "fp16")
    spec = MODELS["gpt3-175b"]
    for zero, dp in ((0, 1), (3, 4)):
        cfg = PlanConfig(model="gpt3-175b", devices=8 * dp, tp=8, zero=zero, batch=4,
                         micro_batch=1, seq=2048, recompute="full", overlap=False)  # fmt: skip
        p = Planner(cfg, prof)
        r = p.run()
        _, bwd = transformer_layer_ops(spec, 1, 2048, 8, False, 2)
        kernels = sum(p._op_time(op) for op in bwd if op.kind != "comm")
        n = spec.layer_params() / (8 * dp)
        acc = cost.compute_time(n, 6 * n, "vector")
        expect = 4 * spec.n_layer * (kernels + acc)
        assert r.breakdown_s["backward_compute"] == pytest.approx(expect, rel=1e-12)
        assert acc > 0
    owned = -(-spec.param_count() // 8)  # zero 0: every parameter of the TP shard
    r = Planner(dataclasses.replace(cfg, zero=0, devices=8), prof).run()
    assert r.breakdown_s["optimizer"] == pytest.approx(
        CostModel(prof, "fp32").compute_time(12 * owned, 48 * owned, "vector"), rel=1e-12
    )
