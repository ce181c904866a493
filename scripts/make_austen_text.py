"""Extract one Jane Austen novel from the R package janeaustenr into simdist/data/text/.

Usage: python scripts/make_austen_text.py PATH/TO/janeaustenr/data/Rdata.rdb [BOOK] [OUT]

Get the package with `apt-get download r-cran-janeaustenr && dpkg-deb -x r-cran-janeaustenr_*.deb
x`; the file is x/usr/lib/R/site-library/janeaustenr/data/Rdata.rdb (Rdata.rdx must sit beside
it). BOOK defaults to "emma"; OUT to simdist/data/text/BOOK.txt.gz. Each book is stored as an R
character vector, one element per line of the Project Gutenberg transcription (without the
Gutenberg header and licence, which janeaustenr strips); the lines are joined with "\\n". Only
R's standard library serialisation format is read, so R itself is not needed.
"""

from __future__ import annotations

import argparse
import bz2
import gzip
import lzma
import struct
import sys
import zlib
from pathlib import Path
from typing import Any

# R SEXP type codes used by lazy-load data bases (see R's serialize.c).
_NIL, _SYM, _LIST, _CHAR, _LGL, _INT, _REAL, _STR, _VEC = 254, 1, 2, 9, 10, 13, 14, 16, 19
_REF = 255


class _RReader:
    """Minimal reader for R's XDR serialisation: enough for vectors, lists and attributes."""

    def __init__(self, data: bytes) -> None:
        if data[:2] != b"X\n":
            raise ValueError("not an XDR R serialisation")
        self.data, self.pos, self.refs = data, 2, []
        version = self.int()
        self.int(), self.int()  # writer R version, minimal reader version
        if version == 3:
            name_len = self.int()  # the writer's native encoding name: not needed
            self.pos += name_len

    def int(self) -> int:
        (v,) = struct.unpack_from(">i", self.data, self.pos)
        self.pos += 4
        return v

    def item(self) -> Any:
        flags = self.int()
        kind, has_attr, has_tag = flags & 0xFF, flags & (1 << 9), flags & (1 << 10)
        if kind == _NIL:
            return None
        if kind == _REF:
            return self.refs[(flags >> 8) - 1 if flags >> 8 else self.int() - 1]
        if kind == _SYM:
            name = self.item()
            self.refs.append(name)
            return name
        if kind == _LIST:  # pairlist, used for attributes: returns {tag: value}
            if has_attr:
                self.item()  # attributes of the pairlist cell itself: never needed here
            tag = self.item() if has_tag else None
            car, cdr = self.item(), self.item()
            return {tag: car, **(cdr or {})}
        if kind == _CHAR:
            n = self.int()
            if n == -1:
                return None  # NA_character_
            s = self.data[self.pos : self.pos + n].decode("utf-8")
            self.pos += n
            return s
        n = self.int()
        if kind in (_LGL, _INT):
            value: Any = list(struct.unpack_from(f">{n}i", self.data, self.pos))
            self.pos += 4 * n
        elif kind == _REAL:
            value = list(struct.unpack_from(f">{n}d", self.data, self.pos))
            self.pos += 8 * n
        elif kind in (_STR, _VEC):
            value = [self.item() for _ in range(n)]
        else:
            raise ValueError(f"unsupported R type {kind}")
        if has_attr:
            names = self.item().get("names")
            if names is not None:
                value = dict(zip(names, value, strict=True))
        return value


def _unpack_entry(chunk: bytes) -> bytes:
    # Each entry: big-endian uncompressed length, then (for compress=2/3) a type byte.
    (length,) = struct.unpack(">I", chunk[:4])
    kind, body = chunk[4:5], chunk[5:]
    if kind == b"Z":
        out = lzma.decompress(body)
    elif kind == b"2":
        out = bz2.decompress(body)
    elif kind == b"0":
        out = body
    else:
        out = zlib.decompress(chunk[4:])
    if len(out) != length:
        raise ValueError(f"entry decompressed to {len(out)} bytes, index says {length}")
    return out


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python scripts/make_austen_text.py",
        description=__doc__.split("\n\n")[0]
        + " Get the package with `apt-get download r-cran-janeaustenr && dpkg-deb -x "
        "r-cran-janeaustenr_*.deb x`; R itself is not needed.",
    )
    p.add_argument("rdb", type=Path, metavar="RDATA_RDB",
                   help="janeaustenr/data/Rdata.rdb (Rdata.rdx must sit beside it)")  # fmt: skip
    p.add_argument("book", nargs="?", default="emma", metavar="BOOK",
                   help="the book's name in janeaustenr (default: emma)")  # fmt: skip
    p.add_argument("out", type=Path, nargs="?", metavar="OUT",
                   help="output file (default: simdist/data/text/BOOK.txt.gz)")  # fmt: skip
    args = p.parse_args(argv)
    for need in (args.rdb, args.rdb.with_suffix(".rdx")):
        if not need.is_file():  # a user error: one line, exit 2, nothing written
            p.error(f"{need} is not a file: give the path of janeaustenr's data/Rdata.rdb")
    return args


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    rdb, book = args.rdb, args.book
    root = Path(__file__).parents[1]
    out = args.out or root / f"simdist/data/text/{book}.txt.gz"

    index = _RReader(gzip.decompress(rdb.with_suffix(".rdx").read_bytes())).item()
    if book not in index["variables"]:  # a user error: one line, exit 2, nothing written
        have = ", ".join(sorted(index["variables"]))
        print(
            f"make_austen_text.py: no book {book!r} in {rdb}; choose one of {have}", file=sys.stderr
        )
        sys.exit(2)
    offset, size = index["variables"][book]
    lines = _RReader(_unpack_entry(rdb.read_bytes()[offset : offset + size])).item()
    text = ("\n".join(lines) + "\n").encode("utf-8")
    # mtime=0 and no file name in the header: re-running reproduces the file byte for byte.
    out.write_bytes(gzip.compress(text, compresslevel=9, mtime=0))
    print(f"{book}: {len(lines)} lines, {len(text)} bytes -> {out} ({out.stat().st_size} bytes)")


if __name__ == "__main__":
    main(sys.argv[1:])
