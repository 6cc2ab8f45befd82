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

Device handling: parameters may live on any device; the worker keeps θ_base and its
buffers as fp32 on the CPU (pinned when the model is on CUDA) and copies explicitly.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

import torch
from torch import nn

from asyncdiloco._proto import parameter_server_pb2 as pb
from asyncdiloco.client import ParameterServerClient
from asyncdiloco.config import WorkerConfig
from asyncdiloco.errors import (
    InvalidPayloadError,
    ModeMismatchError,
    NotInitializedError,
    ServerUnavailableError,
    StalePushError,
    UnknownWorkerError,
)
from asyncdiloco.tensors import Manifest

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


class AsyncDiLoCoWorker:
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
    """

    def __init__(
        self,
        model: nn.Module,
        inner_optimizer: torch.optim.Optimizer,
        config: WorkerConfig,
        *,
        tokens_per_step: int = 0,
    ) -> None:
        self.model = model
        self.inner_optimizer = inner_optimizer
        self.config = config
        self.tokens_per_step = tokens_per_step
        self.manifest = Manifest.from_module(model)
        self._params = [p for _, p in model.named_parameters()]
        on_cuda = any(p.is_cuda for p in self._params)
        n = self.manifest.numel
        self._base = torch.zeros(n, dtype=torch.float32, pin_memory=on_cuda)  # θ_base, (N,) fp32
        self._scratch = torch.zeros(n, dtype=torch.float32, pin_memory=on_cuda)  # θ_local, then Δ
        self._payload = torch.empty(self.manifest.total_bytes, dtype=torch.uint8, pin_memory=on_cuda)
        self._pull_buffer = torch.empty(self.manifest.total_bytes, dtype=torch.uint8, pin_memory=on_cuda)
        self.client = ParameterServerClient(
            config.server, rpc_timeout_s=config.rpc_timeout_s, timeout_s_per_mib=config.timeout_s_per_mib,
            security=config.security,
        )
        self.stats = WorkerStats()
        self.worker_id = 0
        self.version = 0  # the version θ_base was pulled at
        self.local_steps = 1  # H, set by the server
        self._lease_s = 60.0
        self._next_push_id = 1
        self._pending: _PendingPush | None = None
        self._steps_since_sync = 0
        self._tokens_since_sync = 0
        self._round_started = time.monotonic()
        self._backoff_s = config.initial_backoff_s
        self._next_attempt = 0.0
        self._needs_rejoin = False
        self._must_initialize = False
        self._rejoining = False
        self._hook = inner_optimizer.register_step_post_hook(lambda *_: self._after_inner_step())
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    # ------------------------------------------------------------ lifecycle
    def join(self) -> None:
        """Register with the server, then initialize the global model (first worker of
        a fresh server) or load it into ``model``. Retries until ``join_timeout_s``."""
        started = time.monotonic()
        delay = self.config.initial_backoff_s
        while True:
            try:
                self._join_once()
                break
            except (ServerUnavailableError, NotInitializedError) as exc:
                # The initial parameters are a push away: poll for them quickly. Waiting for
                # them may take a lease longer (until a dead initializer's lease lapses).
                waiting = isinstance(exc, NotInitializedError)
                wait_s = 0.1 if waiting else delay
                limit = self.config.join_timeout_s + (self._lease_s if waiting else 0.0)
                if time.monotonic() + wait_s > started + limit:
                    raise ServerUnavailableError(
                        f"could not join the parameter server at {self.config.server} within "
                        f"join_timeout_s={self.config.join_timeout_s:g} ({exc}); check that `asyncdiloco server` "
                        f"runs there and that host and port are right, or raise --join-timeout"
                    ) from None
                log.info("join: %s; retrying in %.1f s", exc, wait_s)
                time.sleep(wait_s)
                if wait_s == delay:
                    delay = min(2 * delay, self.config.max_backoff_s)
        if self._heartbeat is None:
            self._heartbeat = threading.Thread(target=self._heartbeat_loop, name="asyncdiloco-heartbeat", daemon=True)
            self._heartbeat.start()

    def _join_once(self) -> None:
        if not self.worker_id:
            reply = self.client.join(self.manifest, self.config.worker_name)
            if reply.run_config.mode == "sync":
                self.client.leave(reply.worker_id)
                raise ModeMismatchError(
                    f"mode mismatch: the server at {self.config.server} runs mode 'sync'; use SyncDiLoCoWorker "
                    f"(`asyncdiloco worker --mode sync`), or start the server with --mode async"
                )
            self.worker_id = reply.worker_id
            self._next_push_id = 2  # push_id 1 is reserved for the initial parameters
            self._must_initialize = reply.initialize
            self.local_steps = reply.run_config.local_steps
            self._lease_s = reply.run_config.lease_s
        if self._must_initialize:  # a retry after a failed attempt resends push_id 1: applied at most once
            self._load_local_into_base()
            self._send_payload(
                self.manifest.pack_flat(self._base, out=self._payload),
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
            if self.client.heartbeat(self.worker_id).initialize:  # the chosen initializer is gone
                self._must_initialize = True
                log.info("worker %d takes over initializing the global model", self.worker_id)
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
            try:
                self.client.leave(self.worker_id)
            except Exception as exc:  # noqa: BLE001
                log.info("leave failed: %s", exc)
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=5)
        self.client.close()

    def __enter__(self) -> "AsyncDiLoCoWorker":
        self.join()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- steps
    def add_tokens(self, num_tokens: int) -> None:
        """Count ``num_tokens`` more training tokens toward the next push."""
        self._tokens_since_sync += num_tokens
        self.stats.tokens += num_tokens

    def _after_inner_step(self) -> None:
        self.stats.inner_steps += 1
        self._steps_since_sync += 1
        self._tokens_since_sync += self.tokens_per_step
        self.stats.tokens += self.tokens_per_step
        if self._steps_since_sync >= self.local_steps:
            self.sync()

    def sync(self) -> bool:
        """Push the pseudo-gradient and pull the global model now (normally called by
        the inner optimizer hook every H steps).

        Returns:
            True when the model now holds a fresh global model; False when the server
            was unreachable (training goes on locally; a later sync retries).
        Raises:
            InvalidPayloadError: this worker's pseudo-gradient is not finite (diverged).
        """
        if self._stop.is_set() or time.monotonic() < self._next_attempt:
            return False
        started = time.monotonic()
        try:
            if self._needs_rejoin:
                self._rejoin()
                return True
            self._push_round()
            self._pull_and_load()
        except (ServerUnavailableError, NotInitializedError) as exc:
            self.stats.sync_failures += 1
            self._next_attempt = time.monotonic() + self._backoff_s
            log.warning("sync failed (%s); training on locally, next try in %.1f s", exc, self._backoff_s)
            self._backoff_s = min(2 * self._backoff_s, self.config.max_backoff_s)
            return False
        except UnknownWorkerError as exc:
            log.warning("%s; rejoining", exc)
            self._needs_rejoin = True
            return False
        finally:
            self.stats.comm_s += time.monotonic() - started
        self._backoff_s = self.config.initial_backoff_s
        return True

    # ------------------------------------------------------------- internals
    def _push_round(self) -> None:
        """Send the pending push (a retry) or a new one with Δ = θ_base − θ_local."""
        if self._pending is None:
            if self._steps_since_sync == 0:
                return
            self._load_local_into_base(into=self._scratch)
            delta = torch.sub(self._base, self._scratch, out=self._scratch)  # Δ = θ_base − θ_local, (N,)
            if not bool(torch.isfinite(delta).all()):
                raise InvalidPayloadError(
                    f"worker {self.worker_id}: the pseudo-gradient holds non-finite values after "
                    f"{self._steps_since_sync} inner steps; the local model diverged: lower the inner learning rate"
                )
            self.manifest.pack_flat(delta, out=self._payload)
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
            self.stats.pushes_refused += 1
            log.warning("push %d refused (%s); restarting from the global model", pending.push_id, exc)
            return
        except UnknownWorkerError:
            self._pending = None  # not applied: θ_base is unchanged, Δ is recomputed after the rejoin
            raise
        self._pending = None
        # The server now holds this Δ: lower θ_base by exactly what it received, so
        # steps taken before the next successful pull are pushed later as a residual.
        self._base.sub_(self.manifest.unpack_flat(self._payload, out=self._scratch))
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
        pulled = self.client.pull(self.manifest, self.worker_id, buffer=self._pull_buffer)
        with torch.no_grad():
            for p, t in zip(self._params, self.manifest.unpack(pulled.payload)):
                p.copy_(t, non_blocking=p.is_cuda)
            self.manifest.unpack_flat(pulled.payload, out=self._base)
        if any(p.is_cuda for p in self._params):
            torch.cuda.synchronize()
        self.version = pulled.version
        self.local_steps = pulled.run_config.local_steps or self.local_steps
        self._steps_since_sync = 0
        self._tokens_since_sync = 0
        self._round_started = time.monotonic()
        self.stats.pulls += 1
        self.stats.bytes_pulled += pulled.payload.numel()

    def _load_local_into_base(self, into: torch.Tensor | None = None) -> None:
        """Copy the model's parameters, flattened to fp32, into ``into`` (default θ_base)."""
        dst = self._base if into is None else into
        pos = 0
        with torch.no_grad():
            for p in self._params:
                n = p.numel()
                dst[pos : pos + n].copy_(p.detach().reshape(-1))
                pos += n

    def _rejoin(self) -> None:
        if not self._rejoining:  # a rejoin cut short by an outage resumes where it stopped
            self.worker_id = 0
            self._pending = None
            self._rejoining = True
        self._join_once()
        self._rejoining = False
        self._needs_rejoin = False
        log.info("rejoined as worker %d at version %d", self.worker_id, self.version)

    def _heartbeat_loop(self) -> None:
        period = self.config.heartbeat_s or self._lease_s / 3
        while not self._stop.wait(period):
            worker_id = self.worker_id
            if not worker_id or self._needs_rejoin:
                continue
            try:
                self.client.heartbeat(worker_id)
            except UnknownWorkerError:
                if worker_id == self.worker_id:
                    self._needs_rejoin = True
            except Exception as exc:  # noqa: BLE001 - the next sync reports real trouble
                log.debug("heartbeat failed: %s", exc)
