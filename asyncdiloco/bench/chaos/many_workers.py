"""Chaos: many concurrent in-process workers against one parameter server process.

``--workers`` ``AsyncDiLoCoWorker`` threads train small linear models for ``--seconds``
and close; JSON lines report errors (refused pushes, failed syncs, applied counts that
disagree) and the server's memory over the run. Measures; asserts nothing.
docs/operations.md, "Limits".

    python -m asyncdiloco.bench.chaos.many_workers [--workers 64] [--seconds 60] [--params 262144]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch
from torch import nn

from asyncdiloco.bench.perf.harness import MIB, emit, reset_peak_rss, rss_bytes, server_process
from asyncdiloco.worker.async_worker import AsyncDiLoCoWorker
from asyncdiloco.worker.client import ParameterServerClient
from asyncdiloco.worker.config import WorkerConfig

#: Seconds between two samples of the server's RSS.
SAMPLE_S = 0.5


def _model(params: int, seed: int) -> nn.Linear:
    """A square ``nn.Linear`` with about ``params`` parameters (weight and bias)."""
    width = max(1, int(params**0.5))
    torch.manual_seed(seed)
    return nn.Linear(width, width)


def _train(
    k: int, address: str, params: int, stop: threading.Event, results: list, errors: list, started: threading.Barrier
) -> None:
    """Worker ``k``: join, inner steps until ``stop``, close; its stats into ``results``."""
    try:
        model = _model(params, seed=0)  # the same initial model on every worker; the first initializes
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(k)
        width = model.in_features
        config = WorkerConfig(server=address, worker_name=f"chaos-{k}", join_timeout_s=120.0)
        worker = AsyncDiLoCoWorker(model, opt, config, tokens_per_step=8)
        with worker:
            started.wait()
            while not stop.is_set():
                x = torch.randn(8, width, generator=gen)
                nn.functional.mse_loss(model(x), x).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        results.append(worker.stats)
    except Exception as exc:  # noqa: BLE001 - counted and reported
        errors.append(f"worker {k}: {type(exc).__name__}: {exc}")
        started.abort()


def run(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    flags = ["--local-steps", str(args.local_steps), *args.server_flag]
    with server_process(*flags) as (proc, address):
        time.sleep(1.0)
        idle = rss_bytes(proc.pid)
        reset_peak_rss(proc.pid)
        stop, results, errors = threading.Event(), [], []  # type: ignore[var-annotated]
        started = threading.Barrier(args.workers + 1)
        threads = [
            threading.Thread(target=_train, args=(k, address, args.params, stop, results, errors, started), daemon=True)
            for k in range(args.workers)
        ]
        for t in threads:
            t.start()
        try:
            started.wait(timeout=300)  # every worker joined and holds the global model
        except threading.BrokenBarrierError:
            pass
        t0 = time.monotonic()
        samples: list[tuple[float, int]] = []
        while time.monotonic() - t0 < args.seconds and not errors:
            samples.append((time.monotonic() - t0, rss_bytes(proc.pid)))
            time.sleep(SAMPLE_S)
        stop.set()
        for t in threads:
            t.join(timeout=300)
        wall_s = time.monotonic() - t0
        peak = rss_bytes(proc.pid, "VmHWM")
        with ParameterServerClient(address) as client:
            st = client.status()
        hung = sum(t.is_alive() for t in threads)

    numel = sum(p.numel() for p in _model(args.params, 0).parameters())
    state = 2 * 4 * numel  # θ and m, fp32
    quarter = max(1, len(samples) // 4)
    second_q = statistics.median(r for _, r in samples[quarter : 2 * quarter]) if samples else idle
    last_q = statistics.median(r for _, r in samples[-quarter:]) if samples else idle
    applied_by_workers = sum(s.pushes_applied for s in results)
    errors_rec = {
        "bench": "chaos_concurrent",
        "record": "errors",
        "workers": args.workers,
        "workers_finished": len(results),
        "workers_hung": hung,
        "thread_exceptions": errors[:5],
        "thread_exception_count": len(errors),
        "sync_failures": sum(s.sync_failures for s in results),
        "pushes_refused_by_workers": sum(s.pushes_refused for s in results),
        "final_pushes_not_applied": sum(s.final_push not in ("", "applied") for s in results),
        "server_rejected_pushes": st.rejected_pushes,
        "server_applied_pushes": st.applied_pushes,
        "server_duplicate_pushes": st.duplicate_pushes,
        "pushes_applied_by_workers": applied_by_workers,
        "server_version": st.version,
        "inner_steps": sum(s.inner_steps for s in results),
        "wall_s": round(wall_s, 1),
    }
    memory_rec = {
        "bench": "chaos_concurrent",
        "record": "memory",
        "params": numel,
        "state_mib": round(state / MIB, 2),
        "idle_rss_mib": round(idle / MIB, 1),
        "peak_growth_mib": round((peak - idle) / MIB, 1),
        "peak_growth_over_state": round((peak - idle) / state, 2),
        "last_quarter_growth_mib": round((last_q - idle) / MIB, 1),
        "last_quarter_growth_over_state": round((last_q - idle) / state, 2),
        "second_quarter_growth_mib": round((second_q - idle) / MIB, 1),
        "samples": len(samples),
    }
    emit(errors_rec, args.out)
    emit(memory_rec, args.out)
    total_errors = len(errors) + hung + errors_rec["sync_failures"] + errors_rec["pushes_refused_by_workers"]
    total_errors += st.rejected_pushes + abs(applied_by_workers - st.applied_pushes)
    emit(
        {
            "bench": "chaos_concurrent",
            "record": "summary",
            "workers": args.workers,
            "server_flags": flags,
            "errors": total_errors,
            "pushes_applied": st.applied_pushes,
            "peak_rss_growth_over_state": memory_rec["peak_growth_over_state"],
            "rss_growth_last_vs_second_quarter_mib": round((last_q - second_q) / MIB, 1),
        },
        args.out,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=64, help="concurrent in-process workers (default 64)")
    p.add_argument("--seconds", type=float, default=60.0, help="seconds of training once all joined (default 60)")
    p.add_argument("--params", type=int, default=262144, help="parameters of each worker's model (default 262144)")
    p.add_argument("--local-steps", type=int, default=10, help="H, the server's --local-steps (default 10)")
    p.add_argument(
        "--server-flag",
        action="append",
        default=[],
        help="an extra `asyncdiloco server` flag, e.g. --server-flag=--grouping=off (repeatable)",
    )
    p.add_argument("--out", help="also append the JSON lines to this file")
    run(p.parse_args())


if __name__ == "__main__":
    main()
