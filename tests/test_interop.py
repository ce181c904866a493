"""Weights to and from safetensors / PyTorch state dicts, Hugging Face GPT-2 names."""

import h5py
import numpy as np
import pytest

from simdist import interop


def test_safetensors_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    t = {
        "wte.weight": rng.standard_normal((7, 4)).astype(np.float32),
        "h.0.ln_1.bias": np.arange(3, dtype=np.float32),
    }
    interop.write_safetensors(tmp_path / "a.safetensors", t, {"note": "x"})
    back = interop.read_safetensors(tmp_path / "a.safetensors")
    assert back.keys() == t.keys()
    for k in t:
        assert back[k].dtype == np.float32 and np.array_equal(back[k], t[k])


def test_safetensors_matches_the_reference_library(tmp_path):
    st = pytest.importorskip("safetensors.numpy")
    t = {"a": np.ones((2, 3), np.float32), "b": np.arange(5, dtype=np.float32)}
    interop.write_safetensors(tmp_path / "ours.safetensors", t)
    theirs = st.load_file(str(tmp_path / "ours.safetensors"))
    assert all(np.array_equal(theirs[k], t[k]) for k in t)
    st.save_file(t, str(tmp_path / "theirs.safetensors"))
    ours = interop.read_safetensors(tmp_path / "theirs.safetensors")
    assert all(np.array_equal(ours[k], t[k]) for k in t)


def test_corrupt_safetensors_is_a_clear_error(tmp_path):
    p = tmp_path / "bad.safetensors"
    p.write_bytes(b"\xff" * 16)
    with pytest.raises(interop.InteropError, match="header length"):
        interop.read_safetensors(p)


def test_hf_names_are_normalised_and_tie_checked():
    w = np.ones((3, 2), np.float32)
    hf = {
        "transformer.wte.weight": w,
        "transformer.h.0.attn.bias": np.ones((1, 1, 4, 4)),
        "lm_head.weight": w.copy(),
        "transformer.h.0.attn.c_attn.bias": np.zeros(6),
    }
    out = interop.normalize_hf(hf)
    assert sorted(out) == ["h.0.attn.c_attn.bias", "wte.weight"]
    with pytest.raises(interop.InteropError, match="ties them"):
        interop.normalize_hf({**hf, "lm_head.weight": w * 2})


def test_gpt2_export_import_round_trip_through_torch(tmp_path):
    torch = pytest.importorskip("torch")
    from simdist import checkpoint
    from simdist.models.gpt2 import GPT2, PRESETS
    from simdist.testing.torch_reference import TorchGPT2

    cfg = PRESETS["gpt2-mini"]
    model = GPT2(cfg)
    params = {s.name: np.zeros(s.shape, np.float32) for s in model.parameter_specs()}
    model.init_parameters(params, np.random.default_rng(0))
    ckpt = checkpoint.save(tmp_path, 5, params, None, {"model": "gpt2", "layout": {}}, 1)
    pt = interop.export(ckpt, tmp_path / "w.pt")
    tm = TorchGPT2(cfg)
    tm.load_state_dict(torch.load(pt, weights_only=True), strict=True)  # names and shapes
    sf = interop.export(ckpt, tmp_path / "w.safetensors")
    back = interop.import_(sf, tmp_path / "imported.h5")
    _, tensors, attrs = checkpoint.load(
        back, {s.name: s.shape for s in model.parameter_specs()}, "gpt2"
    )
    assert attrs["global_step"] == 0
    for k, v in params.items():
        assert np.array_equal(tensors[k], v)
    with h5py.File(back) as f:
        assert "optimizer" not in f


