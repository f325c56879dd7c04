"""Instructions per iteration of a kernel's loops, read from its sm_90 SASS without a GPU.

`scripts/sm90_compile.py --dump DIR` writes each variant's SASS (`cuobjdump -sass`); this reads
one and reports every loop (a backward branch and its target) with the instructions between
them by opcode class: integer, float, tensor-core (HMMA), global / shared loads and stores,
barriers, conversions. Nested loops are reported each on their own (the outer includes the
inner). What it counts is static: a branch inside the loop (e.g. a row change) is counted as
if taken; `--skip START:END` (hex addresses) leaves a range out.

    python scripts/sm90_compile.py --only "graph decode d128 select" --dump /tmp/dump
    python scripts/sass_loops.py /tmp/dump/_request_decode_stage1_v3.sass [--min 200]
"""
from __future__ import annotations

import argparse
import re
from collections import Counter

LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
CLASSES = {
    "hmma": ("HMMA", "HGMMA"),
    "ldg": ("LDG",), "stg": ("STG",), "lds": ("LDS", "LDSM"), "sts": ("STS",),
    "ldl/stl": ("LDL", "STL"), "bar": ("BAR",), "shfl": ("SHFL",),
    "cvt": ("I2F", "F2I", "F2F", "F2FP", "I2I", "I2FP"),
    "int": ("IMAD", "IADD3", "LOP3", "SHF", "SGXT", "LEA", "ISETP", "IMNMX", "PRMT", "BMSK",
            "LOP", "IABS", "SEL", "FLO", "POPC", "VIMNMX"),
    "float": ("FFMA", "FADD", "FMUL", "FMNMX", "FSETP", "MUFU", "FSEL", "FCHK", "HADD2",
              "HFMA2", "HMUL2", "FSWZADD"),
}


def parse(path: str) -> list[tuple[int, str, str]]:
    """(address, opcode, operands) of every instruction."""
    out = []
    for line in open(path):
        m = LINE.search(line)
        if m:
            out.append((int(m.group(1), 16), m.group(3), m.group(4)))
    return out


def loops(ins: list[tuple[int, str, str]]) -> list[tuple[int, int]]:
    """(target, branch address) of every backward branch."""
    found = []
    for addr, op, rest in ins:
        if op.startswith("BRA"):
            t = re.search(r"0x([0-9a-f]+)", rest)
            if t and int(t.group(1), 16) < addr:
                found.append((int(t.group(1), 16), addr))
    return found


def classify(op: str) -> str:
    head = op.split(".")[0]
    for name, ops in CLASSES.items():
        if head in ops:
            return name
    return "other"


def report(path: str, min_len: int = 0, skip: list[tuple[int, int]] = ()) -> list[dict]:
    ins = parse(path)
    rows = []
    for lo, hi in loops(ins):
        body = [(a, op) for a, op, _ in ins
                if lo <= a <= hi and not any(s <= a < e for s, e in skip)]
        if len(body) < min_len:
            continue
        by_class = Counter(classify(op) for _, op in body)
        by_op = Counter(op.split(".")[0] for _, op in body)
        rows.append({"start": hex(lo), "end": hex(hi), "instructions": len(body),
                     "classes": dict(by_class.most_common()),
                     "top_ops": dict(by_op.most_common(8))})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sass")
    ap.add_argument("--min", type=int, default=50, help="report loops of at least this many")
    ap.add_argument("--skip", action="append", default=[], help="START:END hex range left out")
    args = ap.parse_args(argv)
    skip = [tuple(int(x, 16) for x in s.split(":")) for s in args.skip]
    for r in report(args.sass, args.min, skip):
        print(f"loop {r['start']}..{r['end']}: {r['instructions']} instructions")
        print("   ", "  ".join(f"{k} {v}" for k, v in r["classes"].items()))
        print("   ", "  ".join(f"{k} {v}" for k, v in r["top_ops"].items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
