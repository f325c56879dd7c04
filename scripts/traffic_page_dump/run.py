"""Issue 35's reproduction with every sealed page dumped, then pages paired loaded vs alone.

    python scripts/traffic_page_dump/run.py OUT [MOSAICKV_CONFIG_JSON] [--new-tokens N] [--seed S]

Runs tests/test_traffic_independence.py's scenario (12 concurrent greedy requests into a
4096-token pool, then each prompt alone after /flush_cache) on one server with the page dump of
sitecustomize.py, and pairs each page sealed alone with the page sealed under load at the same
position whose layer-0 K (a function of the page's tokens only) is nearest. Prints how many
requests match and, per layer, in how many pairs the raw K/V before sealing and the sealed
read-back differ (docs/determinism.md, "Float noise, amplified")."""
import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "tests"))

import torch  # noqa: E402

import test_traffic_independence as T  # noqa: E402
from server_utils import flush_cache, make_tiny_llama, mosaickv_stats, running_server  # noqa: E402


def serve(out: Path, config: str, seed: int) -> dict:
    dump = out / "dump"
    dump.mkdir(parents=True, exist_ok=True)
    os.environ["TI_DUMP_DIR"] = str(dump)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE),
                                                             os.environ.get("PYTHONPATH")]))
    prompts = T._prompts(seed)
    args = ["--kv-backend", "mosaickv", *T.COMMON, "--mosaickv-config", config]
    with running_server(make_tiny_llama(out / "tiny", head_dim=64), out / "server.log",
                        *args) as server:
        flush_cache(server.url)
        with ThreadPoolExecutor(len(prompts)) as ex:
            loaded = list(ex.map(lambda p: T._greedy(server.url, p), prompts))
        loaded_end = time.time()
        stats_loaded = mosaickv_stats(server.url)
        alone = []
        for p in prompts:
            flush_cache(server.url)
            alone.append(T._greedy(server.url, p))
        stats_end = mosaickv_stats(server.url)
    result = {"loaded": loaded, "alone": alone, "loaded_end": loaded_end,
              "early_sealed_reads": [stats_loaded["counters"]["early_sealed_reads"],
                                     stats_end["counters"]["early_sealed_reads"]]}
    (out / "result.json").write_text(json.dumps(result))
    return result


def pair_pages(out: Path, loaded_end: float):
    pages = {"loaded": [], "alone": []}
    for f in sorted((out / "dump").glob("*.pt")):
        x = torch.load(f, weights_only=False)
        for r in x["records"]:
            r["callers"] = x["callers"]
            pages["loaded" if x["t"] <= loaded_end else "alone"].append(r)
    layers = None
    raw_differ, sealed_differ, pairs = None, None, 0
    for a in pages["alone"]:
        same_pos = [b for b in pages["loaded"] if b["position"] == a["position"]]
        if not same_pos:
            continue
        b = min(same_pos, key=lambda b: float((b["read_back"][0][0]
                                               - a["read_back"][0][0]).abs().max()))
        if float((b["read_back"][0][0] - a["read_back"][0][0]).abs().max()) > 0.5:
            continue  # not the same tokens
        layers = len(a["read_back"])
        raw_differ = raw_differ or [0] * layers
        sealed_differ = sealed_differ or [0] * layers
        pairs += 1
        for layer in range(layers):
            if a["raw"] is not None and b["raw"] is not None:
                raw_differ[layer] += any(not torch.equal(x[layer], y[layer])
                                         for x, y in zip(a["raw"], b["raw"]))
            sealed_differ[layer] += any(not torch.equal(x, y) for x, y in
                                        zip(a["read_back"][layer], b["read_back"][layer]))
    return pairs, raw_differ, sealed_differ


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("config", nargs="?", default=json.dumps({**T.POSITION_RULE, "daemon": "off"}))
    ap.add_argument("--new-tokens", type=int, default=T.NEW_TOKENS)
    ap.add_argument("--seed", type=int, default=T.SEED)
    a = ap.parse_args()
    T.NEW_TOKENS = a.new_tokens
    r = serve(a.out, a.config, a.seed)
    differ = {i: next((j for j, (x, y) in enumerate(zip(p, q)) if x != y), None)
              for i, (p, q) in enumerate(zip(r["loaded"], r["alone"])) if p != q}
    print(f"{len(r['loaded']) - len(differ)} of {len(r['loaded'])} loaded outputs equal alone; "
          f"request -> first differing token {differ}; early_sealed_reads after the loaded "
          f"phase / at the end {r['early_sealed_reads']}")
    pairs, raw, sealed = pair_pages(a.out, r["loaded_end"])
    print(f"{pairs} pages sealed alone paired with the same page sealed under load; pairs "
          f"differing per layer: raw K/V before sealing {raw}, sealed read-back {sealed}")


if __name__ == "__main__":
    main()
