"""Which CPU this is: what a measurement ran on.

The benchmarks print and record it with every figure; ``simdist.calibrate`` writes it into
the host profile it measures, and a run whose profile was calibrated on another CPU says so
(its predictions describe that machine). This project's machines come as Intel Xeons and
AMD EPYCs whose single-core rates differ by up to 2x, and a virtual machine may hide the
model name ("Intel(R) Xeon(R) Processor"), so the identity carries the family, model and
stepping as well.
"""

from __future__ import annotations

import platform
from pathlib import Path

# ISA extensions that decide which kernels and BLAS paths a CPU takes (printed; ``flags``
# keeps every flag the kernel reports)
ISA_OF_NOTE = (
    "sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512dq", "avx512bw",
    "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8",
)  # fmt: skip


def parse_cpuinfo(text: str) -> dict:
    """Model, vendor, family/model/stepping and flags of the first processor of a
    /proc/cpuinfo text; ``isa``: the flags of ``ISA_OF_NOTE`` present. Fields the text
    lacks keep ``platform``'s answer (model) or stay empty."""
    info: dict = {"model": "", "vendor": "", "family_model_stepping": "", "flags": []}
    fms: dict[str, str] = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key == "model name":
            info["model"] = value
        elif key == "vendor_id":
            info["vendor"] = value
        elif key in ("cpu family", "model", "stepping"):
            fms[key] = value
        elif key == "flags":
            info["flags"] = value.split()
    if not info["model"]:  # (platform.processor runs `uname -p`: only when needed)
        info["model"] = platform.processor() or platform.machine()
    if fms:
        info["family_model_stepping"] = "/".join(
            fms.get(k, "?") for k in ("cpu family", "model", "stepping")
        )
    have = set(info["flags"])
    info["isa"] = [f for f in ISA_OF_NOTE if f in have]
    return info


def cpu_info() -> dict:
    """``parse_cpuinfo`` of this machine's /proc/cpuinfo (Linux; elsewhere ``platform``'s
    name and no flags)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    return parse_cpuinfo(text)


def cpu_identity(info: dict | None = None) -> str:
    """One line naming the CPU: "Intel(R) Xeon(R) Processor (GenuineIntel 6/207/2)"."""
    info = cpu_info() if info is None else info
    detail = " ".join(x for x in (info["vendor"], info["family_model_stepping"]) if x)
    return f"{info['model']} ({detail})" if detail else info["model"]


def other_cpu_note(profile_name: str, measured_on: str | None) -> str | None:
    """The note for a device profile calibrated on another CPU (its predictions describe
    that machine, and the project's CPU kinds differ by up to 2x a core); None where the
    profile names this CPU or none (GPU profiles, the shipped ``host``)."""
    if not measured_on:
        return None
    here = cpu_identity()
    if measured_on == here:
        return None
    return (
        f"note: device profile '{profile_name}' was calibrated on {measured_on}, this CPU is "
        f"{here}: its predictions describe that machine (`mpiexec -n 2 python -m "
        "simdist.calibrate` measures this one)"
    )
