"""Real multi-host runs on network namespaces (scripts/multihost.py).

Skipped unless root with working ``ip netns``. ``run_harness`` takes any program, so a
training run can use the same set-up; the probe tests here check that the Allreduce is
right, that each simulated host has its own hostname and /dev/shm, and that at least the
data an Allreduce must move really crossed the veth link.

FC-MNIST training runs through the harness on 2 hosts (both hostfile forms, 1 and 2 ranks
per host) and must reproduce, bit for bit, the loss trajectory and final parameters of a
single-host run at the same world size, global batch and node grid (see
``test_training_across_hosts`` for why bitwise).

Open MPI tests need a venv whose mpi4py links Open MPI, and the training test also needs
simdist in it: ``scripts/setup_openmpi.sh DIR`` (``scripts/ci_provision.sh`` builds
build/ompi-venv). SIMDIST_OMPI_VENV names the venv; otherwise build/ompi-venv in this
checkout (the default of both scripts).
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
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest
from mpi_launch import run_mpi
from test_train import final_state

from simdist.comm import ALGORITHMS
from simdist.events import read_events

REPO = Path(__file__).resolve().parents[1]
HARNESS = REPO / "scripts" / "multihost.py"
PROBE = ["tests/mpi/multihost_probe.py"]
MIB = 2**20


def _ompi_venv() -> Path:
    """SIMDIST_OMPI_VENV, else build/ompi-venv in this checkout (scripts/ci_provision.sh)."""
    if os.environ.get("SIMDIST_OMPI_VENV"):
        return Path(os.environ["SIMDIST_OMPI_VENV"])
    return REPO / "build" / "ompi-venv"


OMPI_VENV = _ompi_venv()


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


# ------------------------------------------------------------------ collectives across hosts


def test_segmented_collectives_across_hosts(tmp_path):
    """Over real TCP between hosts (2 x 2): the pieces of cross-node copies arrive whole
    and ring, rhd and hierarchical keep their bits (tests/mpi/check_segments.py; its node
    tables are virtual, the placement it runs on is real)."""
    run = run_harness([sys.executable, "tests/mpi/check_segments.py"], tmp_path, 2, 2,
                      timeout=300)  # fmt: skip
    assert run.code == 0, run.stdout + run.stderr
    assert "check_segments np=4:" in run.stdout and " 0 failures" in run.stdout, run.stdout


def test_bench_collectives_leaves_out_what_the_placement_cannot_run(tmp_path):
    """Across hosts, without --algorithms: shm (one node only) is skipped with a note, the
    others run; the CPU model and ISA flags are printed and recorded."""
    out = tmp_path / "bench.json"
    program = [
        sys.executable, "scripts/bench_collectives.py", "--ops", "allreduce", "--min", "64K",
        "--max", "64K", "--rounds", "1", "--warmup", "1", "--iters", "2", "--json", str(out),
    ]  # fmt: skip
    run = run_harness(program, tmp_path, 2, 1)
    assert run.code == 0, run.stdout + run.stderr
    assert "# skipped shm: the shm algorithm needs every rank on one node" in run.stdout
    data = json.loads(out.read_text())
    assert set(data["skipped"]) == {"shm"}
    ran = {r["algorithm"] for r in data["rows"]}
    assert ran == set(ALGORITHMS) - {"shm"}, ran
    cpu = data["machine"]["cpu"]
    assert cpu["model"] and cpu["flags"] and f"# CPU: {cpu['model']}" in run.stdout


def test_validate_sim_scores_the_collectives_across_hosts(tmp_path, monkeypatch):
    """validate_sim --hosts 2: the collective rows measured across two namespaced hosts
    (ring and rhd; shm, one node only, left out), each predicted from the probes run on
    its own buffer; the all-reduces also probe their second half (the Sendrecv after a
    reduce), and the kept probes give a link on which the model prices every case."""
    import importlib.util

    from simdist.device import CostModel, load_profile
    from simdist.device.schedule import schedule_time

    path = HARNESS.parent / "validate_sim.py"
    spec = importlib.util.spec_from_file_location("validate_sim", path)
    vs = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "validate_sim", vs)
    spec.loader.exec_module(vs)
    base = CostModel(load_profile("host")).link("intra", 2)
    out = tmp_path / "hosts.json"
    cmd = [sys.executable, "scripts/validate_sim.py", "--hosts", "2", "--launches", "1",
           "--worker-calls", "3", "--json", str(out)]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads(out.read_text())
    assert len(rows) == 3 * 2 * 3  # ops x (ring, rhd) x sizes
    assert {c["case"].split()[1] for c in rows} == {"ring", "rhd"}
    for row in rows:
        assert row["case"].endswith("np 2 (2 hosts)") and row["link_probed"], row
        assert row["predicted"] > 0 and row["measured"] > 0
        assert f"{row['case']}" in r.stdout
    kept = json.loads((tmp_path / "hosts.links" / "collectives-np2-0.json").read_text())
    for case in kept:
        rounds = case["link"]["rounds"]
        want = {"sendrecv", "reduce"} | ({"gather"} if case["op"] == "allreduce" else set())
        assert set(rounds) == want, case["op"]
        assert {len(v) for by_size in rounds.values() for v in by_size.values()} == {3}
        # each round's probes, taken between the hosts, make a link on which the model gives
        # them back at the case's block: the call overhead, the first half's probe, and for
        # an all-reduce the Sendrecv probed after a reduce
        half, lat = str(case["bytes"] // 2), case["link"]["latency"]
        first = "sendrecv" if case["op"] == "allgather" else "reduce"
        for k, link in enumerate(vs.case_links(case, base)):
            want = lat["call"] + rounds[first][half][k]
            if case["op"] == "allreduce":
                want += rounds["gather"][half][k]
            got = schedule_time(case["op"], case["algorithm"], [case["bytes"] // 2] * 2, link)
            assert got == pytest.approx(want, rel=1e-3), (case["op"], case["algorithm"], k)


# ------------------------------------------------------------------ training across hosts

TRAIN = [
    "-m", "simdist.train", "--model.hidden_sizes=[64, 32]", "--runconfig.max_steps=30",
    "--runconfig.save_summary_steps=5", "--train_input.batch_size=null",
    "--train_input.global_batch_size=48", "--runconfig.mode=train",
    "--runconfig.progress_bar=false",
]  # fmt: skip
STEPS = 30
LOGGED_STEPS = list(range(5, STEPS + 1, 5))
_LOSS_LINE = re.compile(r"^global_step = (\d+), loss = (\S+)$", re.MULTILINE)


def _train(model_dir: Path, python: str = sys.executable) -> list[str]:
    return [python, *TRAIN, f"--runconfig.model_dir={model_dir}"]


@dataclass
class Trained:
    """What a finished FC-MNIST run left: rank 0's log, its event file, its checkpoint."""

    losses: list[tuple[str, str]]  # (step, loss) as rank 0 printed them
    events: list[tuple[int, float]]  # (step, loss) from the event file: float32, not rounded
    state: tuple[dict, dict]  # final parameters, optimizer state
    event_host: str  # hostname in the event file's name: where rank 0 ran
    algorithm: str = ""  # the gradient collectives "auto" chose (from rank 0's log)

    @property
    def nparams(self) -> int:
        return sum(v.size for v in self.state[0].values())


