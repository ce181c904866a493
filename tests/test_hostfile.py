"""Hostfile / --host parsing and the simdist-run command lines (no cluster needed)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from simdist.hostfile import (
    Host,
    HostfileError,
    check_rank_count,
    load_hostfile,
    parse_host_list,
    parse_hostfile,
    parse_hostfile_text,
)
from simdist.launch import LaunchError, detect_mpi, mpi4py_wrap, plan

REPO = Path(__file__).resolve().parents[1]
PINS = ["NUMBA_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"]
ENV = {k: "1" for k in PINS}


# --- parsing -------------------------------------------------------------------------------


def test_openmpi_form_with_comments_and_max_slots():
    text = """# cluster
node1 slots=4   # first

node2 slots = 2 max_slots=6
  node3
"""
    assert parse_hostfile_text(text) == [
        Host("node1", 4),
        Host("node2", 2, 6),
        Host("node3", 1),
    ]


def test_mpich_form_and_bare_names():
    text = "node1:4\nnode2:2 # two\n\nnode3\n"
    assert parse_hostfile_text(text) == [Host("node1", 4), Host("node2", 2), Host("node3", 1)]


def test_forms_are_reported():
    assert load_hostfile(REPO / "hostfiles/openmpi.hosts")[1] == "openmpi"
    assert load_hostfile(REPO / "hostfiles/mpich.hosts")[1] == "mpich"


def test_shipped_examples_parse():
    assert parse_hostfile(REPO / "hostfiles/openmpi.hosts") == [
        Host("node1", 4),
        Host("node2", 4, 8),
    ]
    assert parse_hostfile(REPO / "hostfiles/mpich.hosts") == [Host("node1", 4), Host("node2", 4)]


def test_repeated_bare_names_add_one_slot_each():
    # PBS node-file style, as Open MPI and hydra both read it; order of first appearance.
    assert parse_hostfile_text("a\nb\na\na\n") == [Host("a", 3), Host("b", 1)]
    assert parse_host_list("a,b:2,a") == [Host("a", 2), Host("b", 2)]


def test_max_slots_alone_gives_that_many_slots():
    assert parse_hostfile_text("a max_slots=3") == [Host("a", 3, 3)]


def test_host_list():
    assert parse_host_list("worker-0:2,worker-1:2") == [Host("worker-0", 2), Host("worker-1", 2)]
    assert parse_host_list(" a , 10.0.0.2:3 ") == [Host("a", 1), Host("10.0.0.2", 3)]


# Each malformed input, the line (or --host entry) the error must name, and a phrase of it.
MALFORMED = [
    ("a:0", "hf:1:", "slot count must be at least 1, got 0"),
    ("a:-2", "hf:1:", "slot count must be at least 1, got -2"),
    ("a slots=0", "hf:1:", "slots must be at least 1, got 0"),
    ("a slots=-1", "hf:1:", "slots must be at least 1, got -1"),
    ("a max_slots=0", "hf:1:", "max_slots must be at least 1, got 0"),
    ("a:x", "hf:1:", "slot count must be an integer, got 'x'"),
    ("a slots=four", "hf:1:", "slots must be an integer, got 'four'"),
    ("a slots=", "hf:1:", "slots must be an integer, got ''"),
    ("a:", "hf:1:", "bad syntax 'a:', expected host or host:N"),
    ("a:1:2", "hf:1:", "bad syntax 'a:1:2'"),
    ("# c\na:2 b:2", "hf:2:", "unexpected 'b:2' after 'a:2'"),
    ("a cpus=2", "hf:1:", "bad syntax 'cpus=2', expected slots=N or max_slots=M"),
    ("a b", "hf:1:", "bad syntax 'b'"),
    ("a slots=2 slots=3", "hf:1:", "slots given twice"),
    ("a slots=4 max_slots=2", "hf:1:", "max_slots=2 is less than slots=4"),
    ("user@a slots=2", "hf:1:", "bad host name 'user@a'"),
    ("-np:2", "hf:1:", "bad host name '-np'"),
    (
        "a slots=2\n\nb:2",
        "hf:3:",
        "mpich form 'b:2' in a file that uses the openmpi form since hf:1",
    ),
    ("a:2\nb slots=2", "hf:2:", "openmpi form 'b slots=2' in a file that uses the mpich form"),
    ("a slots=4\nb slots=1\na slots=2", "hf:3:", "host 'a' is already listed at hf:1 (slots=4)"),
    ("a slots=2\na slots=2", "hf:2:", "host 'a' is already listed at hf:1 (slots=2), here with"),
    ("a:2\na", "hf:2:", "host 'a' is already listed at hf:1"),
    ("a\na:2", "hf:2:", "host 'a' is already listed at hf:1 (slots=1), here with slots=2"),
    ("# only comments\n\n", "hf:", "no hosts listed"),
]


@pytest.mark.parametrize(("text", "where", "phrase"), MALFORMED)
def test_malformed_hostfile_names_the_line(text, where, phrase):
    with pytest.raises(HostfileError) as e:
        parse_hostfile_text(text, "hf")
    assert str(e.value).startswith(where), str(e.value)
    assert phrase in str(e.value)


@pytest.mark.parametrize(
    ("spec", "phrase"),
    [
        ("a,,b", "--host entry 2 (''): empty entry"),
        ("a:0", "--host entry 1 ('a:0'): slot count must be at least 1, got 0"),
        ("a,b:x", "--host entry 2 ('b:x'): slot count must be an integer"),
        ("a:2,a:2", "--host entry 2 ('a:2'): host 'a' is already listed at --host entry 1"),
        ("a slots=2", "--host entry 1 ('a slots=2'): bad host name"),
    ],
)
def test_malformed_host_list(spec, phrase):
    with pytest.raises(HostfileError, match="^" + re.escape(phrase)):
        parse_host_list(spec)


def test_missing_file(tmp_path):
    with pytest.raises(HostfileError, match="cannot read hostfile: No such file"):
        parse_hostfile(tmp_path / "nope")


def test_rank_count_checks():
    hosts = [Host("a", 2), Host("b", 2)]
    check_rank_count(hosts, 4, False)
    with pytest.raises(HostfileError, match=r"-np 5 exceeds the 4 slots in hosts \(a:2,b:2\)"):
        check_rank_count(hosts, 5, False)
    check_rank_count(hosts, 9, True)
    capped = [Host("a", 2, 3), Host("b", 2, 4)]
    check_rank_count(capped, 7, True)
    with pytest.raises(HostfileError, match="exceeds the 7 max_slots"):
        check_rank_count(capped, 8, True)
    with pytest.raises(HostfileError, match="at least 1"):
        check_rank_count(hosts, 0, False)


# --- command lines -------------------------------------------------------------------------

TRAIN = ["python", "-m", "simdist.train", "--steps", "3"]
WRAPPED = ["python", "-m", "mpi4py", "-m", "simdist.train", "--steps", "3"]


def _plan(args: list[str], env: dict[str, str] | None = None, euid: int = 0) -> list[str]:
    cmd, dry = plan(args, ENV if env is None else env, euid)
    assert dry == ("--dry-run" in args)
    return cmd


@pytest.mark.parametrize(
    ("program", "wrapped"),
    [
        (TRAIN, WRAPPED),
        (["python3", "train.py", "-x"], ["python3", "-m", "mpi4py", "train.py", "-x"]),
        (
            ["/v/bin/python3.11", "-u", "-X", "dev", "-mfoo"],
            ["/v/bin/python3.11", "-u", "-X", "dev", "-m", "mpi4py", "-m", "foo"],
        ),
        (["python", "-c", "print(1)"], ["python", "-m", "mpi4py", "-c", "print(1)"]),
        (["python", "-m", "mpi4py", "t.py"], ["python", "-m", "mpi4py", "t.py"]),
        (["hostname"], ["hostname"]),
        (["python"], ["python"]),
    ],
)
def test_mpi4py_wrap(program, wrapped):
    assert mpi4py_wrap(program) == wrapped


def test_mpich_from_openmpi_hostfile():
    cmd = _plan(
        ["--mpi", "mpich", "--hostfile", str(REPO / "hostfiles/openmpi.hosts"), "--", *TRAIN]
    )
    genv = [x for k in PINS for x in ("-genv", k, "1")]
    assert cmd == ["mpiexec", "-hosts", "node1:4,node2:4", *genv, "-n", "8", *WRAPPED]


def test_openmpi_gets_its_own_file_and_root_flag():
    hf = str(REPO / "hostfiles/openmpi.hosts")
    cmd = _plan(["--mpi", "openmpi", "-np", "6", "--hostfile", hf, "-x", "FOO=bar", "--", *TRAIN])
    exports = [x for k in PINS for x in ("-x", f"{k}=1")] + ["-x", "FOO=bar"]
    assert cmd == [
        "mpirun", "--allow-run-as-root", "--hostfile", hf, "-np", "6",
        "--map-by", "slot", "--bind-to", "none", *exports, *WRAPPED,
    ]  # fmt: skip
    as_user = _plan(["--mpi", "openmpi", "-np", "6", "--hostfile", hf, "--", *TRAIN], euid=1000)
    assert "--allow-run-as-root" not in as_user


def test_openmpi_from_mpich_hostfile_uses_H_and_oversubscribe():
    hf = str(REPO / "hostfiles/mpich.hosts")
    cmd = _plan(
        ["--mpi", "openmpi", "-np", "10", "--oversubscribe", "--hostfile", hf, "--", *TRAIN]
    )
    assert cmd[:7] == ["mpirun", "--allow-run-as-root", "-H", "node1:4,node2:4", "-np", "10",
                       "--oversubscribe"]  # fmt: skip


def test_host_list_mpich_and_openmpi():
    mpich = _plan(["--mpi", "mpich", "--host", "a:2,b:2", "--", *TRAIN], env={})
    assert mpich == ["mpiexec", "-hosts", "a:2,b:2", "-n", "4", *WRAPPED]
    ompi = _plan(["--mpi", "openmpi", "-H", "a,b", "--mpiexec", "mpirun.openmpi", "--", *TRAIN], {})
    assert ompi[:6] == ["mpirun.openmpi", "--allow-run-as-root", "-H", "a:1,b:1", "-np", "2"]


def test_slurm_detected_from_environment():
    env = {**ENV, "SLURM_JOB_ID": "42"}
    assert _plan(["--", *TRAIN], env) == [
        "srun", "--export=ALL," + ",".join(f"{k}=1" for k in PINS), *WRAPPED,
    ]  # fmt: skip
    cmd = _plan(["--host", "a:2,b:2", "-x", "U=1", "--", *TRAIN], {"SLURM_JOB_ID": "42"})
    assert cmd == ["srun", "-n", "4", "--nodelist", "a,b", "--ntasks-per-node", "2",
                   "--export=ALL,U=1", *WRAPPED]  # fmt: skip
    with pytest.raises(LaunchError, match="srun cannot place different rank counts"):
        _plan(["--host", "a:2,b:1", "--", *TRAIN], {"SLURM_JOB_ID": "42"})


def test_mpi_args_are_split_and_kept_before_the_program():
    cmd = _plan(
        ["--mpi", "mpich", "-np", "2", "--mpi-args", "-iface 'eth 0'", "--", "hostname"], {}
    )
    assert cmd == ["mpiexec", "-iface", "eth 0", "-n", "2", "hostname"]


@pytest.mark.parametrize(
    ("args", "phrase"),
    [
        (["--mpi", "mpich", "--", "hostname"], "give -np N, or --hostfile/--host"),
        (["--mpi", "mpich", "-np", "2"], "no program given"),
        (["--mpi", "mpich", "-np", "5", "--host", "a:2,b:2", "--", "x"], "exceeds the 4 slots"),
        (["--mpi", "mpich", "-np", "1", "-x", "NOT_SET_ANYWHERE", "--", "x"], "not set here"),
        (["--mpi", "mpich", "-np", "1", "-x", "1BAD=2", "--", "x"], "not an environment variable"),
    ],
)
def test_launch_errors(args, phrase):
    with pytest.raises((LaunchError, HostfileError), match=phrase):
        _plan(args, env={})


def _fake_mpiexec(tmp_path: Path, banner: str) -> str:
    exe = tmp_path / "mpiexec"
    exe.write_text(f"#!/bin/sh\necho '{banner}'\n")
    exe.chmod(0o755)
    return str(exe)


@pytest.mark.parametrize(
    ("banner", "kind"),
    [
        ("HYDRA build details:", "mpich"),
        ("mpirun (Open MPI) 4.1.4", "openmpi"),
        ("mpirun.openmpi (OpenRTE) 4.1.4", "openmpi"),
    ],
)
def test_detect_mpi_from_version_banner(tmp_path, banner, kind):
    assert detect_mpi(_fake_mpiexec(tmp_path, banner), {}) == kind


def test_detect_mpi_unknown(tmp_path):
    with pytest.raises(LaunchError, match="neither MPICH/hydra nor Open MPI"):
        detect_mpi(_fake_mpiexec(tmp_path, "Some Other MPI 1.0"), {})
    with pytest.raises(LaunchError, match="cannot run"):
        detect_mpi(str(tmp_path / "missing"), {})


# --- the real command-line tool --------------------------------------------------------------


def _run(args: list[str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
    return subprocess.run([sys.executable, "-m", "simdist.launch", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO, env=env)  # fmt: skip


def test_cli_dry_run_detects_the_venv_mpich():
    r = _run(["--dry-run", "--host", "localhost:2", "--", "python", "-m", "simdist.train"])
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("mpiexec -hosts localhost:2 -genv NUMBA_NUM_THREADS 1")
    assert r.stdout.rstrip().endswith("-n 2 python -m mpi4py -m simdist.train")


def test_cli_error_exit_code_and_message(tmp_path):
    hf = tmp_path / "bad.hosts"
    hf.write_text("a slots=2\nb:2\n")
    r = _run(["--dry-run", "--hostfile", str(hf), "--", "hostname"])
    assert r.returncode == 2
    assert r.stderr.startswith(f"simdist-run: error: {hf}:2: mpich form")


@pytest.mark.skipif(not Path(sys.executable).with_name("mpiexec").exists(), reason="no mpiexec")
def test_cli_runs_and_one_failing_rank_aborts_the_job():
    # One rank prints: hydra merges the ranks' streams in arbitrary chunks.
    code = "from mpi4py import MPI; c = MPI.COMM_WORLD; r = c.gather(c.rank); c.rank or print(r)"
    ok = _run(["-np", "2", "--host", "localhost:2", "--", sys.executable, "-c", code])
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout == "[0, 1]\n"
    assert ok.stderr.startswith("simdist-run: mpiexec")
    # Rank 1 fails while rank 0 waits in a barrier: without -m mpi4py this would hang.
    bad = (
        "from mpi4py import MPI; c = MPI.COMM_WORLD\nif c.rank: raise ValueError('x')\nc.Barrier()"
    )
    r = _run(["-np", "2", "--", sys.executable, "-c", bad], timeout=30)
    assert r.returncode != 0
    assert "ValueError" in r.stderr
