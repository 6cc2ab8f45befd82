"""The CUDA path, checked on a machine with a GPU in under 5 minutes: the demo with CUDA
workers, every wire codec against a real server, a sync allreduce over NCCL, and
push/pull timings against pinned-memory copies. One JSON line per check, then a summary;
it prints ``SKIP_LINE`` and exits 0 without a GPU, exits 1 when a check failed and 124
when ``GPU_CHECK_TIMEOUT_S`` (default 290 s) ran out. docs/operations.md, "Checking a GPU
machine".

    python -m asyncdiloco.bench.gpu_check [--out DIR] [--only demo,codecs,nccl,transfer] [--transfer-mib N]
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import pathlib
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from asyncdiloco.bench.perf.harness import median_seconds

SKIP_LINE = "skipped: no GPU (torch.cuda.is_available() is False)"
CHECKS = ("demo", "codecs", "nccl", "transfer")
#: Substrings of NCCL's refusal of two ranks on one device.
_DUPLICATE_GPU = ("Duplicate GPU detected", "ncclInvalidUsage")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line.

    Raises:
        SystemExit: an unknown check name (argparse's usage error, status 2).
    """
    p = argparse.ArgumentParser(prog="gpu_check", description="check asyncdiloco's CUDA path on this machine's GPU")
    p.add_argument("--out", default="gpu-check-out", help="folder for the JSON lines and the demo's report")
    p.add_argument(
        "--only", default=",".join(CHECKS), help=f"comma-separated checks to run, of {', '.join(CHECKS)} (default: all)"
    )
    p.add_argument("--demo-seconds", type=float, default=45.0, help="seconds each demo worker trains (default 45)")
    p.add_argument("--transfer-mib", type=int, default=256, help="model size for the transfer timings (default 256)")
    p.add_argument("--nccl-rank", type=int, default=None, help=argparse.SUPPRESS)  # the NCCL check's child
    p.add_argument("--nccl-port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--nccl-device", default="cuda:0", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    chosen = [c.strip() for c in args.only.split(",") if c.strip()]
    unknown = [c for c in chosen if c not in CHECKS]
    if unknown or not chosen:
        p.error(f"--only {args.only!r}: unknown check(s) {unknown or '(none given)'}; choose from {', '.join(CHECKS)}")
    args.checks = chosen
    if not args.demo_seconds > 0 or args.transfer_mib < 1:
        p.error("--demo-seconds must be > 0 and --transfer-mib >= 1")
    return args


def codec_tolerance(name: str, reference: Any, block_size: int = 4096) -> Any:
    """The largest |x − decode(encode(x))| the codec ``name`` allows, per element of the
    fp32 vector ``reference`` (N,) (wire/codec.py's bounds, plus float rounding).

    Returns:
        A float32 (N,) tensor of bounds (zeros for raw).
    """
    import torch

    x = reference.float().abs()
    if name == "raw":
        return torch.zeros_like(x)
    if name == "bf16":
        return x * 2.0**-8 + 2.0**-133
    if name == "int8":
        n = x.numel()
        blocks = torch.nn.functional.pad(x, (0, -n % block_size)).view(-1, block_size).amax(dim=1)  # (n_b,)
        # half a quantisation step of the block, plus the float32 rounding of the decoded value
        # (half an ulp of |x|: 2^-24·|x|, taken as 2^-23·|x|)
        return (blocks / 254 * (1 + 2.0**-20)).repeat_interleave(block_size)[:n] + x * 2.0**-23 + 2.0**-126
    raise ValueError(f"codec {name!r} has no known error bound; add it to gpu_check.codec_tolerance")


def nccl_refusal(message: str) -> bool:
    """True when ``message`` is NCCL's refusal of two ranks on one GPU."""
    return any(s in message for s in _DUPLICATE_GPU)


def summary_lines(results: list[dict]) -> list[str]:
    """The compact human summary of the JSON results (one line per check, then the total)."""
    lines = []
    for r in results:
        status = {True: "ok", False: "FAILED", None: "refused"}[r.get("ok")]
        lines.append(f"  {r['check']:<14} {status:<8} {r.get('summary', '')}")
    ok = sum(r.get("ok") is True for r in results)
    failed = sum(r.get("ok") is False for r in results)
    refused = sum(r.get("ok") is None for r in results)
    lines.append(f"result: {ok} ok, {failed} failed, {refused} refused by NCCL (not possible on this machine)")
    return lines


def exit_status(results: list[dict]) -> int:
    return 1 if any(r.get("ok") is False for r in results) else 0


# ------------------------------------------------------------------ the checks
def check_demo(out: pathlib.Path, seconds: float, *, mode: str = "async", devices: Sequence[str] = ("cuda",)) -> dict:
    """The demo's job with one worker per entry of ``devices`` (async: with ``--overlap``)."""
    from asyncdiloco.bench.demo import DemoConfig, run_demo

    sync = mode == "sync"
    cfg = DemoConfig(
        num_workers=max(2, len(devices)),
        max_seconds=seconds,
        out_dir=str(out / f"demo-{mode}"),
        slowdowns=(1.0,) * max(2, len(devices)),
        mode=mode,
        server_args=("--mode", "sync") if sync else (),
        worker_args=("--allreduce-timeout-s", "30") if sync else ("--overlap",),
        per_worker_args=tuple(("--device", devices[i % len(devices)]) for i in range(max(2, len(devices)))),
        eval_every_s=5.0,
    )
    report = run_demo(cfg, progress=False)
    first, last = report["initial_eval_loss"], report["final_eval_loss"]
    written = (out / f"demo-{mode}" / "report.json").is_file()
    ok = written and first is not None and last is not None and last < first
    result = {"check": "sync demo" if sync else "demo", "ok": ok, "initial_eval_loss": first, "final_eval_loss": last}
    result["report"] = str(out / f"demo-{mode}" / "report.json")
    text = f"loss {first:.3f} -> {last:.3f} nats/char" if ok else f"loss {first} -> {last}, report {written}"
    if sync:
        result["rounds_committed"] = report["rounds_committed"]
        result["ok"] = ok and (report["rounds_committed"] or 0) > 0
        text += f", {report['rounds_committed']} rounds committed"
    result["summary"] = f"{text}, {len(devices)} device(s) {','.join(devices)}"
    return result


def check_codec(name: str, syncs: int = 8, local_steps: int = 4, device: str = "cuda") -> dict:
    """An in-process server with codec ``name`` and a worker on ``device`` (see the module
    docstring; on a CPU the host buffers are not pinned and that is not checked)."""
    import torch
    from torch import nn

    from asyncdiloco.worker.async_worker import AsyncDiLoCoWorker
    from asyncdiloco.worker.config import WorkerConfig

    srv = _server(local_steps=local_steps, wire_codec=name)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256)).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        with AsyncDiLoCoWorker(model, opt, WorkerConfig(server=srv.address)) as worker:
            for _ in range(syncs * local_steps):
                x = torch.randn(64, 256, device=device)
                nn.functional.mse_loss(model(x), x.flip(1)).backward()
                opt.step()
                opt.zero_grad()
            server_params = srv.state.params.clone()
            base = worker._base.clone()  # θ_base: the decoded pull (no one else pushes)
            local = worker.flat.copy_into(torch.empty_like(base))
            buffers = (worker._base, worker.wire.buffer("pull"), worker.wire.buffer("push"))
            pinned = all(t.is_pinned() for t in buffers)
            same_version = worker.version == srv.state.version
            stats = worker.stats
        err = (base - server_params).abs()
        bound = codec_tolerance(name, server_params)
        within = bool((err <= bound).all())
        exact_model = bool(torch.equal(local, base)) if worker.wire.codec.lossless else True
        on_cpu = torch.device(device).type == "cpu"
        ok = within and exact_model and (pinned or on_cpu) and same_version and stats.pushes_applied >= syncs
        return {
            "check": f"codec {name}",
            "ok": ok,
            "max_abs_error": float(err.max()),
            "max_bound": float(bound.max()),
            "model_equals_base": exact_model,
            "host_buffers_pinned": pinned,
            "pushes_applied": stats.pushes_applied,
            "sync_failures": stats.sync_failures,
            "summary": f"max |θ_base − θ_server| {float(err.max()):.3g} (bound {float(bound.max()):.3g}), "
            f"{stats.pushes_applied} pushes, pinned {pinned}",
        }
    finally:
        srv.stop(None)


