"""The hierarchical tier (ps/tier/upstream.py): regional servers that are workers of a global one.

Every server runs SGD with outer lr 1 and constant staleness weights, so each applied
pseudo-gradient moves θ by exactly −Δ; the Δs are multiples of 1/16 in [−0.5, 0.5), so
their sums are exact in fp32 and the accounting invariant is an equality: the global
model is θ_0 − ΣΔ over every push of every regional worker, nothing lost or counted twice.
"""

from __future__ import annotations

import pytest
import torch

from asyncdiloco.algo.config import OuterConfig
from asyncdiloco.errors import ConfigError
from asyncdiloco.ps import ParameterServer
from asyncdiloco.ps.config import DurabilityConfig, ServerConfig
from asyncdiloco.ps.tier.upstream import UpstreamConfig, UpstreamLink
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.tensors import Manifest
from asyncdiloco.worker.client import ParameterServerClient
from tests.helpers import STUCK_S, wait_until

N = 64
MANIFEST = Manifest.from_named_tensors([("w", torch.zeros(N))])
SGD1 = OuterConfig(optimizer="sgd", lr=1.0, momentum=0.0)
THETA0 = torch.arange(N, dtype=torch.float32) / 8


def _config(**fields) -> ServerConfig:
    fields.setdefault("port", 0)
    return ServerConfig(outer=SGD1, grouping="off", dylu=False, **fields)


def _link(parent: ParameterServer, every: int = 2, **fields) -> UpstreamConfig:
    return UpstreamConfig(
        parent=parent.address, every=every, initial_backoff_s=0.02, max_backoff_s=0.2, poll_s=0.01, **fields
    )


class Worker:
    """A raw client worker of a regional server: joins, (initializes), pushes given Δs."""

    def __init__(self, server: ParameterServer) -> None:
        self.client = ParameterServerClient(server.address, rpc_timeout_s=10.0)
        reply = self.client.join(MANIFEST, worker_name=f"w-{server.port}")
        self.worker_id, self.push_id = reply.worker_id, 1
        if reply.initialize:
            self._push(MANIFEST.pack_flat(THETA0), 0, pb.PUSH_KIND_INITIAL_PARAMETERS)
        self.pushed = torch.zeros(N)

    def _push(self, payload, base_version, kind=pb.PUSH_KIND_PSEUDO_GRADIENT) -> pb.PushReply:
        reply = self.client.push(
            payload, worker_id=self.worker_id, push_id=self.push_id, base_version=base_version, kind=kind
        )
        self.push_id += 1
        assert reply.applied
        return reply

    def push(self, seed: int) -> None:
        delta = torch.randint(-8, 8, (N,), generator=torch.Generator().manual_seed(seed)).float() / 16
        version = self.client.pull(MANIFEST, self.worker_id).version
        self._push(MANIFEST.pack_flat(delta), version)
        self.pushed += delta

    def close(self) -> None:
        self.client.close()


@pytest.fixture
def servers():
    started: list[ParameterServer] = []

    def start(config: ServerConfig, upstream: UpstreamConfig | None = None) -> ParameterServer:
        srv = ParameterServer(config, upstream)
        started.append(srv)
        return srv.start()

    yield start
    for srv in reversed(started):
        srv.stop(None)


def _synced(region: ParameterServer, syncs: int = 1) -> None:
    assert region.upstream is not None
    wait_until(lambda: region.upstream.syncs >= syncs, f"regional sync {syncs}")


