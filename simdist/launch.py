"""simdist-run: start a simdist program on MPICH, Open MPI or Slurm, the way Horovod does.

    simdist-run [-np N] [--hostfile F | --host a:2,b:2] [--oversubscribe]
                [--mpi auto|mpich|openmpi|slurm] [-x VAR[=VAL]] [--mpi-args "..."]
                [--dry-run] -- python -m simdist.train ...

The hostfile (Open MPI or MPICH form, see ``simdist.hostfile``) is parsed and checked here,
then handed on in the form the chosen launcher reads: hydra gets ``-hosts a:2,b:2``
because its own ``-f`` parser accepts neither ``slots=`` nor trailing comments; Open MPI
gets the file itself when it is in Open MPI form (it alone understands ``max_slots``), and
``-H`` otherwise. Python programs run as ``python -m mpi4py ...`` so an uncaught exception
on one rank aborts the whole job instead of leaving the others blocked in a collective.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from simdist.hostfile import Host, HostfileError, check_rank_count, load_hostfile, parse_host_list

# Thread pins that `import simdist` sets in this process; passed on explicitly because a
# launcher does not forward the environment to remote hosts by itself (Open MPI) or because
# a site's hydra may be configured not to.
PINNED_ENV = ("NUMBA_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
MPI_KINDS = ("mpich", "openmpi", "slurm")

_PYTHON = re.compile(r"python[0-9.]*")
_PY_OPTS_WITH_VALUE = {"-W", "-X", "--check-hash-based-pycs"}


class LaunchError(RuntimeError):
    """The launch cannot be planned (unknown MPI, missing rank count, ...)."""


@dataclass
class LaunchSpec:
    """What to launch, independent of the MPI implementation."""

    program: list[str]
    nranks: int | None = None
    hosts: list[Host] | None = None
    hostfile: str | None = None  # set when Open MPI can read it as is (its form or bare names)
    oversubscribe: bool = False
    exports: list[tuple[str, str]] = field(default_factory=list)
    extra_args: list[str] = field(default_factory=list)


def detect_mpi(mpiexec: str, env: Mapping[str, str]) -> str:
    """``slurm`` inside a Slurm job, else what ``mpiexec --version`` says it is."""
    if env.get("SLURM_JOB_ID"):
        return "slurm"
    try:
        out = subprocess.run(
            [mpiexec, "--version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise LaunchError(f"cannot run '{mpiexec} --version' to detect the MPI: {e}") from None
    text = out.stdout + out.stderr
    # Same markers as Horovod's runner; Open MPI first because its banner never says HYDRA.
    if "Open MPI" in text or "OpenRTE" in text:
        return "openmpi"
    if "HYDRA" in text or "MPICH" in text:
        return "mpich"
    first = text.strip().splitlines()[0] if text.strip() else "no output"
    raise LaunchError(
        f"'{mpiexec} --version' is neither MPICH/hydra nor Open MPI ({first!r}); "
        "pass --mpi mpich|openmpi|slurm"
    )


def mpi4py_wrap(program: Sequence[str]) -> list[str]:
    """Insert ``-m mpi4py`` before the script/module/-c of a python command line."""
    prog = list(program)
    if not prog or not _PYTHON.fullmatch(os.path.basename(prog[0])):
        return prog
    i = 1
    while i < len(prog):
        arg = prog[i]
        if arg.startswith(("-m", "-c")) and len(arg) > 2:  # -mpkg, -cCODE
            prog[i : i + 1] = [arg[:2], arg[2:]]
            arg = arg[:2]
        if arg in ("-m", "-c", "-") or not arg.startswith("-"):
            break
        i += 2 if arg in _PY_OPTS_WITH_VALUE else 1
    else:
        return prog  # interactive interpreter: nothing to wrap
    if prog[i : i + 2] == ["-m", "mpi4py"]:
        return prog
    return prog[:i] + ["-m", "mpi4py"] + prog[i:]


def _host_list(hosts: list[Host]) -> str:
    return ",".join(f"{h.name}:{h.slots}" for h in hosts)


def build_command(
    mpi: str, spec: LaunchSpec, mpiexec: str | None = None, euid: int = 0
) -> list[str]:
    """The launcher command line for ``mpi`` (one of MPI_KINDS); pure, for tests."""
    program = mpi4py_wrap(spec.program)
    if spec.nranks is None and mpi != "slurm":
        raise LaunchError("give -np N, or --hostfile/--host to run one rank per slot")
    if mpi == "mpich":
        cmd = [mpiexec or "mpiexec"]
        if spec.hosts:
            cmd += ["-hosts", _host_list(spec.hosts)]
        for key, value in spec.exports:
            cmd += ["-genv", key, value]
        # hydra has no notion of oversubscription: it wraps around the host list.
        return cmd + spec.extra_args + ["-n", str(spec.nranks)] + program
    if mpi == "openmpi":
        cmd = [mpiexec or "mpirun"]
        if euid == 0:
            cmd.append("--allow-run-as-root")
        if spec.hostfile:
            cmd += ["--hostfile", spec.hostfile]
        elif spec.hosts:
            cmd += ["-H", _host_list(spec.hosts)]
        cmd += ["-np", str(spec.nranks)]
        if spec.oversubscribe:
            cmd.append("--oversubscribe")
        # Fill each host's slots in order (MPICH's placement) and leave binding to the OS:
        # several simulated devices share a core by design.
        cmd += ["--map-by", "slot", "--bind-to", "none"]
        for key, value in spec.exports:
            cmd += ["-x", f"{key}={value}"]
        return cmd + spec.extra_args + program
    if mpi == "slurm":
        cmd = [mpiexec or "srun"]
        if spec.nranks is not None:
            cmd += ["-n", str(spec.nranks)]
        if spec.hosts:
            per_host = {h.slots for h in spec.hosts}
            if len(per_host) != 1:
                raise LaunchError(
                    f"srun cannot place different rank counts per host ({_host_list(spec.hosts)}); "
                    "give every host the same slots or use --mpi mpich|openmpi"
                )
            cmd += ["--nodelist", ",".join(h.name for h in spec.hosts)]
            cmd += ["--ntasks-per-node", str(per_host.pop())]
        if spec.oversubscribe:
            cmd.append("--overcommit")
        if spec.exports:
            cmd.append("--export=ALL," + ",".join(f"{k}={v}" for k, v in spec.exports))
        return cmd + spec.extra_args + program
    raise LaunchError(f"unknown MPI kind {mpi!r}; expected one of {', '.join(MPI_KINDS)}")


def _parse_exports(items: Sequence[str], env: Mapping[str, str]) -> list[tuple[str, str]]:
    """PINNED_ENV as set here, then each ``-x VAR[=VAL]`` (a later one wins)."""
    exports = {k: env[k] for k in PINNED_ENV if k in env}
    for item in items:
        key, sep, value = item.partition("=")
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise LaunchError(f"-x {item!r}: not an environment variable name")
        if not sep:
            if key not in env:
                raise LaunchError(f"-x {key}: not set here; write -x {key}=VALUE")
            value = env[key]
        exports[key] = value
    return list(exports.items())


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="simdist-run",
        description="Launch a simdist program with mpiexec (MPICH), mpirun (Open MPI) or srun.",
        epilog="example: simdist-run -np 4 --hostfile hostfiles/mpich.hosts -- "
        "python -m simdist.train",
        allow_abbrev=False,
    )
    p.add_argument("-np", "-n", dest="nranks", type=int, help="ranks (default: all slots)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--hostfile", "-f", help="Open MPI (host slots=N) or MPICH (host:N) file")
    where.add_argument("--host", "-H", help="comma list like a:2,b:2 (bare name = 1 slot)")
    p.add_argument("--oversubscribe", action="store_true", help="allow more ranks than slots")
    p.add_argument("--mpi", choices=("auto", *MPI_KINDS), default="auto")
    p.add_argument("--mpiexec", help="launcher executable (default: mpiexec, mpirun or srun)")
    p.add_argument(
        "-x", dest="exports", action="append", default=[], metavar="VAR[=VAL]",
        help="environment variable for every rank (repeatable)",
    )  # fmt: skip
    p.add_argument(
        "--mpi-args", action="append", default=[], metavar="ARGS",
        help="extra launcher arguments, shell-quoted (repeatable)",
    )  # fmt: skip
    p.add_argument("--dry-run", action="store_true", help="print the command, do not run it")
    return p


def plan(argv: Sequence[str], env: Mapping[str, str], euid: int) -> tuple[list[str], bool]:
    """Parse simdist-run arguments; return (command, dry_run)."""
    argv = list(argv)
    if "--" in argv:
        cut = argv.index("--")
        opts, program = argv[:cut], argv[cut + 1 :]
    else:
        opts, program = argv, []
    args = make_parser().parse_args(opts)
    if not program:
        raise LaunchError("no program given; put it after --, e.g. -- python -m simdist.train")
    spec = LaunchSpec(program=program, nranks=args.nranks, oversubscribe=args.oversubscribe)
    if args.hostfile:
        spec.hosts, form = load_hostfile(args.hostfile)
        if form != "mpich":
            spec.hostfile = args.hostfile
        source = args.hostfile
    elif args.host:
        spec.hosts, source = parse_host_list(args.host), "--host"
    if spec.hosts:
        if spec.nranks is None:
            spec.nranks = sum(h.slots for h in spec.hosts)
        check_rank_count(spec.hosts, spec.nranks, spec.oversubscribe, source)
    elif spec.nranks is not None and spec.nranks < 1:
        raise LaunchError(f"-np must be at least 1, got {spec.nranks}")
    spec.exports = _parse_exports(args.exports, env)
    spec.extra_args = [a for s in args.mpi_args for a in shlex.split(s)]
    mpi = args.mpi
    if mpi == "auto":
        mpi = detect_mpi(args.mpiexec or "mpiexec", env)
    return build_command(mpi, spec, args.mpiexec, euid), args.dry_run


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``simdist-run`` / ``python -m simdist.launch``."""
    try:
        cmd, dry_run = plan(sys.argv[1:] if argv is None else argv, os.environ, os.geteuid())
    except (HostfileError, LaunchError) as e:
        print(f"simdist-run: error: {e}", file=sys.stderr)
        return 2
    if dry_run:
        print(shlex.join(cmd))
        return 0
    print(f"simdist-run: {shlex.join(cmd)}", file=sys.stderr, flush=True)
    try:
        os.execvp(cmd[0], cmd)
    except OSError as e:
        print(f"simdist-run: error: cannot run {cmd[0]}: {e.strerror}", file=sys.stderr)
    return 127


if __name__ == "__main__":
    sys.exit(main())
