"""Applying pushes to the global model: the initial parameters, and pseudo-gradients
with the outer optimizer weighted by their staleness (async mode).

Push semantics (Liu et al. 2024, arXiv 2401.09135, Sec. 3; staleness weights s(τ) in
outer.py): a pseudo-gradient Δ with base version v arriving at version V has staleness
τ = V − v; it is refused when τ > max_staleness or v > V, otherwise the outer optimizer
steps on s(τ)·Δ at once and the version becomes V + 1. The step that produces version
V + 1 is applied at version V, which keys the outer learning rate's schedule, live and
in log replay. The initial parameters become θ (version unchanged).

Each apply: decode (outside the locks) → check the values → under the ``apply`` lock:
admit (lease, τ, s(τ), the live-worker count N; logged to the journal), the outer step
(tensor math, ``books`` free meanwhile) with the next pull snapshot's copy fused into it
block by block if pulls are coming (snapshots.py ``step_and_encode``), then
under ``books``: the version, the counters, the remembered outcome, and the hand-offs of
a pseudo-gradient: the step-rate meter (DyLU), the push group (schedule.py ``GroupGate``;
Alg. 2) and the divergence monitor.
"""

from __future__ import annotations

import dataclasses

import torch

from asyncdiloco.algo.outer import BlockHook, DelayedNesterov, PseudoGradientMonitor, staleness_weight
from asyncdiloco.algo.schedule import GroupGate
from asyncdiloco.errors import NotInitializedError, StalePushError, UnknownVersionError
from asyncdiloco.ps.intake import check_values
from asyncdiloco.ps.parts import CoreParts
from asyncdiloco.ps.records import AppliedAs, PushOutcome, WorkerRecord
from asyncdiloco.ps.snapshots import Snapshots
from asyncdiloco.wire._proto import parameter_server_pb2 as pb


def _admit(parts: CoreParts, header: pb.PushHeader) -> WorkerRecord | PushOutcome:
    """The worker's record, its lease renewed; or the answer to a replay: a concurrent
    retry that won the race, or an id at or below the high-water mark (books lock held)."""
    rec = parts.registry.get(header.worker_id)
    if rec is not None:
        retried = rec.answer_retry(header.push_id, parts.model.version, parts.config.local_steps)
        if retried is not None:
            return retried
    return parts.registry.touch(header.worker_id, header.session_id)


def _live_workers(parts: CoreParts, worker_id: int) -> set[int]:
    """The workers a push group waits for, with the pusher: N for Delayed Nesterov."""
    return parts.registry.expected(parts.clock()) | {worker_id}


