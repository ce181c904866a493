"""Hostfiles and ``--host`` lists for MPI launches.

Two hostfile forms are accepted, one per file (``#`` starts a comment, blank lines are
skipped, a bare ``host`` line means one slot and fits either form):

* Open MPI: ``node1 slots=4 [max_slots=8]``
* MPICH (hydra machinefile): ``node1:4``

``--host`` lists use the Horovod/Open MPI ``-H`` spelling: ``node1:4,node2:4,node3``.

Repeated hosts follow what Open MPI 4.1.4 does (checked with mpirun.openmpi): a bare name
repeated N times is one host with N slots (PBS node files list a host once per core), but
a host whose line gives a count (``slots=N``, ``host:N``) may appear only once -- Open MPI
refuses a second definition ("multiple definitions of the slot count"), also when the two
lines agree or one of them is bare. The same rule is applied to the MPICH form and to
``--host`` (where Open MPI would sum ``a:1,a:2``), so a list means the same whichever MPI
runs it, and a half-edited file (``a slots=4`` ... ``a slots=2``) stops with both line
numbers instead of silently placing 6 ranks on a 4-core node.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

# Horovod checks -H entries against [\w.-]+; a leading '-' would read as an mpirun option.
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", re.ASCII)
_INT = re.compile(r"[+-]?[0-9]+")
_OMPI_KEYS = {"slots": "slots", "max_slots": "max_slots", "max-slots": "max_slots"}


class HostfileError(ValueError):
    """A hostfile, ``--host`` list or rank count that cannot be used; says where."""


@dataclass(frozen=True)
class Host:
    """One host and how many ranks it takes (``max_slots``: Open MPI's hard cap, if set)."""

    name: str
    slots: int
    max_slots: int | None = None


@dataclass(frozen=True)
class _Entry:
    host: Host
    form: str | None  # "openmpi", "mpich", or None for a bare name (fits both)
    where: str  # "file:line" or "--host entry N", for error messages


def _count(text: str, what: str, where: str) -> int:
    if not _INT.fullmatch(text):
        raise HostfileError(f"{where}: {what} must be an integer, got {text!r}")
    n = int(text)
    if n <= 0:
        raise HostfileError(f"{where}: {what} must be at least 1, got {n}")
    return n


def _name(text: str, where: str) -> str:
    if not _NAME.fullmatch(text):
        raise HostfileError(
            f"{where}: bad host name {text!r} (letters, digits, '.', '_', '-'; "
            "user@host and IPv6 are not supported)"
        )
    return text


def _parse_mpich(token: str, where: str) -> _Entry:
    """``host`` or ``host:N``."""
    name, sep, count = token.partition(":")
    if not sep:
        return _Entry(Host(_name(name, where), 1), None, where)
    if ":" in count or not count:
        raise HostfileError(f"{where}: bad syntax {token!r}, expected host or host:N")
    return _Entry(Host(_name(name, where), _count(count, "slot count", where)), "mpich", where)


def _parse_line(text: str, where: str) -> _Entry:
    # Open MPI's lexer treats '=' as its own token, so "slots = 4" is legal there too.
    tokens = re.sub(r"\s*=\s*", "=", text).split()
    if len(tokens) == 1 and "=" not in tokens[0]:
        return _parse_mpich(tokens[0], where)
    if ":" in tokens[0]:
        raise HostfileError(
            f"{where}: unexpected {' '.join(tokens[1:])!r} after {tokens[0]!r} "
            "(MPICH form is one host:N per line)"
        )
    name = _name(tokens[0], where)
    values: dict[str, int] = {}
    for tok in tokens[1:]:
        key, sep, value = tok.partition("=")
        field = _OMPI_KEYS.get(key)
        if not sep or field is None:
            raise HostfileError(
                f"{where}: bad syntax {tok!r}, expected slots=N or max_slots=M after the host"
            )
        if field in values:
            raise HostfileError(f"{where}: {key} given twice")
        values[field] = _count(value, key, where)
    max_slots = values.get("max_slots")
    # As in Open MPI: a line with only max_slots=M offers M slots.
    slots = values.get("slots", max_slots or 1)
    if max_slots is not None and max_slots < slots:
        raise HostfileError(f"{where}: max_slots={max_slots} is less than slots={slots}")
    return _Entry(Host(name, slots, max_slots), "openmpi", where)


def _merge(entries: list[_Entry], source: str) -> list[Host]:
    """Sum repeated bare names, refuse repeats with a count; keep first-appearance order."""
    if not entries:
        raise HostfileError(f"{source}: no hosts listed")
    first: dict[str, _Entry] = {}
    repeats: dict[str, int] = {}
    for e in entries:
        prev = first.setdefault(e.host.name, e)
        if prev is not e and (prev.form is not None or e.form is not None):
            raise HostfileError(
                f"{e.where}: host {e.host.name!r} is already listed at {prev.where} "
                f"({_describe(prev.host)}), here with {_describe(e.host)}; a host with a slot "
                "count must appear once: write one line with the total"
            )
        repeats[e.host.name] = repeats.get(e.host.name, 0) + 1
    return [Host(n, first[n].host.slots * k, first[n].host.max_slots) for n, k in repeats.items()]


def _describe(h: Host) -> str:
    return f"slots={h.slots}" + ("" if h.max_slots is None else f" max_slots={h.max_slots}")


def _parse_text(text: str, source: str) -> tuple[list[Host], str | None]:
    entries: list[_Entry] = []
    form_seen: _Entry | None = None  # first line that fixed the file's form
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source}:{lineno}"
        entry = _parse_line(line, where)
        if entry.form is not None:
            if form_seen is None:
                form_seen = entry
            elif entry.form != form_seen.form:
                raise HostfileError(
                    f"{where}: {entry.form} form {line!r} in a file that uses the "
                    f"{form_seen.form} form since {form_seen.where}; use one form per file"
                )
        entries.append(entry)
    return _merge(entries, source), None if form_seen is None else form_seen.form


