"""Sync mode's part of the parameter server's state (``ParameterServerState`` inherits it).

Rank 0 of each quorum uploads the reduced pseudo-gradient Δ̄ (``PUSH_KIND_ROUND_RESULT``)
before it votes; on commit the state applies the same ``OuterOptimizer`` step to θ and m
that every member applies to its θ_base (synchronous DiLoCo, Douillard et al. 2023,
arXiv 2311.08105, Alg. 1), and the version becomes the committed-round count. Joining or
healing workers pull θ and m (``sync_state``). The rounds themselves are run by the
network-free ``QuorumManager`` (quorum.py).
"""

from __future__ import annotations

import logging

import torch

from asyncdiloco.errors import (
    InvalidPayloadError,
    ManifestMismatchError,
    NotInitializedError,
)
from asyncdiloco.ps.quorum import Assignment, CommittedRound, Decision
from asyncdiloco.ps.records import PushOutcome
from asyncdiloco.wire._proto import parameter_server_pb2 as pb

log = logging.getLogger(__name__)


class SyncRounds:
    """Methods of ``ParameterServerState`` for sync mode (uses its locks and fields)."""

    def _stage_round_result(self, header: pb.PushHeader, payload: torch.Tensor) -> PushOutcome:
        delta = payload.view(torch.float32)  # (N,) Δ̄, the assembler's own fresh buffer
        if delta.numel() != self.manifest.numel:
            raise InvalidPayloadError(f"round result holds {delta.numel()} floats; the model has {self.manifest.numel}")
        if not bool(torch.isfinite(delta).all()):
            raise InvalidPayloadError(
                f"round result of quorum {header.quorum_id} holds non-finite values; the limit is 0: "
                f"a member diverged, lower the inner learning rate"
            )
        with self._lock:
            self._touch_locked(header.worker_id)
        self.quorum.stage_result(header.worker_id, header.quorum_id, delta)  # RoundRefusedError
        with self._lock:
            self.bytes_pushed += header.total_bytes
            return PushOutcome(True, False, self.version, 0, 1.0, self.config.local_steps)

    def _apply_round(self, done: CommittedRound) -> None:
        """Apply a committed round (called by the QuorumManager, its lock held)."""
        with self._apply_lock, self._lock:
            if done.result is not None:
                # the same step every member applies to θ_base, at the round it started from
                self.outer.step(done.result, version=done.round - 1)
                self.version = done.round
            for worker_id, steps in done.steps_by_worker.items():
                if steps <= 0:  # a healing member contributed nothing
                    continue
                tokens = done.tokens_by_worker.get(worker_id, 0)
                self.applied_pushes += 1
                self.staleness_histogram[0] += 1  # synchronous: τ = 0 by construction
                self.tokens += tokens
                rec = self._workers.get(worker_id)
                if rec is not None:
                    rec.applied_pushes += 1
                    rec.tokens += tokens
                    rec.local_steps += steps

    def _check_sync_request(self, worker_id: int, what: str) -> None:
        with self._lock:
            self._touch_locked(worker_id)
            if not self.sync_mode:
                raise self.mode_mismatch_error(what)
            if not self.initialized:
                raise NotInitializedError("not initialized: no worker has pushed the initial parameters yet")

    def request_quorum(
        self, worker_id: int, worker_round: int, manifest_hash: str, timeout_s: float
    ) -> Assignment | None:
        """Sync mode: block up to ``timeout_s`` seconds for the next round's quorum.

        Raises:
            ModeMismatchError (async server), UnknownWorkerError, NotInitializedError,
            ManifestMismatchError (the hash differs from the server's manifest).
        """
        self._check_sync_request(worker_id, f"the quorum request of worker {worker_id}")
        if manifest_hash != self.manifest.manifest_hash:
            raise ManifestMismatchError(
                f"manifest mismatch: worker {worker_id} asks for a quorum with manifest_hash {manifest_hash[:16]}..., "
                f"the server's is {self.manifest.manifest_hash[:16]}...; every member must train the same model"
            )
        if not timeout_s > 0:
            raise InvalidPayloadError(f"timeout_s is {timeout_s}; it must be > 0 seconds")
        return self.quorum.wait_quorum(worker_id, worker_round, timeout_s)

    def commit(
        self, worker_id: int, quorum_id: int, *, success: bool, total_weight: float, num_tokens: int,
        num_local_steps: int, reason: str, timeout_s: float,
    ) -> Decision | None:  # fmt: skip
        """Sync mode: vote, then block up to ``timeout_s`` seconds for the decision
        (None: not decided yet; ask again)."""
        self._check_sync_request(worker_id, f"the commit vote of worker {worker_id}")
        decision = self.quorum.vote(
            worker_id, quorum_id, success=success, total_weight=total_weight, num_tokens=num_tokens,
            num_local_steps=num_local_steps, reason=reason,
        )  # fmt: skip
        if decision is None and timeout_s > 0:
            decision = self.quorum.wait_decision(quorum_id, timeout_s)
        return decision

    def sync_state(self) -> tuple[int, torch.Tensor]:
        """Sync mode, for healing: (round, payload) where the payload is θ as float32
        bytes followed by the outer momentum m as float32 bytes (absent when μ = 0);
        a private copy, consistent with one committed round."""
        with self._apply_lock, self._lock:
            if self.params is None:
                raise NotInitializedError("not initialized: no worker has pushed the initial parameters yet")
            parts = [self.params]
            if self.outer.momentum_buffer is not None:
                parts.append(self.outer.momentum_buffer)
            payload = torch.cat(parts).view(torch.uint8)  # (k·N·4,) a copy
            return self.version, payload
