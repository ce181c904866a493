"""Real multi-host runs on network namespaces (scripts/multihost.py).

Skipped unless root with working ``ip netns``. ``run_harness`` takes any program, so a
training run can use the same set-up; the probe tests here check that the Allreduce is
right, that each simulated host has its own hostname and /dev/shm, and that at least the
data an Allreduce must move really crossed the veth link.

Open MPI tests need a venv whose mpi4py links Open MPI: ``scripts/setup_openmpi.sh
[DIR]`` (default /tmp/ompi-venv; override with SIMDIST_OMPI_VENV).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HARNESS = REPO / "scripts" / "multihost.py"
PROBE = ["tests/mpi/multihost_probe.py"]
MIB = 2**20
OMPI_VENV = Path(os.environ.get("SIMDIST_OMPI_VENV", "/tmp/ompi-venv"))


def _netns_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "multi-host tests need root (network namespaces)"
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            return f"multi-host tests need '{tool}' (apt-get install iproute2 util-linux)"
    # Listing works even without CAP_NET_ADMIN; creating one (and the per-host UTS and mount
    # namespaces inside it) is what the harness needs. The name does not match the
    # harness's stale pattern (sdmh<pid>), so a concurrent run leaves it alone.
    ns = f"sdmhprobe-{os.getpid()}"
    try:
        probe = subprocess.run(
            f"ip netns add {ns} && ip netns exec {ns} unshare --uts --mount true",
            shell=True, capture_output=True, text=True, timeout=30,
        )  # fmt: skip
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    if probe.returncode != 0:
        return f"network namespaces unavailable: {probe.stderr.strip()}"
    return None


_NO_NETNS = _netns_unavailable()
pytestmark = pytest.mark.skipif(_NO_NETNS is not None, reason=str(_NO_NETNS))


@dataclass
class HarnessRun:
    code: int
    stdout: str
    stderr: str
    report: dict

    def probe(self) -> dict:
        lines = [ln for ln in self.stdout.splitlines() if ln.startswith("PROBE ")]
        assert len(lines) == 1, self.stdout + self.stderr
        return json.loads(lines[0][len("PROBE ") :])


def run_harness(
    program: list[str],
    tmp_path: Path,
    hosts: int = 2,
    ranks_per_host: int = 1,
    form: str = "mpich",
    mpi: str = "mpich",
    extra: tuple[str, ...] = (),
    timeout: float = 120,
) -> HarnessRun:
    """Run ``program`` (argv, cwd = repo) under the harness; returns its exit and report."""
    report = tmp_path / "report.json"
    cmd = [
        sys.executable, str(HARNESS), "--hosts", str(hosts), "--ranks-per-host",
        str(ranks_per_host), "--form", form, "--mpi", mpi, "--json", str(report),
        "--timeout", str(timeout - 15), *extra, "--", *program,
    ]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    data = json.loads(report.read_text()) if report.exists() else {}
    if data:  # teardown must leave nothing of this run behind
        ours = {*data["hosts"], data["hosts"][0][: -len("h0")] + "sw"}
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert not ours & {ln.split()[0] for ln in listed.splitlines() if ln.strip()}, listed
        assert not [ns for ns in ours if Path("/etc/netns", ns).exists()]
    return HarnessRun(r.returncode, r.stdout, r.stderr, data)


def check_probe(run: HarnessRun, hosts: int, ranks_per_host: int, mib: float = 4.0) -> dict:
    """Correct sum, one hostname per simulated host, and the bytes an Allreduce must move."""
    assert run.code == 0, run.stdout + run.stderr
    probe = run.probe()
    assert probe["ok"] and probe["size"] == hosts * ranks_per_host
    assert sorted(probe["hosts"]) == run.report["hosts"]  # hostname = the namespace's host
    for i, h in enumerate(run.report["hosts"]):
        assert probe["hosts"][h] == list(range(i * ranks_per_host, (i + 1) * ranks_per_host))
    # Every host has to receive one value per element from the others (the data is not
    # compressible), so each link carries >= the buffer into each host.
    size = int(mib * MIB)
    for link in run.report["links"]:
        assert link["rx_bytes"] >= size, link
    assert run.report["total_bytes"] >= hosts * size
    return probe


def _python_probe(*args: str, python: str = sys.executable) -> list[str]:
    return [python, *PROBE, *args]


@pytest.mark.parametrize(("form", "ranks_per_host"), [("mpich", 2), ("openmpi", 1)])
def test_two_hosts_mpich(tmp_path, form, ranks_per_host):
    run = run_harness(_python_probe("--expect-hosts", "2"), tmp_path, 2, ranks_per_host, form)
    check_probe(run, 2, ranks_per_host)
    assert "-launcher ssh -launcher-exec" in run.stderr


def test_three_hosts_on_a_bridge(tmp_path):
    run = run_harness(_python_probe("--expect-hosts", "3", "--mib", "1"), tmp_path, 3, 1)
    check_probe(run, 3, 1, mib=1)
    assert {link["peer"] for link in run.report["links"]} == {run.report["hosts"][0][:-2] + "sw"}


def test_rate_limit_holds(tmp_path):
    rate = 100e6  # bit/s; 4 MiB must take >= 0.34 s per direction when it is shaped
    run = run_harness(_python_probe("--expect-hosts", "2"), tmp_path, extra=("--rate", "100mbit"))
    probe = check_probe(run, 2, 1)
    floor = 4 * MIB * 8 / rate
    assert probe["seconds_per_op"] >= 0.8 * floor, probe


def test_failures_are_reported(tmp_path):
    # The probe's own checks fail (3 hosts expected on 2): a rank raises, the job aborts.
    run = run_harness(_python_probe("--expect-hosts", "3"), tmp_path, timeout=60)
    assert run.code not in (0, 124), run.stderr
    assert "2 distinct hosts, expected 3" in run.stderr
    # The program succeeds but moves too little for --require-bytes: exit 3.
    small = _python_probe("--mib", "0.01")
    run = run_harness(small, tmp_path, extra=("--require-bytes", "64MiB"), timeout=60)
    assert run.code == 3 and "--require-bytes" in run.stderr


def test_stale_namespaces_of_a_dead_run_are_removed(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()  # its pid now names nobody
    stale = f"sdmh{dead.pid}h0"
    subprocess.run(["ip", "netns", "add", stale], check=True)
    Path("/etc/netns", stale).mkdir(parents=True, exist_ok=True)
    try:
        run = run_harness(["true"], tmp_path)
        assert run.code == 0, run.stderr
        assert f"removed stale {stale}" in run.stderr
        assert stale not in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                           text=True).stdout  # fmt: skip
        assert not Path("/etc/netns", stale).exists()
    finally:
        subprocess.run(["ip", "netns", "del", stale], capture_output=True)
        shutil.rmtree(Path("/etc/netns", stale), ignore_errors=True)


def _ranks_with(marker: str) -> list[int]:
    """Pids of ranks (``python -m mpi4py ...``) whose command line holds ``marker``."""
    pids = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv[1:3] == [b"-m", b"mpi4py"] and any(marker.encode() in a for a in argv):
            pids.append(int(proc.name))
    return pids


def test_sigterm_tears_everything_down(tmp_path):
    marker = f"sdmh-sigterm-test-{os.getpid()}"
    program = [sys.executable, "-c", f"import time; time.sleep(300)  # {marker}"]
    harness = subprocess.Popen(
        [sys.executable, str(HARNESS), "--hosts", "3", "--", *program],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    prefix = f"sdmh{harness.pid}"
    try:
        deadline = time.monotonic() + 30
        while len(_ranks_with(marker)) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)  # wait until a rank runs on every host
        assert len(_ranks_with(marker)) == 3, "ranks did not start"
        harness.terminate()
        _, err = harness.communicate(timeout=30)
    finally:
        harness.kill()
    assert harness.returncode == 128 + 15, err
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not [ln for ln in left.splitlines() if re.match(prefix + r"(h[0-9]+|sw)\b", ln)]
    assert not list(Path("/etc/netns").glob(prefix + "h*"))
    assert not list(Path(tempfile.gettempdir()).glob(prefix + "-*"))
    assert _ranks_with(marker) == []


def _ompi_missing() -> str | None:
    if shutil.which("mpirun.openmpi") is None:
        return "Open MPI not installed (apt-get install openmpi-bin libopenmpi-dev)"
    if not (OMPI_VENV / "bin" / "python").exists():
        return f"no Open MPI venv at {OMPI_VENV} (run scripts/setup_openmpi.sh {OMPI_VENV})"
    return None


_NO_OMPI = _ompi_missing()


@pytest.mark.skipif(_NO_OMPI is not None, reason=str(_NO_OMPI))
@pytest.mark.parametrize("form", ["openmpi", "mpich"])
def test_two_hosts_openmpi(tmp_path, form):
    program = _python_probe("--expect-hosts", "2", python=str(OMPI_VENV / "bin" / "python"))
    run = run_harness(program, tmp_path, 2, 2, form, mpi="openmpi")
    probe = check_probe(run, 2, 2)
    assert probe["library"].startswith("Open MPI")
    # Open MPI form: mpirun reads the file itself; MPICH form: converted to -H.
    assert ("--hostfile" in run.stderr) == (form == "openmpi")