def parse_hostfile_text(text: str, source: str = "<hostfile>") -> list[Host]:
    """Parse hostfile contents; errors name ``source:line``."""
    return _parse_text(text, source)[0]


def load_hostfile(path: str | Path) -> tuple[list[Host], str | None]:
    """Read a hostfile; returns its hosts and its form (``"openmpi"``, ``"mpich"`` or None
    when it lists bare names only)."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise HostfileError(f"{path}: cannot read hostfile: {e.strerror}") from None
    return _parse_text(text, str(path))


def parse_hostfile(path: str | Path) -> list[Host]:
    """Read and parse a hostfile in Open MPI or MPICH form."""
    return load_hostfile(path)[0]


def parse_host_list(spec: str) -> list[Host]:
    """Parse ``a,b:2`` (``--host``); a name without ``:N`` is one slot."""
    entries = []
    for i, item in enumerate(spec.split(","), start=1):
        where = f"--host entry {i} ({item.strip()!r})"
        if not item.strip():
            raise HostfileError(f"{where}: empty entry in {spec!r}")
        entries.append(_parse_mpich(item.strip(), where))
    return _merge(entries, "--host")


def total_slots(hosts: list[Host]) -> int:
    return sum(h.slots for h in hosts)


def check_rank_count(
    hosts: list[Host], nranks: int, oversubscribe: bool, source: str = "hosts"
) -> None:
    """Refuse more ranks than slots (unless oversubscribing) and more than max_slots allow."""
    if nranks < 1:
        raise HostfileError(f"-np must be at least 1, got {nranks}")
    slots = total_slots(hosts)
    listing = ",".join(f"{h.name}:{h.slots}" for h in hosts)
    if nranks > slots and not oversubscribe:
        raise HostfileError(
            f"-np {nranks} exceeds the {slots} slots in {source} ({listing}); "
            "pass --oversubscribe to place more ranks than slots"
        )
    # Open MPI never exceeds max_slots, not even when oversubscribing; only when every host
    # has a cap is the total bounded.
    if nranks > slots and all(h.max_slots is not None for h in hosts):
        cap = sum(h.max_slots or 0 for h in hosts)
        if nranks > cap:
            raise HostfileError(
                f"-np {nranks} exceeds the {cap} max_slots in {source}, even with --oversubscribe"
            )