def _gradient_algorithm(log: str) -> str:
    found = re.findall(r"gradient collectives: (\S+)", log)
    assert len(found) == 1, log
    return found[0]


def _trained(log: str, model_dir: Path) -> Trained:
    losses = _LOSS_LINE.findall(log)
    # Printed once (by rank 0) per summary step: a second copy would mean two "rank 0"s.
    assert [int(s) for s, _ in losses] == LOGGED_STEPS, log
    files = list(model_dir.glob("events.out.tfevents.*"))
    assert len(files) == 1, files
    events = [(step, v) for step, tag, v in read_events(files[0]) if tag == "loss"]
    host = files[0].name.split(".", 4)[4]  # events.out.tfevents.<time>.<hostname>
    return Trained(losses, events, final_state(model_dir), host)


@pytest.fixture(scope="module")
def single_host(tmp_path_factory):
    """``get(world, ranks_per_node)``: the single-host MPICH run at that world size, with that
    many ranks per virtual node (None: one node), made once, on first use."""
    runs: dict[tuple[int, int | None], Trained] = {}

    def get(world: int, ranks_per_node: int | None = None) -> Trained:
        key = (world, ranks_per_node)
        if key not in runs:
            d = tmp_path_factory.mktemp(f"single_host_np{world}") / "run"
            extra = (
                [] if ranks_per_node is None else [f"--runconfig.ranks_per_node={ranks_per_node}"]
            )
            r = run_mpi(world, [*_train(d)[1:], *extra], timeout=180)
            assert r.returncode == 0, r.stdout
            runs[key] = _trained(r.stdout, d)
            runs[key].algorithm = _gradient_algorithm(r.stdout)
        return runs[key]

    return get


