"""The performance suite: bench_transport.py and bench_server.py, one JSON-lines file and
a markdown summary of each target met or missed.

    python benchmarks/perf_suite.py --out DIR [--sizes 4,64,256]   (or: asyncdiloco bench --suite perf)

Writes DIR/perf.jsonl (one line per measurement) and DIR/perf.md.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent

#: measure -> (how to read it, whether larger is better)
_TARGETS = {
    "push+pull throughput / raw TCP loopback throughput": ("≥", True),
    "outer step / fused torch SGD(nesterov)": ("≤", False),
    "peak RSS growth / (params + momentum), 8 pushers": ("≤", False),
    "pushes applied per second, 1M params, 16 workers": ("≥", True),
}


def _value(rec: dict) -> float:
    return rec["pushes_per_s"] if "pushes_per_s" in rec else rec["ratio"]


def summarize(records: list[dict]) -> str:
    lines = [
        "# asyncdiloco performance suite",
        "",
        "Each value is a ratio against a baseline measured in the same run (or a rate); medians of repeats.",
        "",
        "| measure | model | value | target | met |",
        "|---|---|---|---|---|",
    ]
    for r in records:
        if "target" not in r:  # a diagnostic line (e.g. the bulk channel's time breakdown)
            continue
        sign, larger = _TARGETS.get(r["measure"], ("?", True))
        v = _value(r)
        met = v >= r["target"] if larger else v <= r["target"]
        measure = f"{r['measure']} ({r['path']})" if "path" in r else r["measure"]
        lines.append(f"| {measure} | {r['model_mib']:.0f} MiB | {v:.3g} | {sign} {r['target']} | {'yes' if met else 'no'} |")
    lines += ["", "Raw records: perf.jsonl. Not measured yet: the worker's blocked fraction with overlap (no overlap mode yet)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="perf-out", help="output folder (default perf-out)")
    p.add_argument("--sizes", default="4,64,256", help="model sizes in MiB")
    args = p.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    jsonl = out / "perf.jsonl"
    jsonl.unlink(missing_ok=True)
    for script in ("bench_transport.py", "bench_server.py"):
        subprocess.run([sys.executable, str(HERE / script), "--sizes", args.sizes, "--out", str(jsonl)], check=True)
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    (out / "perf.md").write_text(summarize(records))
    print((out / "perf.md").read_text())


if __name__ == "__main__":
    main()
