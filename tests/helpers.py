"""Helpers shared by the tests: a fake clock, model ↔ flat-vector copies, the state
fingerprint that refused or replayed pushes must leave bit-identical, bounded waits,
and a crash of the durable store.

Everything here is plain functions and classes; the fixtures built on them live in
``conftest.py``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

import torch
from torch import nn

#: Seconds a bounded wait allows before it calls the test stuck: far beyond what any
#: step takes on a loaded machine, so it only fails when something really hangs.
STUCK_S = 60.0


class FakeClock:
    """A monotonic clock the test moves by hand: pass it as ``clock=`` to the server
    state, the quorum manager or the group gate.

    Args:
        now: the starting time, seconds.
    """

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        """Move the clock forward by ``seconds``; returns the new time."""
        self.now += seconds
        return self.now


def flat(model: nn.Module) -> torch.Tensor:
    """A copy of ``model``'s parameters as one fp32 vector, (N,), in parameter order."""
    return torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])


def load(model: nn.Module, theta: torch.Tensor) -> None:
    """Copy the flat vector ``theta`` (N,) into ``model``'s parameters."""
    pos = 0
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(theta[pos : pos + p.numel()].view(p.shape))
            pos += p.numel()


def fingerprint(state) -> tuple:
    """Everything a refused push must leave unchanged and a replayed log must restore:
    θ, the outer optimizer's buffers, the counters and every worker's record (ids,
    names, per-worker counts and the push outcomes kept for retries).

    Args:
        state: a ``ParameterServerState`` (or a ``ParameterServer``: its ``.state``).
    """
    state = getattr(state, "state", state)
    outer = state.model.outer
    mom = outer.momentum_buffer if outer is not None else None
    dn = getattr(outer, "delta_buffer", None)
    workers = {
        w.worker_id: (w.name, w.applied_pushes, w.tokens, w.local_steps, dict(w.outcomes))
        for w in state.registry.workers.values()
    }
    return (
        None if state.params is None else state.params.clone(),
        None if mom is None else mom.clone(),
        None if dn is None else dn.clone(),
        getattr(outer, "arrivals", None),
        state.version,
        state.counters.applied_pushes,
        state.counters.tokens,
        state.counters.bytes_pushed,
        tuple(state.counters.staleness_histogram),
        workers,
        state.registry.next_worker_id,
    )


def assert_same(a: tuple, b: tuple) -> None:
    """Two fingerprints are equal, tensors bit for bit."""
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and torch.equal(x, y), f"field {i} differs"
        else:
            assert x == y, f"field {i}: {x!r} != {y!r}"


def open_durable(config):
    """A ``ParameterServerState`` and its opened ``DurableStore`` for ``config`` (which has
    ``durability``), wired as ps/server.py wires them (the store reports to the state's
    observer); restores what the checkpoint folder holds. Returns (state, store)."""
    from asyncdiloco.ps.durable.store import DurableStore
    from asyncdiloco.ps.state import ParameterServerState

    state = ParameterServerState(config)
    store = DurableStore(config.durability, config)
    store.observer = state.observer
    store.open(state.durability)
    return state, store


def crash(store) -> None:
    """What kill -9 does to a ``DurableStore``: its files stay as they are, the folder
    lock is released (by the kernel), and its state journals no more."""
    if store._segment is not None:  # noqa: SLF001
        store._segment.close()  # noqa: SLF001
        store._segment = None  # noqa: SLF001
    store._state.journal.journal = None  # noqa: SLF001 - the state's JournalSlot forwards to nothing
    store._unlock_dir()  # noqa: SLF001


def wait_until(condition: Callable[[], object], what: str, timeout_s: float = STUCK_S, poll_s: float = 0.01):
    """Poll ``condition`` (changed by another thread or process) until it is true.

    Returns:
        the condition's (true) value.
    Raises:
        AssertionError: still false after ``timeout_s`` seconds, naming ``what``.
    """
    deadline = time.monotonic() + timeout_s
    idle = threading.Event()
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        idle.wait(poll_s)  # the pause between polls, not a synchronisation


def run_threads(targets: Iterable[Callable[[], object]], timeout_s: float = STUCK_S) -> None:
    """Run each callable on its own thread, wait for all, and re-raise the first error.

    Raises:
        AssertionError: a thread is still running after ``timeout_s`` seconds.
    """
    errors: list[BaseException] = []

    def wrap(fn: Callable[[], object]) -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=wrap, args=(fn,), daemon=True) for fn in targets]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), f"a thread still ran after {timeout_s:g} s"
    if errors:
        raise errors[0]
