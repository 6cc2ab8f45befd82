"""A torch.distributed process group (a torchrun group, usually DDP) trained as ONE worker
(``LocalGroup``): rank 0 is the worker the server sees; the followers mirror it.
docs/operations.md, "A torchrun group as one worker".
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import pickle
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from asyncdiloco.errors import AsyncDiLoCoError, ConfigError
from asyncdiloco.worker.flat import FlatParams

log = logging.getLogger(__name__)

#: ``share_outcome``'s codes: what rank 0's due step (or close) did; ``WAITING``: rank 0
#: is still inside it (a keep-alive: the followers wait for the next code).
UNCHANGED, CHANGED, RAISED, WAITING = 0, 1, 2, 3

#: The longest pause between two keep-alives, seconds (with a long group timeout).
KEEP_ALIVE_MAX_S = 5.0
#: The pause when the group's timeout cannot be read (a backend without ``options``).
KEEP_ALIVE_UNKNOWN_TIMEOUT_S = 1.0
#: At close, the longest rank 0 waits for the followers to take its outcome, seconds (or
#: the group's timeout, if shorter): a follower whose ``with`` raised never takes it.
CLOSE_SHARE_TIMEOUT_S = 30.0


def resolve_group(process_group: Any) -> LocalGroup | None:
    """The ``LocalGroup`` a worker trains as (None: alone), from ``process_group``: "auto"
    (torch.distributed's default group when initialized with more than one rank), a
    ``torch.distributed.ProcessGroup``, or "off".

    Raises:
        ConfigError: another value, or a process group while torch.distributed is not
            initialized.
    """
    if isinstance(process_group, str) and process_group in ("auto", "off"):
        if process_group == "off" or not _initialized():
            return None
        import torch.distributed as dist

        return LocalGroup(None) if dist.get_world_size() > 1 else None
    if _initialized():
        import torch.distributed as dist

        if isinstance(process_group, dist.ProcessGroup):
            return LocalGroup(process_group)
    raise ConfigError(
        f"process_group={process_group!r} is invalid: give 'auto' (torch.distributed's default group when it is "
        f"initialized, as under torchrun), a torch.distributed.ProcessGroup (after dist.init_process_group), or "
        f"'off' to train every process as a worker of its own"
    )


def _initialized() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module whose parameters a worker syncs: ``model``, or the one DDP wraps.

    Raises:
        ConfigError: the model is sharded (FSDP1, FSDP2 or any DTensor parameter).
    """
    if not torch.distributed.is_available():
        return model
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.distributed.tensor import DTensor
    from torch.nn.parallel import DistributedDataParallel

    fsdp = (FullyShardedDataParallel, FSDPModule)
    sharded = next((type(m).__name__ for m in model.modules() if isinstance(m, fsdp)), None)
    if sharded is None and any(isinstance(p, DTensor) for p in model.parameters()):
        sharded = "a DTensor parameter"
    if sharded is not None:
        raise ConfigError(
            f"the model is sharded ({sharded}): a DiLoCo worker pushes and pulls the whole model from rank 0, which "
            f"would have to gather every parameter in full at every sync; FSDP (FullyShardedDataParallel, "
            f"fully_shard) is not supported: replicate the model on every rank with DistributedDataParallel "
            f"(docs/operations.md, 'A torchrun group as one worker')"
        )
    return model.module if isinstance(model, DistributedDataParallel) else model


@dataclasses.dataclass(frozen=True)
class StepTotals:
    """What one inner step's ``exchange`` told every rank."""

    #: Σ over the ranks of the tokens they sent (rank 0 sends 0: it counts its own).
    tokens: int
    #: Some rank asked to stop: every rank's loop ends after this step.
    stop: bool
    #: Rank 0 runs a sync point or a merge now; ``share_outcome`` follows.
    due: bool


class LocalGroup:
    """One worker's ranks and the collectives that keep them one replica; ``process_group``
    None: the default group. Control tensors live on the CUDA device under NCCL."""

    def __init__(self, process_group: Any) -> None:
        import torch.distributed as dist

        self.process_group = process_group
        #: This process's rank in the group, and the group's size.
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        #: The global rank of the group's rank 0 (torch.distributed's ``src``).
        self.src = 0 if process_group is None else dist.get_global_rank(process_group, 0)
        nccl = str(dist.get_backend(process_group)) == "nccl"
        #: Where the control tensors live.
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        #: The group's collective timeout, seconds (None: the backend does not say).
        self.timeout_s = group_timeout_s(process_group, self.device)
        #: Seconds between rank 0's keep-alives while it waits on the server (``leading``):
        #: a quarter of the group's timeout, at most ``KEEP_ALIVE_MAX_S``.
        self.keep_alive_s = (
            KEEP_ALIVE_UNKNOWN_TIMEOUT_S if self.timeout_s is None else min(KEEP_ALIVE_MAX_S, self.timeout_s / 4)
        )
        #: Keep-alives rank 0 sent (``leading``), and those a follower received (``await_code``).
        self.keep_alives = 0
        #: The group's join completed on every rank (``share_join``).
        self.joined = False
        #: An exception or a failed collective: no more group collectives.
        self.broken = False
        #: Some rank's stop request arrived with a step's exchange (``step_exchange``).
        self.stopping = False
        #: Rank 0 runs a step whose outcome the group shares (``shared``).
        self.in_shared = False

    @property
    def close_wait_s(self) -> float:
        """At close, the longest rank 0 waits for the followers to take a code, seconds."""
        return min(CLOSE_SHARE_TIMEOUT_S, self.timeout_s or CLOSE_SHARE_TIMEOUT_S)

    @property
    def is_leader(self) -> bool:
        """Rank 0: the worker the server sees."""
        return self.rank == 0

    def exchange(self, *, tokens: int, stop: bool, due: bool) -> StepTotals:
        """Every rank, once per inner step: sum [tokens, stop, due] over the group (RuntimeError: a rank died)."""
        import torch.distributed as dist

        t = torch.tensor([tokens, int(stop), int(due)], dtype=torch.int64, device=self.device)  # (3,)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.process_group)
        total_tokens, stops, dues = (int(v) for v in t.tolist())
        return StepTotals(tokens=total_tokens, stop=stops > 0, due=dues > 0)

    def step_exchange(self, *, tokens: int, stop: bool, due: bool) -> StepTotals:
        """``exchange``; a failure ends the group's training (AsyncDiLoCoError)."""
        try:
            totals = self.exchange(tokens=tokens, stop=stop, due=due)
        except RuntimeError as exc:
            self.broken = True
            raise AsyncDiLoCoError(
                f"rank {self.rank}: the group's step exchange failed ({exc}); a rank of the torchrun group died "
                f"or stalled past the group's timeout; restart the group (its state folder resumes it)"
            ) from exc
        self.stopping = self.stopping or totals.stop
        return totals

    def follow_step(self, flat: FlatParams, tokens: int, stop: bool) -> float:
        """A follower's step: send its ``tokens`` and ``stop``; mirror a due step. Returns the
        seconds spent mirroring (0 when none was due)."""
        if not self.step_exchange(tokens=tokens, stop=stop, due=False).due:
            return 0.0
        started = time.monotonic()
        try:
            self.shared(flat, lambda: None)
        finally:
            blocked_s = time.monotonic() - started
        return blocked_s

    def shared(self, flat: FlatParams, action: Callable[[], Any], *, broken_ok: bool = False) -> Any:
        """Run ``action`` on rank 0 (inside ``leading``) and share its outcome: every rank
        takes rank 0's parameters, or raises its exception. Returns ``action()``'s result on
        rank 0; on a follower, True when the model changed."""
        assert broken_ok or not self.broken, "a live group shares outcomes"
        if not self.is_leader:
            try:
                return self.share_outcome(flat.params)
            except BaseException:
                self.broken = True
                raise
        writes = flat.writes
        self.in_shared = True
        try:
            with self.leading(closing=broken_ok):  # the followers wait through keep-alives, however long
                result = action()
        except BaseException as exc:
            self.broken = True
            with contextlib.suppress(RuntimeError):  # a dead group: rank 0 raises its own error
                self.share_outcome(flat.params, error=exc)
            raise
        finally:
            self.in_shared = False
        self.share_outcome(flat.params, changed=flat.writes != writes, closing=broken_ok)
        return result

    def share_join(
        self, flat: FlatParams, inner_optimizer: torch.optim.Optimizer, extra: dict, error: BaseException | None
    ) -> dict:
        """Every rank, at join: rank 0's outcome (its exception raised everywhere), its inner
        optimizer's state, parameters and ``extra`` (returned as rank 0 restored it)."""
        joined: dict[str, Any] | None = None
        if self.is_leader:
            joined = {"error": portable(error)} if error is not None else {}
            if error is None:
                joined.update(inner_optimizer=to_cpu(inner_optimizer.state_dict()), extra=extra)
        try:
            if self.is_leader:
                self.send_code(UNCHANGED)
            else:
                self.await_code()  # rank 0's keep-alives while it joins (``leading``)
            joined = self.broadcast_object(joined)
        except Exception:
            if error is not None:
                return extra  # the join's own error is what rank 0 raises
            raise
        assert joined is not None, "rank 0 broadcasts its join"
        if "error" in joined:
            if not self.is_leader:
                raise noted(joined["error"], f"raised by rank 0's join; rank {self.rank} raises it too")
            return extra
        if not self.is_leader:
            inner_optimizer.load_state_dict(joined["inner_optimizer"])
            extra = dict(joined["extra"])
        self.broadcast_params(flat.params)
        self.joined = True
        return extra

    def check_state_dict(self, merge_in_flight: bool) -> None:
        """``state_dict`` is rank 0's, and may not merge a background sync outside a step."""
        if not self.is_leader:
            raise ConfigError(
                f"state_dict() on rank {self.rank} of the group: the group's state is rank 0's (it saves it in "
                f"state_dir after every sync); call it on rank 0"
            )
        if merge_in_flight and not self.in_shared and not self.broken:
            raise ConfigError(
                "state_dict() on rank 0 while an overlapped sync is in flight: merging it now would change rank 0's "
                "model alone; let the worker save its state (state_dir), or call it after close()"
            )

    def broadcast_params(self, params: Sequence[torch.Tensor]) -> None:
        """Every rank: ``params`` ← rank 0's, each tensor on its own device, in place."""
        import torch.distributed as dist

        with torch.no_grad():
            works = [dist.broadcast(p, src=self.src, group=self.process_group, async_op=True) for p in params]
            for work in works:
                assert work is not None, "async_op returns a work handle"
                work.wait()

    def broadcast_object(self, obj: Any) -> Any:
        """Every rank: rank 0's ``obj`` (picklable; others pass anything, e.g. None)."""
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=self.src, group=self.process_group, device=self.device)
        return box[0]

    @contextlib.contextmanager
    def leading(self, closing: bool = False) -> Iterator[None]:
        """Rank 0, around a call that may wait on the server: a thread broadcasts ``WAITING``
        every ``keep_alive_s`` so no follower's collective times out; stopped on exit.
        ``closing``: each keep-alive waits at most ``close_wait_s``."""
        stop = threading.Event()
        wait_s = self.close_wait_s if closing else None
        thread = threading.Thread(
            target=self._keep_alive, args=(stop, wait_s), name="asyncdiloco-keepalive", daemon=True
        )
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()

    def _keep_alive(self, stop: threading.Event, wait_s: float | None) -> None:
        """``leading``'s thread (rank 0): one ``WAITING`` broadcast every ``keep_alive_s`` until ``stop``."""
        device = torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()
        with device:  # the current CUDA device is per thread: NCCL's on this one too
            while not stop.wait(self.keep_alive_s):
                try:
                    self.send_code(WAITING, timeout_s=wait_s)
                except RuntimeError as exc:
                    log.warning("rank 0: a keep-alive to the group failed (%s)", exc)
                    return
                self.keep_alives += 1

    def send_code(self, code: int, timeout_s: float | None = None) -> None:
        """Rank 0: broadcast one int64 ``code``, waiting at most ``timeout_s`` (None: the
        group's timeout); RuntimeError when a rank died or the wait timed out."""
        import torch.distributed as dist

        t = torch.tensor([code], dtype=torch.int64, device=self.device)
        work = dist.broadcast(t, src=self.src, group=self.process_group, async_op=True)
        assert work is not None, "async_op returns a work handle"
        if timeout_s is None:
            work.wait()
        else:
            work.wait(timeout=datetime.timedelta(seconds=timeout_s))

    def await_code(self) -> int:
        """A follower: rank 0's next code other than ``WAITING``; RuntimeError when a rank died."""
        import torch.distributed as dist

        t = torch.zeros(1, dtype=torch.int64, device=self.device)
        while True:
            dist.broadcast(t, src=self.src, group=self.process_group)
            code = int(t.item())
            if code != WAITING:
                return code
            self.keep_alives += 1

    def share_outcome(
        self,
        params: Sequence[torch.Tensor],
        *,
        changed: bool = False,
        error: BaseException | None = None,
        closing: bool = False,
    ) -> bool:
        """Every rank, after a due step (or at close, ``closing``): rank 0 sends what happened,
        the followers mirror it. True when rank 0's parameters changed (and were broadcast).
        Raises rank 0's exception on the followers, or RuntimeError when a rank died."""
        if self.is_leader:
            code = RAISED if error is not None else CHANGED if changed else UNCHANGED
            self.send_code(code, timeout_s=self.close_wait_s if closing else None)
        else:
            code = self.await_code()
        if code == RAISED:
            raised = self.broadcast_object(portable(error) if self.is_leader else None)
            if not self.is_leader:
                noted(raised, f"raised on rank 0 of the group; rank {self.rank} raises it too")
                raise raised
        elif code == CHANGED:
            self.broadcast_params(params)
        return code == CHANGED


