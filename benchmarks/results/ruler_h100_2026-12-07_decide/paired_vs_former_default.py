"""Paired per-cell differences: the 2026-11-30 default (ruler_h200_2026-11-30, mosaickv) minus each
system of this run, on the same prompts (prompt_hash), with a 95% bootstrap (2000 resamples, seed 0).
Run from the repository root: python benchmarks/results/ruler_h100_2026-12-07_decide/paired_vs_former_default.py"""
import json, lzma, random, sys
C = "niah_single_1@2048 niah_single_2@2048 niah_single_3@2048 niah_multikey_1@2048 niah_multivalue@2048 niah_single_1@4096 niah_single_2@4096 niah_single_3@4096 niah_single_1@8192 niah_single_2@8192".split()
def load(path, opener=open):
    out = {}
    with opener(path, "rt") as f:
        for l in f:
            r = json.loads(l)
            if r.get("kind") != "sample" or r.get("error"): continue
            out[(r["system"], f'{r["task"]}@{r["length"]}', r["prompt_hash"])] = r["score"]
    return out
old = load("benchmarks/results/ruler_h200_2026-11-30/samples.jsonl.xz", lzma.open)
new = load("benchmarks/results/ruler_h100_2026-12-07_decide/samples.jsonl.xz", lzma.open)
# dense in both: check identical prompt hashes
base = {k: v for k, v in old.items() if k[0] == "mosaickv"}
def cellpairs(a, b):
    res = {}
    for c in C:
        ka = {k[2]: v for k, v in a.items() if k[1] == c}
        kb = {k[2]: v for k, v in b.items() if k[1] == c}
        common = sorted(set(ka) & set(kb))
        res[c] = [(ka[h], kb[h]) for h in common]
    return res
for name in ["mosaickv_rescore_b12", "mosaickv_position_rescore_b12", "mosaickv_compact_c20", "dense"]:
    b = {k: v for k, v in new.items() if k[0] == name}
    pairs = cellpairs(base, b)
    diffs = {c: sum(x - y for x, y in p) / len(p) for c, p in pairs.items() if p}
    n = {c: len(p) for c, p in pairs.items()}
    rng = random.Random(0)
    boots = []
    for _ in range(2000):
        tot = 0
        for c, p in pairs.items():
            s = [p[rng.randrange(len(p))] for _ in p]
            tot += sum(x - y for x, y in s) / len(s)
        boots.append(tot / len(pairs))
    boots.sort()
    avg = sum(diffs.values()) / len(diffs)
    print(f"{name}: old default minus it, avg {avg:+.2f} [{boots[50]:+.2f}, {boots[1949]:+.2f}] n={min(n.values())}-{max(n.values())}")
    # per-cell CI
    for c, p in pairs.items():
        bs = sorted(sum(x - y for x, y in (p[rng.randrange(len(p))] for _ in p)) / len(p) for _ in range(2000))
        print(f"   {c}: {diffs[c]:+.1f} [{bs[50]:+.1f}, {bs[1949]:+.1f}]")