def test_two_regions_average_in_every_pseudo_gradient_once(servers):
    """The parent averages each regional push in over the live regions (θ ← θ − Δ/R, R = 2
    here, whatever its own outer optimizer: wire/roles.py), so every worker's pushes count
    exactly once, halved."""
    top = servers(_config())
    regions = [servers(_config(), _link(top, every=2)) for _ in range(2)]
    workers = [Worker(r) for r in regions]
    for r in regions:
        _synced(r)
    for k in range(5):  # 5 pushes each: two pushes upward per region on K = 2, one left over
        for j, w in enumerate(workers):
            w.push(100 * j + k)
    for r in regions:
        assert r.upstream.sync_now(STUCK_S)  # the left-over push goes up
    expected = THETA0 - (workers[0].pushed + workers[1].pushed) / 2
    assert torch.equal(top.state.params, expected)
    assert all(top.state.registry.workers.get(r.upstream.worker_id).region for r in regions)
    assert top.state.model.outer.momentum_buffer is None or not top.state.model.outer.momentum_buffer.any()
    assert top.state.counters.applied_pushes == sum(r.upstream.pushes for r in regions)
    # a sync with nothing applied meanwhile: the region's model is now the global one
    a = regions[0]
    before = a.state.version
    assert a.upstream.sync_now(STUCK_S)
    assert torch.equal(a.state.params, top.state.params)
    assert a.state.version == before + 1  # the rebase is one regional version
    assert a.state.version == a.state.counters.applied_pushes + a.upstream.rebases
    assert a.upstream.parent_version == top.state.version
    for w in workers:
        w.close()


def test_the_rebase_keeps_what_was_applied_while_the_push_was_under_way(servers):
    top = servers(_config())
    region = servers(_config())
    link = UpstreamLink(region.state, _link(top, every=1000))  # driven step by step here, no thread
    w = Worker(region)
    link._step()  # joins, initializes the parent with θ_0
    assert link.syncs == 1 and torch.equal(top.state.params, THETA0)
    w.push(1)
    link._cut = link._make_cut()  # S taken: Δ(1) goes up ...
    w.push(2)  # ... while Δ(2) is applied regionally
    link._step()  # the push, the pull, the rebase
    assert torch.equal(top.state.params, THETA0 - w.pushed + _delta(2))  # only Δ(1) is global
    assert torch.equal(region.state.params, THETA0 - w.pushed)  # Δ(2) kept on top of it
    link._requested += 1  # noqa: SLF001 - as sync_now asks, without waiting
    link._step()
    link._step()
    assert link.syncs == 3 and torch.equal(top.state.params, THETA0 - w.pushed)  # it went with the next push
    link.stop()
    w.close()


def _delta(seed: int) -> torch.Tensor:
    return torch.randint(-8, 8, (N,), generator=torch.Generator().manual_seed(seed)).float() / 16


def test_training_goes_on_through_a_parent_outage_and_nothing_is_lost(servers, tmp_path):
    durable = DurabilityConfig(checkpoint_dir=str(tmp_path / "top"), checkpoint_every=1000)
    top = servers(_config(durability=durable))
    region = servers(_config(), _link(top, every=1))
    w = Worker(region)
    _synced(region)
    w.push(1)
    _synced(region, 2)
    port, failures = top.port, region.upstream.failures
    top.stop(None)  # the parent goes away; the region's workers push on
    for k in range(2, 5):
        w.push(k)
    assert region.state.counters.applied_pushes == 4
    wait_until(lambda: region.upstream.failures > failures, "a failed call to the absent parent")
    top = servers(_config(port=port, durability=durable))  # back, from its checkpoint and log
    w.push(5)
    wait_until(lambda: top.state.counters.applied_pushes >= 1 and region.upstream.sync_now(1.0), "the link back")
    assert region.upstream.sync_now(STUCK_S)
    assert torch.equal(top.state.params, THETA0 - w.pushed)
    w.close()


def test_stop_pushes_the_rest_and_leaves_the_parent(servers):
    top = servers(_config())
    region = servers(_config(), _link(top, every=1000))
    w = Worker(region)
    _synced(region)
    w.push(7)
    w.push(8)
    worker_id = region.upstream.worker_id
    region.stop(None)
    assert region.upstream is None
    assert torch.equal(top.state.params, THETA0 - w.pushed)
    assert not top.state.registry.workers.get(worker_id).alive  # it left
    w.close()


def test_a_region_joining_an_initialized_parent_takes_its_model_and_keeps_its_own_pushes(servers):
    top = servers(_config())
    first = servers(_config(), _link(top, every=1000))
    w1 = Worker(first)
    _synced(first)
    w1.push(1)
    assert first.upstream.sync_now(STUCK_S)
    second = servers(_config(), _link(top, every=1000))
    w2 = Worker(second)
    _synced(second)
    assert torch.equal(second.state.params, top.state.params)  # its θ_0 replaced by the global model
    w2.push(2)
    assert second.upstream.sync_now(STUCK_S)
    assert torch.equal(top.state.params, THETA0 - w1.pushed - w2.pushed / 2)  # R = 1, then 2
    w1.close()
    w2.close()


