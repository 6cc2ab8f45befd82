"""kill -9 the parameter server at random during an async run: is an acknowledged push
lost, or one applied twice? Worker processes (this module with ``--worker``) record every
push reply; every log segment and checkpoint is archived as it appears and checked
against the replies and one replay (docs/operations.md, "Chaos runs").

    python -m asyncdiloco.bench.chaos.server_kills [--kills 20] [--workers 4] [--seed 0] [--after-append] [--out DIR]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import logging
import os
import pathlib
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from asyncdiloco.bench.perf.harness import exit_on_sigterm, wait_for_port

#: Seconds a server may take from spawn to its port file, and workers to finish at the end.
START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 180.0
#: The flags the result line repeats.
RUN_SETTINGS = "kills workers seed mean_up_s local_steps checkpoint_every max_backoff_s after_append".split()


# ---------------------------------------------------------------------- the workers
def worker_main(argv: list[str]) -> int:
    """One worker process: trains the default job until ``--stop-file`` exists, writing
    one JSON line per push reply to ``--acks``."""
    p = argparse.ArgumentParser()
    p.add_argument("--server", required=True)
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--acks", required=True)
    p.add_argument("--stop-file", required=True)
    p.add_argument("--max-backoff-s", type=float, default=2.0)
    args = p.parse_args(argv)

    import torch

    from asyncdiloco.job.config import JobConfig
    from asyncdiloco.job.dataset import BatchStream, CharCorpus
    from asyncdiloco.job.models import lm_loss
    from asyncdiloco.worker.async_worker import AsyncDiLoCoWorker
    from asyncdiloco.worker.client import ParameterServerClient
    from asyncdiloco.worker.config import WorkerConfig

    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    acks = open(args.acks, "a", buffering=1)  # noqa: SIM115 - open for the whole run
    push = ParameterServerClient.push

    def recorded_push(self: ParameterServerClient, payload: torch.Tensor, **kw: Any) -> Any:
        ids = {"worker_id": kw["worker_id"], "push_id": kw["push_id"]}
        try:
            reply = push(self, payload, **kw)
        except Exception as exc:
            acks.write(json.dumps({"t": time.time(), **ids, "error": type(exc).__name__}) + "\n")
            raise
        outcome = {"kind": int(kw.get("kind", 0)), "applied": reply.applied, "duplicate": reply.duplicate}
        acks.write(json.dumps({"t": time.time(), **ids, **outcome, "version": reply.version}) + "\n")
        return reply

    ParameterServerClient.push = recorded_push  # type: ignore[method-assign]

    job = JobConfig()
    corpus = CharCorpus.default()
    model = job.build(corpus)
    inner, _ = job.build_inner(model.parameters())
    batches = BatchStream(corpus, job.batch_size, job.context_len, job.seed, args.index)
    config = WorkerConfig(server=args.server, worker_name=f"chaos-{args.index}", max_backoff_s=args.max_backoff_s)
    worker = AsyncDiLoCoWorker(model, inner, config, tokens_per_step=job.tokens_per_step)
    with worker:
        while not os.path.exists(args.stop_file):
            x, y = next(batches)
            lm_loss(model(x), y).backward()
            inner.step()  # every H-th step pushes and pulls
            inner.zero_grad(set_to_none=True)
    counters = ("inner_steps", "pushes_applied", "pushes_refused", "sync_failures")
    print(json.dumps({"index": args.index, **{k: getattr(worker.stats, k) for k in counters}}), flush=True)
    acks.close()
    return 0


# ---------------------------------------------------------------------- the archive
class Archive:
    """Hard-links every ``wal-*.log`` and ``ckpt-*`` file of ``source`` into ``folder``
    as soon as it appears (polled every ``poll_s``), so pruning does not remove them."""

    def __init__(self, source: pathlib.Path, folder: pathlib.Path, poll_s: float = 0.02) -> None:
        self.source, self.folder, self.poll_s = source, folder, poll_s
        folder.mkdir(parents=True, exist_ok=True)
        self.inodes: dict[str, int] = {}
        #: Names that came back with another inode (a file replaced, not appended to).
        self.replaced: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="archive", daemon=True)

    def start(self) -> Archive:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.poll()
            self._stop.wait(self.poll_s)

    def poll(self) -> None:
        for pattern in ("wal-*.log", "ckpt-*.json", "ckpt-*.pt"):
            for path in self.source.glob(pattern):
                try:
                    inode = path.stat().st_ino
                except FileNotFoundError:
                    continue  # pruned meanwhile
                known = self.inodes.get(path.name)
                if known == inode:
                    continue
                target = self.folder / path.name
                if known is not None:
                    self.replaced.append(path.name)
                    target = self.folder / f"{path.name}.{len(self.replaced)}"
                with contextlib.suppress(FileNotFoundError):
                    os.link(path, target)
                    self.inodes[path.name] = inode

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.poll()


# ---------------------------------------------------------------------- the server
class Server:
    """The server process, restarted on the same folder and port."""

    def __init__(self, out: pathlib.Path, args: argparse.Namespace) -> None:
        self.out, self.args = out, args
        self.state = out / "state"
        self.port_file = out / "port"
        self.port = 0
        self.lives = 0
        self.popen: subprocess.Popen | None = None

    def start(self) -> float:
        """Spawn it and wait for its port file; returns the seconds that took."""
        self.port_file.unlink(missing_ok=True)
        self.lives += 1
        cmd = [sys.executable, "-m", "asyncdiloco", "server", "--port", str(self.port), "--drain-s", "0"]
        cmd += ["--port-file", str(self.port_file), "--checkpoint-dir", str(self.state)]
        cmd += ["--local-steps", str(self.args.local_steps), "--checkpoint-every", str(self.args.checkpoint_every)]
        log = open(self.out / f"server-{self.lives:02d}.log", "w")  # noqa: SIM115 - the child holds it
        started = time.monotonic()
        self.popen = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        self.port = wait_for_port(self.popen, self.port_file, START_TIMEOUT_S, pathlib.Path(log.name))
        return time.monotonic() - started

    def kill(self) -> None:
        assert self.popen is not None
        self.popen.send_signal(signal.SIGKILL)
        self.popen.wait()

    def stop(self) -> int:
        assert self.popen is not None
        self.popen.send_signal(signal.SIGTERM)
        try:
            return self.popen.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.kill()
            return -9


def _wait_for_an_append(state: pathlib.Path, timeout_s: float = 30.0) -> float:
    """Seconds until the newest log segment grows (a record was just appended and fsynced:
    its push is being applied, or its reply is being sent or held); polled every 1 ms."""

    def size() -> int:
        segments = sorted(state.glob("wal-*.log"))
        try:
            return segments[-1].stat().st_size if segments else 0
        except FileNotFoundError:
            return 0

    started = time.monotonic()
    before = size()
    while size() <= before and time.monotonic() - started < timeout_s:
        time.sleep(0.001)
    return time.monotonic() - started


def _acked_count(ack_files: list[pathlib.Path]) -> list[int]:
    counts = []
    for path in ack_files:
        lines = path.read_text().splitlines() if path.exists() else []
        counts.append(sum(1 for line in lines if '"applied": true' in line))
    return counts


# ---------------------------------------------------------------------- the checks
def _read_archive(folder: pathlib.Path) -> tuple[dict[int, Any], list[str]]:
    """Records of every archived log segment by LSN, and conflicts (one LSN, two contents)."""
    from asyncdiloco.ps.durable.wal import read_segment

    records: dict[int, Any] = {}
    conflicts = []
    for path in sorted(folder.glob("wal-*.log*")):
        for rec in read_segment(path, is_last=True, repair=False):  # a torn tail reads as the end
            seen = records.get(rec.lsn)
            if seen is not None and (seen.meta != rec.meta or seen.payload != rec.payload):
                conflicts.append(f"LSN {rec.lsn} in {path.name}")
            records[rec.lsn] = rec
    return records, conflicts


def _replay_identical(archive: pathlib.Path, state_dir: pathlib.Path, work: pathlib.Path) -> dict:
    """Replay the whole archived log on the first (empty) checkpoint and compare with the
    final server's state (its newest checkpoint plus the log after it)."""
    import torch

    from asyncdiloco.ps.durable.store import DurableStore, read_only_config
    from asyncdiloco.ps.state import ParameterServerState
    from asyncdiloco.tools.export import restore

    first = sorted(archive.glob("ckpt-*.json"))[0].stem  # ckpt-<LSN 0>
    work.mkdir()
    for path in archive.glob(f"{first}.*"):
        os.link(path, work / path.name)
    for path in archive.glob("wal-*.log"):
        os.link(path, work / path.name)
    config = read_only_config(work)
    replayed = ParameterServerState(config)
    assert config.durability is not None
    DurableStore(config.durability, config).restore_read_only(replayed.durability)
    final, _lsn = restore(state_dir)
    assert replayed.params is not None and final.params is not None, "a run that pushed is initialized"
    same = replayed.version == final.version and torch.equal(replayed.params, final.params)
    rb, fb = replayed.model.outer_buffers(), final.model.outer_buffers()
    same = same and rb.keys() == fb.keys() and all(torch.equal(rb[k], fb[k]) for k in rb)
    return {
        "replay_identical": bool(same),
        "replayed_version": replayed.version,
        "final_version": final.version,
        "first_checkpoint": first,
    }


