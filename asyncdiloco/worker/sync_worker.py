"""The synchronous worker (``SyncDiLoCoWorker``): LocalSGD and synchronous DiLoCo over a
quorum-gated allreduce (Douillard et al. 2023, arXiv 2311.08105, Alg. 1, the outer step
taken by every replica). ``_round`` runs one round, a method per phase; a failing phase
raises ``RoundFailed`` with the reason it votes. docs/protocol.md, "The sync round".
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
import zlib
from typing import Any

import torch
from torch import nn

from asyncdiloco.algo.config import OuterConfig
from asyncdiloco.algo.outer import OuterOptimizer
from asyncdiloco.errors import (
    AsyncDiLoCoError,
    ConfigError,
    InvalidPayloadError,
    NotInitializedError,
    RoundRefusedError,
)
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.worker.base import WorkerBase
from asyncdiloco.worker.collectives import (
    InFlightAllreduce,
    QuorumCollectives,
    QuorumGroup,
    QuorumProcessGroup,
    RoundFailed,
    agree,
    largest_magnitude,
    non_finite_sum_reason,
)
from asyncdiloco.worker.config import SyncWorkerConfig, WorkerConfig
from asyncdiloco.worker.drops import reset_diverged_state
from asyncdiloco.worker.stats import SyncWorkerStats

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _Vote:
    """This member's Commit vote on a round."""

    success: bool
    #: Σ w of the allreduce (0 when it did not complete).
    total_weight: float = 0.0
    #: Why this member votes failure ("" on success).
    reason: str = ""


