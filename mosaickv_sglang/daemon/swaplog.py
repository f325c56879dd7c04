"""Swap decisions in a form two tensor-parallel ranks can compare.

Every rank holds different KV heads but must switch the *same* logical pages at the *same*
adoption point (adopt.py). Each rank records the pages installed since its previous adoption
point (daemon results, backpressure and fallback seals alike) and, at the adoption point, logs
one line when there were any: the adoption step (the count of adoption points, equal on every
rank because every rank's scheduler runs them in lockstep), the number of pages, a digest of the
(page, generation) set and a chain digest over every line so far. Two ranks agree iff their
lines are equal; ``python -m mosaickv_sglang.daemon.swaplog SERVER.log [...]`` checks that.
"""
from __future__ import annotations

import argparse
import hashlib
import logging
import re
import struct
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

PREFIX = "MosaicKV swaps:"
LINE = re.compile(PREFIX + r" rank=(\d+) step=(\d+) pages=(\d+) digest=([0-9a-f]{16}) "
                  r"chain=([0-9a-f]{16})")


def digest(pairs) -> int:
    """A 63-bit digest of (page, generation) pairs, independent of their order (fits int64)."""
    h = hashlib.blake2b(digest_size=8)
    for page, gen in sorted(pairs):
        h.update(struct.pack("<qq", page, gen))
    return int.from_bytes(h.digest(), "little") >> 1


class SwapLog:
    """Pages installed since the last adoption point, flushed as one log line per point."""

    def __init__(self):
        self.step = 0  # adoption points seen
        self.pending: list[tuple[int, int]] = []
        self.lines = 0
        self.pages = 0
        self.chain = 0

    def add(self, page: int, gen: int) -> None:
        self.pending.append((page, gen))

    def flush(self, rank: int) -> None:
        """Called once per adoption point, after it installed what it installs."""
        self.step += 1
        if not self.pending:
            return
        d = digest(self.pending)
        self.chain = digest([(self.chain, d), (self.step, len(self.pending))])
        self.lines += 1
        self.pages += len(self.pending)
        logger.info("%s rank=%d step=%d pages=%d digest=%016x chain=%016x", PREFIX, rank,
                    self.step, len(self.pending), d, self.chain)
        self.pending = []

    def stats(self) -> dict:
        return {"adoption_steps": self.step, "swap_lines": self.lines, "pages": self.pages,
                "chain": f"{self.chain:016x}"}


def parse(text: str) -> dict[int, list[tuple[int, int, str, str]]]:
    """rank -> [(step, pages, digest, chain)] in log order."""
    out: dict[int, list[tuple[int, int, str, str]]] = {}
    for m in LINE.finditer(text):
        rank, step, pages, d, chain = m.groups()
        out.setdefault(int(rank), []).append((int(step), int(pages), d, chain))
    return out


def compare(text: str, ranks: int = 2) -> tuple[bool, str]:
    """(ranks agree, a one-paragraph report). Fewer than `ranks` ranks with swaps is a failure:
    nothing was compared."""
    logs = parse(text)
    if len(logs) < ranks:
        return False, f"swap lines from ranks {sorted(logs)}, expected {ranks} ranks"
    ref_rank = min(logs)
    ref = logs[ref_rank]
    for rank, lines in sorted(logs.items()):
        for i, (a, b) in enumerate(zip(ref, lines)):
            if a != b:
                return False, (f"rank {rank} differs from rank {ref_rank} at line {i}: "
                               f"{b} vs {a}")
        if len(lines) != len(ref):
            return False, (f"rank {rank} has {len(lines)} swap lines, rank {ref_rank} "
                           f"{len(ref)} (equal for the first {min(len(lines), len(ref))})")
    pages = sum(n for _, n, _, _ in ref)
    return True, (f"{len(logs)} ranks agree: {len(ref)} adoption points with swaps, {pages} "
                  f"pages, chain {ref[-1][3] if ref else '-'}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Compare the MosaicKV swap lines of TP ranks "
                                             "in server logs (exit 1 if they differ).")
    ap.add_argument("logs", nargs="+", type=Path)
    ap.add_argument("--ranks", type=int, default=2)
    args = ap.parse_args(argv)
    ok, report = compare("".join(p.read_text(errors="replace") for p in args.logs), args.ranks)
    print(("OK: " if ok else "MISMATCH: ") + report)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
