"""Profile numbers the cost model divides by or allocates against are checked at load time:
a bad one is a clean ProfileError (exit 2 from the CLI), not a crash mid-run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from simdist.device.profile import PROFILE_DIR, ProfileError, load_profile

REPO = Path(__file__).resolve().parents[1]
BASE = (PROFILE_DIR / "a100-40gb.yaml").read_text()
HOST = (PROFILE_DIR / "host.yaml").read_text()


def _edit(text: str, old: str, new: str) -> str:
    assert old in text, old  # the fixture must still match the shipped profile
    return text.replace(old, new, 1)


# (what to replace in a100-40gb.yaml, with what, words the error must contain)
CASES = [
    ("capacity_gib: 40 ", "capacity_gib: -40 ", "memory.capacity_gib must be > 0, got -40"),
    ("capacity_gib: 40 ", "capacity_gib: 0 ", "memory.capacity_gib must be > 0, got 0"),
    ("capacity_gib: 40 ", "capacity_gib: 1.0e-12 ", "memory.capacity_gib must be at least 1 byte"),
    ("capacity_gib: 40 ", "capacity_gib: lots ", "memory.capacity_gib must be a number"),
    ("    fp32: 19.5          # [ds] IEEE", "    fp32: 0 # IEEE", "matrix_tflops.fp32 must be > 0"),
    (
        "    fp32: 19.5          # [ds]\n    tf32: 19.5",
        "    fp32: 0\n    tf32: 19.5",
        "vector_tflops.fp32 must be > 0",
    ),  # fmt: skip
    ("    bf16: 39 ", "    bf16: -39 ", "vector_tflops.bf16 must be > 0"),
    ("  bandwidth_gbs: 1555", "  bandwidth_gbs: 0", "memory.bandwidth_gbs must be > 0"),
    ("    bandwidth_gbs: 300", "    bandwidth_gbs: 0", "links.intra.bandwidth_gbs must be > 0"),
    ("    efficiency: 0.8 ", "    efficiency: 0 ", "links.intra.efficiency must be > 0"),
    ("    efficiency: 0.8 ", "    efficiency: 1.5 ", "links.intra.efficiency must be in (0, 1]"),
    (
        "    nics_per_node: 8",
        "    nics_per_node: 0",
        "links.inter.nics_per_node must be a positive",
    ),
    (
        "  devices_per_node: 8",
        "  devices_per_node: -8",
        "links.devices_per_node must be a positive",
    ),
    ("    - [128, 0.95]", "    - [128, 0]", "matrix_efficiency: efficiency must be in (0, 1]"),
    ("    - [128, 0.95]", "    - [big, 0.95]", "matrix_efficiency: min_size must be a number"),
]


@pytest.mark.parametrize(("old", "new", "words"), CASES, ids=[c[2] for c in CASES])
def test_bad_sizes_and_rates_are_rejected_at_load(tmp_path, old, new, words):
    path = tmp_path / "bad.yaml"
    path.write_text(_edit(BASE, old, new))
    with pytest.raises(ProfileError) as err:
        load_profile(path)
    assert words in str(err.value)


def test_host_link_extras_and_scalar_rates_are_checked(tmp_path):
    """On host.yaml, whatever figures `simdist.calibrate` last wrote into it: each key's
    first value is replaced."""
    import re

    path = tmp_path / "bad.yaml"
    scalar = HOST.index("scalar_tflops:")
    for key, new, words in [
        ("reduce_gbs", "0", "links.intra.reduce_gbs must be > 0"),
        ("call_overhead_us", "-1", "call_overhead_us must be >= 0"),
        ("call_overhead_us", "x", "call_overhead_us must be a number"),
        ("fp32", "0", "scalar_tflops.fp32 must be > 0"),
    ]:
        start = scalar if key == "fp32" else 0  # the scalar table's fp32, not the GEMM's
        head, tail = HOST[:start], HOST[start:]
        edited, n = re.subn(rf"(\n\s*{key}:) [^\s#]+", rf"\1 {new}", tail, count=1)
        assert n == 1, key
        path.write_text(head + edited)
        with pytest.raises(ProfileError, match=words.replace(".", r"\.")):
            load_profile(path)


def test_streaming_capacity_and_bandwidth_are_checked(tmp_path):
    text = (PROFILE_DIR / "tiny-ws.yaml").read_text()
    path = tmp_path / "bad.yaml"
    path.write_text(_edit(text, "capacity_gb: 4 ", "capacity_gb: -4 "))
    with pytest.raises(ProfileError, match=r"streaming\.capacity_gb must be > 0"):
        load_profile(path)


def test_null_still_means_not_published(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text(_edit(BASE, "    bf16: 39 ", "    bf16: null "))
    prof = load_profile(path)
    assert "compute.vector_tflops.bf16" in prof.unknown and not prof.has_peak("vector", "bf16")


@pytest.mark.parametrize(
    ("old", "new", "words"),
    [
        ("capacity_gib: 40 ", "capacity_gib: -40 ", "memory.capacity_gib must be > 0"),
        ("    fp32: 19.5          # [ds] IEEE", "    fp32: 0 # IEEE", "fp32 must be > 0"),
    ],
)
def test_train_with_a_bad_profile_exits_2_and_writes_nothing(tmp_path, old, new, words):
    path = tmp_path / "bad.yaml"
    path.write_text(_edit(BASE, old, new))
    model_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "simdist.train", "--runconfig.max_steps=5",
           f"--runconfig.model_dir={model_dir}", "--profile", str(path)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.strip()
    assert words in err and str(path) in err
    assert "Traceback" not in err and len(err.splitlines()) == 1
    assert not model_dir.exists()