class InitialParameters:
    """``PUSH_KIND_INITIAL_PARAMETERS``: the chosen worker's model becomes θ (both modes)."""

    pooled = True

    def __init__(self, parts: CoreParts) -> None:
        self.parts = parts

    def check(self, header: pb.PushHeader) -> None:
        """Raises StalePushError: already initialized, or not the chosen initializer."""
        model, registry = self.parts.model, self.parts.registry
        if model.initialized:
            raise StalePushError(
                f"initial parameters from worker {header.worker_id} refused: the server is already "
                f"initialized at version {model.version}; pull the global model instead"
            )
        if header.worker_id != registry.initializer:
            raise StalePushError(
                f"initial parameters from worker {header.worker_id} refused: worker {registry.initializer} "
                f"was chosen to initialize; pull the global model once it is there"
            )

    def payload_bytes(self) -> tuple[int, str]:
        return self.parts.model.known_manifest.total_bytes, "(see the manifest from Join)"

    def apply(self, header: pb.PushHeader, payload: torch.Tensor, largest: float | None = None) -> PushOutcome:
        """θ ← the payload (in the manifest's layout), a fresh outer optimizer
        (``largest``: its ‖x‖∞ scanned as it landed, values.py; else computed here).

        Raises:
            InvalidPayloadError: non-finite or too large values. StalePushError: another
            worker initialized meanwhile. UnknownWorkerError: the lease lapsed.
        """
        parts = self.parts
        delta = parts.model.known_manifest.unpack_flat(payload)  # (N,) float32, a view when all fp32
        check_values(delta, header.worker_id, parts.config.max_abs_value, parts.model.known_manifest, largest=largest)
        with parts.locks.apply:
            with parts.locks.books:
                rec = _admit(parts, header)
                if isinstance(rec, PushOutcome):
                    return rec
                if parts.model.initialized:
                    raise StalePushError(
                        f"initial parameters from worker {header.worker_id} refused: already initialized"
                    )
                live = len(_live_workers(parts, header.worker_id))
                applied = AppliedAs(tau=0, weight=1.0, version_after=parts.model.version, num_workers=live)
                parts.journal.log_push(header, payload, applied)
            parts.model.initialize(delta, header.worker_id)
            with parts.locks.books:
                outcome = self.record(rec, header)
        parts.observer.initialized()  # the health service turns SERVING
        parts.journal.maybe_checkpoint()
        return outcome

    def record(self, rec: WorkerRecord, header: pb.PushHeader) -> PushOutcome:
        """The outcome remembered for retries (books lock held); no counter moves."""
        parts = self.parts
        outcome = PushOutcome(True, False, parts.model.version, 0, 1.0, parts.config.local_steps)
        rec.remember(header.push_id, outcome)
        return outcome

    def replay(self, rec: WorkerRecord, header: pb.PushHeader, delta: torch.Tensor, applied: AppliedAs) -> None:
        """Redo a logged initialization (both locks held; τ = 0, s = 1, the version stays)."""
        self.parts.model.initialize(delta, header.worker_id)
        self.record(rec, header)


