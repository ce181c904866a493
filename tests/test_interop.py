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
