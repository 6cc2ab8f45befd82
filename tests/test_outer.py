"""Outer optimizers and staleness weights against hand-computed values."""

import math

import pytest
import torch

from asyncdiloco.algo.config import OuterConfig
from asyncdiloco.algo.lr_schedule import lr_factor
from asyncdiloco.algo.outer import OuterOptimizer, describe, staleness_weight
from asyncdiloco.errors import ConfigError


def test_nesterov_two_steps_by_hand():
    # η = 0.5, μ = 0.9, θ0 = [1, 2], Δ1 = [0.1, -0.2], Δ2 = [0.3, 0.0]
    theta = torch.tensor([1.0, 2.0])
    opt = OuterOptimizer(theta, OuterConfig(optimizer="nesterov", lr=0.5, momentum=0.9))
    opt.step(torch.tensor([0.1, -0.2]), version=0)
    # m1 = Δ1 = [0.1, -0.2]; θ1 = θ0 − 0.5·(Δ1 + 0.9·m1) = θ0 − 0.5·1.9·Δ1
    torch.testing.assert_close(theta, torch.tensor([1.0 - 0.095, 2.0 + 0.19]))
    opt.step(torch.tensor([0.3, 0.0]), version=1)
    # m2 = 0.9·m1 + Δ2 = [0.39, -0.18]; θ2 = θ1 − 0.5·(Δ2 + 0.9·m2)
    m2 = torch.tensor([0.39, -0.18])
    torch.testing.assert_close(opt.momentum_buffer, m2)
    expected = torch.tensor([0.905, 2.19]) - 0.5 * (torch.tensor([0.3, 0.0]) + 0.9 * m2)
    torch.testing.assert_close(theta, expected)


def test_nesterov_matches_torch_sgd_nesterov():
    gen = torch.Generator().manual_seed(0)
    theta = torch.randn(100, generator=gen)
    ref = torch.nn.Parameter(theta.clone())
    ref_opt = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=True)
    opt = OuterOptimizer(theta, OuterConfig(optimizer="nesterov", lr=0.7, momentum=0.9))
    for v in range(5):
        delta = torch.randn(100, generator=gen)
        opt.step(delta, version=v)
        ref.grad = delta.clone()
        ref_opt.step()
    torch.testing.assert_close(theta, ref.detach())


def test_heavy_ball_sgd_by_hand():
    theta = torch.tensor([0.0])
    opt = OuterOptimizer(theta, OuterConfig(optimizer="sgd", lr=0.1, momentum=0.5))
    opt.step(torch.tensor([1.0]), version=0)  # m = 1, θ = −0.1
    opt.step(torch.tensor([1.0]), version=1)  # m = 1.5, θ = −0.25
    torch.testing.assert_close(theta, torch.tensor([-0.25]))


def test_sgd_lr1_mom0_adopts_worker_parameters():
    # With η = 1, μ = 0 and Δ = θ_base − θ_worker the global model becomes θ_worker:
    # a flipped sign would give 2·θ_base − θ_worker instead.
    base = torch.tensor([1.0, -2.0, 3.5])
    worker = torch.tensor([0.5, -1.0, 4.0])
    theta = base.clone()
    OuterOptimizer(theta, OuterConfig(optimizer="sgd", lr=1.0, momentum=0.0)).step(base - worker, version=0)
    assert torch.equal(theta, worker)


def test_staleness_weight_scales_the_step():
    theta = torch.zeros(2)
    opt = OuterOptimizer(theta, OuterConfig(optimizer="sgd", lr=1.0, momentum=0.0))
    opt.step(torch.tensor([1.0, 2.0]), weight=0.25, version=0)
    torch.testing.assert_close(theta, torch.tensor([-0.25, -0.5]))


@pytest.mark.parametrize(
    ("kind", "a", "b", "tau", "expected"),
    [
        ("constant", 0.5, 4, 7, 1.0),
        ("inverse", 0.5, 4, 0, 1.0),
        ("inverse", 0.5, 4, 3, 0.25),
        ("polynomial", 0.5, 4, 3, 0.5),  # (1+3)^-0.5
        ("polynomial", 2.0, 4, 1, 0.25),  # (1+1)^-2
        ("hinge", 0.5, 4, 4, 1.0),  # τ ≤ b
        ("hinge", 0.5, 4, 6, 0.5),  # 1/(0.5·(6−4)+1)
        ("hinge", 2.0, 1, 3, 0.2),  # 1/(2·2+1)
    ],
)
def test_staleness_weights(kind, a, b, tau, expected):
    cfg = OuterConfig(staleness=kind, staleness_a=a, staleness_b=b)
    assert math.isclose(staleness_weight(cfg, tau), expected, rel_tol=1e-12)


def test_negative_staleness_is_an_error():
    with pytest.raises(ValueError, match="staleness is -1"):
        staleness_weight(OuterConfig(), -1)