class PseudoGradient:
    """``PUSH_KIND_PSEUDO_GRADIENT`` (async mode): θ moves by the outer optimizer's step
    on s(τ)·Δ (see the module docstring).

    Args:
        parts: what the apply reads and changes.
        snapshots: builds the next pull snapshot while pulls are coming.
        groups: holds push replies per group (schedule.py).
        monitor: warns when a push's ‖Δ‖∞ jumps (outer.py).
    """

    pooled = True

    def __init__(
        self, parts: CoreParts, snapshots: Snapshots, groups: GroupGate, monitor: PseudoGradientMonitor
    ) -> None:
        self.parts = parts
        self.snapshots = snapshots
        self.groups = groups
        self.monitor = monitor

    def check(self, header: pb.PushHeader) -> None:
        """Raises NotInitializedError: no θ yet."""
        if not self.parts.model.initialized:
            raise NotInitializedError("not initialized: no global parameters yet to apply a pseudo-gradient to")

    def payload_bytes(self) -> tuple[int, str]:
        return self.parts.model.pseudo_gradient_bytes()

    def apply(self, header: pb.PushHeader, payload: torch.Tensor, largest: float | None = None) -> PushOutcome:
        """Decode Δ with the run's wire codec (outside the locks), check it, apply it
        (``largest``: ‖Δ‖∞ scanned as the raw payload landed, values.py; else computed here).

        Returns:
            The outcome: the version after, τ, s(τ), and the push group to wait for.
        Raises:
            InvalidPayloadError: non-finite or too large values. StalePushError:
            τ > max_staleness; UnknownVersionError, a base version from the future. UnknownWorkerError: the
            lease lapsed meanwhile. In every case θ, momentum, version and counters are unchanged.
        """
        with self.parts.model.decoded_pseudo_gradient(payload) as delta:  # (N,) fp32, the step's scratch
            largest = check_values(
                delta,
                header.worker_id,
                self.parts.config.max_abs_value,
                self.parts.model.known_manifest,
                largest=largest,
            )
            outcome = self._apply_checked(header, payload, delta, largest)
        self.parts.journal.maybe_checkpoint()
        return outcome

    def _apply_checked(
        self, header: pb.PushHeader, payload: torch.Tensor, delta: torch.Tensor, largest: float
    ) -> PushOutcome:
        parts = self.parts
        with parts.locks.apply:  # one apply at a time; θ and m change only under this lock
            with parts.locks.books:
                rec = _admit(parts, header)
                if isinstance(rec, PushOutcome):
                    return rec
                tau, weight, version_after = self.staleness(header)
                expected = _live_workers(parts, header.worker_id)
                applied = AppliedAs(tau=tau, weight=weight, version_after=version_after, num_workers=len(expected))
                parts.journal.log_push(header, payload, applied)
            self.snapshots.before_apply(version_after - 1)  # pulls meanwhile get θ as it is now
            # the tensor math, books free meanwhile
            with parts.observer.timed("outer_step"):  # with the next snapshot's copy, fused per block
                snap = self.snapshots.step_and_encode(
                    version_after, lambda on_block: self._step(delta, applied, on_block)
                )
            with parts.locks.books:
                outcome = self.record(rec, header, tau, weight)
                self.snapshots.publish(snap)
                return self._hand_off(rec, header, outcome, expected, largest)

    def staleness(self, header: pb.PushHeader) -> tuple[int, float, int]:
        """(τ, s(τ), version after the apply) of a push about to be applied (books lock held).

        Raises:
            StalePushError: τ > max_staleness. UnknownVersionError: a base version from the future.
        """
        version = self.parts.model.version
        tau = version - header.base_version
        if tau < 0:
            raise UnknownVersionError(
                f"base_version {header.base_version} was never served (from the future): the server is at version "
                f"{version}; pull the global model and push against its version"
            )
        limit = self.parts.config.outer.max_staleness
        if tau > limit:
            raise StalePushError(
                f"staleness {tau} (base_version {header.base_version}, server version {version}) "
                f"exceeds max_staleness={limit}; pull the global model and sync more often "
                f"(smaller H) or raise --max-staleness"
            )
        return tau, staleness_weight(self.parts.config.outer, tau), version + 1

    def record(self, rec: WorkerRecord, header: pb.PushHeader, tau: int, weight: float) -> PushOutcome:
        """The version, the counters and the outcome remembered for retries (books lock held)."""
        parts = self.parts
        parts.model.version += 1
        parts.counters.count_applied(tau, header.num_tokens)
        parts.counters.bytes_pushed += header.total_bytes
        rec.applied_pushes += 1
        rec.tokens += header.num_tokens
        rec.local_steps += header.num_local_steps
        rec.staleness_sum += tau
        rec.staleness_pushes += 1
        rec.last_staleness = tau
        outcome = PushOutcome(True, False, parts.model.version, tau, weight, parts.config.local_steps)
        rec.remember(header.push_id, outcome)
        return outcome

    def _hand_off(
        self, rec: WorkerRecord, header: pb.PushHeader, outcome: PushOutcome, expected: set[int], largest: float
    ) -> PushOutcome:
        """DyLU's rate, the push group, the divergence monitor (books lock held)."""
        registry, outer = self.parts.registry, self.parts.model.outer
        now = self.parts.clock()
        registry.rates.record(header.worker_id, header.num_local_steps, now, header.compute_s)
        rec.last_push = now
        buffer_complete = isinstance(outer, DelayedNesterov) and outer.arrivals == 0
        group_id = self.groups.arrive(header.worker_id, expected, registry.group_max_wait_s(), buffer_complete)
        self.monitor.observe(largest, header.worker_id, self.parts.model.version)
        # (the remembered outcome stays as replay rebuilds it; H_w is recomputed per reply)
        return dataclasses.replace(outcome, group_id=group_id)

    def replay(self, rec: WorkerRecord, header: pb.PushHeader, delta: torch.Tensor, applied: AppliedAs) -> None:
        """Redo a logged push with its τ, s(τ) and N (both locks held); the logged
        version keys η's schedule."""
        self._step(delta, applied)
        self.record(rec, header, applied.tau, applied.weight)

    def _step(self, delta: torch.Tensor, applied: AppliedAs, on_block: BlockHook | None = None) -> None:
        """The outer step of one push; the step making version V + 1 is applied at V (η's
        schedule). ``on_block``: called after each block of θ is updated (outer.py)."""
        self.parts.model.optimizer.step(
            delta,
            applied.weight,
            version=applied.version_after - 1,
            num_workers=applied.num_workers,
            on_block=on_block,
        )