def test_bad_tier_settings_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="HOST:PORT"):
        UpstreamConfig(parent="nohost")
    with pytest.raises(ConfigError, match="parent_every"):
        UpstreamConfig(parent="127.0.0.1:1", every=0)
    durable = ServerConfig(port=0, durability=DurabilityConfig(checkpoint_dir=str(tmp_path)))
    with pytest.raises(ConfigError, match="checkpoint-dir"):
        ParameterServer(durable, UpstreamConfig(parent="127.0.0.1:1"))


def test_the_cli_builds_the_link(tmp_path):
    from asyncdiloco.cli import app as cli
    from asyncdiloco.cli import server as cli_server

    args = cli.build_parser().parse_args(["server", "--parent", "127.0.0.1:29501", "--parent-every", "8"])
    link = cli_server.upstream(args)
    assert link is not None and (link.parent, link.every) == ("127.0.0.1:29501", 8)
    assert cli_server.upstream(cli.build_parser().parse_args(["server"])) is None
    with pytest.raises(ConfigError, match="without --parent"):
        cli_server.upstream(cli.build_parser().parse_args(["server", "--parent-every", "8"]))


class Weights(torch.nn.Module):
    """θ, (4,) fp32; the loss −Σθ has the constant gradient −1: SGD η = 1 adds exactly 1 to
    every weight per inner step, so each push of H steps is Δ = −H."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(4))


def test_library_workers_through_two_regions_average_in_every_inner_step(servers, one_thread):
    from asyncdiloco.worker.async_worker import AsyncDiLoCoWorker
    from asyncdiloco.worker.config import WorkerConfig

    top = servers(ServerConfig(port=0, grouping="off", dylu=False))  # the default outer optimizer
    regions = [servers(_config(local_steps=2), _link(top, every=2)) for _ in range(2)]
    joined = []
    for j, region in enumerate(regions):  # each region initialized by its worker, so its link joins the parent
        model = Weights()
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        worker = AsyncDiLoCoWorker(model, opt, WorkerConfig(server=region.address, worker_name=f"lib-{j}"))
        worker.join()
        joined.append((model, opt, worker))
    wait_until(lambda: len(top.state.live_worker_ids()) == 2, "both regions joined")  # R = 2 from the start
    trained = []
    for j, (model, opt, worker) in enumerate(joined):
        steps = 6 + 4 * j  # H = 2: 3 and 5 pushes
        for _ in range(steps):
            (-model.w.sum()).backward()
            opt.step()
            opt.zero_grad()
        worker.close()
        trained.append(steps)
    for region in regions:
        _synced(region)
        assert region.upstream.sync_now(STUCK_S)
    assert torch.equal(top.state.params, torch.full((4,), float(sum(trained)) / 2))


def test_a_push_upward_whose_reply_is_lost_is_applied_once(servers):
    from asyncdiloco.errors import ServerUnavailableError

    class LosesOneReply(ParameterServerClient):
        """The parent applies the first pseudo-gradient push; its reply never arrives."""

        lost = 0

        def push(self, payload, **kw):
            reply = super().push(payload, **kw)
            if kw.get("kind", pb.PUSH_KIND_PSEUDO_GRADIENT) == pb.PUSH_KIND_PSEUDO_GRADIENT and not LosesOneReply.lost:
                LosesOneReply.lost += 1
                raise ServerUnavailableError("the connection broke before the reply")
            return reply

    top = servers(_config())
    region = servers(_config())
    config = _link(top, every=1)
    link = UpstreamLink(region.state, config, client=lambda: LosesOneReply(config.parent))
    w = Worker(region)
    link.start()
    try:
        wait_until(lambda: link.syncs >= 1, "the parent initialized")
        w.push(3)
        wait_until(lambda: link.syncs >= 2, "the push upward, retried")
        assert LosesOneReply.lost == 1 and link.failures >= 1
        assert (
            top.state.counters.applied_pushes == 1 and top.state.counters.duplicate_pushes == 1
        )  # the retry was answered
        assert torch.equal(top.state.params, THETA0 - w.pushed)
    finally:
        link.stop()
        w.close()


def test_what_a_lossy_parent_codec_drops_goes_up_with_the_next_push(servers):
    top = servers(_config(wire_codec="bf16"))
    region = servers(_config())
    link = UpstreamLink(region.state, _link(top, every=1000))  # driven step by step
    w = Worker(region)
    link._step()  # initializes the parent with θ_0 (raw: exact)
    delta = (torch.arange(N, dtype=torch.float32) + 1) / 3  # not representable in bf16
    w.client.push(MANIFEST.pack_flat(delta), worker_id=w.worker_id, push_id=w.push_id, base_version=0)
    exact = THETA0 - delta
    link._requested += 1  # noqa: SLF001 - as sync_now asks, without waiting
    link._step()  # Δ_region = Δ, sent as bf16(Δ)
    once = float((top.state.params - exact).abs().max())
    assert once > 1e-4  # bf16 dropped ~2^-9 of it
    link._requested += 1  # noqa: SLF001 - as sync_now asks, without waiting
    link._step()  # nothing new regionally: the push carries the residual
    twice = float((top.state.params - exact).abs().max())
    assert twice < once / 50
    link.stop()
    w.close()


def test_a_regional_server_started_again_links_up_again(servers):
    top = servers(_config())
    region = servers(_config(), _link(top, every=1000))
    w = Worker(region)
    _synced(region)
    w.push(4)
    w.close()
    region.stop(None)  # its last push goes up
    region.start()  # the same state, already initialized: a new link takes its model as θ_base
    _synced(region)
    assert torch.equal(top.state.params, THETA0 - w.pushed)
    assert torch.equal(region.state.params, top.state.params)


def test_an_initial_push_upward_that_fails_is_sent_again(servers):
    from asyncdiloco.errors import ServerUnavailableError

    class FailsFirstInit(ParameterServerClient):
        failed = 0

        def push(self, payload, **kw):
            if kw.get("kind") == pb.PUSH_KIND_INITIAL_PARAMETERS and not FailsFirstInit.failed:
                FailsFirstInit.failed += 1
                raise ServerUnavailableError("the parent went away before the initial parameters arrived")
            return super().push(payload, **kw)

    top = servers(_config())
    region = servers(_config())
    config = _link(top, every=1)
    link = UpstreamLink(region.state, config, client=lambda: FailsFirstInit(config.parent))
    w = Worker(region)
    link.start()
    try:
        wait_until(lambda: link.syncs >= 1, "the parent initialized on the second try")
        assert FailsFirstInit.failed == 1 and torch.equal(top.state.params, THETA0)
        w.push(5)
        wait_until(lambda: link.pushes >= 1 and link.syncs >= 2, "a push upward")
        assert torch.equal(top.state.params, THETA0 - w.pushed)
    finally:
        link.stop()
        w.close()


def test_sync_now_during_a_push_upward_waits_for_a_push_cut_after_it(servers):
    """Before, sync_now was answered by whichever sync finished next: a push cut before the
    call (in flight) returned it while the region's newest pushes had not gone up."""
    import threading

    top = servers(_config())
    region = servers(_config())
    link = UpstreamLink(region.state, _link(top, every=1000))  # driven step by step here, no thread
    w = Worker(region)
    link._step()  # joins, initializes the parent with θ_0
    w.push(1)
    link._cut = link._make_cut()  # Δ(1) cut, not sent yet: a push upward in flight
    answered = []
    asker = threading.Thread(target=lambda: answered.append(link.sync_now(STUCK_S)))
    asker.start()
    asked = lambda: getattr(link, "_requested", 0) == 1 or getattr(link, "_sync_requested", False)  # noqa: E731
    wait_until(asked, "the sync_now request")  # (the second name: the link before the fix)
    w.push(2)  # applied after the request: sync_now must carry it up
    link._step()  # the push cut before the request, its pull and rebase
    assert answered == [] and asker.is_alive()
    link._step()  # a new cut, covering the request
    asker.join(STUCK_S)
    assert answered == [True] and torch.equal(top.state.params, THETA0 - w.pushed)
    link.stop()
    w.close()