def test_wrong_delta_shape_changes_nothing():
    theta = torch.tensor([1.0, 2.0])
    opt = OuterOptimizer(theta, OuterConfig())
    with pytest.raises(ValueError, match="expected float32"):
        opt.step(torch.zeros(3), version=0)
    assert torch.equal(theta, torch.tensor([1.0, 2.0]))
    assert torch.equal(opt.momentum_buffer, torch.zeros(2))


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"optimizer": "adam"}, "outer optimizer='adam'"),
        ({"lr": 0.0}, "outer lr=0.0"),
        ({"momentum": 1.0}, "outer momentum=1.0"),
        ({"staleness": "exp"}, "staleness='exp'"),
        ({"max_staleness": -1}, "max_staleness=-1"),
        ({"lr_schedule": "step"}, "outer lr schedule kind='step' is invalid"),
        ({"lr_schedule": "cosine", "lr_warmup_versions": 5}, "outer lr schedule total=0 is invalid"),
        ({"lr_warmup_versions": -2}, "outer lr schedule warmup=-2 is invalid"),
        ({"lr_min_ratio": 2.0}, "outer lr schedule min_ratio=2.0 is invalid"),
    ],
)
def test_outer_config_errors_name_the_value(kwargs, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        OuterConfig(**kwargs)


def test_outer_schedule_errors_name_the_flag_to_change():
    with pytest.raises(ConfigError, match=r"total > warmup=5.*total: lr_total_versions, --outer-total-versions"):
        OuterConfig(lr_schedule="cosine", lr_warmup_versions=5, lr_total_versions=5)


def test_scheduled_step_uses_the_lr_of_its_version():
    # sgd, μ = 0: θ ← θ − η_v·Δ; warmup 4 versions: η_v = η·(v + 1)/4
    theta = torch.zeros(1)
    opt = OuterOptimizer(theta, OuterConfig(optimizer="sgd", lr=0.8, momentum=0.0, lr_warmup_versions=4))
    opt.step(torch.ones(1), version=0)
    torch.testing.assert_close(theta, torch.tensor([-0.2]))
    opt.step(torch.ones(1), version=3)  # the peak
    torch.testing.assert_close(theta, torch.tensor([-1.0]))
    opt.step(torch.ones(1), version=100)
    torch.testing.assert_close(theta, torch.tensor([-1.8]))


def test_scheduled_nesterov_equals_torch_sgd_with_lambda_lr():
    # η_v through torch's own scheduler: the same update, version by version.
    gen = torch.Generator().manual_seed(2)
    cfg = OuterConfig(
        optimizer="nesterov",
        lr=0.7,
        momentum=0.9,
        lr_schedule="cosine",
        lr_warmup_versions=2,
        lr_total_versions=6,
        lr_min_ratio=0.2,
    )
    theta = torch.randn(40, generator=gen)
    ref = torch.nn.Parameter(theta.clone())
    ref_opt = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=True)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda v: lr_factor(cfg.schedule(), v))
    opt = OuterOptimizer(theta, cfg)
    for v in range(8):
        delta = torch.randn(40, generator=gen)
        opt.step(delta.clone(), version=v)
        ref.grad = delta
        ref_opt.step()
        ref_sched.step()
        torch.testing.assert_close(theta, ref.detach())


def test_negative_version_changes_nothing():
    theta = torch.tensor([1.0])
    with pytest.raises(ValueError, match="step is -1"):
        OuterOptimizer(theta, OuterConfig()).step(torch.ones(1), version=-1)
    assert torch.equal(theta, torch.tensor([1.0]))


def test_describe_names_a_schedule_and_keeps_the_old_text_without_one():
    assert describe(OuterConfig())[0] == "nesterov(lr=0.7, momentum=0.9)"
    opt, _ = describe(OuterConfig(lr_schedule="cosine", lr_warmup_versions=10, lr_total_versions=100))
    assert opt == "nesterov(lr=0.7, momentum=0.9), lr schedule cosine(warmup=10, total=100, min_ratio=0.1) by version"


def test_weighted_nesterov_step_equals_torch_sgd_on_the_weighted_delta():
    gen = torch.Generator().manual_seed(1)
    theta = torch.randn(50, generator=gen)
    ref = torch.nn.Parameter(theta.clone())
    ref_opt = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=True)
    opt = OuterOptimizer(theta, OuterConfig(optimizer="nesterov", lr=0.7, momentum=0.9))
    for v, weight in enumerate((1.0, 0.5, 0.25)):
        delta = torch.randn(50, generator=gen)
        ref.grad = weight * delta
        ref_opt.step()
        opt.step(delta, weight, version=v)
    torch.testing.assert_close(theta, ref.detach())


# ------------------------------------------------------------------ Delayed Nesterov
from asyncdiloco.algo.outer import DelayedNesterov, make_outer_optimizer  # noqa: E402


