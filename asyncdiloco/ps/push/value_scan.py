"""‖x‖∞ of a push measured chunk by chunk as the chunks land (``ValueScan``), so the
value check (value_check.py) costs no second pass over the payload; the refusal still
comes after the whole payload arrived and its CRC-32 matched.
"""

from __future__ import annotations

import math

import torch


def largest_magnitude(x: torch.Tensor) -> float:
    """max |x| of a 1-D float tensor (NaN if any NaN, inf if any ±inf; 0 when empty),
    in one ``aminmax`` pass."""
    if not x.numel():
        return 0.0
    lo, hi = (float(v) for v in torch.aminmax(x))
    return math.nan if math.isnan(lo) or math.isnan(hi) else max(-lo, hi)


class ValueScan:
    """‖x‖∞ of a float32 payload, accumulated as its bytes arrive.

    Call it with each byte range ``[start, end)`` as it is filled, in order (the
    ``watch`` of wire/tensors.py ``PayloadAssembler``); ranges need not fall on element
    edges: an element is scanned once all its 4 bytes are in.

    Args:
        buffer: the receive buffer, uint8 (4·N,) CPU, viewed as float32 (N,).
    Raises:
        ValueError: ``buffer`` is not a whole number of float32 elements.
    """

    def __init__(self, buffer: torch.Tensor) -> None:
        if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() % 4:
            raise ValueError(f"a value scan needs a uint8 (4*N,) buffer; got {buffer.dtype} {tuple(buffer.shape)}")
        self._floats = buffer.view(torch.float32)
        self._scanned = 0  # elements
        self._largest = 0.0

    def __call__(self, start: int, end: int) -> None:
        """Bytes ``[start, end)`` of the buffer were filled (every byte before ``start`` too)."""
        upto = min(end // 4, self._floats.numel())
        if upto <= self._scanned:
            return
        part = largest_magnitude(self._floats[self._scanned : upto])
        self._scanned = upto
        if not math.isnan(self._largest):  # NaN stays NaN, as in one pass over the whole
            self._largest = part if math.isnan(part) else max(self._largest, part)

    @property
    def largest(self) -> float | None:
        """max |x| over the whole payload (``largest_magnitude``'s value), or None while
        some of it was not scanned."""
        return self._largest if self._scanned == self._floats.numel() else None