def _server(**fields: Any) -> Any:
    """An in-process server on 127.0.0.1 (a free port), fixed H: no DyLU, no grouping."""
    from asyncdiloco.ps import ParameterServer
    from asyncdiloco.ps.config import ServerConfig

    return ParameterServer(ServerConfig(port=0, host="127.0.0.1", dylu=False, grouping="off", **fields)).start()


def check_nccl(out: pathlib.Path, timeout_s: float = 90.0) -> dict:
    """Two processes sum over NCCL with ``QuorumCollectives`` (module docstring)."""
    import torch
    import torch.distributed as dist

    gpus = torch.cuda.device_count()
    devices = ["cuda:0", "cuda:1"] if gpus >= 2 else ["cuda:0", "cuda:0"]
    store = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True, wait_for_workers=False)
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "asyncdiloco.bench.gpu_check", "--out", str(out), "--nccl-rank", str(rank)]
            + ["--nccl-port", str(store.port), "--nccl-device", devices[rank]],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = []
    for proc in procs:
        try:
            outputs.append(proc.communicate(timeout=timeout_s)[0])
        except subprocess.TimeoutExpired:
            proc.kill()
            outputs.append(proc.communicate()[0] + f"\n(killed after {timeout_s:g} s)")
    lines = [json.loads(line) for text in outputs for line in text.splitlines() if line.startswith('{"nccl_rank"')]
    sums_ok = len(lines) == 2 and all(r.get("ok") for r in lines)
    text = "\n".join(outputs)
    result: dict[str, Any] = {"check": "nccl", "devices": devices, "ranks": lines}
    if sums_ok:
        result.update(ok=True, summary=f"2 ranks on {' and '.join(devices)}: sum exact, {lines[0]['seconds']:.2f} s")
    elif gpus < 2 and nccl_refusal(text):
        result.update(
            ok=None,
            summary="NCCL refuses two ranks on one GPU (Duplicate GPU detected): a sync quorum over NCCL needs "
            "one GPU per member; with one GPU run sync workers on --device cpu (gloo)",
        )
    else:
        result.update(ok=False, summary="the NCCL sum failed; see 'output'", output=text[-4000:])
    return result