class SyncDiLoCoWorker(WorkerBase):
    """Synchronous DiLoCo / LocalSGD around ``model`` and ``inner_optimizer``.

    Args:
        model: any ``nn.Module`` with float32/bfloat16/float16 parameters, the same on every member.
        inner_optimizer: the optimizer the user steps (e.g. AdamW); its ``step`` is hooked.
        config: server address, deadlines, backoff.
        sync: collective timeout, quorum wait, bind address.
        tokens_per_step: tokens per inner step (the "tokens" weighting uses them).
        process_group: as for ``AsyncDiLoCoWorker`` (rank 0 is the quorum member).

    ``with worker:`` joins (or call ``join()``), else the first inner step does.

    Raises:
        ModeMismatchError (from ``join``): the server does not run ``--mode sync``.
        ManifestMismatchError (from ``join``): the model differs from the server's.
        ServerUnavailableError (from ``join``): no server within ``join_timeout_s``.
    """

    mode = "sync"
    stats: SyncWorkerStats

    def __init__(
        self,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        config: WorkerConfig,
        *,
        sync: SyncWorkerConfig | None = None,
        tokens_per_step: int = 0,
        process_group: Any = "auto",
    ) -> None:
        if config.overlap:  # refused, not ignored: a round is a barrier, there is nothing to overlap with
            raise ConfigError(
                "overlap=True is invalid for the sync worker: a sync round is a barrier every member waits at; "
                "drop --overlap, or run asynchronously (server and worker with --mode async)"
            )
        super().__init__(model, inner_optimizer, config, tokens_per_step, process_group)
        self.sync_config = sync or SyncWorkerConfig()
        self.stats = SyncWorkerStats()
        self.round = -1  # committed rounds θ_base reflects; -1 before the first pull (rank 0's)
        #: Seconds of inner steps since the last decided round (the vote's ``compute_s``).
        self._compute_s = 0.0
        #: A sync point since the last decided round asked for a round (a decision resets it).
        self._tried = False
        if self.follower:  # it mirrors rank 0: no θ_base, no buffers, no quorum collectives
            return
        n = self._numel = self.manifest.numel
        self._base = self.flat.host_buffer()  # θ_base, (N,) fp32
        self._buf = self.flat.host_buffer(n + 1)  # [w·Δ, w], (N+1,) fp32
        self._largest = 0.0  # ‖Δ‖∞ of this member's Δ this round (inf: not finite; 0: healing)
        self._largest_by_rank: list[float] = []  # every member's, by rank (the agreement's result)
        self._server_host = config.server.rpartition(":")[0].strip("[]")
        self.run_config: pb.RunConfig | None = None
        self.outer: OuterOptimizer | None = None
        self._collectives = QuorumCollectives(self._server_host, self.sync_config.collective_host, self.flat.device)
        #: When the H inner steps of the coming sync point began (the last join or sync point's end), monotonic s.
        self._steps_began_at = time.monotonic()
        self._restore_saved_state()

    # ------------------------------------------------------------ lifecycle
    def _join_once(self) -> None:
        if not self.worker_id:
            reply = self._register()
            if reply.run_config.join_timeout_s < self.sync_config.allreduce_timeout_s:
                log.warning(
                    "the server's join_timeout_s=%g is below this worker's allreduce_timeout_s=%g: after a failed "
                    "round a quorum may form before every survivor is back, splitting the replicas; start the "
                    "server with a larger --quorum-wait-s",
                    reply.run_config.join_timeout_s,
                    self.sync_config.allreduce_timeout_s,
                )
            self.run_config = reply.run_config
        if self._must_initialize:  # a retry resends push_id 1: applied at most once
            self.client.push(
                self.manifest.pack_flat(self.flat.copy_into(self._base)),
                worker_id=self.worker_id,
                push_id=1,
                base_version=0,
                kind=pb.PUSH_KIND_INITIAL_PARAMETERS,
            )
            self._must_initialize = False
            log.info("worker %d initialized the global model", self.worker_id)
        try:
            self._heal()  # NotInitializedError until the initial parameters arrive
        except NotInitializedError:
            self._take_over_initialization_if_told()
            raise
        self._save_state()
        self._steps_began_at = time.monotonic()

    def _close_worker(self) -> None:
        """``close``: leave and release; steps since the last round are not synchronized."""
        self._close_connection()
        self._collectives.end_round()

    # ---------------------------------------------------------------- rounds
    def _sync_due(self) -> bool:
        """A sync point every H inner steps since the last round; a rejoin at once."""
        h = self.local_steps
        steps = self._steps_since_sync
        return steps >= h and (self._lost or not self._tried or steps % h == 0)

    def _wants_rate(self, run_config: pb.RunConfig) -> bool:
        """The server sizes each member's H_w by its rate (``--sync-local-steps adaptive``)."""
        return run_config.sync_local_steps == "adaptive"

    def _sync_once(self) -> bool:
        """One round; True when it committed, False when aborted or no quorum formed."""
        self._compute_s += time.monotonic() - self._steps_began_at
        self._tried = True
        try:
            return self._round()
        finally:
            self._steps_began_at = time.monotonic()

    def _round_compute_s(self, steps: int) -> float:
        """The vote's ``compute_s`` for ``steps``: steps / v_w, or (none timed) the training
        time since the last decided round."""
        return self.step_rate.seconds_for(steps) or self._compute_s

    def _round(self) -> bool:
        """Quorum → heal or weigh Δ → allreduce and upload → vote → apply the decision; a
        failing phase still votes, so the others are not left waiting."""
        steps, tokens = self._steps_since_sync, self._tokens_since_sync
        compute_s = self._round_compute_s(steps) if steps else 0.0
        delta = self._take_pseudo_gradient()
        started = time.monotonic()
        q = self._wait_for_quorum()
        quorum_wait_s = time.monotonic() - started
        if q is None:
            return False
        started = time.monotonic()
        vote = self._contribute(q, delta, steps, tokens, started)
        allreduce_s = time.monotonic() - started
        started = time.monotonic()
        try:
            decision = self._vote(
                q, vote, tokens=0 if q.heal else tokens, steps=0 if q.heal else steps, compute_s=compute_s
            )
        finally:
            self._collectives.end_round()  # the quorum's rendezvous store closes with its round
        commit_wait_s = time.monotonic() - started
        self.stats.allreduce_s += allreduce_s
        self.stats.idle_s += allreduce_s + commit_wait_s
        self._apply_decision(q, decision, delta, vote.total_weight)
        self._record_round(q, decision, steps, quorum_wait_s, allreduce_s, commit_wait_s)
        self._count_dropped(q, decision.committed, steps)
        return decision.committed

    def _count_dropped(self, q: pb.QuorumReply, committed: bool, steps: int) -> None:
        """After a decided round: count the steps an abort dropped, and a non-finite Δ."""
        if q.heal or steps == 0:
            return
        if not committed:
            self.stats.steps_dropped += steps
        if math.isfinite(self._largest):
            self.drops.applied()
            return
        self.stats.non_finite_rounds += 1
        reset_diverged_state(self.inner_optimizer, self.worker_id)
        self.drops.note(
            InvalidPayloadError,
            f"its pseudo-gradient of {steps} inner steps in quorum {q.quorum_id} was not finite (NaN/Inf)",
            "the local model diverges: lower the inner learning rate (--inner-lr) or clip the gradients",
        )
        self._raise_if_dropping_every_push()

    def _record_round(
        self,
        q: pb.QuorumReply,
        decision: pb.CommitReply,
        steps: int,
        quorum_wait_s: float,
        allreduce_s: float,
        commit_wait_s: float,
    ) -> None:
        """One entry of ``stats.rounds`` (SyncWorkerStats), the phases' seconds included."""
        self.stats.groups_built = self._collectives.groups_built
        self.stats.groups_reused = self._collectives.groups_reused
        self.stats.rounds.append(
            {
                "round": self.round,
                "quorum_id": q.quorum_id,
                "committed": decision.committed,
                "heal": q.heal,
                "world_size": q.world_size,
                "local_steps": steps,
                "next_local_steps": self.local_steps,
                "rank": q.rank,
                "quorum_wait_s": round(quorum_wait_s, 4),
                "allreduce_s": round(allreduce_s, 4),
                "commit_wait_s": round(commit_wait_s, 4),
                "end_s": time.monotonic(),
                "end_unix_s": time.time(),
                "checksum": self.checksum(),
                "reason": decision.reason,
            }
        )

    def _take_pseudo_gradient(self) -> torch.Tensor:
        """Δ = θ_base − θ_local, the (N,) fp32 view of the allreduce buffer's first N floats."""
        delta = self._buf[: self._numel]
        self.flat.copy_into(delta)
        return torch.sub(self._base, delta, out=delta)  # Δ = θ_base − θ_local, (N,)

    def _wait_for_quorum(self) -> pb.QuorumReply | None:
        """Phase 1: ask for this round's quorum and wait for it (the wait is idle time). A
        worker the server queued for the running group's next round asks again, up to twice
        the time its own last H inner steps took (docs/protocol.md, "The sync round").

        Returns:
            The quorum, or None when none formed in time (the round is skipped and the
            server's reason logged; the next sync point, H steps on, asks again).
        """
        started = time.monotonic()
        # Wait at least the server's join timeout, or a quorum waiting on it could never form.
        wait_s = max(self.sync_config.quorum_timeout_s, self._server_run().join_timeout_s + 1.0)
        queued_until = started + max(wait_s, 2.0 * (started - self._steps_began_at))
        timeout_s = wait_s
        while True:
            q = self.client.quorum(
                worker_id=self.worker_id,
                round=self.round,
                manifest_hash=self.manifest.manifest_hash,
                timeout_s=timeout_s,
            )
            timeout_s = queued_until - time.monotonic()
            if q.formed or not q.queued or timeout_s < 0.5 or self._stop.is_set():
                break
            log.info("worker %d: %s; waiting up to %.1f s more", self.worker_id, q.reason, timeout_s)
        waited_s = time.monotonic() - started
        self.stats.quorum_wait_s += waited_s
        self.stats.idle_s += waited_s
        if not q.formed:
            self.stats.rounds_skipped += 1
            log.warning(
                "worker %d: no quorum within %.1f s: %s; training on locally, next try in %d inner steps",
                self.worker_id,
                waited_s,
                q.reason,
                self.local_steps,
            )
            return None
        return q

    def _contribute(self, q: pb.QuorumReply, delta: torch.Tensor, steps: int, tokens: int, started: float) -> _Vote:
        """Heal when told to, weigh Δ, allreduce ``[w·Δ, w]``, Δ̄ = Σ w_i Δ_i / Σ w_i, and
        (rank 0) upload it; returns this member's vote."""
        total_weight = 0.0
        self._largest_by_rank = []
        try:
            if q.heal:
                self._heal_for(q)
            self._largest = 0.0 if q.heal or steps == 0 else largest_magnitude(delta)
            self._weigh(delta, 0.0 if q.heal else self._weight_of(steps, tokens))
            total_weight = self._allreduce_weighted(q, started)
            if not math.isfinite(total_weight):  # the weights' sum: finite weights never make it so
                raise RoundFailed(non_finite_sum_reason(self._largest_by_rank, total_weight, q))
            if total_weight > 0:
                delta.div_(total_weight)  # Δ̄ = Σ w_i Δ_i / Σ w_i
                if not math.isfinite(largest_magnitude(delta)):  # the same bits on every member: all decide alike
                    raise RoundFailed(non_finite_sum_reason(self._largest_by_rank, total_weight, q))
                if q.rank == 0:
                    self._upload(q, delta)
        except RoundFailed as exc:
            return _Vote(success=False, total_weight=total_weight, reason=str(exc))
        return _Vote(success=True, total_weight=total_weight)

    def _heal_for(self, q: pb.QuorumReply) -> None:
        """Pull the committed state the quorum starts from; RoundFailed when that fails."""
        log.info("worker %d heals before quorum %d: round %d -> %d", self.worker_id, q.quorum_id, self.round, q.round)
        try:
            self._heal()
        except AsyncDiLoCoError as exc:  # vote failure rather than leave the others waiting
            raise RoundFailed(f"could not pull the committed state to heal: {exc}") from exc
        if self.round != q.round:
            raise RoundFailed(f"healed to round {self.round} but the quorum is at round {q.round}")

    def _weight_of(self, steps: int, tokens: int) -> float:
        """w of this member's Δ: 1 (mean) or its tokens; 0 without steps or for a non-finite Δ."""
        if steps == 0:
            return 0.0
        if not math.isfinite(self._largest):
            log.error(
                "worker %d: pseudo-gradient not finite after %d steps (diverged); every member skips the round "
                "and this one restarts from the global model",
                self.worker_id,
                steps,
            )
            return 0.0
        return 1.0 if self._server_run().sync_weighting != "tokens" else float(tokens)

    def _weigh(self, delta: torch.Tensor, weight: float) -> None:
        """``[Δ, ·]`` → ``[w·Δ, w]`` in the allreduce buffer."""
        if weight == 0.0:
            delta.zero_()
        elif weight != 1.0:
            delta.mul_(weight)
        self._buf[self._numel] = weight

    def _allreduce_weighted(self, q: pb.QuorumReply, started: float) -> float:
        """Sum ``[w·Δ, w]`` over the quorum; returns Σ w; RoundFailed when the collective failed."""
        try:
            self._allreduce(q)
        except RoundFailed as exc:  # the agreement refused the sum
            log.warning("worker %d, quorum %d: %s", self.worker_id, q.quorum_id, exc)
            raise
        except Exception as exc:  # noqa: BLE001 - any collective failure fails the round here
            reason = f"allreduce failed after {time.monotonic() - started:.2f} s: {exc}"
            log.warning("worker %d, quorum %d: %s", self.worker_id, q.quorum_id, reason)
            raise RoundFailed(reason) from exc
        self.stats.bytes_allreduced += self._buf.numel() * 4
        return float(self._buf[self._numel])

    def _allreduce(self, q: pb.QuorumReply) -> None:
        """Agree, then sum ``[w·Δ, w]`` in place (the seam the fault-injection tests wrap)."""
        self._start_allreduce(q).wait()

    def _start_allreduce(self, q: pb.QuorumReply) -> InFlightAllreduce:
        """Build the quorum's group, run the agreement (``_agree``) and launch the sum in flight."""
        members = tuple(int(m) for m in q.members)
        group = QuorumGroup(q.quorum_id, q.rank, q.world_size, self._rendezvous_store(q), members)
        pg = self._collectives.open(group, self.sync_config.allreduce_timeout_s)
        self._agree(pg, q)
        return pg.start_allreduce_sum(self._buf)

    def _rendezvous_store(self, q: pb.QuorumReply) -> Any:
        """The quorum's rendezvous store: the server's, over this worker's gRPC channel."""
        from asyncdiloco.worker.rendezvous import ServerStore  # torch.distributed, imported when a round needs it

        return ServerStore(
            self.client.store,
            worker_id=self.worker_id,
            quorum_id=q.quorum_id,
            timeout_s=self.sync_config.allreduce_timeout_s,
            rpc_timeout_s=self.config.rpc_timeout_s,
        )

    def _agree(self, pg: QuorumProcessGroup, q: pb.QuorumReply) -> None:
        """``collectives.agree``; every member's ‖Δ‖∞ is kept for the messages."""
        self._largest_by_rank = agree(pg, q, self._buf.numel(), self._largest)

    def _largest_member(self, q: pb.QuorumReply) -> str:
        """ "worker 3's (‖Δ‖∞ = 1e+30)": the member with the largest ‖Δ‖∞ this round."""
        if not self._largest_by_rank:
            return "unknown"
        rank = max(range(len(self._largest_by_rank)), key=self._largest_by_rank.__getitem__)
        return f"worker {int(q.members[rank])}'s (‖Δ‖∞ = {self._largest_by_rank[rank]:.3g})"

    def _upload(self, q: pb.QuorumReply, mean_delta: torch.Tensor) -> None:
        """Rank 0: send Δ̄ to the server (applied if the round commits); else RoundFailed."""
        try:
            self.client.push(
                mean_delta.view(torch.uint8),
                worker_id=self.worker_id,
                push_id=q.quorum_id,
                base_version=q.round,
                kind=pb.PUSH_KIND_ROUND_RESULT,
                quorum_id=q.quorum_id,
            )
        except AsyncDiLoCoError as exc:
            raise RoundFailed(
                f"rank 0 could not upload the round result: {exc} (the largest pseudo-gradient was "
                f"{self._largest_member(q)})"
            ) from exc
        self.stats.bytes_pushed += self._numel * 4

    def _vote(
        self, q: pb.QuorumReply, vote: _Vote, *, tokens: int, steps: int, compute_s: float = 0.0
    ) -> pb.CommitReply:
        """Vote and wait for the decision; a refused vote (the server restarted) is an abort."""
        while True:
            try:
                reply = self.client.commit(
                    worker_id=self.worker_id,
                    quorum_id=q.quorum_id,
                    success=vote.success,
                    total_weight=vote.total_weight,
                    num_tokens=tokens,
                    num_local_steps=steps,
                    reason=vote.reason,
                    timeout_s=max(1.0, q.round_deadline_s + 1.0),
                    compute_s=compute_s if steps else 0.0,
                )
            except RoundRefusedError as exc:
                return pb.CommitReply(decided=True, committed=False, round=self.round, reason=str(exc))
            if reply.decided:
                if steps and compute_s > 0:
                    self._rate_known = True  # each vote carries the rate from now on: no more probes
                return reply

    def _apply_decision(
        self, q: pb.QuorumReply, decision: pb.CommitReply, mean_delta: torch.Tensor, total_weight: float
    ) -> None:
        """Commit: the outer step on θ_base; abort: θ_base stays; the model restarts from θ_base."""
        if decision.committed:
            self._collectives.keep()  # the next quorum of the same members reuses its group
            if total_weight > 0:
                # the same step on every member and on the server, at the round it started from
                self._outer().step(mean_delta, version=decision.round - 1)
            self.round = decision.round
            self.stats.rounds_committed += total_weight > 0  # an all-healing round applies nothing
        else:
            self._collectives.drop()  # every member builds a fresh group next round
            self.stats.rounds_failed += 1
            log.warning(
                "worker %d: round of quorum %d aborted (%s); restarting from round %d",
                self.worker_id,
                q.quorum_id,
                decision.reason,
                self.round,
            )
        if decision.local_steps and decision.local_steps != self.local_steps:
            log.info(
                "worker %d: H_w %d -> %d from round %d's decision (the server's --sync-local-steps)",
                self.worker_id,
                self.local_steps,
                decision.local_steps,
                decision.round,
            )
            self.local_steps = decision.local_steps
        self.flat.load(self._base)
        self._restart_round()
        self._save_state()

    def _restart_round(self) -> None:
        """The model holds θ_base again: the next round's steps, tokens and compute time start from 0."""
        self._steps_since_sync = 0
        self._tokens_since_sync = 0
        self._compute_s = 0.0
        self._tried = False

    # ------------------------------------------------------------- internals
    def _server_run(self) -> pb.RunConfig:
        """The server's run config (from Join; rounds only run after a join)."""
        assert self.run_config is not None, "rounds run only after join"
        return self.run_config

    def _outer(self) -> OuterOptimizer:
        """The outer optimizer (made by the first heal, which every join does)."""
        assert self.outer is not None, "the outer optimizer is made by the first heal"
        return self.outer

    def _heal(self) -> None:
        """Pull the committed θ and outer momentum and load them (θ_base and model)."""
        rc = self._server_run()
        with_momentum = rc.outer_momentum > 0
        pulled = self.client.pull_sync_state(self.manifest, self.worker_id, with_momentum)
        state = pulled.payload.view(torch.float32)  # (k·N,)
        n = self._numel
        self._base.copy_(state[:n])
        if self.outer is None:  # the server's, so that every member's outer step equals the server's bit for bit
            self.outer = OuterOptimizer(self._base, _outer_config(rc))
        if with_momentum:
            momentum = self.outer.momentum_buffer
            assert momentum is not None, "an outer optimizer with momentum keeps a buffer"
            momentum.copy_(state[n : 2 * n])
        if pulled.version < self.round:
            log.warning(
                "worker %d: the server's committed round %d is behind this worker's %d: it restarted without its "
                "state (no --checkpoint-dir) or from an older folder; taking its model and going on from round %d",
                self.worker_id,
                pulled.version,
                self.round,
                pulled.version,
            )
        self.round = pulled.version
        self.local_steps = pulled.run_config.local_steps or self.local_steps
        self.flat.load(self._base)
        self._restart_round()
        self.stats.heals += 1
        self.stats.bytes_pulled += pulled.payload.numel()

    def checksum(self) -> int:
        """CRC-32 of θ_base's float32 bytes: equal on every member after each round."""
        return zlib.crc32(self._base.numpy().data.cast("B")) & 0xFFFFFFFF


def _outer_config(rc: pb.RunConfig) -> OuterConfig:
    """The server's outer optimizer, from its run config."""
    return OuterConfig(
        optimizer=rc.outer_optimizer,
        lr=rc.outer_lr,
        momentum=rc.outer_momentum,
        lr_schedule=rc.outer_lr_schedule or "constant",
        lr_warmup_versions=rc.outer_lr_warmup_versions,
        lr_total_versions=rc.outer_lr_total_versions,
        lr_min_ratio=rc.outer_lr_min_ratio,
    )