@pytest.mark.parametrize("n", [1, 2, 4])
def test_delayed_nesterov_c0_equals_sync_nesterov_on_the_mean(n):
    # Liu et al. 2024, Alg. 3: with c = 0, every N arrivals equal one synchronous
    # Nesterov step on their mean, round after round (momentum carried over).
    gen = torch.Generator().manual_seed(n)
    theta = torch.randn(30, generator=gen)
    ref = torch.nn.Parameter(theta.clone())
    ref_opt = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=True)
    dn = make_outer_optimizer(theta, OuterConfig(optimizer="delayed_nesterov", lr=0.7, momentum=0.9, dn_buffer=n))
    assert isinstance(dn, DelayedNesterov)
    for r in range(3):  # rounds
        gs = [torch.randn(30, generator=gen) for _ in range(n)]
        for i, g in enumerate(gs):
            dn.step(g.clone(), version=r * n + i)
        ref.grad = torch.stack(gs).mean(0)
        ref_opt.step()
        torch.testing.assert_close(theta, ref.detach())


def test_delayed_nesterov_buffer_follows_the_worker_count_when_zero():
    theta = torch.zeros(4)
    dn = make_outer_optimizer(theta, OuterConfig(optimizer="delayed_nesterov", lr=1.0, momentum=0.5))
    dn.step(torch.ones(4), version=0, num_workers=2)  # θ −= g/2
    torch.testing.assert_close(theta, torch.full((4,), -0.5))
    assert dn.arrivals == 1 and torch.equal(dn.momentum_buffer, torch.zeros(4))
    dn.step(torch.ones(4), version=1, num_workers=2)  # m = 1; θ −= 0.5·1 + 1/2
    torch.testing.assert_close(theta, torch.full((4,), -1.5))
    assert dn.arrivals == 0 and torch.equal(dn.delta_buffer, torch.zeros(4))


def test_delayed_nesterov_with_c_by_hand():
    # N = 2, c = 0.25, η = 1, μ = 0.5, g = 1 each arrival.
    theta = torch.zeros(1)
    dn = DelayedNesterov(theta, OuterConfig(optimizer="delayed_nesterov", lr=1.0, momentum=0.5, dn_buffer=2, dn_c=0.25))
    dn.step(torch.ones(1), version=0)  # m = 0: θ = −(0 + 1/2) = −0.5
    dn.step(torch.ones(1), version=1)  # m = 1: θ −= (1 − 0.5 + 0.25)·0.5·1 + 0.5 = 0.875
    torch.testing.assert_close(theta, torch.tensor([-1.375]))
    dn.step(torch.ones(1), version=2)  # between updates: θ −= 0.25·0.5·1 + 0.5 = 0.625
    torch.testing.assert_close(theta, torch.tensor([-2.0]))


def test_dn_c_bound_is_checked():
    with pytest.raises(ConfigError, match="dn_c=0.6"):
        OuterConfig(optimizer="delayed_nesterov", dn_buffer=2, dn_c=0.6)


def test_delayed_nesterov_buffer_takes_the_mean_of_its_arrivals_when_n_shrinks():
    # N = live workers: 4 when two pushes arrived, then two workers left (N = 2). The buffer
    # completes with the mean of the two pushes it holds, not their sum over N = 2 ... of 4.
    from asyncdiloco.algo.outer import DelayedNesterov

    cfg = OuterConfig(optimizer="delayed_nesterov", lr=1.0, momentum=0.5)
    theta = torch.zeros(3)
    dn = DelayedNesterov(theta, cfg)
    dn.step(torch.full((3,), 1.0), version=0, num_workers=4)
    dn.step(torch.full((3,), 3.0), version=1, num_workers=2)
    assert dn.arrivals == 0
    assert torch.equal(dn.momentum_buffer, torch.full((3,), 2.0))  # (1 + 3) / 2 arrivals


def test_block_check_damps_only_the_tensors_that_oppose_the_momentum():
    from asyncdiloco.algo.outer import DelayedNesterov

    cfg = OuterConfig(optimizer="delayed_nesterov", lr=1.0, momentum=0.5, dn_buffer=1, block_check=True)
    dn = DelayedNesterov(torch.zeros(4), cfg, block_sizes=[2, 2])
    dn.momentum_buffer.copy_(torch.tensor([1.0, 0.0, 1.0, 0.0]))
    g = torch.tensor([1.0, 0.0, -1.0, 0.0])  # block 0 agrees, block 1 points the other way (cos = -1)
    dn._damp_against_momentum(g)
    assert torch.equal(g, torch.tensor([1.0, 0.0, -0.0, 0.0]))
    g = torch.tensor([0.0, 1.0, -1.0, 1.0])  # block 1: cos = -1/sqrt(2)
    dn._damp_against_momentum(g)
    assert g[2].item() == pytest.approx(-(1 - 2**-0.5)) and g[0].item() == 0.0 and g[1].item() == 1.0


def test_monitor_warns_when_pseudo_gradients_grow_tenfold(caplog):
    from asyncdiloco.algo.outer import PseudoGradientMonitor

    mon = PseudoGradientMonitor()
    for v in range(20):
        assert not mon.observe(1.0 + 0.1 * (v % 3), worker_id=1, version=v)
    with caplog.at_level("WARNING"):
        assert mon.observe(50.0, worker_id=2, version=20)
    assert mon.warnings == 1 and "may be diverging" in caplog.text and "--outer-lr" in caplog.text
    assert not mon.observe(1.1, worker_id=1, version=21)
