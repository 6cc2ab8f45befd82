"""The synchronous worker: LocalSGD and synchronous DiLoCo over quorum-gated allreduce.

Same user-facing shape as ``AsyncDiLoCoWorker``; the loop stays a plain PyTorch loop::

    worker = SyncDiLoCoWorker(model, inner_opt, WorkerConfig(server="10.0.0.5:29500"),
                              tokens_per_step=batch * context)
    with worker:                       # join; pull the committed global state
        for x, y in batches:
            loss_fn(model(x), y).backward()
            inner_opt.step()           # every H-th step also runs a round
            inner_opt.zero_grad()

Every H inner steps (H, the outer optimizer and the weighting come from the server,
which must run ``--mode sync``) the worker runs one **round** (DiLoCo, Douillard et al.
2023, arXiv 2311.08105, Alg. 1, with the outer step taken by every replica):

1. Δ = θ_base − θ_local into a separate buffer (a copy: θ_local stays in the model).
2. ``Quorum``: wait for the round's quorum (ps/quorum.py). If the server says *heal*
   (this worker's θ_base is from another committed round: it joined late, or missed a
   commit), pull the server's committed θ and outer momentum, and contribute weight 0.
3. A fresh process group for this quorum over the server's TCPStore, prefix
   ``q<quorum_id>`` (collectives.py: gloo for CPU tensors; NCCL when the model is on
   CUDA, which is written but untested: the project has no GPU CI), with a bounded timeout
   (``allreduce_timeout_s``): one allreduce (sum) of ``[w·Δ, w]``, float32 (N+1,), so
   Δ̄ = Σ w_i Δ_i / Σ w_i (w = 1: mean; w = tokens: token-weighted mean).
4. Rank 0 uploads Δ̄ to the server (``PUSH_KIND_ROUND_RESULT``); every member votes
   (``Commit``). A dead member fails the collective on the others at once, a hung one
   after ``allreduce_timeout_s``; they vote failure and the server aborts the round.
5. On commit every member applies the same ``OuterOptimizer`` step (outer.py, the code
   the async server uses) to θ_base: ``sgd`` with η = 1, μ = 0 is LocalSGD (θ_base
   becomes the members' mean); ``nesterov`` is synchronous DiLoCo. θ_base goes into
   the model. On abort the round is discarded: the model restarts from θ_base of the
   last committed round (its local steps are lost; restoring θ_local instead would let
   replicas drift apart, breaking "every member starts each round from identical
   parameters").

The inner optimizer's state is kept across rounds. If no quorum forms within
``quorum_timeout_s`` or the server is unreachable, training goes on locally and the
next sync point tries again (Δ then spans more steps, still against θ_base).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import time
import zlib

import torch
from torch import nn

from asyncdiloco.algo.config import OuterConfig
from asyncdiloco.algo.outer import OuterOptimizer
from asyncdiloco.errors import AsyncDiLoCoError, ConfigError, NotInitializedError
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.worker.base import WorkerBase
from asyncdiloco.worker.collectives import QuorumCollectives
from asyncdiloco.worker.config import SyncWorkerConfig, WorkerConfig

log = logging.getLogger(__name__)


@dataclasses.dataclass
class SyncWorkerStats:
    """Counters of one sync worker (units in the names).

    ``idle_s`` is the time spent waiting for the quorum, in the collective, uploading
    and waiting for the commit decision (what a faster worker loses to a slower one).
    ``rounds`` has one entry per quorum taken part in: ``round`` (committed rounds
    after it), ``committed``, ``heal``, ``world_size``, the time parts in seconds and
    ``checksum`` (CRC-32 of θ_base's float32 bytes after it).
    """

    inner_steps: int = 0
    tokens: int = 0
    rounds_committed: int = 0
    rounds_failed: int = 0
    rounds_skipped: int = 0
    heals: int = 0
    sync_failures: int = 0
    bytes_pushed: int = 0
    bytes_pulled: int = 0
    bytes_allreduced: int = 0
    comm_s: float = 0.0
    #: Seconds the training thread spent in sync points (equals ``comm_s`` here: no overlap).
    blocked_s: float = 0.0
    idle_s: float = 0.0
    quorum_wait_s: float = 0.0
    allreduce_s: float = 0.0
    rounds: list[dict] = dataclasses.field(default_factory=list)


class SyncDiLoCoWorker(WorkerBase):
    """Synchronous DiLoCo / LocalSGD around ``model`` and ``inner_optimizer``.

    Args:
        model: any ``nn.Module`` with float32/bfloat16/float16 parameters; every member
            must have the same manifest (names, shapes, dtypes).
        inner_optimizer: the optimizer the user steps (e.g. AdamW); its ``step`` is hooked.
        config: server address, deadlines, backoff.
        sync: collective timeout, quorum wait, bind address, fault injection.
        tokens_per_step: tokens per inner step (the "tokens" weighting uses them).
    Raises:
        ModeMismatchError (from ``join``): the server does not run ``--mode sync``.
        ManifestMismatchError (from ``join``): the model differs from the server's.
        ServerUnavailableError (from ``join``): no server within ``join_timeout_s``.
    """

    mode = "sync"

    def __init__(
        self,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        config: WorkerConfig,
        *,
        sync: SyncWorkerConfig | None = None,
        tokens_per_step: int = 0,
    ) -> None:
        if config.overlap:  # refused, not ignored: a round is a barrier, there is nothing to overlap with
            raise ConfigError(
                "overlap=True is invalid for the sync worker: a sync round is a barrier every member waits at; "
                "drop --overlap, or run asynchronously (server and worker with --mode async)"
            )
        super().__init__(model, inner_optimizer, config, tokens_per_step)
        self.sync_config = sync or SyncWorkerConfig()
        n = self._numel = self.manifest.numel
        self._base = torch.zeros(n, dtype=torch.float32, pin_memory=self._on_cuda)  # θ_base, (N,) fp32
        self._buf = torch.zeros(n + 1, dtype=torch.float32, pin_memory=self._on_cuda)  # [w·Δ, w], (N+1,)
        self._server_host = config.server.rpartition(":")[0].strip("[]")
        self.stats = SyncWorkerStats()
        self.round = -1  # committed rounds θ_base reflects; -1 before the first pull
        self.run_config: pb.RunConfig | None = None
        self.outer: OuterOptimizer | None = None
        self._collectives = QuorumCollectives(self._server_host, self.sync_config.collective_host, self._on_cuda)
        self._fault_fired = False

    # ------------------------------------------------------------ lifecycle
    def _mode_mismatch_message(self, server_mode: str) -> str:
        return (
            f"mode mismatch: the server at {self.config.server} runs mode {server_mode!r}; "
            f"SyncDiLoCoWorker needs `asyncdiloco server --mode sync` (or use AsyncDiLoCoWorker)"
        )

    def _join_once(self) -> None:
        if not self.worker_id:
            reply = self._register()
            if reply.run_config.join_timeout_s < self.sync_config.allreduce_timeout_s:
                log.warning(
                    "the server's join_timeout_s=%g is below this worker's allreduce_timeout_s=%g: after a failed "
                    "round a quorum may form before every survivor is back, splitting the replicas; start the "
                    "server with a larger --join-timeout-s", reply.run_config.join_timeout_s,
                    self.sync_config.allreduce_timeout_s,
                )  # fmt: skip
            self.run_config = reply.run_config
        if self._must_initialize:  # a retry resends push_id 1: applied at most once
            self._copy_model_into(self._base)
            self.client.push(
                self.manifest.pack_flat(self._base), worker_id=self.worker_id, push_id=1, base_version=0,
                kind=pb.PUSH_KIND_INITIAL_PARAMETERS,
            )  # fmt: skip
            self._must_initialize = False
            log.info("worker %d initialized the global model", self.worker_id)
        try:
            self._heal()  # NotInitializedError until the initial parameters arrive
        except NotInitializedError:
            self._take_over_initialization_if_told()
            raise

    def close(self) -> None:
        """Leave (so that no quorum waits for this worker) and release resources. Steps
        taken since the last round are not synchronized."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._hook.remove()
        self._close_connection()
        self._collectives.close()

    # ---------------------------------------------------------------- rounds
    def _sync_once(self) -> bool:
        """One round: quorum, allreduce, commit vote. True when it committed; False when
        it was aborted (the model restarts from the last committed θ_base) or no quorum
        formed (training goes on; the next sync point asks again)."""
        return self._round()

    # ------------------------------------------------------------- the round
    def _round(self) -> bool:
        n, buf, cfg = self._numel, self._buf, self.sync_config
        steps, tokens = self._steps_since_sync, self._tokens_since_sync
        delta = buf[:n]
        self._copy_model_into(delta)
        torch.sub(self._base, delta, out=delta)  # Δ = θ_base − θ_local, a copy, (N,)

        t0 = time.monotonic()
        # Wait at least the server's join timeout, or a quorum waiting on it could never form.
        wait_s = max(cfg.quorum_timeout_s, self.run_config.join_timeout_s + 1.0)
        q = self.client.quorum(
            worker_id=self.worker_id, round=self.round, manifest_hash=self.manifest.manifest_hash, timeout_s=wait_s,
        )  # fmt: skip
        quorum_wait_s = time.monotonic() - t0
        self.stats.quorum_wait_s += quorum_wait_s
        self.stats.idle_s += quorum_wait_s
        if not q.formed:
            self.stats.rounds_skipped += 1
            log.warning("no quorum within %g s; training on locally", wait_s)
            return False

        t1 = time.monotonic()
        success, reason = True, ""
        if q.heal:
            log.info(
                "worker %d heals before quorum %d: round %d -> %d", self.worker_id, q.quorum_id, self.round, q.round
            )
            try:
                self._heal()
            except AsyncDiLoCoError as exc:  # vote failure rather than leave the others waiting
                success, reason = False, f"could not pull the committed state to heal: {exc}"
            if success and self.round != q.round:
                success, reason = False, f"healed to round {self.round} but the quorum is at round {q.round}"
        weight = 0.0
        if not q.heal and steps > 0:
            weight = 1.0 if self.run_config.sync_weighting != "tokens" else float(tokens)
            if not bool(torch.isfinite(delta).all()):
                log.error("worker %d: pseudo-gradient not finite after %d steps (diverged); it contributes "
                          "weight 0 and restarts from the global model", self.worker_id, steps)  # fmt: skip
                weight = 0.0
        if weight == 0.0:
            delta.zero_()
        elif weight != 1.0:
            delta.mul_(weight)
        buf[n] = weight
        if success:
            try:
                self._allreduce(q)
                self.stats.bytes_allreduced += buf.numel() * 4
            except Exception as exc:  # noqa: BLE001 - any collective failure fails the round here
                success, reason = False, f"allreduce failed after {time.monotonic() - t1:.2f} s: {exc}"
                log.warning("worker %d, quorum %d: %s", self.worker_id, q.quorum_id, reason)
        total_weight = float(buf[n]) if success else 0.0
        if success and total_weight > 0:
            delta.div_(total_weight)  # Δ̄ = Σ w_i Δ_i / Σ w_i
            if q.rank == 0:
                try:
                    self.client.push(
                        delta.view(torch.uint8), worker_id=self.worker_id, push_id=q.quorum_id,
                        base_version=q.round, kind=pb.PUSH_KIND_ROUND_RESULT, quorum_id=q.quorum_id,
                    )  # fmt: skip
                    self.stats.bytes_pushed += n * 4
                except AsyncDiLoCoError as exc:
                    success, reason = False, f"rank 0 could not upload the round result: {exc}"
        allreduce_s = time.monotonic() - t1

        t2 = time.monotonic()
        decision = self._vote(q, success, total_weight, 0 if q.heal else tokens, 0 if q.heal else steps, reason)
        commit_wait_s = time.monotonic() - t2
        self.stats.allreduce_s += allreduce_s
        self.stats.idle_s += allreduce_s + commit_wait_s

        if decision.committed:
            if total_weight > 0:
                # the same step on every member and on the server, at the round it started from
                self.outer.step(delta, version=decision.round - 1)
            self.round = decision.round
            self.stats.rounds_committed += total_weight > 0  # an all-healing round applies nothing
        else:
            self.stats.rounds_failed += 1
            log.warning("worker %d: round of quorum %d aborted (%s); restarting from round %d",
                        self.worker_id, q.quorum_id, decision.reason, self.round)  # fmt: skip
        self._load_base_into_model()  # commit: the new global model; abort: the last committed one
        self._steps_since_sync = 0
        self._tokens_since_sync = 0
        self.stats.rounds.append({
            "round": self.round, "quorum_id": q.quorum_id, "committed": decision.committed, "heal": q.heal,
            "world_size": q.world_size, "rank": q.rank, "quorum_wait_s": round(quorum_wait_s, 4),
            "allreduce_s": round(allreduce_s, 4), "commit_wait_s": round(commit_wait_s, 4),
            "end_s": time.monotonic(), "checksum": self.checksum(), "reason": decision.reason,
        })  # fmt: skip
        return decision.committed

    def _vote(self, q: pb.QuorumReply, success: bool, total_weight: float, tokens: int, steps: int,
              reason: str) -> pb.CommitReply:  # fmt: skip
        while True:
            reply = self.client.commit(
                worker_id=self.worker_id, quorum_id=q.quorum_id, success=success, total_weight=total_weight,
                num_tokens=tokens, num_local_steps=steps, reason=reason,
                timeout_s=max(1.0, q.round_deadline_s + 1.0),
            )  # fmt: skip
            if reply.decided:
                return reply

    def _allreduce(self, q: pb.QuorumReply) -> None:
        """Sum ``[w·Δ, w]`` over the quorum's members in a fresh process group, with
        the fault injection of ``SyncWorkerConfig`` (``fail_at_round``, ``fail_mode``)."""
        cfg = self.sync_config
        failing = (
            cfg.fail_at_round is not None and q.round + 1 >= cfg.fail_at_round
            and q.world_size >= cfg.fail_min_world_size and not self._fault_fired
        )  # fmt: skip
        self._fault_fired |= failing  # once: the retried round goes through
        if failing and cfg.fail_mode == "raise":
            raise RuntimeError(f"injected fault at round {cfg.fail_at_round}")
        if failing and cfg.fail_mode == "hang":
            log.warning("fault injection: hanging in round %d", cfg.fail_at_round)
            threading.Event().wait()  # never returns; the heartbeat thread keeps the lease

        def die() -> None:
            log.warning("fault injection: SIGKILL with the allreduce of round %d in flight", q.round + 1)
            os.kill(os.getpid(), signal.SIGKILL)

        self._collectives.allreduce_sum(
            self._buf, quorum_id=q.quorum_id, rank=q.rank, world_size=q.world_size, store_host=q.store_host,
            store_port=q.store_port, timeout_s=cfg.allreduce_timeout_s,
            in_flight=die if failing and cfg.fail_mode == "kill" else None,
        )  # fmt: skip

    # ------------------------------------------------------------- internals
    def _heal(self) -> None:
        """Pull the committed θ and outer momentum and load them (θ_base and model)."""
        rc = self.run_config
        with_momentum = rc.outer_momentum > 0
        pulled = self.client.pull_sync_state(self.manifest, self.worker_id, with_momentum)
        state = pulled.payload.view(torch.float32)  # (k·N,)
        n = self._numel
        self._base.copy_(state[:n])
        if self.outer is None:
            cfg = OuterConfig(
                optimizer=rc.outer_optimizer,
                lr=rc.outer_lr,
                momentum=rc.outer_momentum,
                lr_schedule=rc.outer_lr_schedule or "constant",
                lr_warmup_versions=rc.outer_lr_warmup_versions,
                lr_total_versions=rc.outer_lr_total_versions,
                lr_min_ratio=rc.outer_lr_min_ratio,
            )  # the server's, so that every member's outer step equals the server's bit for bit
            self.outer = OuterOptimizer(self._base, cfg)
        if with_momentum:
            self.outer.momentum_buffer.copy_(state[n : 2 * n])
        self.round = pulled.version
        self.local_steps = pulled.run_config.local_steps or self.local_steps
        self._load_base_into_model()
        self._steps_since_sync = 0
        self._tokens_since_sync = 0
        self.stats.heals += 1
        self.stats.bytes_pulled += pulled.payload.numel()

    def checksum(self) -> int:
        """CRC-32 of θ_base's float32 bytes: equal on every member after each round."""
        return zlib.crc32(memoryview(self._base.numpy()).cast("B")) & 0xFFFFFFFF

    def _load_base_into_model(self) -> None:
        pos, parts = 0, []
        for p in self._params:
            parts.append(self._base[pos : pos + p.numel()])
            pos += p.numel()
        self._load_into_model(parts)