def check(out: pathlib.Path, archive: Archive, ack_files: list[pathlib.Path]) -> dict:
    from asyncdiloco.ps.durable.wal import PUSH
    from asyncdiloco.wire._proto import parameter_server_pb2 as pb

    records, conflicts = _read_archive(archive.folder)
    lsns = sorted(records)
    gaps = [lsn for lsn in range(1, lsns[-1] + 1) if lsn not in records] if lsns else []
    pushes = [r for r in records.values() if r.kind == PUSH]
    applied = collections.Counter((r.meta["worker_id"], r.meta["push_id"]) for r in pushes)
    pseudo = sum(1 for r in pushes if r.meta["kind"] == pb.PUSH_KIND_PSEUDO_GRADIENT)
    acked: set[tuple[int, int]] = set()
    replies = dropped = errors = resent = 0
    for path in ack_files:
        for line in path.read_text().splitlines():
            r = json.loads(line)
            if "error" in r:
                errors += 1
                continue
            replies += 1
            if r["applied"]:
                acked.add((r["worker_id"], r["push_id"]))
                resent += r["duplicate"]  # logged by a server that died (or replied too late) before answering
            else:
                dropped += 1
    lost = sorted(acked - set(applied))
    twice = sorted(k for k, n in applied.items() if n > 1)
    result = {
        "log_records": len(records),
        "archive_complete": not gaps and not conflicts and not archive.replaced,
        "lsn_gaps": gaps[:20],
        "conflicts": conflicts[:20],
        "replaced_files": archive.replaced,
        "push_replies": replies,
        "push_errors": errors,
        "acknowledged": len(acked),
        "acknowledged_as_duplicate": resent,
        "not_applied_replies": dropped,
        "applied": len(applied),
        "applied_not_acknowledged": len(set(applied) - acked),
        "lost": len(lost),
        "lost_ids": [list(k) for k in lost[:20]],
        "applied_twice": len(twice),
        "applied_twice_ids": [list(k) for k in twice[:20]],
        "pseudo_gradients_logged": pseudo,
    }
    logs = [path.read_text() for path in sorted(out.glob("server-*.log"))]
    result["torn_tails_cut"] = sum(text.count("dropping a torn record") for text in logs)
    # a worker whose pushes all failed for lease_s (the server kept dying) is dated by its last
    # logged contact and expires at the restart; it rejoins under its name, with its id
    result["leases_expired"] = sum(text.count("lease expired") for text in logs)
    result["records_replayed_at_starts"] = sum(
        int(n) for text in logs for n in re.findall(r"checkpoint ckpt-\d+ and (\d+) log records", text)
    )
    result.update(_replay_identical(archive.folder, out / "state", out / "replay"))
    result["version_matches"] = result["final_version"] == pseudo
    return result