def _show_bytes(capsys: pytest.CaptureFixture[str], label: str, run: HarnessRun) -> None:
    """Put the harness's byte counts into the test log even when pytest captures output."""
    lines = [ln for ln in run.stderr.splitlines() if ln.startswith("multihost: sdmh")]
    lines += [ln for ln in run.stderr.splitlines() if "crossed the links" in ln]
    with capsys.disabled():
        print(f"\n[{label}] " + (" | ".join(lines) or "no byte counts: " + run.stderr[-2000:]))


def _train_across_hosts(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    ref: Trained,
    form: str,
    ranks_per_host: int,
    mpi: str = "mpich",
    python: str = sys.executable,
) -> tuple[Trained, HarnessRun]:
    """Train on 2 hosts; check the bytes; return the run's results for comparison."""
    # Each step every host needs the other host's contribution to every gradient element,
    # and the buffers are sent uncompressed: >= 4 bytes per parameter per step into each
    # host, whatever the algorithm. Shared memory between "hosts" would carry it instead.
    per_link = STEPS * 4 * ref.nparams
    d = tmp_path / "run"
    run = run_harness(
        _train(d, python), tmp_path, 2, ranks_per_host, form, mpi,
        extra=("--require-bytes", str(2 * per_link)), timeout=150,
    )  # fmt: skip
    _show_bytes(capsys, f"{mpi}, {form} hostfile, 2 hosts x {ranks_per_host}", run)
    assert run.code == 0, run.stdout + run.stderr
    for link in run.report["links"]:
        assert link["rx_bytes"] >= per_link, (link, per_link)
    got = _trained(run.stdout, d)
    got.algorithm = _gradient_algorithm(run.stdout)
    # Rank 0 ran in the first host's namespaces and its model_dir under /tmp is the one this
    # process sees (the per-host mount namespaces only replace /dev/shm).
    assert got.event_host == run.report["hosts"][0]
    return got, run


def _assert_same_training(got: Trained, ref: Trained) -> None:
    assert got.losses == ref.losses, f"loss trajectory differs:\n{got.losses}\n{ref.losses}"
    assert got.events == ref.events
    for which, name in ((0, "parameter"), (1, "optimizer state")):
        a, b = got.state[which], ref.state[which]
        assert a.keys() == b.keys()
        for k in a:
            diff = float(np.max(np.abs(a[k] - b[k])))
            assert np.array_equal(a[k], b[k]), f"{name} {k} differs by up to {diff:.3e}"


@pytest.mark.parametrize(
    ("form", "ranks_per_host"), [("mpich", 2), ("openmpi", 2), ("mpich", 1), ("openmpi", 1)]
)
def test_training_across_hosts(tmp_path, capsys, single_host, form, ranks_per_host):
    """FC-MNIST on 2 hosts trains exactly like one host with the same grid: bitwise.

    Tolerance zero, because nothing in the arithmetic depends on where the ranks run, only
    on the grid of nodes x ranks per node: the sampler gives each rank the same samples (a
    function of rank and world size), "auto" picks the gradient algorithm from buffer
    size, world size and that grid (``comm.cost``), simdist's ring, rhd and hierarchical
    sum every element in an order fixed by the grid and the block's owner (MPI only moves
    the bytes), and the logged loss is summed in rank order. With 2 ranks per host "auto"
    picks the hierarchical all-reduce; the single-host reference then runs it on virtual
    nodes of 2 ranks (``runconfig.ranks_per_node``), and a real 2-host run must match it
    bit for bit. With 1 rank per host the grid is flat: "rhd" on both (the reference on
    virtual nodes of 1 rank, as one host would otherwise choose its shared-memory "shm").
    """
    ref = single_host(2 * ranks_per_host, ranks_per_host)
    got, _ = _train_across_hosts(tmp_path, capsys, ref, form, ranks_per_host)
    assert got.algorithm == ref.algorithm == ("hierarchical" if ranks_per_host == 2 else "rhd")
    _assert_same_training(got, ref)


