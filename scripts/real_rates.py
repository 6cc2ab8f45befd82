"""One reduced real-clock run: DyLU's rates and the utilisation of one method and seed.

    nice -n 10 .venv/bin/python scripts/real_rates.py OUT [--method async_dn_dylu] [--seed 0] [--step-s 0.05]

Runs the uneven profile of ``asyncdiloco bench --suite quick --clock real`` for one method
and seed with the suite's own pieces (``suite_real.real_schedule``, ``server_flags``,
``run_demo``, ``_record``, ``rate_figures``) and ``--step-s`` padding (default the suite's
``REAL_STEP_S``), polls ``Status`` every 0.25 s while every worker has a rate, and prints
one JSON object: utilisation, group sizes, training seconds, the record's ``rates`` (the
rate each worker reported last against the mean over its timed steps) and, from the
polls, per worker the median rate DyLU used and H_w over the last three quarters of the
run against (its inner steps ÷ its training time outside syncs). Also written to
``OUT/real_rates-METHOD-SEED.json``. docs/algorithms.md, "DyLU's rates and utilisation
on the real clock".
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import statistics
import threading
import time

from asyncdiloco.bench import suite_real
from asyncdiloco.bench.demo import DemoConfig, run_demo
from asyncdiloco.bench.profiles import PROFILES
from asyncdiloco.bench.sim import SimConfig
from asyncdiloco.bench.suite_config import REAL_SUITES
from asyncdiloco.worker.client import ParameterServerClient

PROFILE = "uneven"


def _poll(run_dir: pathlib.Path, workers: int, polls: list[dict], stop: threading.Event) -> None:
    """Append {worker name: (steps_per_s, H_w)} while every worker has a rate."""
    port = run_dir / "server.port"
    while not stop.is_set() and not port.exists():
        time.sleep(0.1)
    time.sleep(0.5)
    if stop.is_set():
        return
    client = ParameterServerClient(f"127.0.0.1:{port.read_text().strip()}")
    while not stop.is_set():
        try:
            rows = {w.worker_name: (w.steps_per_s, w.local_steps_per_round) for w in client.status().workers if w.alive}
        except Exception:  # noqa: BLE001 - the server is starting or stopping
            rows = {}
        if len(rows) == workers and all(v for v, _ in rows.values()):
            polls.append(rows)
        time.sleep(0.25)
    client.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--method", default="async_dn_dylu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-s", type=float, default=suite_real.REAL_STEP_S)
    args = p.parse_args()
    suite_real.REAL_STEP_S = args.step_s  # server_flags passes it to every worker
    cfg, prof = REAL_SUITES["quick"], PROFILES[PROFILE]
    sim_cfg = SimConfig(
        method=args.method,
        speeds_s_per_step=prof["speeds"],
        total_steps=cfg.total_steps,
        local_steps=cfg.local_steps,
        seed=args.seed,
        job=cfg.job,
    )
    mode, flags, worker_args = suite_real.server_flags(sim_cfg)
    job = dataclasses.replace(cfg.job, seed=args.seed)
    out = pathlib.Path(args.out)
    run_dir = out / f"{PROFILE}-{args.method}-{args.seed}"
    (run_dir / "server.port").unlink(missing_ok=True)
    demo = DemoConfig(
        num_workers=len(prof["speeds"]),
        max_seconds=1200.0,
        out_dir=str(run_dir),
        slowdowns=suite_real.real_schedule(prof, 1.0).slowdowns,
        server_args=flags,
        job=job,
        eval_every_s=suite_real.REAL_EVAL_EVERY_S,
        worker_args=worker_args,
        mode=mode,
        token_budget=cfg.total_steps * job.tokens_per_step,
    )
    polls: list[dict] = []
    stop = threading.Event()
    poller = threading.Thread(target=_poll, args=(run_dir, demo.num_workers, polls, stop), daemon=True)
    poller.start()
    started = time.monotonic()
    try:
        report = run_demo(demo, progress=False)
    finally:
        stop.set()
        poller.join(timeout=5)
    rec = suite_real._record(PROFILE, args.method, args.seed, sim_cfg, report, time.monotonic() - started)
    true = {}
    for path in sorted(run_dir.glob("worker-*.json")):
        st = json.loads(path.read_text())
        if st.get("wall_s"):
            true[st["name"]] = st["inner_steps"] / (st["wall_s"] - st["blocked_s"])
    steady = polls[len(polls) // 4 :]
    polled = {}
    if steady and true:
        names = sorted(steady[-1])
        used = {n: statistics.median(p[n][0] for p in steady) for n in names}
        h_w = {n: statistics.median(p[n][1] for p in steady) for n in names}
        for n in names:
            ratio = true[n] / max(true.values())
            polled[n] = {
                "steps_per_s": round(true[n], 3),
                "used_steps_per_s": round(used[n], 3),
                "H_w": h_w[n],
                "first_H_w": polls[0][n][1],
                "rate_ratio_error": round(used[n] / max(used.values()) / ratio - 1, 4),
            }
    result = {
        "method": args.method,
        "seed": args.seed,
        "step_s": args.step_s,
        "utilisation": rec["utilisation"],
        "group_size_histogram": rec["group_size_histogram"],
        "train_s": rec["virtual_wall_s"],
        "final_eval_loss": rec["final_eval_loss"],
        "rates": rec["rates"],
        "polled": polled,
    }
    text = json.dumps(result, indent=1)
    print(text)
    (out / f"real_rates-{args.method}-{args.seed}.json").write_text(text + "\n")


if __name__ == "__main__":
    main()