def group_timeout_s(process_group: Any, device: torch.device) -> float | None:
    """The collective timeout of ``process_group`` on ``device``'s backend, seconds (None: unknown)."""
    import torch.distributed as dist

    group: Any = process_group if process_group is not None else dist.group.WORLD
    try:
        timeout = group._get_backend(device).options._timeout
        return float(timeout.total_seconds())
    except (AttributeError, RuntimeError, TypeError):
        return None


def noted(exc: BaseException, note: str) -> BaseException:
    """``exc`` with ``note`` added to its traceback's notes (Python 3.11+; on 3.10 as is)."""
    add_note = getattr(exc, "add_note", None)
    if add_note is not None:
        add_note(note)
    return exc


def portable(exc: BaseException | None) -> BaseException:
    """``exc`` if it survives pickling, else an AsyncDiLoCoError naming it."""
    assert exc is not None, "rank 0 shares the exception it raised"
    try:
        copy = pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001 - any exception that cannot travel is described instead
        return AsyncDiLoCoError(f"{type(exc).__name__}: {exc}")
    return copy if isinstance(copy, BaseException) else AsyncDiLoCoError(f"{type(exc).__name__}: {exc}")


def to_cpu(obj: Any) -> Any:
    """``obj`` (dicts, lists, tuples, tensors, scalars) with every tensor copied to the CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu")
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj
