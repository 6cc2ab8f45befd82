"""A blocked outer step (``on_block``: the server's fused step + snapshot copy) gives
bit-identical θ, m and b to one pass over the whole vectors, for every outer optimizer,
and the one-pass step still equals torch's fused SGD as it was called before."""

from __future__ import annotations

import pytest
import torch
from torch.optim.sgd import sgd as torch_sgd

from asyncdiloco.algo.config import OuterConfig
from asyncdiloco.algo.outer import STEP_BLOCK_ELEMS, make_outer_optimizer

N = 3 * STEP_BLOCK_ELEMS + 1234  # a ragged last block

CONFIGS = {
    "nesterov": OuterConfig(optimizer="nesterov", lr=0.7, momentum=0.9),
    "sgd": OuterConfig(optimizer="sgd", lr=0.5, momentum=0.8),
    "sgd-no-momentum": OuterConfig(optimizer="sgd", lr=1.0, momentum=0.0),
    "nesterov-cosine": OuterConfig(
        optimizer="nesterov", lr=0.7, momentum=0.9, lr_schedule="cosine", lr_warmup_versions=2, lr_total_versions=10
    ),
    "dn": OuterConfig(optimizer="delayed_nesterov", lr=0.7, momentum=0.9, dn_buffer=3),
    "dn-c": OuterConfig(optimizer="delayed_nesterov", lr=0.7, momentum=0.9, dn_buffer=3, dn_c=0.2),
    "dn-workers": OuterConfig(optimizer="delayed_nesterov", lr=0.7, momentum=0.9, dn_buffer=0),
    "dn-block-check": OuterConfig(optimizer="delayed_nesterov", lr=0.7, momentum=0.9, dn_buffer=2, block_check=True),
}


def _states(opt) -> list[torch.Tensor]:
    out = [opt.params]
    for name in ("momentum_buffer", "delta_buffer"):
        vec = getattr(opt, name, None)
        if vec is not None:
            out.append(vec)
    return out


def _run(config: OuterConfig, blocked: bool, block_elems: int = STEP_BLOCK_ELEMS) -> tuple[list[torch.Tensor], list]:
    gen = torch.Generator().manual_seed(7)
    params = torch.randn(N, generator=gen)
    opt = make_outer_optimizer(params, config, [N // 2, N - N // 2])
    seen: list[tuple[int, int]] = []
    for step in range(7):
        delta = torch.randn(N, generator=gen) * 0.01
        weight = 1.0 if step % 2 else 0.5
        hook = None
        if blocked:

            def hook(start: int, end: int, _p=params) -> None:
                seen.append((start, end))

        opt.step(delta, weight, version=step, num_workers=4 - step % 3, on_block=hook, block_elems=block_elems)
    return _states(opt), seen


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_blocked_step_is_bit_identical(name):
    plain, _ = _run(CONFIGS[name], blocked=False)
    blocked, seen = _run(CONFIGS[name], blocked=True)
    for a, b in zip(plain, blocked, strict=True):
        assert torch.equal(a, b)
    per_step = len(seen) // 7
    assert seen[:per_step] == [(s, min(N, s + STEP_BLOCK_ELEMS)) for s in range(0, N, STEP_BLOCK_ELEMS)]


def test_smaller_blocks_are_bit_identical_too():
    plain, _ = _run(CONFIGS["nesterov"], blocked=False)
    blocked, _ = _run(CONFIGS["nesterov"], blocked=True, block_elems=4096)
    assert all(torch.equal(a, b) for a, b in zip(plain, blocked, strict=True))


def test_hook_sees_each_block_already_updated():
    params = torch.zeros(N)
    opt = make_outer_optimizer(params, CONFIGS["nesterov"])
    expected = torch.zeros(N)
    expected_opt = make_outer_optimizer(expected, CONFIGS["nesterov"])
    delta = torch.ones(N)
    expected_opt.step(delta.clone(), version=0)
    copies = torch.full((N,), float("nan"))

    def hook(start: int, end: int) -> None:
        copies[start:end] = params[start:end]

    opt.step(delta.clone(), version=0, on_block=hook)
    assert torch.equal(copies, expected)


@pytest.mark.parametrize("name", ["nesterov", "sgd", "sgd-no-momentum"])
def test_one_pass_equals_torch_fused_sgd(name):
    """The kernel call is torch's own ``sgd(fused=True)`` (the step before blocking)."""
    config = CONFIGS[name]
    gen = torch.Generator().manual_seed(3)
    params = torch.randn(N, generator=gen)
    ref = params.clone()
    ref_m = torch.zeros(N) if config.momentum > 0 else None
    opt = make_outer_optimizer(params, config)
    for step in range(4):
        delta = torch.randn(N, generator=gen)
        opt.step(delta.clone(), version=step)
        torch_sgd(
            [ref],
            [delta.clone()],
            [ref_m],
            fused=True,
            weight_decay=0.0,
            momentum=config.momentum,
            lr=opt.lr_at(step),
            dampening=0.0,
            nesterov=config.optimizer == "nesterov",
            maximize=False,
        )
    assert torch.equal(params, ref)
    if ref_m is not None:
        assert torch.equal(opt.momentum_buffer, ref_m)


def test_block_elems_must_be_positive():
    opt = make_outer_optimizer(torch.zeros(8), CONFIGS["nesterov"])
    with pytest.raises(ValueError, match="block_elems is 0"):
        opt.step(torch.ones(8), version=0, on_block=lambda s, e: None, block_elems=0)
    assert torch.equal(opt.params, torch.zeros(8))