def test_export_header_names_dtypes_shapes_and_metadata(tmp_path):
    """What Hugging Face reads: the raw JSON header of an exported checkpoint."""
    import json
    import struct

    from simdist import checkpoint

    params = {
        "wte.weight": np.arange(12, dtype=np.float32).reshape(4, 3),
        "h.0.ln_1.bias": np.ones(3, np.float32),
    }
    ckpt = checkpoint.save(tmp_path, 7, params, None, {"model": "gpt2", "layout": {}}, 1)
    out = interop.export(ckpt, tmp_path / "w.safetensors")
    raw = out.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    assert header.pop("__metadata__") == {
        "format": "pt",
        "simdist_model": "gpt2",
        "global_step": "7",
    }
    assert {k: (v["dtype"], v["shape"]) for k, v in header.items()} == {
        "wte.weight": ("F32", [4, 3]),
        "h.0.ln_1.bias": ("F32", [3]),
    }
    back = interop.read_safetensors(out)
    assert all(np.array_equal(back[k], v) for k, v in params.items())


def test_unwritable_dtype_is_an_interop_error(tmp_path):
    with pytest.raises(interop.InteropError, match="cannot write safetensors"):
        interop.write_safetensors(tmp_path / "o.safetensors", {"a": np.array(["x"])})


def _tiny_gpt2_file(path, drop: str | None = None):
    from simdist.models.gpt2 import GPT2Config, parameter_specs

    cfg = GPT2Config(n_layer=2, n_head=1, n_embd=4, block_size=3, vocab_size=5)
    t = {s.name: np.zeros(s.shape, np.float32) for s in parameter_specs(cfg) if s.name != drop}
    interop.write_safetensors(path, t)
    return path


def _cli(capsys, *argv) -> tuple[int, str]:
    rc = interop.main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return rc, err


def test_import_refuses_an_unknown_model(tmp_path, capsys):
    src = _tiny_gpt2_file(tmp_path / "g.safetensors")
    rc, err = _cli(capsys, "import", src, tmp_path / "x.h5", "--model", "bogus")
    assert rc == 2 and "'bogus' is not a simdist model" in err
    assert all(m in err for m in ("gpt2", "bert", "t5", "transformer", "fc_mnist"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.safetensors"]


def test_import_checks_names_against_the_model(tmp_path, capsys):
    src = _tiny_gpt2_file(tmp_path / "g.safetensors")
    rc, err = _cli(capsys, "import", src, tmp_path / "x.h5", "--model", "bert")
    assert rc == 2 and "not a bert state dict" in err and "h.0.attn.c_attn.bias" in err
    assert "pass --model gpt2" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["g.safetensors"]  # nothing written
    short = _tiny_gpt2_file(tmp_path / "short.safetensors", drop="ln_f.weight")
    rc, err = _cli(capsys, "import", short, tmp_path / "x.h5")
    assert rc == 2 and "not a gpt2 state dict" in err and "no ln_f.weight" in err
    assert interop.main(["import", str(src), str(tmp_path / "x.h5"), "--model", "gpt2"]) == 0
    with h5py.File(tmp_path / "x.h5") as f:
        assert f.attrs["model"] == "gpt2" and "h.1.mlp.c_proj.bias" in f["model"]


def test_export_of_an_optimizer_shard_names_the_checkpoint(tmp_path, capsys):
    from simdist import checkpoint

    layout = {"padded": 4, "numel": 4}
    name, _ = checkpoint.save_optimizer_shard(
        tmp_path, 5, 0, 2, 0, 2, layout, {"exp_avg": np.zeros(2, np.float32)}
    )
    rc, err = _cli(capsys, "export", tmp_path / name, tmp_path / "sh.safetensors")
    assert rc == 2 and "is an optimizer shard of checkpoint_5.h5" in err
    assert not (tmp_path / "sh.safetensors").exists()


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o027, 0o640)])
def test_safetensors_export_mode_follows_the_umask(tmp_path, umask, mode):
    import os

    old = os.umask(umask)
    try:
        interop.write_safetensors(tmp_path / "a.safetensors", {"a": np.ones(2, np.float32)})
    finally:
        os.umask(old)
    assert (tmp_path / "a.safetensors").stat().st_mode & 0o777 == mode
    assert [p.name for p in tmp_path.iterdir()] == ["a.safetensors"]  # no temp file left
