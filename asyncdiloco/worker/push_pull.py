"""The async worker's one push-then-pull (``push_then_pull``), inline or on a background
thread (``BackgroundSync``); it touches only the client and CPU buffers.
docs/worker.md, "The sync path".
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from collections.abc import Callable

import torch

from asyncdiloco.errors import DROP_AND_REPULL, AsyncDiLoCoError, InvalidPayloadError, PayloadCorruptedError
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.tensors import Manifest
from asyncdiloco.worker.client import ParameterServerClient
from asyncdiloco.worker.drops import NON_FINITE


@dataclasses.dataclass
class PendingPush:
    """A pseudo-gradient push until the server acknowledged or refused it."""

    #: uint8 payload; None until the background thread takes and encodes Δ.
    payload: torch.Tensor | None
    push_id: int
    base_version: int
    num_local_steps: int
    num_tokens: int
    #: Seconds of inner steps the push carries.
    compute_s: float
    #: Sent while the worker closes: the server does not hold its reply for a group.
    last: bool = False


@dataclasses.dataclass(frozen=True)
class SyncLink:
    """What every sync of one worker uses: the server and the wire codec."""

    #: The worker's client (gRPC channels are thread-safe).
    client: ParameterServerClient
    manifest: Manifest
    #: Δ fp32 (N,) -> payload (``WorkerWire.encode``).
    encode: Callable[[torch.Tensor], torch.Tensor]
    #: (payload, out fp32 (N,)) -> out (``WorkerWire.decode``).
    decode: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class SyncRequest:
    """One push + pull: what it sends and the CPU buffers it writes (the training thread
    touches none of them while a background sync is in flight)."""

    worker_id: int
    #: The push to send, or None (a pull only). A new push without a payload takes
    #: Δ = θ_base − θ_local(t0) here, checks it and encodes it.
    pending: PendingPush | None
    #: θ_base, fp32 (N,); lowered in place by what the server received when the push is
    #: acknowledged and the rest is kept (``keep_unsent``, or the pull did not complete).
    base: torch.Tensor
    #: θ_local(t0), fp32 (N,), or None inline (the model holds it: no step runs meanwhile).
    #: Becomes the correction c = θ_g' − θ_local(t0) when nothing else is kept.
    snapshot: torch.Tensor | None
    #: fp32 (N,); receives θ_g' (and serves as scratch before).
    theta_g: torch.Tensor
    #: uint8 (wire bytes,) receive buffer for the pull.
    pull_buffer: torch.Tensor | None
    #: The wire codec is lossy (bf16/int8): after an acknowledged push the quantisation
    #: error the server did not receive is kept (error feedback).
    lossy: bool = False
    #: θ_base − θ_local(t0) holds steps the server has not received (a retry's later
    #: steps, a restored state): c = θ_g' − θ_base keeps them on top of θ_g'.
    keep_unsent: bool = False
    #: Pull after the push (False: the final pushes at close).
    pull: bool = True


@dataclasses.dataclass
class SyncOutcome:
    """What one push + pull did; read by the training thread once it finished."""

    #: The push this sync carried (None: a pull only).
    pending: PendingPush | None
    #: The server's reply (None: no push, refused, or outcome unknown).
    push_reply: pb.PushReply | None = None
    #: Why the push was dropped without a reply: the refusal (one of
    #: ``errors.DROP_AND_REPULL``), or the InvalidPayloadError of a Δ that was not finite.
    refused: AsyncDiLoCoError | None = None
    #: ``WorkerStats.drops`` key of ``refused``: its reason code, or ``NON_FINITE``.
    drop_reason: str = ""
    #: The pulled version and run config (None: the pull did not complete).
    version: int | None = None
    run_config: pb.RunConfig | None = None
    bytes_pulled: int = 0
    #: fp32 (N,): θ_local(now) + correction is the merged model (None: load θ_g').
    correction: torch.Tensor | None = None
    #: The failure that ended the sync early (push not acknowledged, or pull failed).
    error: BaseException | None = None
    #: Seconds spent in push + pull + decode.
    comm_s: float = 0.0
    #: θ_base was lowered by the acknowledged payload (at most once per sync).
    base_lowered: bool = False

    @property
    def pulled(self) -> bool:
        return self.version is not None

    @property
    def acknowledged(self) -> bool:
        return self.push_reply is not None and self.push_reply.applied


def push_then_pull(link: SyncLink, request: SyncRequest) -> SyncOutcome:
    """Push ``request.pending`` (if any), then pull θ_g' and compute the correction.

    Returns:
        The outcome; exceptions are caught into ``outcome.error`` (re-raised by the merge).
    """
    out = SyncOutcome(pending=request.pending)
    started = time.monotonic()
    try:
        _push(link, request, out)
        if request.pull:
            _pull_and_correct(link, request, out)
    except Exception as exc:  # noqa: BLE001 - handed to the training thread, which re-raises it
        out.error = exc
    if out.acknowledged and not out.base_lowered and not out.pulled:
        _lower_base(link, request, out)  # the rest goes out later, as a residual
    out.comm_s = time.monotonic() - started
    return out


def _push(link: SyncLink, request: SyncRequest, out: SyncOutcome) -> None:
    """Encode a new push's Δ, then send it; a Δ that is not finite (not sent) and a refusal
    in ``errors.DROP_AND_REPULL`` are recorded in ``out.refused``: the pull still runs, so
    the merge restarts from the global model."""
    pending = request.pending
    if pending is None:
        return
    if pending.payload is None:  # a new push: Δ, its check and its encoding
        assert request.snapshot is not None, "an inline push is encoded before"
        delta = torch.sub(request.base, request.snapshot, out=request.theta_g)  # Δ = θ_base − θ_local(t0), (N,)
        try:
            check_finite_delta(delta, request.worker_id, pending.num_local_steps)
            pending.payload = link.encode(delta)  # θ_g' overwrites the Δ in theta_g later
        except InvalidPayloadError as exc:
            out.refused, out.drop_reason = exc, NON_FINITE
            return
    try:
        out.push_reply = link.client.push(
            pending.payload,
            worker_id=request.worker_id,
            push_id=pending.push_id,
            base_version=pending.base_version,
            num_local_steps=pending.num_local_steps,
            num_tokens=pending.num_tokens,
            compute_s=pending.compute_s,
            last=pending.last,
        )
    except PayloadCorruptedError:
        raise  # every resend arrived corrupted (client.py): the push is kept for a retry
    except DROP_AND_REPULL as exc:
        out.refused, out.drop_reason = exc, exc.reason  # dropped: pull and restart from the global model


def _lower_base(link: SyncLink, request: SyncRequest, out: SyncOutcome) -> None:
    """θ_base −= decode(payload): the server now holds exactly that, so what is left of
    θ_base − θ_local is what it has not received."""
    assert request.pending is not None and request.pending.payload is not None, "a sent push"
    request.base.sub_(link.decode(request.pending.payload, request.theta_g))
    out.base_lowered = True


def _pull_and_correct(link: SyncLink, request: SyncRequest, out: SyncOutcome) -> None:
    """Pull θ_g' into ``theta_g`` and compute the correction (θ_base lowered first when the
    unsent part is kept)."""
    pulled = link.client.pull(link.manifest, request.worker_id, buffer=request.pull_buffer)
    base, theta_g = request.base, request.theta_g
    keep = request.keep_unsent or (out.acknowledged and request.lossy)
    if keep and out.acknowledged:
        _lower_base(link, request, out)
    link.decode(pulled.payload, theta_g)  # θ_g', (N,) fp32
    if keep:
        out.correction = torch.sub(theta_g, base, out=base)  # c = θ_g' − θ_base, (N,)
    elif request.snapshot is not None:
        out.correction = torch.sub(theta_g, request.snapshot, out=request.snapshot)  # c = θ_g' − θ_local(t0)
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