# ---------------------------------------------------------------------- the run
def _event(event: str, began: float, **fields: Any) -> None:
    """One progress line: the event, its fields and the seconds since ``began``."""
    elapsed_s = round(time.monotonic() - began, 1)
    print(json.dumps({"bench": "chaos_server_kills", "event": event, **fields, "elapsed_s": elapsed_s}), flush=True)


def run(args: argparse.Namespace, out: pathlib.Path) -> dict:
    rng = random.Random(args.seed)
    server = Server(out, args)
    archive = Archive(server.state, out / "archive").start()
    stop_file = out / "stop"
    ack_files = [out / f"acks-{i}.jsonl" for i in range(args.workers)]
    workers: list[subprocess.Popen] = []
    began = time.monotonic()
    try:
        first_start_s = server.start()
        address = f"127.0.0.1:{server.port}"
        for i in range(args.workers):
            cmd = [sys.executable, "-m", "asyncdiloco.bench.chaos.server_kills", "--worker", "--server", address]
            cmd += ["--index", str(i), "--acks", str(ack_files[i]), "--stop-file", str(stop_file)]
            cmd += ["--max-backoff-s", str(args.max_backoff_s)]
            log = open(out / f"worker-{i}.log", "w")  # noqa: SIM115 - the child holds it
            workers.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
            log.close()
        while min(_acked_count(ack_files)) < 2:  # every worker past its first acknowledged push
            if any(w.poll() is not None for w in workers):
                raise RuntimeError(f"a worker exited early; see {out}/worker-*.log")
            if time.monotonic() - began > START_TIMEOUT_S * 2:
                raise RuntimeError(f"the workers did not get a push acknowledged; see {out}")
            time.sleep(0.1)
        _event("steady", began, first_start_s=round(first_start_s, 2))
        for n in range(1, args.kills + 1):
            up_s = rng.expovariate(1.0 / args.mean_up_s)
            time.sleep(up_s)
            if args.after_append:
                up_s += _wait_for_an_append(server.state)
            server.kill()
            restart_s = server.start()
            acknowledged = sum(_acked_count(ack_files))
            _event(
                "kill",
                began,
                kill=n,
                up_s=round(up_s, 3),
                restart_s=round(restart_s, 2),
                acknowledged_so_far=acknowledged,
            )
        time.sleep(args.tail_s)
        stop_file.touch()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        worker_rcs = []
        for w in workers:
            try:
                worker_rcs.append(w.wait(timeout=max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                w.kill()
                worker_rcs.append(w.wait())
        server_rc = server.stop()
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait()
        if server.popen is not None and server.popen.poll() is None:
            server.kill()
        archive.stop()
    result = {
        "bench": "chaos_server_kills",
        **{k: getattr(args, k) for k in RUN_SETTINGS},
        "worker_exit_codes": worker_rcs,
        "server_exit_code": server_rc,
        "completed": all(rc == 0 for rc in worker_rcs) and server_rc == 0,
        "wall_s": round(time.monotonic() - began, 1),
    }
    result.update(check(out, archive, ack_files))
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker_main(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=20, help="server SIGKILLs (default %(default)s)")
    p.add_argument("--workers", type=int, default=4, help="worker processes (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the kill times (default %(default)s)")
    p.add_argument(
        "--mean-up-s",
        type=float,
        default=3.0,
        help="mean seconds from listening to the kill (exponential; default %(default)s)",
    )
    p.add_argument("--local-steps", type=int, default=5, help="H, the server's --local-steps (default %(default)s)")
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=10,
        help="the server's --checkpoint-every, small so kills hit checkpoints and pruning too (default %(default)s)",
    )
    p.add_argument(
        "--max-backoff-s",
        type=float,
        default=2.0,
        help="the workers' longest wait between two "
        "sync tries (WorkerConfig.max_backoff_s; default %(default)s, the library's is 30)",
    )
    p.add_argument(
        "--after-append",
        action="store_true",
        help="after each drawn time, wait for the next log append and kill at once: aims the kills at the "
        "window between logging a push and answering it",
    )
    p.add_argument(
        "--tail-s", type=float, default=5.0, help="seconds of training after the last restart (default %(default)s)"
    )
    p.add_argument(
        "--out", help="keep the logs, the state folder and the archive here (default: a temp folder, removed)"
    )
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, exit_on_sigterm)  # the finally blocks reap the children
    with tempfile.TemporaryDirectory(prefix="chaos-server-") as tmp:
        out = pathlib.Path(args.out or tmp)
        out.mkdir(parents=True, exist_ok=not args.out)  # --out: a fresh folder
        print(json.dumps(run(args, out)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
