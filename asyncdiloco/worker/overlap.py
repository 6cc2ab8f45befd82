"""Overlapping a worker's push and pull with its next inner steps (``WorkerConfig.overlap``).

Without overlap the asynchronous worker stops training at every H-th inner step until
its push and the following pull are done. With overlap on (``AsyncDiLoCoWorker``,
async_worker.py) a sync point instead does, on the training thread:

1. θ_local(t0) → a CPU fp32 snapshot (from CUDA through pinned buffers);
2. hands push + pull to ONE background thread (``BackgroundSync``; at most one sync in
   flight) and returns to training at once.

The background thread (``push_then_pull``) touches only the client and CPU buffers: it
takes Δ = θ_base − θ_local(t0), checks it is finite and encodes it (``_encode_delta``;
the training thread does not touch θ_base while a sync is in flight), pushes the
payload, pulls the new global model θ_g' into a pull buffer, decodes it
to fp32 and turns the snapshot into the correction c = θ_g' − θ_local(t0). It never
touches the model or the inner optimizer. The training thread checks for the result
without blocking after every inner step and **merges** it:

    θ_local ← θ_local(now) + c = θ_g' + (θ_local(now) − θ_local(t0))
    θ_base  ← θ_g'        version ← the pulled version

so the local progress made while the sync was in flight is kept on top of the new
global model. Those steps belong to the next round: their progress is exactly
θ_local − θ_base after the merge, and the step/token counters were reset at t0, so the
next push carries them once. If the next sync point comes while the sync still runs,
the training thread waits for it (that wait is counted in ``WorkerStats.blocked_s``).

How this relates to the papers:

- Streaming DiLoCo (Douillard et al. 2025, arXiv 2501.18512, Sec. 2, "overlapping
  communication"): a replica sends its outer gradient, keeps training for τ inner
  steps while it travels, then merges the received global parameters with its own as
  α·θ_local + (1 − α)·θ_global (mixing factor α; α = 0 overwrites the τ steps). Here
  τ is however many inner steps the push + pull take (at most H), and instead of a
  convex mix we add the τ steps' displacement to θ_g' in full.
- Eager updates (Kale et al. 2025, arXiv 2502.12996): overlap the outer step with the
  next inner phase, applying the replica's own fresh outer gradient before the
  delayed average from the others arrives. In the asynchronous server θ_g' already
  contains this worker's Δ (applied on arrival, weighted by staleness) and every other
  worker's push so far; re-adding only the progress since t0 is the asynchronous
  counterpart, and it also makes every inner step's progress reach the server exactly
  once (tests/test_overlap.py checks this with outer SGD η = 1, μ = 0).

Faults keep the semantics of the blocking path (async_worker.py): an unacknowledged push is
retried at the next sync point with the same ``push_id`` and payload (the snapshot is
kept for it, so the merge still measures progress from the snapshot); after an
acknowledged push whose pull failed θ_base is lowered by what the server received and
the later steps go out as a residual; a Δ that is not finite (found here, before
sending) and a push refused in ``errors.DROP_AND_REPULL`` are recorded in
``SyncOutcome.refused``, the pull still runs, and the merge restarts the model from θ_g'
(dropping the steps since t0 too); a forgotten worker rejoins on the training thread,
keeping the unacknowledged push for the rejoin to retry. ``close()`` waits for a sync in
flight, merges it, then pushes the residual.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from collections.abc import Callable
from typing import Protocol

import torch

from asyncdiloco.errors import DROP_AND_REPULL, AsyncDiLoCoError, InvalidPayloadError, PayloadCorruptedError
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.tensors import Manifest
from asyncdiloco.worker.client import ParameterServerClient

#: The drop reason of a pseudo-gradient found not finite before it was sent (a diverged
#: local model; ``WorkerStats.drops``).
NON_FINITE = "non_finite"


class PushToSend(Protocol):
    """The push an overlapped sync carries (``async_worker._PendingPush``)."""

    #: uint8 payload; None until the background thread takes and encodes Δ.
    payload: torch.Tensor | None
    push_id: int
    num_local_steps: int
    #: Seconds of inner steps the push carries.
    compute_s: float

    def send(self, client: ParameterServerClient, worker_id: int) -> pb.PushReply: ...


@dataclasses.dataclass(frozen=True)
class SyncLink:
    """What every background sync of one worker uses: the server and the wire codec."""

    #: The worker's client (gRPC channels are thread-safe).
    client: ParameterServerClient
    manifest: Manifest
    #: Δ fp32 (N,) -> payload (``WorkerBase._encode_delta``).
    encode: Callable[[torch.Tensor], torch.Tensor]
    #: (payload, out fp32 (N,)) -> out (``WorkerBase._decode_payload``).
    decode: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class SyncRequest:
    """One background push + pull: what it sends and the CPU buffers it writes.

    The training thread does not touch any of these buffers while the sync is in flight.
    """

    #: The worker's registration.
    worker_id: int
    #: The push to send, or None (a pull only). A new push (``payload`` None) takes
    #: Δ = θ_base − θ_local(t0) in the background, checks it and encodes it, so the
    #: training thread only pays the snapshot.
    pending: PushToSend | None
    #: θ_base, fp32 (N,).
    base: torch.Tensor
    #: θ_local(t0), fp32 (N,); becomes c = θ_g' − θ_local(t0) once the pull completed
    #: (unchanged otherwise, so a retried push keeps it).
    snapshot: torch.Tensor
    #: fp32 (N,); receives θ_g'.
    theta_g: torch.Tensor
    #: uint8 (wire bytes,) receive buffer for the pull.
    pull_buffer: torch.Tensor | None
    #: The wire codec is lossy (bf16/int8): the correction then keeps the quantisation
    #: error e = Δ − decode(encode(Δ)) the server did not receive,
    #: c = θ_g' − (θ_base − decode(payload)) = θ_g' − θ_local(t0) − e, so it is pushed
    #: next round (error feedback, as in the blocking path).
    carry_residual: bool = False


@dataclasses.dataclass
class SyncOutcome:
    """What one background push + pull did. Filled in by the background thread, read by
    the training thread only after the thread finished."""

    #: The push this sync carried (None: a pull only).
    pending: PushToSend | None
    #: The server's acknowledgement (None: no push, refused, or outcome unknown).
    push_reply: pb.PushReply | None = None
    #: Why the push was dropped without an acknowledgement: the refusal (one of
    #: ``errors.DROP_AND_REPULL``), or the InvalidPayloadError of a Δ that was not finite
    #: (not sent); the model restarts from θ_g'. None: not dropped.
    refused: AsyncDiLoCoError | None = None
    #: ``WorkerStats.drops`` key of ``refused``: its reason code, or ``NON_FINITE``.
    drop_reason: str = ""
    #: The pulled version and run config (None: the pull did not complete).
    version: int | None = None
    run_config: pb.RunConfig | None = None
    #: Bytes the pull received.
    bytes_pulled: int = 0
    #: The failure that ended the sync early (push not acknowledged, or pull failed).
    error: BaseException | None = None
    #: Seconds the background thread spent in push + pull + decode.
    comm_s: float = 0.0

    @property
    def pulled(self) -> bool:
        return self.version is not None


def push_then_pull(link: SyncLink, request: SyncRequest) -> SyncOutcome:
    """The background half of an overlapped sync (runs in ``BackgroundSync``'s thread):
    push ``request.pending`` (if any), pull θ_g', and turn the snapshot into the correction.

    Returns:
        The outcome; exceptions are caught into ``outcome.error`` (re-raised by the
        training thread at the merge).
    """
    out = SyncOutcome(pending=request.pending)
    started = time.monotonic()
    try:
        _push(link, request, out)
        _pull_and_correct(link, request, out)
    except Exception as exc:  # noqa: BLE001 - handed to the training thread, which re-raises it
        out.error = exc
    out.comm_s = time.monotonic() - started
    return out


def _push(link: SyncLink, request: SyncRequest, out: SyncOutcome) -> None:
    """Encode a new push's Δ, then send it; a Δ that is not finite (not sent) and a
    refusal in ``errors.DROP_AND_REPULL`` are recorded in ``out.refused``, not raised:
    the pull still runs, so the merge restarts from the global model."""
    pending = request.pending
    if pending is None:
        return
    if pending.payload is None:  # a new push: Δ, its check and its encoding
        delta = torch.sub(request.base, request.snapshot, out=request.theta_g)  # Δ = θ_base − θ_local(t0), (N,)
        try:
            check_finite_delta(delta, request.worker_id, pending.num_local_steps)
            pending.payload = link.encode(delta)  # θ_g' overwrites the Δ in theta_g later
        except InvalidPayloadError as exc:
            out.refused, out.drop_reason = exc, NON_FINITE
            return
    try:
        out.push_reply = pending.send(link.client, request.worker_id)
    except PayloadCorruptedError:
        raise  # every resend arrived corrupted (client.py): the push is kept for a retry
    except DROP_AND_REPULL as exc:
        out.refused, out.drop_reason = exc, exc.reason  # dropped: pull and restart from the global model


def _pull_and_correct(link: SyncLink, request: SyncRequest, out: SyncOutcome) -> None:
    """Pull θ_g' into ``theta_g`` and make the snapshot the correction c (module docstring)."""
    pulled = link.client.pull(link.manifest, request.worker_id, buffer=request.pull_buffer)
    theta_g, snapshot = request.theta_g, request.snapshot
    link.decode(pulled.payload, theta_g)  # θ_g', (N,) fp32
    sent = request.pending.payload if request.pending is not None else None
    if request.carry_residual and out.push_reply is not None and sent is not None:
        link.decode(sent, snapshot)  # what the server received, (N,)
        snapshot.add_(theta_g).sub_(request.base)  # c = θ_g' − (θ_base − decode(payload))
    else:
        torch.sub(theta_g, snapshot, out=snapshot)  # c = θ_g' − θ_local(t0), (N,)
    out.version, out.run_config, out.bytes_pulled = pulled.version, pulled.run_config, pulled.payload.numel()


def check_finite_delta(delta: torch.Tensor, worker_id: int, num_local_steps: int) -> None:
    """Refuse a pseudo-gradient with NaN/Inf before it is sent.

    A finite sum proves every element finite (one pass and no temporary, where
    ``isfinite().all()`` allocates a mask of N booleans); only a non-finite sum (NaN/inf,
    or overflow) needs the exact element-wise check.

    Raises:
        InvalidPayloadError: Δ holds non-finite values (the local model diverged).
    """
    if not (bool(torch.isfinite(delta.sum())) or bool(torch.isfinite(delta).all())):
        raise InvalidPayloadError(
            f"worker {worker_id}: the pseudo-gradient holds non-finite values after {num_local_steps} inner "
            f"steps; the local model diverged: lower the inner learning rate"
        )


class BackgroundSync:
    """One background thread that runs at most one ``push_then_pull`` at a time.

    Args:
        link: the worker's client and wire codec.
        snapshot: fp32 (N,) CPU buffer (pinned when the model is on CUDA) for θ_local(t0).
    """

    def __init__(self, link: SyncLink, snapshot: torch.Tensor) -> None:
        self.link = link
        #: θ_local(t0) at the sync point; c = θ_g' − θ_local(t0) after a completed pull. (N,) fp32.
        self.snapshot = snapshot
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="asyncdiloco-sync")
        self._future: concurrent.futures.Future[SyncOutcome] | None = None

    @property
    def in_flight(self) -> bool:
        """A sync was started and its outcome not collected yet."""
        return self._future is not None

    def done(self) -> bool:
        """The sync in flight has finished (non-blocking)."""
        return self._future is not None and self._future.done()

    def submit(self, request: SyncRequest) -> None:
        """Start ``push_then_pull(self.link, request)`` in the background thread."""
        assert self._future is None, "at most one sync in flight"
        self._future = self._executor.submit(push_then_pull, self.link, request)

    def wait(self) -> SyncOutcome:
        """Block until the sync in flight finished; return (and forget) its outcome. An
        interrupted wait (KeyboardInterrupt) leaves it in flight, so ``close()`` waits again."""
        assert self._future is not None, "no sync in flight"
        outcome = self._future.result()
        self._future = None
        return outcome

    def close(self) -> None:
        self._executor.shutdown(wait=True)
