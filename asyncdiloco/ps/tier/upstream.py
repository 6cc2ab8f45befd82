"""A hierarchical tier: this regional server is a worker of a parent one (HALoS, Kim et al.
2025, arXiv 2506.04531, Sec. 3): ``UpstreamLink`` pushes Δ_region upward every K regional
pushes, pulls θ_g and rebases (rebase.py). docs/algorithms.md, "Hierarchical tier".
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable

import torch

from asyncdiloco.errors import (
    ManifestMismatchError,
    NotInitializedError,
    ServerUnavailableError,
    StalePushError,
    UnknownWorkerError,
    WorkerSupersededError,
)
from asyncdiloco.ps.state import ParameterServerState
from asyncdiloco.ps.tier.rebase import DEFAULT_PARENT_EVERY, UpstreamConfig, rebase_onto, take_snapshot
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.codec import WireCodec, codec_for
from asyncdiloco.worker.client import ParameterServerClient

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_PARENT_EVERY", "UpstreamConfig", "UpstreamLink", "rebase_onto", "take_snapshot"]


@dataclasses.dataclass
class _Cut:
    """A push upward, cut and not yet answered: its id, S, its payload and residual r."""

    push_id: int
    snapshot: torch.Tensor  # S, fp32 (N,)
    payload: torch.Tensor  # uint8, the parent's wire codec
    residual: torch.Tensor  # r = Δ − decode(payload), fp32 (N,)
    tokens: int
    covers: int = 0  # the ``sync_now`` requests made before it was cut (it carries what they asked for)


class _Stopped(Exception):
    """The link is stopping (raised out of a backoff wait)."""


class UpstreamLink:
    """The regional server's worker of the parent, on a thread of its own.

    Args:
        state: the regional server's state (async mode, in memory).
        config: the parent and K.
        client: builds the client to the parent (tests inject one); default
            ``ParameterServerClient(config.parent, ...)``.

    Counters: ``syncs``, ``rebases`` (regional versions they added), ``pushes`` (applied
    by the parent), ``bytes_up``/``bytes_down``, ``parent_version``, ``failures``.
    """

    def __init__(
        self,
        state: ParameterServerState,
        config: UpstreamConfig,
        client: Callable[[], ParameterServerClient] | None = None,
    ) -> None:
        self.state = state
        self.config = config
        self._make_client = client or (
            lambda: ParameterServerClient(config.parent, rpc_timeout_s=config.rpc_timeout_s, security=config.security)
        )
        self.syncs = self.rebases = self.pushes = self.bytes_up = self.bytes_down = self.failures = 0
        self.parent_version = 0
        self.worker_id = 0
        self._client: ParameterServerClient | None = None
        self._base: torch.Tensor | None = None  # θ_base, fp32 (N,)
        self._codec: WireCodec | None = None
        self._cut: _Cut | None = None
        self._marks = (0, 0)  # (applied pushes, tokens) of the regional server at the last cut
        self._next_push_id = 1
        self._joined = self._synced = self._must_initialize = False
        self._heartbeat_at = 0.0
        self._stop = threading.Event()
        self._wake = threading.Event()
        #: ``sync_now`` requests made, and the newest one a finished push upward was cut after.
        self._requested = self._synced_for = 0
        self._done = threading.Condition()
        self._thread: threading.Thread | None = None
        if state.initialized:  # a server started again: its model as it is now is θ_base
            with state.locks.apply:
                self._base = state.model.theta.clone()
        else:
            state.observer.when_initialized(self._capture_base)

    # ------------------------------------------------------------- lifecycle
    def start(self) -> UpstreamLink:
        """Start the link's thread (it waits for the regional initial parameters)."""
        self._thread = threading.Thread(target=self._run, name="ps-upstream", daemon=True)
        self._thread.start()
        return self

    def stop(self, flush: bool = True) -> None:
        """Stop the link: one last push of what was applied since the last one (when
        ``flush`` and the parent answers within ``flush_timeout_s``), then Leave the parent."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._client is not None:
            if flush and self.config.flush_timeout_s > 0 and self._synced:
                self._flush()
            if self._joined:
                try:
                    self._client.leave(self.worker_id)
                except Exception as exc:  # noqa: BLE001 - best effort at shutdown
                    log.info("leaving the parent %s failed: %s", self.config.parent, exc)
            self._client.close()
            self._client = None

    def sync_now(self, timeout_s: float) -> bool:
        """Push what was applied since the last push upward (a zero Δ if nothing) and rebase now,
        without waiting for K; True once done within ``timeout_s`` seconds."""
        with self._done:  # a push cut before this call (one in flight) does not answer it
            self._requested += 1
            mine = self._requested
            self._wake.set()
            return self._done.wait_for(lambda: self._synced_for >= mine, timeout_s)

    # ------------------------------------------------------------- the thread
    def _capture_base(self) -> None:
        """The regional initial parameters were applied: they are θ_base until the first sync."""
        with self.state.locks.apply:
            if self.state.version != 0:
                log.warning("the regional model moved before its initial parameters were kept; keeping it as it is")
            self._base = self.state.model.theta.clone()

    def _run(self) -> None:
        delay_s = self.config.initial_backoff_s
        while not self._stop.is_set():
            try:
                self._step()
                delay_s = self.config.initial_backoff_s
            except _Stopped:
                return
            except (ServerUnavailableError, NotInitializedError) as exc:
                self.failures += 1
                log.warning("parent %s: %s; retrying in %.1f s", self.config.parent, exc, delay_s)
                self._sleep(delay_s)
                delay_s = min(2 * delay_s, self.config.max_backoff_s)
            except UnknownWorkerError as exc:  # the parent forgot the lease (a restart): join again
                log.warning("parent %s: %s; joining again", self.config.parent, exc)
                self._joined = False
            except (ManifestMismatchError, WorkerSupersededError) as exc:
                log.error("the link to the parent %s stops: %s", self.config.parent, exc)
                return
            except Exception:  # noqa: BLE001 - the link must not die of one bad call
                log.exception("the link to the parent %s failed; retrying in %.1f s", self.config.parent, delay_s)
                self._sleep(delay_s)
                delay_s = min(2 * delay_s, self.config.max_backoff_s)

    def _sleep(self, seconds: float) -> None:
        if self._stop.wait(seconds):
            raise _Stopped

    def _step(self) -> None:
        """One move of the link: wait for the model, join, first sync, or one push and rebase."""
        if self._base is None:
            self._sleep(self.config.poll_s)
            return
        if self._client is None:
            self._client = self._make_client()
        if not self._joined:
            self._join()
        if self._must_initialize:  # retried here until the parent has its initial parameters
            self._initialize_parent()
        if not self._synced:
            self._first_sync()
            return
        if self._cut is None and not self._wait_for_cut():
            return
        self._push_and_rebase()

    def _join(self) -> None:
        assert self._client is not None and self.state.model.manifest is not None
        name = self.config.name or f"region-{id(self):x}"
        reply = self._client.join(self.state.model.manifest, worker_name=name, region=True)
        self.worker_id, self._joined = reply.worker_id, True
        self._next_push_id = max(self._next_push_id, reply.last_push_id + 1)
        self._codec = codec_for(reply.run_config, self.state.model.manifest)
        self._heartbeat_at = time.monotonic() + reply.run_config.lease_s / 3
        log.info("joined the parent %s as worker %d (version %d)", self.config.parent, reply.worker_id, reply.version)
        self._must_initialize = reply.initialize

    def _initialize_parent(self) -> None:
        """The parent has no model yet: θ_base (the regional initial parameters) becomes it."""
        assert self._client is not None and self._base is not None and self.state.model.manifest is not None
        payload = self.state.model.manifest.pack_flat(self._base)
        try:
            self._client.push(
                payload, worker_id=self.worker_id, push_id=self._take_push_id(), base_version=0,
                kind=pb.PUSH_KIND_INITIAL_PARAMETERS,
            )  # fmt: skip
        except StalePushError as exc:  # initialized meanwhile (by another worker, or by this retried push)
            log.info("the parent %s is initialized (%s); pulling its model", self.config.parent, exc)
            self._must_initialize = self._synced = False  # the first sync rebases against θ_base
            return
        self._must_initialize = False
        self.bytes_up += payload.numel()
        self.parent_version, self._synced = 0, True
        self._finished_sync("initialized the parent at")

    def _first_sync(self) -> None:
        """Pull the global model and rebase against θ_base (keeping all that was applied
        since, so a cut not yet applied by this parent is dropped: it goes with the next push)."""
        assert self._base is not None
        self._cut = None
        theta_g, version = self._pull()
        self._rebase(theta_g, version, self._base, None)
        self._synced = True

    def _take_push_id(self) -> int:
        push_id, self._next_push_id = self._next_push_id, self._next_push_id + 1
        return push_id

    def _applied(self) -> tuple[int, int]:
        with self.state.locks.books:
            return self.state.counters.applied_pushes, self.state.counters.tokens

    def _wait_for_cut(self) -> bool:
        """Wait (heartbeating the parent) until K regional pushes were applied since the
        last cut, or ``sync_now``; then cut. False: nothing was cut this time."""
        applied, _ = self._applied()
        with self._done:
            requested = self._requested > self._synced_for
        if applied - self._marks[0] < self.config.every and not requested:
            self._wake.wait(self.config.poll_s)
            self._wake.clear()
            if self._stop.is_set():
                raise _Stopped
            if time.monotonic() >= self._heartbeat_at:
                self._heartbeat()
            return False
        self._cut = self._make_cut()
        return True

    def _heartbeat(self) -> None:
        assert self._client is not None
        reply = self._client.heartbeat(self.worker_id)
        self._heartbeat_at = time.monotonic() + max(reply.lease_remaining_s, 1.0) / 3
        self._must_initialize = self._must_initialize or reply.initialize

    def _make_cut(self) -> _Cut:
        """S ← θ_regional; Δ_region = θ_base − S, encoded with the parent's wire codec."""
        assert self._base is not None and self._codec is not None
        snapshot, marks = take_snapshot(self.state)
        tokens = marks[1] - self._marks[1]
        self._marks = marks
        delta = self._base - snapshot
        payload = self._codec.encode(delta, torch.empty(self._codec.wire_bytes, dtype=torch.uint8))
        residual = delta.sub_(self._codec.decode(payload, torch.empty_like(delta)))
        with self._done:
            covers = self._requested
        return _Cut(self._take_push_id(), snapshot, payload, residual, tokens, covers)

    def _push_and_rebase(self) -> None:
        """Send the cut (retried by ``_run`` with the same id), pull, rebase."""
        assert self._client is not None and self._cut is not None and self._base is not None
        cut = self._cut
        try:
            reply = self._client.push(
                cut.payload, worker_id=self.worker_id, push_id=cut.push_id, base_version=self.parent_version,
                num_tokens=cut.tokens,
            )  # fmt: skip
            applied = reply.applied
        except StalePushError as exc:
            log.warning("the parent refused push %d (%s): its content goes with the next push", cut.push_id, exc)
            applied = False
        self.bytes_up += cut.payload.numel()
        theta_g, version = self._pull()
        if applied:
            self.pushes += 1
            self._rebase(theta_g, version, cut.snapshot, cut.residual, covers=cut.covers)
        else:  # nothing of it reached the global model: keep all that was applied since θ_base
            self._rebase(theta_g, version, self._base, None, covers=cut.covers)
        self._cut = None

    def _pull(self) -> tuple[torch.Tensor, int]:
        """The global model θ_g, fp32 (N,), and its version."""
        assert self._client is not None and self.state.model.manifest is not None
        pulled = self._client.pull(self.state.model.manifest, self.worker_id)
        self.bytes_down += pulled.payload.numel()
        self._codec = codec_for(pulled.run_config, self.state.model.manifest)
        theta_g = self._codec.decode(pulled.payload, torch.empty(self.state.model.manifest.numel, dtype=torch.float32))
        return theta_g, pulled.version

    def _rebase(
        self,
        theta_g: torch.Tensor,
        version: int,
        since: torch.Tensor,
        residual: torch.Tensor | None,
        covers: int | None = None,
    ) -> None:
        """θ_regional ← θ_g − (since − θ_regional) − residual; θ_base ← θ_g (one regional version)."""
        rebase_onto(self.state, theta_g, since, residual)
        self.rebases += 1
        self._base, self.parent_version = theta_g, version
        self._finished_sync(covers=covers)

    def _finished_sync(self, what: str = "rebased onto", covers: int | None = None) -> None:
        """One more sync; ``covers``: the push upward it finished was cut after that many
        ``sync_now`` requests (None: a sync that pushed nothing, which answers none)."""
        with self._done:
            self.syncs += 1
            if covers is not None:
                self._synced_for = max(self._synced_for, covers)
            self._done.notify_all()
        log.info("%s the parent's version %d (sync %d)", what, self.parent_version, self.syncs)

    def _flush(self) -> None:
        """``stop``'s last push: what was applied since the last cut, within ``flush_timeout_s``."""
        deadline = time.monotonic() + self.config.flush_timeout_s
        if self._cut is None:
            if self._applied()[0] == self._marks[0]:
                return
            self._cut = self._make_cut()
        assert self._client is not None
        self._client.rpc_timeout_s = min(self._client.rpc_timeout_s, self.config.flush_timeout_s)
        while True:
            try:
                self._push_and_rebase()
                return
            except ServerUnavailableError as exc:
                if time.monotonic() + self.config.initial_backoff_s >= deadline:
                    log.warning("the last push to the parent %s was not delivered: %s", self.config.parent, exc)
                    return
                time.sleep(self.config.initial_backoff_s)
            except Exception as exc:  # noqa: BLE001 - best effort at shutdown
                log.warning("the last push to the parent %s failed: %s", self.config.parent, exc)
                return
