"""The value check of a push: no NaN/Inf, no magnitude over ``max_abs_value``, the
refusal naming the first bad element. docs/architecture.md, "One push".
"""

from __future__ import annotations

import math

import torch

from asyncdiloco.errors import InvalidPayloadError
from asyncdiloco.ps.push.value_scan import largest_magnitude
from asyncdiloco.wire.tensors import Manifest


def check_values(
    delta: torch.Tensor,
    worker_id: int,
    max_abs_value: float,
    manifest: Manifest | None = None,
    what: str = "",
    largest: float | None = None,
    fix: str = "lower the inner learning rate or clip gradients",
) -> float:
    """Refuse a decoded push (float32 (N,), in the manifest's parameter order) with
    non-finite values or values too large for θ; returns ‖Δ‖∞ (the divergence monitor's
    input). The refusal names the parameter and index of the first bad element.

    Args:
        what: names the payload in the refusal (default "payload from worker <id>").
        largest: ‖Δ‖∞ when it is known already (value_scan.py ``ValueScan``, computed while
            the chunks landed): then a payload that passes costs no pass here.
    Raises:
        InvalidPayloadError: a NaN or ±inf, or a magnitude over ``max_abs_value``.
    """
    what = what or f"payload from worker {worker_id}"
    if largest is None:
        largest = largest_magnitude(delta)  # NaN/Inf propagate
    if not math.isfinite(largest):
        bad = ~torch.isfinite(delta)
        first = int(torch.argmax(bad.to(torch.uint8)))  # argmax gives the first maximal index
        raise InvalidPayloadError(
            f"{what} holds {int(bad.sum())} non-finite values (NaN/Inf), the first at "
            f"{element_name(manifest, first)}; the limit is 0: {fix}"
        )
    if largest > max_abs_value:
        first = int(torch.argmax((delta.abs() > max_abs_value).to(torch.uint8)))
        raise InvalidPayloadError(
            f"{what} holds a value of magnitude {largest:.3g} (the first over the limit at "
            f"{element_name(manifest, first)}), over max_abs_value={max_abs_value:g} (it would overflow the "
            f"global model); {fix}, or raise --max-abs-value for a model on that scale"
        )
    return largest


def element_name(manifest: Manifest | None, index: int) -> str:
    """ "parameter #0 'weight', index (0, 7)": where element ``index`` of the flat (N,)
    vector lies (the manifest's parameter order); "element <index>" without a manifest."""
    if manifest is not None:
        start = 0
        for i, spec in enumerate(manifest.tensors):
            if index < start + spec.numel:
                at = tuple(int(v) for v in torch.unravel_index(torch.tensor(index - start), spec.shape))
                return f"parameter #{i} {spec.name!r}, index {at}"
            start += spec.numel
    return f"element {index}"