def _server_store_over(port: int, rank: int) -> Any:
    """The ``ServerStore`` sync workers rendezvous over (worker/rendezvous.py: the polling,
    torch's Python-store path under NCCL), its calls answered from the parent's TCPStore
    instead of a parameter server, without blocking, as the server answers them."""
    import torch.distributed as dist

    from asyncdiloco.wire._proto import parameter_server_pb2 as pb
    from asyncdiloco.worker.rendezvous import ServerStore

    tcp = dist.TCPStore("127.0.0.1", port, is_master=False)

    def call(req: Any, timeout_s: float) -> Any:
        key = req.keys[0] if req.keys else ""
        if req.op == pb.STORE_OP_GET:
            found = tcp.check([key])
            return pb.StoreReply(found=found, value=tcp.get(key) if found else b"")
        if req.op == pb.STORE_OP_CHECK:
            return pb.StoreReply(found=tcp.check(list(req.keys)))
        if req.op == pb.STORE_OP_SET:
            tcp.set(key, req.value)
            return pb.StoreReply()
        if req.op == pb.STORE_OP_ADD:
            return pb.StoreReply(count=tcp.add(key, req.amount))
        if req.op == pb.STORE_OP_COMPARE_SET:
            return pb.StoreReply(value=tcp.compare_set(key, req.expected, req.value))
        if req.op == pb.STORE_OP_DELETE:
            return pb.StoreReply(found=tcp.delete_key(key))
        return pb.StoreReply(count=tcp.num_keys())

    return ServerStore(call, worker_id=rank + 1, quorum_id=1, timeout_s=60.0)


def nccl_child(rank: int, port: int, device: str) -> int:
    """One rank of ``check_nccl``: sum a pinned buffer of (rank + 1)s with the other rank, the
    group built over a ``ServerStore`` as in sync mode."""
    import torch

    from asyncdiloco.worker.collectives import QuorumCollectives, QuorumGroup
    from asyncdiloco.worker.flat import host_buffer

    torch.cuda.set_device(torch.device(device))
    buf = host_buffer(1 << 20, pin=True).fill_(rank + 1.0)  # (2^20,) fp32
    group = QuorumGroup(quorum_id=1, rank=rank, world_size=2, store=_server_store_over(port, rank))
    started = time.monotonic()
    try:
        QuorumCollectives("127.0.0.1", None, torch.device(device)).allreduce_sum(buf, group, timeout_s=60.0)
        ok, error = bool((buf == 3.0).all()), ""
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        ok, error = False, f"{type(exc).__name__}: {exc}"
    print(json.dumps({"nccl_rank": rank, "ok": ok, "seconds": time.monotonic() - started, "error": error[-2000:]}))
    return 0