def test_tensor_parallel_weight_mode_x_pipeline_across_hosts(tmp_path):
    """gpt2-mini, TP 2 (weight mode) x PP 2 on 2 hosts x 2 ranks: each stage's group sits
    on one host (its collectives stay inside), the pipeline's activations cross the link,
    and the run equals the single-host one on virtual nodes of 2 bit for bit (loss lines,
    checkpoint). Placement says so at start-up."""
    args = [
        "-m", "simdist.train", "--params=gpt2_mini", "--runconfig.max_steps=3",
        "--train_input.batch_size=1", "--optimizer.grad_accum_steps=2",
        "--tensor-parallel=2", "--tensor-parallel-mode=weight", "--pipeline-parallel=2",
        "--runconfig.save_summary_steps=1", "--runconfig.mode=train",
        "--runconfig.progress_bar=false",
    ]  # fmt: skip
    ref_dir = tmp_path / "one" / "run"
    ref = run_mpi(
        4, [*args, f"--runconfig.model_dir={ref_dir}", "--runconfig.ranks_per_node=2"], 240
    )
    assert ref.returncode == 0, ref.stdout
    d = tmp_path / "two" / "run"
    d.parent.mkdir()
    run = run_harness([sys.executable, *args, f"--runconfig.model_dir={d}"], tmp_path / "two",
                      2, 2, "mpich", timeout=240)  # fmt: skip
    assert run.code == 0, run.stdout + run.stderr
    assert "groups of 2 ranks on one node: [0, 1] [2, 3]" in run.stdout
    losses = [ln for ln in run.stdout.splitlines() if ln.startswith("global_step = ")]
    assert len(losses) == 3 and losses == [
        ln for ln in ref.stdout.splitlines() if ln.startswith("global_step = ")
    ]
    a, b = final_state(ref_dir), final_state(d)
    for which in (0, 1):
        assert a[which].keys() == b[which].keys()
        assert all(np.array_equal(a[which][k], b[which][k]) for k in a[which])


def _ompi_training_missing() -> str | None:
    """Why the Open MPI venv cannot run simdist training like the MPICH venv, if it cannot."""
    missing = _ompi_missing()
    if missing:
        return missing
    # The same numpy/numba as here, or bitwise equality with the MPICH run is not expected.
    code = (
        "import sys; from importlib import metadata as m, util; s = util.find_spec('simdist');"
        "print(s.origin if s else None, *(m.version(d) for d in sys.argv[1:]))"
    )
    dists = ("numpy", "numba", "scipy", "h5py", "tqdm", "safetensors")
    r = subprocess.run([str(OMPI_VENV / "bin" / "python"), "-c", code, *dists],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    fix = f"run scripts/setup_openmpi.sh {OMPI_VENV}"
    if r.returncode != 0:
        return f"Open MPI venv {OMPI_VENV} lacks one of {', '.join(dists)} ({fix})"
    origin, *versions = r.stdout.split()
    if not origin.startswith(str(REPO) + "/"):
        return f"Open MPI venv {OMPI_VENV} has no simdist from {REPO} ({fix})"
    ours = [metadata.version(d) for d in dists]
    if versions != ours:
        return f"Open MPI venv has {versions} of {dists}, this venv {ours} ({fix})"
    return None


_NO_OMPI_TRAINING = _ompi_training_missing() if _NO_NETNS is None else _NO_NETNS


@pytest.mark.skipif(_NO_OMPI_TRAINING is not None, reason=str(_NO_OMPI_TRAINING))
def test_training_on_openmpi(tmp_path, capsys, single_host):
    """FC-MNIST on Open MPI, 2 hosts x 2 ranks: bitwise the single-host MPICH run on virtual
    nodes of 2 (both run the hierarchical all-reduce).

    Same argument as test_training_across_hosts, plus: the MPI library never adds (simdist's
    algorithms use point-to-point messages), and the Open MPI venv has the same numpy and
    numba (scripts/setup_openmpi.sh pins them).
    """
    python = str(OMPI_VENV / "bin" / "python")
    got, run = _train_across_hosts(tmp_path, capsys, single_host(4), "openmpi", 2, "openmpi",
                                   python)  # fmt: skip
    assert "mpirun.openmpi" in run.stderr and "--hostfile" in run.stderr
    ref = single_host(4, 2)
    assert got.algorithm == ref.algorithm == "hierarchical"
    _assert_same_training(got, ref)
