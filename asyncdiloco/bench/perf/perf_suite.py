"""The performance suite: every ``SCRIPTS`` benchmark into DIR/perf.jsonl, and DIR/perf.md,
each target met or missed with what the measurement says about the gap.

    python -m asyncdiloco.bench.perf.perf_suite --out DIR [--sizes 4,64,256]   (or: asyncdiloco bench --suite perf)
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import time

from asyncdiloco.bench.perf.targets import SIGNS

SCRIPTS = ("bench_transport", "bench_server", "bench_codec", "bench_overlap", "bench_gpu")


def _variant(rec: dict) -> str:
    """What distinguishes rows of one measure: the path, pattern, codec or overlap."""
    parts = [str(rec[k]) for k in ("path", "pattern", "codec") if k in rec]
    if "overlap" in rec:
        parts.append("overlap on" if rec["overlap"] else "overlap off")
    return ", ".join(parts) or "—"


def summarize(records: list[dict]) -> str:
    lines = [
        "# asyncdiloco performance suite",
        "",
        "Each value is a ratio against a baseline measured in the same run (or a rate); medians of repeats.",
        "The machine's cores are shared by the client and server processes of each benchmark, and by",
        "whatever else runs: compare ratios, not absolute speeds.",
        "",
        "| measure | variant | model | value | target | met | what the measurement says |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in records:
        if "measure" not in r or not ("ratio" in r or "pushes_per_s" in r):  # a diagnostic line; in perf.jsonl
            continue
        sign, larger = SIGNS.get(r["measure"], ("?", True))
        v = r["pushes_per_s"] if "pushes_per_s" in r else r["ratio"]
        note = r.get("note", "")
        head = f"| {r['measure']} | {_variant(r)} | {r['model_mib']:.0f} MiB | {v:.3g}"
        if r.get("target") is None:  # a baseline row (overlap off, the codecs, small models): no target
            lines.append(f"{head} | — | — | {note} |")
            continue
        met = v >= r["target"] if larger else v <= r["target"]
        lines.append(f"{head} | {sign} {r['target']} | {'yes' if met else 'no'} | {note} |")
    lines += ["", *(f"Skipped: {r['bench']}: {r['skipped']}." for r in records if "skipped" in r)]
    lines += ["", "Raw records (with every baseline and breakdown): perf.jsonl."]
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
    started = time.monotonic()
    for script in SCRIPTS:
        subprocess.run(
            [sys.executable, "-m", f"asyncdiloco.bench.perf.{script}", "--sizes", args.sizes, "--out", str(jsonl)],
            check=True,
        )
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    summary = summarize(records) + f"\nWhole suite: {time.monotonic() - started:.0f} s.\n"
    (out / "perf.md").write_text(summary)
    print(summary)


if __name__ == "__main__":
    main()
