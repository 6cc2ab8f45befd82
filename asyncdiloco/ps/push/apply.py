"""Applying pushes to the global model: the initial parameters, and async pseudo-gradients
through the outer optimizer weighted by their staleness (Liu et al. 2024, arXiv
2401.09135, Sec. 3). docs/architecture.md, "One push"; docs/algorithms.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable

import torch

from asyncdiloco.algo.outer import (
    BlockDelta,
    DelayedNesterov,
    PseudoGradientMonitor,
    average_in,
    staleness_weight,
)
from asyncdiloco.algo.schedule import GroupGate
from asyncdiloco.errors import InvalidPayloadError, NotInitializedError, StalePushError, UnknownVersionError
from asyncdiloco.ps.books import AppliedAs, PushOutcome, WorkerRecord
from asyncdiloco.ps.core import CoreParts
from asyncdiloco.ps.pull.snapshots import Snapshots
from asyncdiloco.ps.push.shard_order import CURRENT, OrderGate, ShardOrder
from asyncdiloco.ps.push.value_check import check_values
from asyncdiloco.wire._proto import parameter_server_pb2 as pb

#: The push id a follower shard logs its zero fills with (ps/push/shard_order.py); real pushes start at 1.
ZERO_FILL_PUSH_ID = 0


def _admit(parts: CoreParts, header: pb.PushHeader) -> WorkerRecord | PushOutcome:
    """The worker's record, its lease renewed; or the answer to a replay: a concurrent
    retry that won the race, or an id at or below the high-water mark (books lock held)."""
    rec = parts.registry.workers.get(header.worker_id)
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
        if header.worker_id != registry.initializer and self.parts.config.shard_index == 0:
            # a follower shard takes them from whoever initialized shard 0 (ps/push/shard_order.py)
            raise StalePushError(
                f"initial parameters from worker {header.worker_id} refused: worker {registry.initializer} "
                f"was chosen to initialize; pull the global model once it is there"
            )

    def payload_bytes(self) -> tuple[int, str]:
        return self.parts.model.known_manifest.total_bytes, "(see the manifest from Join)"

    def apply(self, header: pb.PushHeader, payload: torch.Tensor, largest: float | None = None) -> PushOutcome:
        """θ ← the payload (in the manifest's layout), a fresh outer optimizer
        (``largest``: its ‖x‖∞ scanned as it landed, value_scan.py; else computed here).

        Raises:
            InvalidPayloadError: non-finite or too large values. StalePushError: another
            worker initialized meanwhile. UnknownWorkerError: the lease lapsed.
        """
        parts = self.parts
        delta = parts.model.known_manifest.unpack_flat(payload)  # (N,) float32, a view when all fp32
        check_values(
            delta,
            header.worker_id,
            parts.config.max_abs_value,
            parts.model.known_manifest,
            what=f"the initial parameters from worker {header.worker_id}",
            largest=largest,
            fix="the model this worker started from holds them: check its initialization or the checkpoint "
            "it was loaded from",
        )
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
        #: A follower shard's wait for shard 0's order (ps/push/shard_order.py); None on shard 0 or unsharded.
        self.gate: OrderGate | None = None
        if parts.config.shard_index > 0:
            self.gate = OrderGate(lambda: parts.model.version, self.fill_zero, parts.config.shard_fill_timeout_s)

    def check(self, header: pb.PushHeader) -> None:
        """Raises NotInitializedError: no θ yet."""
        if not self.parts.model.initialized:
            raise NotInitializedError("not initialized: no global parameters yet to apply a pseudo-gradient to")

    def payload_bytes(self) -> tuple[int, str]:
        return self.parts.model.pseudo_gradient_bytes()

    def apply(self, header: pb.PushHeader, payload: torch.Tensor, largest: float | None = None) -> PushOutcome:
        """Decode Δ with the run's wire codec (outside the locks), check it, apply it
        (``largest``: ‖Δ‖∞ scanned as the raw payload landed, value_check.py; else computed here).

        Returns:
            The outcome: the version after, τ, s(τ), and the push group to wait for.
        Raises:
            InvalidPayloadError: non-finite or too large values. StalePushError:
            τ > max_staleness; UnknownVersionError, a base version from the future. UnknownWorkerError: the
            lease lapsed meanwhile. In every case θ, momentum, version and counters are unchanged.
        """
        config, model = self.parts.config, self.parts.model
        blocks = model.pseudo_gradient_blocks(payload)
        delta: torch.Tensor | BlockDelta
        with contextlib.ExitStack() as scratch:
            if blocks is not None:  # bf16: checked as it is, decoded block by block inside the step
                delta, values = blocks
            else:  # (N,) fp32, the step's scratch
                delta = values = scratch.enter_context(model.decoded_pseudo_gradient(payload))
            largest = check_values(
                values, header.worker_id, config.max_abs_value, model.known_manifest, largest=largest
            )
            outcome = self._apply_checked(header, payload, delta, largest)
        self.parts.journal.maybe_checkpoint()
        return outcome

    def _apply_checked(
        self, header: pb.PushHeader, payload: torch.Tensor, delta: torch.Tensor | BlockDelta, largest: float
    ) -> PushOutcome:
        parts = self.parts
        order = self._order()
        if order is not None and self.gate is not None:
            self.gate.wait_turn(order, header.worker_id)
        with parts.locks.apply:  # one apply at a time; θ and m change only under this lock
            with parts.locks.books:
                rec = _admit(parts, header)
                if isinstance(rec, PushOutcome):
                    return rec
                applied, expected = self._admitted(header, rec, order)
                parts.journal.log_push(header, payload, applied)
            # the tensor math, books free meanwhile; pulls meanwhile get θ as it was before
            in_payload = isinstance(delta, torch.Tensor) and delta.data_ptr() == payload.data_ptr()
            on_block = self.snapshots.before_step(applied.version_after, swap_into=payload if in_payload else None)
            try:
                with parts.observer.timed("outer_step"):
                    self.outer_step(applied)(delta, on_block=on_block)
            finally:
                snap = self.snapshots.after_step(applied.version_after)
            with parts.locks.books:
                outcome = self.record(rec, header, applied.tau, applied.weight, applied.num_workers, applied.closing)
                self.snapshots.publish(snap)
                if self.gate is None:
                    return self._hand_off(rec, header, outcome, expected, largest)
        self.gate.notify()  # a follower holds no reply: shard 0's already did
        return outcome

    def _admitted(
        self, header: pb.PushHeader, rec: WorkerRecord, order: ShardOrder | None
    ) -> tuple[AppliedAs, set[int]]:
        """What the push's step depends on (books lock held), and the workers its group
        waits for. A follower takes shard 0's τ, s(τ), version, N and closing."""
        parts = self.parts
        if order is not None:
            tau, weight, version_after = self._follow(order)
            applied = AppliedAs(tau, weight, version_after, order.num_workers, rec.region, order.closing)
            return applied, {header.worker_id}
        tau, weight, version_after = self.staleness(header)
        expected = _live_workers(parts, header.worker_id)
        num_workers = parts.registry.live_regions() if rec.region else len(expected)
        closing = header.last and not rec.region
        if closing:  # N not shrunk by the Leaves of the run's end (outer.py ``step_closing``)
            num_workers = parts.model.optimizer.closing_workers(num_workers)
        return AppliedAs(tau, weight, version_after, num_workers, rec.region, closing), expected

    def before_receive(self, header: pb.PushHeader) -> None:
        """A follower shard: wait for this push's turn in shard 0's order before a receive
        buffer is taken (waiting pushes then never hold the buffer budget the push before
        them needs). Nothing on shard 0 or an unsharded server.

        Raises:
            InvalidPayloadError: a follower got a push without shard 0's decision.
        """
        order = self._order()
        if order is not None and self.gate is not None:
            self.gate.wait_turn(order, header.worker_id)

    def _order(self) -> ShardOrder | None:
        """The decision of shard 0 this follower must apply the push with (None on shard 0).

        Raises:
            InvalidPayloadError: a follower got a push without one.
        """
        if self.gate is None:
            return None
        order = CURRENT.get()
        if order is None:
            raise InvalidPayloadError(
                f"this server is shard {self.parts.config.shard_index} of {self.parts.config.shard_count}: it applies "
                f"pseudo-gradients only in shard 0's order; push through the sharded client (worker/sharded.py) "
                f"with the shard map"
            )
        return order

    def _follow(self, order: ShardOrder) -> tuple[int, float, int]:
        """(τ, s(τ), version after) of shard 0's decision, at its turn (books lock held).

        Raises:
            StalePushError: its turn passed (applied as zeros after the fill timeout).
        """
        version = self.parts.model.version
        if version != order.version_after - 1:
            raise StalePushError(
                f"this part of the push making version {order.version_after} came too late: shard "
                f"{self.parts.config.shard_index} is at version {version} (it was applied here as a zero "
                f"pseudo-gradient after shard_fill_timeout_s={self.parts.config.shard_fill_timeout_s}); pull and go on"
            )
        return order.tau, order.weight, order.version_after

    def fill_zero(self, order: ShardOrder, worker_id: int) -> None:
        """Apply zero pseudo-gradients until the version is ``order.version_after − 1``
        (a follower's missing parts; ps/push/shard_order.py), with the decision's N. Each is
        logged as a push of ``worker_id`` (the waiting push's worker) with push id 0, which
        no real push has (ids start at 1): replay steps it and counts it for nobody."""
        parts = self.parts
        size = parts.model.pseudo_gradient_bytes()[0]
        with parts.locks.apply:
            while parts.model.version < order.version_after - 1:
                version = parts.model.version
                applied = AppliedAs(tau=0, weight=1.0, version_after=version + 1, num_workers=order.num_workers)
                with parts.locks.books:
                    header = pb.PushHeader(
                        worker_id=worker_id,
                        push_id=ZERO_FILL_PUSH_ID,
                        total_bytes=size,
                        kind=pb.PUSH_KIND_PSEUDO_GRADIENT,
                    )
                    parts.journal.log_push(header, torch.zeros(size, dtype=torch.uint8), applied)
                self.snapshots.before_apply(version)
                self.outer_step(applied)(torch.zeros_like(parts.model.theta))
                snap = self.snapshots.after_apply(version + 1)
                with parts.locks.books:
                    parts.model.version += 1
                    self.snapshots.publish(snap)
                    if self.gate is not None:
                        self.gate.zero_filled += 1

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

    def record(
        self,
        rec: WorkerRecord,
        header: pb.PushHeader,
        tau: int,
        weight: float,
        num_workers: int = 0,
        closing: bool = False,
    ) -> PushOutcome:
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
        outcome = PushOutcome(
            True,
            False,
            parts.model.version,
            tau,
            weight,
            parts.config.local_steps,
            num_workers=num_workers,
            closing=closing,
        )
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
        version keys η's schedule. A follower's zero fill (push id 0) moves only θ, m and the version."""
        self.outer_step(applied)(delta)
        if header.push_id == ZERO_FILL_PUSH_ID:
            self.parts.model.version += 1
            return
        self.record(rec, header, applied.tau, applied.weight, applied.num_workers, applied.closing)

    def outer_step(self, applied: AppliedAs) -> Callable[..., None]:
        """The outer step of one push, to call with Δ (and ``on_block``: called after each
        block of θ is updated, outer.py); the step making version V + 1 is applied at V
        (η's schedule). A regional server's push is averaged in instead: θ ← θ − s(τ)·Δ/R
        (outer.py ``average_in``; R = ``applied.num_workers``, the live regions). A worker's
        closing push (``applied.closing``) takes the direct term alone (outer.py ``step_closing``)."""
        model = self.parts.model
        if applied.region:
            return functools.partial(average_in, model.theta, scale=applied.weight / max(1, applied.num_workers))
        step = model.optimizer.step_closing if applied.closing else model.optimizer.step
        return functools.partial(
            step, weight=applied.weight, version=applied.version_after - 1, num_workers=applied.num_workers
        )
