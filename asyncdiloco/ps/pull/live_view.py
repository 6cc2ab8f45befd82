"""Pulls served from θ's own memory (``LiveView``: one version of θ read in place, chunk by
chunk under the view's lock). Before θ changes, the version being read moves block by
block into the pushed Δ's receive buffer as the outer step goes (``begin_swap``; counted
in the receive budget until its last pull ends) or is copied (``freeze``: rounds,
rebases, replays). docs/architecture.md, "How a pull flows"; docs/performance.md.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import torch

from asyncdiloco.algo.outer import STEP_BLOCK_ELEMS, BlockHook
from asyncdiloco.ps.pull.encoded import new_bytes
from asyncdiloco.wire.grpc_chunks import chunk_prefix
from asyncdiloco.wire.tensors import crc32_update, num_chunks_for

#: Bytes read per lock hold while a CRC is computed (a step waits at most that long for it).
_CRC_PIECE = 1 << 22


class LiveView:
    """θ of one version, read in place by pulls until θ changes.

    Args:
        version: the global version θ holds now.
        theta: θ, float32 (N,) CPU, contiguous; the view reads its bytes in place.
        crc32: CRC-32 of θ's bytes when already known (computed during the step), else None.
    """

    def __init__(self, version: int, theta: torch.Tensor, crc32: int | None = None) -> None:
        self.version = version
        self.total_bytes = theta.numel() * 4
        self._tensor = theta
        self._theta = theta.view(torch.uint8).numpy().data  # θ's bytes, no copy
        self._lock = threading.Lock()
        self._crc_lock = threading.Lock()
        self._crc = crc32
        self._readers = 0
        #: Where this version's bytes are once θ changed (a swap target or a copy), else None.
        self._old: memoryview | None = None
        self._filled = 0  # bytes of ``_old`` already holding this version (== total once frozen)
        self._scratch: memoryview | None = None  # during a swap: this version's bytes of the block being stepped
        self._dead = False  # θ changed and no copy was kept: no pull may start here
        self._release: Callable[[], None] | None = None  # gives a swap target back to the receive pool

    def reads(self, theta: torch.Tensor | None) -> bool:
        """True when this view was made of the tensor ``theta`` (θ was not replaced since)."""
        return theta is self._tensor

    # ----------------------------------------------------------------- readers
    def enter(self) -> bool:
        """Register a pull; False when θ no longer holds this version and nothing kept it."""
        with self._lock:
            if self._dead:
                return False
            self._readers += 1
            return True

    def exit(self) -> None:
        """A pull from ``enter`` ended (completed or not)."""
        with self._lock:
            self._readers -= 1
            if self._readers == 0 and self._frozen_locked():
                self._drop_old_locked()

    @property
    def readers(self) -> int:
        with self._lock:
            return self._readers

    def crc32(self) -> int:
        """CRC-32 of this version's bytes (computed once, by the first caller)."""
        with self._crc_lock:
            if self._crc is None:
                crc = 0

                def fold(part: memoryview) -> None:
                    nonlocal crc
                    crc = crc32_update(crc, part)

                for offset in range(0, self.total_bytes, _CRC_PIECE):
                    self._read(offset, min(_CRC_PIECE, self.total_bytes - offset), fold)
                self._crc = crc
            return self._crc

    def _read(self, offset: int, nbytes: int, use: Callable[[memoryview], None]) -> None:
        """``use`` each piece of bytes [offset, offset + nbytes) of this version, in order,
        under the lock (so no piece changes while it is used)."""
        with self._lock:
            end = offset + nbytes
            for start, stop, src in self._sources_locked():
                lo, hi = max(start, offset), min(stop, end)
                if lo < hi:
                    use(src[lo - start : hi - start])

    def _sources_locked(self) -> list[tuple[int, int, memoryview]]:
        """(start, stop, bytes) covering this version: the old home's filled part, then the
        block being stepped (from the scratch), then the rest of θ, not touched yet."""
        if self._old is None:
            return [(0, self.total_bytes, self._theta)]
        parts = [(0, self._filled, self._old)]
        if self._filled < self.total_bytes:
            assert self._scratch is not None
            block_end = min(self.total_bytes, self._filled + len(self._scratch))
            parts.append((self._filled, block_end, self._scratch))
            parts.append((block_end, self.total_bytes, self._theta[block_end:]))
        return parts

    def copy_into(self, offset: int, dst: memoryview) -> None:
        """Copy bytes [offset, offset + len(dst)) of this version into ``dst``."""
        pos = 0

        def put(part: memoryview) -> None:
            nonlocal pos
            dst[pos : pos + len(part)] = part
            pos += len(part)

        self._read(offset, len(dst), put)

    def messages(self, chunk_bytes: int) -> Iterator[bytes]:
        """The serialised ``PullMessage(chunk=...)`` of each chunk, each built as it is sent."""
        for index in range(num_chunks_for(self.total_bytes, chunk_bytes)):
            offset = index * chunk_bytes
            n = min(chunk_bytes, self.total_bytes - offset)
            prefix = chunk_prefix(index, offset, n)
            msg, view = new_bytes(len(prefix) + n)
            view[: len(prefix)] = prefix
            self.copy_into(offset, view[len(prefix) :])
            del view
            yield msg

    def data_views(self, chunk_bytes: int = 1 << 22) -> Iterator[memoryview]:
        """The payload in pieces of ``chunk_bytes``, each valid until the next is asked for."""
        scratch = memoryview(bytearray(min(chunk_bytes, self.total_bytes)))
        for offset in range(0, self.total_bytes, chunk_bytes):
            n = min(chunk_bytes, self.total_bytes - offset)
            self.copy_into(offset, scratch[:n])
            yield scratch[:n].toreadonly()

    # ------------------------------------------------------- before θ changes
    def freeze(self, keep: bool) -> None:
        """θ is about to change (the caller holds the apply lock): copy this version out
        when a pull reads it or ``keep`` (pulls are coming), else close the view."""
        with self._lock:
            if self._old is not None:
                return
            if not (self._readers or keep):
                self._dead = True
                return
            self._old = memoryview(bytearray(self._theta))
            self._filled = self.total_bytes

    def begin_swap(self, target: torch.Tensor, release: Callable[[], None]) -> BlockHook:
        """The outer step is about to change θ block by block while it reads Δ from
        ``target`` (uint8, this view's size): this version moves into ``target`` as the
        step goes. Returns the ``on_block`` hook the step must be run with (blocks of
        ``STEP_BLOCK_ELEMS`` elements, in order); call ``finish_swap`` after the step.
        ``release`` gives ``target`` back (called once, when no pull reads it any more)."""
        if target.numel() != self.total_bytes:
            raise ValueError(f"swap target has {target.numel()} bytes; the view has {self.total_bytes}")
        block = STEP_BLOCK_ELEMS * 4
        with self._lock:
            self._old = target.numpy().data
            self._scratch = memoryview(bytearray(self._theta[:block]))
            self._filled = 0
            self._release = release

        def on_block(start: int, end: int) -> None:
            lo, hi = start * 4, end * 4
            with self._lock:
                assert self._old is not None and self._scratch is not None
                if lo != self._filled or hi - lo > len(self._scratch):
                    raise AssertionError(f"blocked step went to bytes [{lo}, {hi}); the swap is at {self._filled}")
                self._old[lo:hi] = self._scratch[: hi - lo]  # Δ's block is spent: this version takes its place
                self._filled = hi
                nxt = min(self.total_bytes, hi + block)
                self._scratch[: nxt - hi] = self._theta[hi:nxt]  # the next block, before the step changes it

        return on_block

    def evict(self) -> None:
        """Move this version out of the swap target into memory of its own and give the
        target back to the receive pool (a pull of it outlived the pool's hold lease:
        pushes wait for that room). Nothing happens during the swap itself."""
        with self._lock:
            release = self._release
            if release is None or self._old is None or self._scratch is not None:
                return
            self._old = memoryview(bytearray(self._old))
            self._release = None
        release()

    def finish_swap(self) -> None:
        """The step is done: this version lives in the swap target until its last pull ends."""
        with self._lock:
            assert self._old is not None and self._scratch is not None
            if self._filled < self.total_bytes:  # the step stopped early (it raised): the rest is still this version
                block_end = min(self.total_bytes, self._filled + len(self._scratch))
                self._old[self._filled : block_end] = self._scratch[: block_end - self._filled]
                self._old[block_end:] = self._theta[block_end:]
            self._scratch = None
            self._filled = self.total_bytes
            if self._readers == 0:
                self._drop_old_locked()

    def retire(self) -> None:
        """A newer view replaced this one: free a copy no pull reads (pulls still reading
        it keep it until they end)."""
        with self._lock:
            if self._readers == 0 and self._old is not None and self._scratch is None:
                self._drop_old_locked()

    def _frozen_locked(self) -> bool:
        return self._old is not None and self._filled == self.total_bytes and self._scratch is None

    def _drop_old_locked(self) -> None:
        """No pull reads this version any more: free its home (a swap target goes back to the pool)."""
        self._old, self._dead = None, True
        release, self._release = self._release, None
        if release is not None:
            release()


def crc_hook(theta: torch.Tensor) -> tuple[BlockHook, Callable[[], int]]:
    """An ``on_block`` hook folding each new block of θ (float32 (N,)) into a CRC-32 while
    it is in cache, and a function giving the CRC once the step is done."""
    raw = theta.view(torch.uint8).numpy().data
    state = {"crc": 0, "at": 0}

    def on_block(start: int, end: int) -> None:
        assert start * 4 == state["at"], "blocks out of order"
        state["crc"] = crc32_update(state["crc"], raw[start * 4 : end * 4])
        state["at"] = end * 4

    return on_block, lambda: state["crc"]
