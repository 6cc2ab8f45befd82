"""The sharded parameter server (wire/shards.py, ps/push/shard_order.py, worker/sharded.py):
S shards on 127.0.0.1 give the same model, bit for bit, as one server on the same pushes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from asyncdiloco.algo.config import OuterConfig
from asyncdiloco.errors import CheckpointError, ConfigError, InvalidPayloadError
from asyncdiloco.ps import ParameterServer
from asyncdiloco.ps.config import DurabilityConfig, ServerConfig
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.shards import ShardMap, load_shard_addresses, write_shard_addresses
from asyncdiloco.wire.tensors import Manifest
from asyncdiloco.worker.async_worker import AsyncDiLoCoWorker
from asyncdiloco.worker.client import ParameterServerClient
from asyncdiloco.worker.config import WorkerConfig
from asyncdiloco.worker.sharded import ShardedClient

pytestmark = pytest.mark.timeout(120)

INITIAL, PSEUDO = pb.PUSH_KIND_INITIAL_PARAMETERS, pb.PUSH_KIND_PSEUDO_GRADIENT


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 40), nn.Linear(40, 2))  # one big weight (40×3)


def start_shards(start_server, count: int, **fields) -> list[ParameterServer]:
    return [start_server(shard_index=i, shard_count=count, **fields) for i in range(count)]


def client_for(servers: list[ParameterServer]) -> ShardedClient | ParameterServerClient:
    if len(servers) == 1:
        return ParameterServerClient(servers[0].address, bulk_channel=False)
    return ShardedClient([s.address for s in servers])


def scripted_run(client, manifest: Manifest, theta0: torch.Tensor, steps: int = 9) -> tuple[int, torch.Tensor]:
    """Two workers push seeded pseudo-gradients, the second one always one version stale;
    returns (version, pulled payload)."""
    a = client.join(manifest, "a")
    b = client.join(manifest, "b")
    client.push(manifest.pack_flat(theta0), worker_id=a.worker_id, push_id=1, base_version=0, kind=INITIAL)
    gen = torch.Generator().manual_seed(7)
    version = 0
    for step in range(steps):
        for who, lag in ((a, 0), (b, 1)):
            delta = torch.randn(manifest.numel, generator=gen) * 0.01
            reply = client.push(
                manifest.pack_flat(delta),
                worker_id=who.worker_id,
                push_id=step + 2,
                base_version=max(0, version - lag),
                num_tokens=16,
            )
            assert reply.applied
            version = reply.version
    pulled = client.pull(manifest, a.worker_id)
    return pulled.version, pulled.payload.clone()


@pytest.mark.parametrize("outer", [None, OuterConfig(optimizer="sgd", lr=0.7, momentum=0.0)], ids=["default", "sgd"])
def test_two_shards_equal_one_server_bit_for_bit(start_server, outer):
    model = make_model()
    manifest = Manifest.from_module(model)
    theta0 = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    fields = dict(outer=outer, grouping="off", dylu=False)
    single = client_for([start_server(**fields)])
    sharded = client_for(start_shards(start_server, 2, **fields))
    try:
        v1, payload1 = scripted_run(single, manifest, theta0)
        v2, payload2 = scripted_run(sharded, manifest, theta0)
    finally:
        single.close()
        sharded.close()
    assert v1 == v2 == 18
    assert torch.equal(payload1, payload2)  # the raw codec: bytes of every parameter
    assert not torch.equal(payload1, manifest.pack_flat(theta0))


def test_a_worker_trains_through_two_shards_as_through_one(start_server):
    """AsyncDiLoCoWorker unchanged: ``server`` lists the shards; the default outer optimizer."""

    def train(servers) -> torch.Tensor:
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        gen = torch.Generator().manual_seed(3)
        server = ",".join(s.address for s in servers)
        with AsyncDiLoCoWorker(model, opt, WorkerConfig(server=server), tokens_per_step=8):
            for _ in range(12):
                x = torch.randn(8, 4, generator=gen)
                nn.functional.mse_loss(model(x), x[:, :2]).backward()
                opt.step()
                opt.zero_grad()
        with client_for(servers) as c:
            manifest = Manifest.from_module(model)
            pulled = c.pull(manifest)
        return pulled.version, pulled.payload.clone()

    fields = dict(local_steps=3, grouping="off", dylu=False)
    v1, one = train([start_server(**fields)])
    v2, two = train(start_shards(start_server, 2, **fields))
    assert v1 == v2 >= 4
    assert torch.equal(one, two)


def test_a_part_missing_on_a_follower_is_applied_as_zero_after_the_timeout(start_server):
    model = make_model()
    manifest = Manifest.from_module(model)
    theta0 = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    servers = start_shards(start_server, 2, grouping="off", dylu=False, shard_fill_timeout_s=0.2)
    client = ShardedClient([s.address for s in servers])
    smap = client.shard_map(manifest)
    try:
        a = client.join(manifest, "a")
        client.push(manifest.pack_flat(theta0), worker_id=a.worker_id, push_id=1, base_version=0, kind=INITIAL)
        delta = torch.full((manifest.numel,), 0.01)
        # push 2 reaches shard 0 only (its worker "died" before the follower push)
        ids = client._ids_of(a.worker_id)
        lo, hi = smap.range_of(0)
        r = client.clients[0].push(
            smap.sub_manifest(0).pack_flat(delta[lo:hi]), worker_id=ids[0], push_id=2, base_version=0
        )
        assert r.applied and r.version == 1
        # push 3 goes through both shards: the follower waits 0.2 s for version 1, then fills it with zeros
        r3 = client.push(manifest.pack_flat(delta), worker_id=a.worker_id, push_id=3, base_version=1)
        assert r3.version == 2
        assert servers[1].state.version == servers[0].state.version == 2
        assert servers[1].state.intake.kinds[PSEUDO].gate.zero_filled == 1
        pulled = client.pull(manifest, a.worker_id)
        assert pulled.version == 2
    finally:
        client.close()


def test_a_follower_refuses_a_push_without_shard_0s_order(start_server):
    model = make_model()
    manifest = Manifest.from_module(model)
    servers = start_shards(start_server, 2, grouping="off", dylu=False)
    smap = ShardMap.balance(manifest, 2)
    sub = smap.sub_manifest(1)
    with ParameterServerClient(servers[1].address, bulk_channel=False) as c:
        w = c.join(sub, "direct")
        theta = torch.zeros(sub.numel)
        c.push(sub.pack_flat(theta), worker_id=w.worker_id, push_id=1, base_version=0, kind=INITIAL)
        with pytest.raises(InvalidPayloadError, match="shard 0's order"):
            c.push(sub.pack_flat(theta), worker_id=w.worker_id, push_id=2, base_version=0)
    assert servers[1].state.version == 0


def test_restart_with_another_shard_count_is_refused(tmp_path):
    folder = str(tmp_path / "shard-0")

    def config(count: int) -> ServerConfig:
        return ServerConfig(
            port=0, shard_index=0, shard_count=count, durability=DurabilityConfig(checkpoint_dir=folder)
        )

    ParameterServer(config(2)).start().stop(None)
    with pytest.raises(CheckpointError, match=r"2 shard\(s\) but this one starts with 3.*--shards 2"):
        ParameterServer(config(3)).start()
    ParameterServer(config(2)).start().stop(None)  # the same count resumes


def test_shard_map_balances_bytes_and_splits_a_big_tensor():
    manifest = Manifest.from_named_tensors(
        [("small.a", torch.zeros(10)), ("big", torch.zeros(1000, 4)), ("small.b", torch.zeros(6))]
    )
    smap = ShardMap.balance(manifest, 2)
    assert smap.bounds == (0, 2008, 4016)  # the cut falls in "big" at byte 4·4016/2
    assert [t.name for t in smap.sub_manifest(0).tensors] == ["small.a", "big#0:1998"]
    assert [t.name for t in smap.sub_manifest(1).tensors] == ["big#1998:4000", "small.b"]
    assert sum(smap.sizes_bytes()) == manifest.total_bytes
    # small tensors stay whole: the cut moves to the nearer edge
    whole = Manifest.from_named_tensors([(f"t{i}", torch.zeros(10)) for i in range(5)])
    assert ShardMap.balance(whole, 2).bounds == (0, 20, 50)
    parts = smap.split_flat(torch.arange(4016, dtype=torch.float32))
    assert torch.equal(torch.cat(parts), torch.arange(4016, dtype=torch.float32))
    with pytest.raises(ConfigError, match="num_shards is 0"):
        ShardMap.balance(manifest, 0)


def test_shard_map_file_round_trip_and_refusal(tmp_path):
    path = tmp_path / "shards.json"
    write_shard_addresses(path, ["127.0.0.1:1", "127.0.0.1:2"])
    assert load_shard_addresses(path) == ["127.0.0.1:1", "127.0.0.1:2"]
    path.write_text('{"shards": []}')
    with pytest.raises(ConfigError, match="at least one address"):
        load_shard_addresses(path)


def test_followers_use_shard_0s_worker_count_and_a_retry_completes_a_half_applied_push(start_server):
    """A third worker known to shard 0 only (N = 3 there, 2 on the follower): the follower
    still steps with N = 3; and a push that reached shard 0 only, retried with its push id,
    is completed on the follower once. Both as one server with three workers."""
    model = make_model()
    manifest = Manifest.from_module(model)
    theta0 = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    fields = dict(grouping="off", dylu=False)  # the default outer optimizer: Delayed Nesterov, N = live workers
    single = ParameterServerClient(start_server(**fields).address, bulk_channel=False)
    servers = start_shards(start_server, 2, **fields)
    sharded = ShardedClient([s.address for s in servers])
    smap = sharded.shard_map(manifest)
    gen = torch.Generator().manual_seed(5)
    deltas = [torch.randn(manifest.numel, generator=gen) * 0.01 for _ in range(7)]
    try:
        a1, a2 = single.join(manifest, "a"), sharded.join(manifest, "a")
        b1, b2 = single.join(manifest, "b"), sharded.join(manifest, "b")
        single.join(manifest, "c")
        ParameterServerClient(servers[0].address, bulk_channel=False).join(smap.sub_manifest(0), "c")
        for c, w in ((single, a1), (sharded, a2)):
            c.push(manifest.pack_flat(theta0), worker_id=w.worker_id, push_id=1, base_version=0, kind=INITIAL)
        for n, delta in enumerate(deltas):
            (w1, w2) = (a1, a2) if n % 2 == 0 else (b1, b2)
            r1 = single.push(manifest.pack_flat(delta), worker_id=w1.worker_id, push_id=n + 2, base_version=n)
            if n == 3:  # the follower part is lost the first time: only shard 0 gets it
                lo, hi = smap.range_of(0)
                sharded.clients[0].push(
                    smap.sub_manifest(0).pack_flat(delta[lo:hi]),
                    worker_id=sharded._ids_of(w2.worker_id)[0],
                    push_id=n + 2,
                    base_version=n,
                )
            r2 = sharded.push(manifest.pack_flat(delta), worker_id=w2.worker_id, push_id=n + 2, base_version=n)
            assert r1.version == r2.version == n + 1
        assert servers[1].state.intake.kinds[PSEUDO].gate.zero_filled == 0
        one, two = single.pull(manifest, a1.worker_id), sharded.pull(manifest, a2.worker_id)
    finally:
        single.close()
        sharded.close()
    assert one.version == two.version == 7
    assert torch.equal(one.payload, two.payload)


def test_a_zero_fill_is_in_the_followers_log_and_replayed_after_a_crash(start_server, tmp_path):
    from helpers import crash, open_durable

    model = make_model()
    manifest = Manifest.from_module(model)
    theta0 = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    durability = DurabilityConfig(checkpoint_dir=str(tmp_path / "shard-1"), checkpoint_every=1000)
    fields = dict(grouping="off", dylu=False, shard_fill_timeout_s=0.2)
    servers = [
        start_server(shard_index=0, shard_count=2, **fields),
        start_server(shard_index=1, shard_count=2, durability=durability, **fields),
    ]
    client = ShardedClient([s.address for s in servers])
    smap = client.shard_map(manifest)
    try:
        a = client.join(manifest, "a")
        client.push(manifest.pack_flat(theta0), worker_id=a.worker_id, push_id=1, base_version=0, kind=INITIAL)
        delta = torch.full((manifest.numel,), 0.01)
        lo, hi = smap.range_of(0)
        part = smap.sub_manifest(0).pack_flat(delta[lo:hi])
        client.clients[0].push(part, worker_id=client._ids_of(a.worker_id)[0], push_id=2, base_version=0)
        client.push(manifest.pack_flat(delta), worker_id=a.worker_id, push_id=3, base_version=1)
    finally:
        client.close()
    follower = servers[1].state
    assert follower.intake.kinds[PSEUDO].gate.zero_filled == 1 and follower.version == 2
    outer = follower.model.outer
    before = (follower.version, follower.params.clone(), outer.momentum_buffer.clone(), outer.arrivals)
    crash(servers[1].store)
    restored, store = open_durable(servers[1].config)
    try:
        assert restored.version == before[0]
        assert torch.equal(restored.params, before[1])
        assert (
            torch.equal(restored.model.outer.momentum_buffer, before[2]) and restored.model.outer.arrivals == before[3]
        )
        assert restored.registry.workers.get(client._ids_of(a.worker_id)[1]).applied_pushes == 1  # the fill is nobody's
    finally:
        store.close()


def test_a_push_waiting_for_its_turn_holds_no_receive_buffer(start_server):
    """The follower's budget admits one push at a time: the later push of the order, there
    first, waits without a buffer, so the earlier one is received and applied (no zero fill)."""
    import threading

    from helpers import wait_until

    from asyncdiloco.ps.push.shard_order import METADATA_KEY

    model = make_model()
    manifest = Manifest.from_module(model)
    theta0 = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    fields = dict(grouping="off", dylu=False, receive_buffer_bytes=0, shard_fill_timeout_s=20.0)
    servers = [start_server(shard_index=i, shard_count=2, **fields) for i in range(2)]
    client = ShardedClient([s.address for s in servers])
    smap = client.shard_map(manifest)
    delta = torch.full((manifest.numel,), 0.01)
    parts = [smap.sub_manifest(i).pack_flat(x) for i, x in enumerate(smap.split_flat(delta))]
    try:
        a, b = client.join(manifest, "a"), client.join(manifest, "b")
        client.push(manifest.pack_flat(theta0), worker_id=a.worker_id, push_id=1, base_version=0, kind=INITIAL)
        orders = []
        for w in (a, b):  # shard 0 sequences a's push (version 1), then b's (version 2)
            shard0 = client.clients[0]
            shard0.push(parts[0], worker_id=client._ids_of(w.worker_id)[0], push_id=2, base_version=0)
            orders.append(((METADATA_KEY, dict(shard0.last_push_trailer)[METADATA_KEY]),))
        follower = client.clients[1]
        ids = [client._ids_of(w.worker_id)[1] for w in (a, b)]
        late = threading.Thread(
            target=follower.push,
            args=(parts[1],),
            kwargs=dict(worker_id=ids[1], push_id=2, base_version=0, last=True, metadata=orders[1]),
        )
        late.start()
        gate = servers[1].state.intake.kinds[PSEUDO].gate
        wait_until(lambda: gate.waiting == 1, "b's part waiting for its turn")
        other = ParameterServerClient(servers[1].address, bulk_channel=False)
        other._sessions = follower._sessions  # noqa: SLF001 - the same worker's session
        other.push(parts[1], worker_id=ids[0], push_id=2, base_version=0, last=True, metadata=orders[0])
        other.close()
        late.join(timeout=30)
        assert not late.is_alive()
        assert gate.zero_filled == 0 and servers[1].state.version == servers[0].state.version == 2
    finally:
        client.close()


def test_a_follower_one_version_behind_is_pulled_again_only_once_it_caught_up():
    """The follower is a version behind shard 0 for its first 5 status asks; before, its whole
    part was pulled again every 5 ms until it caught up."""
    from asyncdiloco.worker.client import Pulled

    manifest = Manifest.from_named_tensors([("a", torch.zeros(64)), ("b", torch.zeros(64))])
    sharded = ShardedClient(["127.0.0.1:1", "127.0.0.1:2"])
    pulls, asks = [0, 0], []

    class Shard:
        def __init__(self, index: int) -> None:
            self.index = index

        def version(self) -> int:
            return 4 if self.index == 0 or len(asks) >= 5 else 3

        def pull(self, sub, worker_id):
            pulls[self.index] += 1
            return Pulled(self.version(), torch.zeros(sub.total_bytes, dtype=torch.uint8), pb.RunConfig())

        def status(self):
            asks.append(self.index)
            return pb.StatusReply(version=self.version())

    sharded.clients = [Shard(0), Shard(1)]
    pulled = sharded.pull(manifest)
    assert pulled.version == 4 and pulled.payload.numel() == manifest.total_bytes
    assert pulls == [1, 2] and asks == [1] * 5  # one pull at version 3, one once it reported 4