def _cuda_seconds(fn: Callable[[], Any], repeats: int) -> float:
    """Median seconds of ``fn`` on the current CUDA stream, timed with CUDA events."""
    import torch

    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def check_transfer(mib: int, repeats: int = 5) -> dict:
    """Push + pull and the pinned-buffer copies of a ``mib`` MiB model, against raw pinned copies."""
    import torch
    from torch import nn

    from asyncdiloco.worker.async_worker import AsyncDiLoCoWorker
    from asyncdiloco.worker.config import WorkerConfig

    numel = mib * 2**20 // 4
    model = nn.ParameterList([nn.Parameter(torch.zeros(numel // 8, device="cuda")) for _ in range(8)])
    nbytes = 4 * sum(p.numel() for p in model)
    host, device = torch.empty(nbytes // 4, pin_memory=True), torch.empty(nbytes // 4, device="cuda")
    h2d = _cuda_seconds(lambda: device.copy_(host, non_blocking=True), repeats)
    d2h = _cuda_seconds(lambda: host.copy_(device, non_blocking=True), repeats)
    srv = _server(local_steps=1, max_payload_bytes=4 * nbytes)
    try:
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        for p in model:
            p.grad = torch.zeros_like(p)
        with AsyncDiLoCoWorker(model, opt, WorkerConfig(server=srv.address)) as worker:
            flat, buf = worker.flat, worker._base
            copy_in = median_seconds(lambda: flat.copy_into(buf), repeats)
            load = median_seconds(lambda: flat.load(buf), repeats)
            sync = median_seconds(opt.step, repeats)  # H = 1: every step pushes Δ and pulls θ_g
            pinned = buf.is_pinned()
    finally:
        srv.stop(None)
    pinned_s = h2d + d2h
    return {
        "check": "transfer",
        "ok": bool(pinned) and worker.stats.sync_failures == 0,
        "model_mib": nbytes / 2**20,
        "pinned_h2d_gb_per_s": nbytes / h2d / 1e9,
        "pinned_d2h_gb_per_s": nbytes / d2h / 1e9,
        "copy_into_s": copy_in,
        "load_s": load,
        "push_pull_s": sync,
        "flat_copies_vs_pinned": (copy_in + load) / pinned_s,
        "push_pull_vs_pinned": sync / pinned_s,
        "summary": f"{nbytes / 2**20:.0f} MiB: pinned copies {pinned_s * 1e3:.1f} ms "
        f"(H2D {nbytes / h2d / 1e9:.1f} GB/s, D2H {nbytes / d2h / 1e9:.1f} GB/s); worker copies "
        f"{(copy_in + load) / pinned_s:.2f}x, push+pull {sync:.2f} s = {sync / pinned_s:.1f}x",
    }


# --------------------------------------------------------------------- running
def run_checks(args: argparse.Namespace, emit: Callable[[dict], None]) -> list[dict]:
    """Run the chosen checks in order; a check that raises is a failed check."""
    import torch

    from asyncdiloco.wire.codec import WIRE_CODECS

    out = pathlib.Path(args.out)
    plan: list[tuple[str, Callable[[], dict]]] = []
    if "demo" in args.checks:
        plan.append(("demo", lambda: check_demo(out, args.demo_seconds)))
    if "codecs" in args.checks:
        plan += [(f"codec {n}", functools.partial(check_codec, n)) for n in WIRE_CODECS]
    if "nccl" in args.checks:
        plan.append(("nccl", lambda: check_nccl(out)))
        if torch.cuda.device_count() >= 2:
            gpus = ("cuda:0", "cuda:1")
            plan.append(("sync demo", lambda: check_demo(out, args.demo_seconds, mode="sync", devices=gpus)))
    if "transfer" in args.checks:
        plan.append(("transfer", lambda: check_transfer(args.transfer_mib)))
    results = []
    for name, check in plan:
        started = time.monotonic()
        try:
            result = check()
        except Exception as exc:  # noqa: BLE001 - a check that raises failed; the others still run
            result = {"check": name, "ok": False, "summary": f"{type(exc).__name__}: {exc}"[:300]}
        result["seconds"] = round(time.monotonic() - started, 2)
        emit(result)
        results.append(result)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.nccl_rank is not None:
        return nccl_child(args.nccl_rank, args.nccl_port, args.nccl_device)
    import torch

    if not torch.cuda.is_available():
        print(SKIP_LINE, flush=True)
        return 0
    limit_s = int(os.environ.get("GPU_CHECK_TIMEOUT_S", "290"))
    signal.signal(signal.SIGALRM, _out_of_time)
    signal.alarm(limit_s)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    header = {
        "check": "machine",
        "gpus": gpus,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else None,
    }
    with open(out / "gpu_check.jsonl", "w") as log:

        def emit(result: dict) -> None:
            line = json.dumps(result, default=_jsonable)
            print(line, flush=True)
            log.write(line + "\n")
            log.flush()

        emit(header)
        results = run_checks(args, emit)
    print(f"gpu_check: {', '.join(gpus)}; torch {header['torch']} (CUDA {header['cuda']})")
    print("\n".join(summary_lines(results)), flush=True)
    return exit_status(results)


def _out_of_time(signum: int, frame: Any) -> None:
    limit = os.environ.get("GPU_CHECK_TIMEOUT_S", "290")
    print(
        f"gpu_check: stopped after the time limit of {limit} s (GPU_CHECK_TIMEOUT_S); the lines above are the "
        "checks that finished",
        file=sys.stderr,
        flush=True,
    )
    raise SystemExit(124)  # unwinds the checks' context managers, which stop their processes


def _jsonable(value: Any) -> Any:
    return value if not isinstance(value, float) or math.isfinite(value) else str(value)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "4")
    sys.exit(main())
