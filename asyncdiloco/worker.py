"""The asynchronous DiLoCo worker: wraps a model and its inner optimizer.

The user's loop stays a plain PyTorch loop::

    worker = AsyncDiLoCoWorker(model, inner_opt, WorkerConfig(server="10.0.0.5:29500"),
                               tokens_per_step=batch * context)
    with worker:                       # joins; pulls (or initializes) the global model
        for x, y in batches:
            loss = loss_fn(model(x), y)
            loss.backward()
            inner_opt.step()           # every H-th step also syncs with the server
            inner_opt.zero_grad()

A post-step hook on the inner optimizer counts inner steps; every H steps (H from the
server) the worker pushes the pseudo-gradient Δ = θ_base − θ_local against the version
θ_base was pulled at, then pulls the new global parameters into the model (DiLoCo,
Douillard et al. 2023, arXiv 2311.08105, Alg. 1; asynchronous variant as in Liu et al.
2024, arXiv 2401.09135, Sec. 3). The inner optimizer's state is kept across rounds.

Faults: if the server is unreachable the worker keeps training locally and retries at
later sync points with exponential backoff. An unacknowledged push is retried with the
same ``push_id`` (the server applies it at most once); once a push is acknowledged,
θ_base is lowered by it, so local progress made while a pull failed is pushed later as
a residual and never counted twice. A push refused as too stale is dropped and the
worker restarts from the global model. An expired lease triggers a rejoin.

Wire codec (codec.py; the server's ``RunConfig.wire_codec``): Δ is encoded for the push
and pulls are decoded into θ_base; θ_base, Δ and the model stay in their own precision.
Because θ_base is lowered by decode(encode(Δ)), exactly what the server received, the
quantisation error stays in θ_base − θ_local and is pushed next round: error feedback
for free (Seide et al. 2014; Karimireddy et al. 2019, arXiv 1901.09847). With bf16 or
int8 it also survives the pull: the model is loaded with θ_pulled − (θ_base − θ_local),
so a value too small to register in its block (int8) still accumulates until it does.

Device handling: parameters may live on any device; the worker keeps θ_base and its
buffers as fp32 on the CPU (pinned when the model is on CUDA) and copies explicitly.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch
from torch import nn

from asyncdiloco._proto import parameter_server_pb2 as pb
from asyncdiloco._worker_base import WorkerBase
from asyncdiloco.config import WorkerConfig
from asyncdiloco.errors import (
    InvalidPayloadError,
    NotInitializedError,
    StalePushError,
    UnknownWorkerError,
)

log = logging.getLogger(__name__)


@dataclasses.dataclass
class WorkerStats:
    """Counters of one worker (units in the names)."""

    inner_steps: int = 0
    tokens: int = 0
    pushes_applied: int = 0
    pushes_refused: int = 0
    sync_failures: int = 0
    pulls: int = 0
    bytes_pushed: int = 0
    bytes_pulled: int = 0
    comm_s: float = 0.0
    #: τ of every applied push, in order.
    staleness: list[int] = dataclasses.field(default_factory=list, repr=False)

    @property
    def mean_staleness(self) -> float:
        return sum(self.staleness) / len(self.staleness) if self.staleness else 0.0


@dataclasses.dataclass
class _PendingPush:
    push_id: int
    base_version: int
    num_local_steps: int
    num_tokens: int
    compute_s: float


class AsyncDiLoCoWorker(WorkerBase):
    """Asynchronous DiLoCo around ``model`` and ``inner_optimizer``.

    Args:
        model: any ``nn.Module`` with float32/bfloat16/float16 parameters, on any device.
        inner_optimizer: the optimizer the user steps (e.g. AdamW); the worker hooks
            its ``step`` to count inner steps and sync every H of them.
        config: server address, deadlines, backoff.
        tokens_per_step: tokens consumed per inner step, reported to the server (0 if
            unknown); ``add_tokens`` adds more.
    Raises:
        ServerUnavailableError (from ``join``): the server could not be reached within
            ``config.join_timeout_s``.
        ManifestMismatchError (from ``join``): the model differs from the server's.
        ModeMismatchError (from ``join``): the server runs ``--mode sync``.
    """

    mode = "async"

    def __init__(
        self,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        config: WorkerConfig,
        *,
        tokens_per_step: int = 0,
    ) -> None:
        super().__init__(model, inner_optimizer, config, tokens_per_step)
        on_cuda, n = self._on_cuda, self.manifest.numel
        self._base = torch.zeros(n, dtype=torch.float32, pin_memory=on_cuda)  # θ_base, (N,) fp32
        self._scratch = torch.zeros(n, dtype=torch.float32, pin_memory=on_cuda)  # θ_local, then Δ
        self._payload: torch.Tensor | None = None  # the encoded pending push (the base's push buffer)
        self._carry_residual = False  # an acknowledged push left a quantisation residual for the next pull to keep
        self.stats = WorkerStats()
        self.version = 0  # the version θ_base was pulled at
        self._next_push_id = 1
        self._pending: _PendingPush | None = None
        self._round_started = time.monotonic()

    # ------------------------------------------------------------ lifecycle
    def _mode_mismatch_message(self, server_mode: str) -> str:
        return (
            f"mode mismatch: the server at {self.config.server} runs mode {server_mode!r}; use SyncDiLoCoWorker "
            f"(`asyncdiloco worker --mode sync`), or start the server with --mode async"
        )

    def _join_once(self) -> None:
        if not self.worker_id:
            self._register()
            self._next_push_id = 2  # push_id 1 is reserved for the initial parameters
        if self._must_initialize:  # a retry after a failed attempt resends push_id 1: applied at most once
            self._copy_model_into(self._base)
            self._send_payload(
                self.manifest.pack_flat(self._base),  # always raw, exact
                pending=_PendingPush(push_id=1, base_version=0, num_local_steps=0, num_tokens=0, compute_s=0.0),
                kind=pb.PUSH_KIND_INITIAL_PARAMETERS,
            )
            self._must_initialize = False
            self.version = 0
            self._steps_since_sync = 0  # the steps so far are in the initial parameters
            self._tokens_since_sync = 0
            self._round_started = time.monotonic()
            log.info("worker %d initialized the global model", self.worker_id)
            return
        try:
            self._pull_and_load()  # raises NotInitializedError until the initial parameters arrive
        except NotInitializedError:
            self._take_over_initialization_if_told()
            raise

    def close(self) -> None:
        """Push the steps since the last sync (if ``push_on_close``), leave, release."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._hook.remove()
        if self.worker_id and not self._needs_rejoin:
            if self.config.push_on_close and (self._steps_since_sync > 0 or self._pending):
                try:
                    self._push_round()
                except Exception as exc:  # noqa: BLE001 - best effort at shutdown
                    log.warning("final push failed: %s", exc)
        self._close_connection()

    # ---------------------------------------------------------------- sync
    def _sync_once(self) -> bool:
        """Push the pseudo-gradient, then pull the global model (the model holds it after).

        Raises:
            InvalidPayloadError: this worker's pseudo-gradient is not finite (diverged).
        """
        self._push_round()
        self._pull_and_load()
        return True

    # ------------------------------------------------------------- internals
    def _push_round(self) -> None:
        """Send the pending push (a retry) or a new one with Δ = θ_base − θ_local."""
        if self._pending is None:
            if self._steps_since_sync == 0:
                return
            self._copy_model_into(self._scratch)  # θ_local, (N,) fp32
            delta = torch.sub(self._base, self._scratch, out=self._scratch)  # Δ = θ_base − θ_local, (N,)
            if not bool(torch.isfinite(delta).all()):
                raise InvalidPayloadError(
                    f"worker {self.worker_id}: the pseudo-gradient holds non-finite values after "
                    f"{self._steps_since_sync} inner steps; the local model diverged: lower the inner learning rate"
                )
            self._payload = self._encode_delta(delta)
            self._pending = _PendingPush(
                push_id=self._next_push_id,
                base_version=self.version,
                num_local_steps=self._steps_since_sync,
                num_tokens=self._tokens_since_sync,
                compute_s=time.monotonic() - self._round_started,
            )
            self._next_push_id += 1
            self._steps_since_sync = 0
            self._tokens_since_sync = 0
            self._round_started = time.monotonic()
        pending = self._pending
        try:
            reply = self._send_payload(self._payload, pending=pending)
        except StalePushError as exc:
            self._pending = None
            self._carry_residual = False  # Δ is dropped: restart from the global model
            self.stats.pushes_refused += 1
            log.warning("push %d refused (%s); restarting from the global model", pending.push_id, exc)
            return
        except UnknownWorkerError:
            self._pending = None  # not applied: θ_base is unchanged, Δ is recomputed after the rejoin
            raise
        self._pending = None
        # The server now holds this Δ: lower θ_base by exactly what it received, so
        # steps taken before the next successful pull are pushed later as a residual.
        self._base.sub_(self._decode_payload(self._payload, self._scratch))
        self._carry_residual = self.codec.name != "raw"
        self.stats.pushes_applied += 1
        self.stats.staleness.append(reply.staleness)
        self.local_steps = reply.local_steps or self.local_steps

    def _send_payload(
        self, payload: torch.Tensor, *, pending: _PendingPush, kind: int = pb.PUSH_KIND_PSEUDO_GRADIENT
    ) -> pb.PushReply:
        reply = self.client.push(
            payload,
            worker_id=self.worker_id,
            push_id=pending.push_id,
            base_version=pending.base_version,
            num_local_steps=pending.num_local_steps,
            num_tokens=pending.num_tokens,
            compute_s=pending.compute_s,
            kind=kind,
        )
        self.stats.bytes_pushed += payload.numel()
        return reply

    def _pull_and_load(self) -> None:
        pulled = self.client.pull(self.manifest, self.worker_id, buffer=self._wire_buffer("pull"))
        self._set_codec(pulled.run_config)  # the same unless a restarted server uses another
        if self._carry_residual:  # keep what the server has not received (θ_base − θ_local)
            self._copy_model_into(self._scratch)
            torch.sub(self._base, self._scratch, out=self._scratch)  # residual, (N,)
        self._decode_payload(pulled.payload, self._base)
        if self._carry_residual:
            self._load_into_model(self._flat_views(torch.sub(self._base, self._scratch, out=self._scratch)))
            self._carry_residual = False
        else:
            self._load_into_model(self._flat_views(self._base))
        self.version = pulled.version
        self.local_steps = pulled.run_config.local_steps or self.local_steps
        self._steps_since_sync = 0
        self._tokens_since_sync = 0
        self._round_started = time.monotonic()
        self.stats.pulls += 1
        self.stats.bytes_pulled += pulled.payload.numel()

    def _forget_unsent(self) -> None:
        self._pending = None  # not applied (the server did not know this worker): Δ is recomputed
        self._carry_residual = False
