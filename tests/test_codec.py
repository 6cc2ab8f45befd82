"""Wire codecs (codec.py): round-trip bounds, layouts, and the codec through the server,
its write-ahead log, a real worker and a demo run."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import crash
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from asyncdiloco.algo.config import OuterConfig
from asyncdiloco.algo.outer import STEP_BLOCK_ELEMS
from asyncdiloco.errors import CheckpointError, ConfigError, InvalidPayloadError
from asyncdiloco.ps.config import DurabilityConfig, ServerConfig
from asyncdiloco.ps.durable.store import DurableStore
from asyncdiloco.ps.state import ParameterServerState
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.codec import DEFAULT_BLOCK_SIZE, make_codec, wire_bytes_for
from asyncdiloco.wire.tensors import Manifest
from asyncdiloco.worker.async_worker import AsyncDiLoCoWorker
from asyncdiloco.worker.config import WorkerConfig

pytestmark = pytest.mark.timeout(120)


def flat_manifest(n: int) -> Manifest:
    return Manifest.from_named_tensors([("w", torch.zeros(n))])


def roundtrip(name: str, x: torch.Tensor, block_size: int = DEFAULT_BLOCK_SIZE):
    codec = make_codec(name, flat_manifest(x.numel()), block_size)
    payload = torch.full((codec.wire_bytes,), 0xAB, dtype=torch.uint8)  # garbage: every byte must be written
    out = torch.full((x.numel(),), float("nan"))
    assert codec.encode(x, payload) is payload
    assert codec.decode(payload, out) is out
    return codec, payload, out


@st.composite
def vectors(draw):
    """fp32 vectors: empty, single, partial last blocks, zero blocks, magnitudes 2^-140..2^120."""
    n = draw(st.integers(0, 700))
    # up to 64 values chosen by hypothesis (its edge cases: 0, -0, ±1, the tiniest floats)
    # at a chosen offset, the rest uniform in [-1, 1) from a chosen seed: drawing all 700
    # one by one made generation, not the codec, the cost of these tests
    chosen = draw(st.lists(st.floats(-1, 1, width=32), min_size=min(n, 64), max_size=min(n, 64)))
    start = draw(st.integers(0, n - len(chosen)))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    unit = torch.rand(n, generator=gen, dtype=torch.float64) * 2 - 1
    unit[start : start + len(chosen)] = torch.tensor(chosen, dtype=torch.float64)
    exponent = draw(st.integers(-140, 120))
    x = (unit.float().double() * 2.0**exponent).float()  # fp32 units, as before
    block = draw(st.sampled_from([1, 3, 64, 100, 128, 4096]))
    for b in draw(st.lists(st.integers(0, max(0, (n - 1) // block)), max_size=3)):
        x[b * block : (b + 1) * block] = 0  # all-zero blocks
    return x, block


# ------------------------------------------------------------------- bounds
@settings(max_examples=200, deadline=None)
@given(vectors())
def test_bf16_round_trip_within_2_to_the_minus_8_relative(case):
    x, _ = case
    codec, payload, out = roundtrip("bf16", x)
    assert codec.wire_bytes == 2 * x.numel()
    assert torch.equal(out, x.to(torch.bfloat16).float())  # torch's cast: round to nearest even
    assert bool(((x - out).abs() <= 2.0**-8 * x.abs() + 2.0**-133).all())


@settings(max_examples=200, deadline=None)
@given(vectors())
def test_int8_round_trip_within_absmax_over_254_per_block(case):
    x, block = case
    codec, payload, out = roundtrip("int8", x, block)
    n, nb = x.numel(), -(-x.numel() // block)
    assert codec.wire_bytes == 4 * nb + n
    scales = payload[: 4 * nb].view(torch.float32)
    q = payload[4 * nb :].view(torch.int8)
    for b in range(nb):
        xb, ob = x[b * block : (b + 1) * block], out[b * block : (b + 1) * block]
        absmax = float(xb.abs().max())
        assert float(scales[b]) == float(torch.tensor(absmax) / 127)  # the documented layout: scales first
        if absmax == 0:
            assert float(scales[b]) == 0 and not q[b * block : (b + 1) * block].any()
        bound = absmax / 254 + absmax * 2.0**-20 + (absmax if absmax < 127 * 2.0**-126 else 0.0)
        assert float((xb - ob).abs().max()) <= bound, (b, absmax)
    assert not bool((q == -128).any())  # clamped to [-127, 127]


def test_int8_values_round_half_to_even_and_decode_is_q_times_scale():
    x = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, 0.0, -127.0])
    codec, payload, out = roundtrip("int8", x, 8)
    assert float(payload[:4].view(torch.float32)) == 1.0
    assert payload[4:].view(torch.int8).tolist() == [127, 0, 2, 2, 0, 0, -127]
    assert out.tolist() == [127.0, 0.0, 2.0, 2.0, 0.0, 0.0, -127.0]


def test_raw_codec_is_byte_identical_to_pack_flat():
    manifest = Manifest.from_named_tensors(
        [
            ("a", torch.zeros(3, 5)),
            ("b", torch.zeros(7, dtype=torch.bfloat16)),
            ("c", torch.zeros(2, dtype=torch.float16)),
            ("d", torch.zeros(())),
        ]
    )
    flat = torch.randn(manifest.numel)
    codec = make_codec("raw", manifest)
    assert codec.wire_bytes == manifest.total_bytes
    payload = codec.encode(flat, torch.empty(codec.wire_bytes, dtype=torch.uint8))
    assert torch.equal(payload, manifest.pack_flat(flat))
    assert torch.equal(codec.decode(payload, torch.empty(manifest.numel)), manifest.unpack_flat(payload))


@pytest.mark.parametrize("name", ["raw", "bf16", "int8"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_input_is_refused(name, bad):
    x = torch.ones(10)
    x[3] = bad
    codec = make_codec(name, flat_manifest(10))
    with pytest.raises(InvalidPayloadError, match="1 non-finite values"):
        codec.encode(x, torch.empty(codec.wire_bytes, dtype=torch.uint8))


def test_values_the_codec_cannot_represent_are_refused():
    codec = make_codec("bf16", flat_manifest(2))
    with pytest.raises(InvalidPayloadError, match="cannot represent"):
        codec.encode(torch.tensor([1.0, 3.4e38]), torch.empty(4, dtype=torch.uint8))
    half = Manifest.from_named_tensors([("h", torch.zeros(2, dtype=torch.float16))])
    with pytest.raises(InvalidPayloadError, match="cannot represent"):
        make_codec("raw", half).encode(torch.tensor([1.0, 1e6]), torch.empty(4, dtype=torch.uint8))


def test_wrong_buffers_and_settings_are_refused():
    codec = make_codec("int8", flat_manifest(10), 4)
    with pytest.raises(InvalidPayloadError, match=r"expects uint8 \(22,\)"):
        codec.encode(torch.ones(10), torch.empty(40, dtype=torch.uint8))
    with pytest.raises(InvalidPayloadError, match=r"expects a contiguous float32 \(10,\)"):
        codec.decode(torch.empty(22, dtype=torch.uint8), torch.empty(10, dtype=torch.float64))
    with pytest.raises(InvalidPayloadError, match="unknown"):
        make_codec("int4", flat_manifest(1))
    rc = pb.RunConfig(wire_codec="int8", codec_block_size=4)
    assert wire_bytes_for(rc, flat_manifest(10)) == codec.wire_bytes == 22
    assert wire_bytes_for(pb.RunConfig(), flat_manifest(10)) == 40
    for kw, needle in [
        ({"wire_codec": "int4"}, "wire_codec='int4' is invalid"),
        ({"codec_block_size": 0}, "codec_block_size=0 is invalid"),
        ({"mode": "sync", "wire_codec": "bf16"}, "use --wire-codec raw with --mode sync"),
    ]:
        with pytest.raises(ConfigError, match=needle):
            ServerConfig(**kw)


# ------------------------------------------------------------ server state
def sgd_state(codec: str, block_size: int = DEFAULT_BLOCK_SIZE, **kw) -> ParameterServerState:
    return ParameterServerState(
        ServerConfig(
            port=0,
            chunk_bytes=1024,
            wire_codec=codec,
            codec_block_size=block_size,
            outer=OuterConfig(optimizer="sgd", lr=1.0, momentum=0.0),
            **kw,
        )
    )


def initialize(state: ParameterServerState, theta: torch.Tensor) -> int:
    manifest = flat_manifest(theta.numel())
    wid, init, _ = state.join(manifest, "w")
    assert init
    state.intake.push(manifest.pack_flat(theta), worker_id=wid, push_id=1, kind=pb.PUSH_KIND_INITIAL_PARAMETERS)  # raw
    assert torch.equal(state.params, theta)
    return wid


@pytest.mark.parametrize("name", ["bf16", "int8"])
def test_a_thousand_pushes_of_1e_minus_4_move_a_weight_at_one_by_about_0_1(name):
    assert float(torch.tensor(1.0 + 1e-4).to(torch.bfloat16)) == 1.0  # a bf16 master copy would be stuck
    state = sgd_state(name)
    theta = torch.zeros(50)
    theta[7] = 1.0
    wid = initialize(state, theta)
    codec = make_codec(name, state.model.manifest)
    delta = torch.zeros(50)
    delta[7] = -1e-4  # θ ← θ − η·Δ moves the weight up by 1e-4 per push
    payload = codec.encode(delta, torch.empty(codec.wire_bytes, dtype=torch.uint8))
    for k in range(1000):
        out = state.intake.push(payload, worker_id=wid, push_id=2 + k, base_version=state.version)
        assert out.applied
    assert state.counters.bytes_pushed == 1000 * codec.wire_bytes
    moved = float(state.params[7]) - 1.0
    assert moved == pytest.approx(0.1, rel=0.03)
    assert float(state.params.abs().sum()) == pytest.approx(1.0 + moved)  # nothing else moved


def test_pull_snapshot_is_encoded_once_per_version_and_initial_parameters_stay_raw():
    state = sgd_state("int8", 16)
    theta = torch.randn(100)
    initialize(state, theta)  # the initial push was raw (400 bytes), applied exactly
    snap = state.snapshots.acquire()
    codec = make_codec("int8", state.model.manifest, 16)
    assert snap.total_bytes == codec.wire_bytes == 4 * 7 + 100
    again = state.snapshots.acquire()
    assert again is snap
    for s in (snap, again):
        state.snapshots.release(s)
    payload = torch.frombuffer(bytearray(b"".join(snap.data_views())), dtype=torch.uint8)
    decoded = codec.decode(payload, torch.empty(100))
    assert float((decoded - theta).abs().max()) <= float(theta.abs().max()) / 254 * 1.001
    rc = state.run_config(0)
    assert (rc.wire_codec, rc.codec_block_size) == ("int8", 16)


def test_a_push_of_the_wrong_size_is_refused_and_changes_nothing():
    state = sgd_state("int8", 16)
    wid = initialize(state, torch.randn(100))
    before = (state.params.clone(), state.version, state.counters.applied_pushes, state.counters.bytes_pushed)
    raw = state.model.manifest.pack_flat(torch.full((100,), 1e-3))  # a raw push to an int8 server
    with pytest.raises(
        InvalidPayloadError,
        match=r"total_bytes is 400; the model's payload is 128 bytes encoded with "
        r"this run's wire codec int8 \(block_size 16\) \(raw: 400 bytes\)",
    ):
        state.intake.push(raw, worker_id=wid, push_id=2, base_version=state.version)
    after = (state.params.clone(), state.version, state.counters.applied_pushes, state.counters.bytes_pushed)
    assert torch.equal(before[0], after[0]) and before[1:] == after[1:]


def test_a_decoded_non_finite_push_is_refused_and_changes_nothing():
    state = sgd_state("int8", 16)
    wid = initialize(state, torch.randn(100))
    before = state.params.clone()
    codec = make_codec("int8", state.model.manifest, 16)
    payload = codec.encode(torch.randn(100), torch.empty(codec.wire_bytes, dtype=torch.uint8))
    payload[:4].view(torch.float32)[0] = float("inf")  # a broken client's scale
    with pytest.raises(InvalidPayloadError, match="non-finite"):
        state.intake.push(payload, worker_id=wid, push_id=2, base_version=0)
    assert torch.equal(state.params, before) and state.version == 0


# ------------------------------------------------------------- durability
def durable(tmp_path, codec: str, block_size: int = 16):
    cfg = ServerConfig(
        port=0,
        chunk_bytes=1024,
        wire_codec=codec,
        codec_block_size=block_size,
        outer=OuterConfig(optimizer="nesterov", lr=0.7, momentum=0.9),
        durability=DurabilityConfig(checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=1000),
    )
    state = ParameterServerState(cfg)
    store = DurableStore(cfg.durability, cfg)
    store.open(state.durability)
    return state, store


@pytest.mark.parametrize("name", ["bf16", "int8"])
def test_wal_replay_with_a_codec_is_bit_identical_and_another_codec_is_refused(tmp_path, name):
    state, store = durable(tmp_path, name)
    wid = initialize(state, torch.randn(100, generator=torch.Generator().manual_seed(0)))
    codec = make_codec(name, state.model.manifest, 16)
    g = torch.Generator().manual_seed(1)
    for k in range(5):
        delta = torch.randn(100, generator=g) * 0.01
        state.intake.push(
            codec.encode(delta, torch.empty(codec.wire_bytes, dtype=torch.uint8)),
            worker_id=wid,
            push_id=2 + k,
            base_version=state.version,
        )
    expected = (state.params.clone(), state.model.outer.momentum_buffer.clone(), state.version)
    crash(store)  # the pushes are only in the log: replay must decode them
    for other, block in (("raw", 16), ("int8" if name == "bf16" else "bf16", 16)) + (
        (("int8", 32),) if name == "int8" else ()
    ):
        with pytest.raises(CheckpointError, match="--wire-codec|--codec-block-size"):
            durable(tmp_path, other, block)
    again, store2 = durable(tmp_path, name)
    assert torch.equal(again.params, expected[0]) and torch.equal(again.model.outer.momentum_buffer, expected[1])
    assert again.version == expected[2] == 5
    store2.close()


# ------------------------------------------------------------- real server
@pytest.fixture
def server(start_server):
    return start_server


class _Vector(nn.Module):
    def __init__(self, values: list[float]) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor(values))


@pytest.mark.parametrize("overlap", [False, True])
def test_error_feedback_moves_a_weight_whose_steps_quantise_to_zero(server, overlap):
    """Weight 0 steps 1e-4 per round; weight 1 steps ±1 (so the block's scale is 1/127
    and 1e-4 alone quantises to 0). The residual is carried across pulls until it
    counts: after R rounds the server's weight 0 moved by R·1e-4 within one quantum.
    With overlap the background sync's merge keeps the residual the same way."""
    srv = server(local_steps=1, wire_codec="int8", outer=OuterConfig(optimizer="sgd", lr=1.0, momentum=0.0))
    model = _Vector([1.0, 0.5, 0.0, 0.0])
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    codec = make_codec("int8", Manifest.from_module(model))
    probe = torch.tensor([-1e-4, 1.0, 0.0, 0.0])
    assert (
        float(codec.decode(codec.encode(probe, torch.empty(codec.wire_bytes, dtype=torch.uint8)), torch.empty(4))[0])
        == 0.0
    )  # without error feedback the weight would never move
    rounds = 300
    with AsyncDiLoCoWorker(model, opt, WorkerConfig(server=srv.address, overlap=overlap)) as worker:
        assert worker.wire.codec.name == "int8"
        for k in range(rounds):
            model.w.grad = torch.tensor([-1e-4, 1.0 if k % 2 == 0 else -1.0, 0.0, 0.0])
            opt.step()  # H = 1: every step pushes and pulls
        if not overlap:  # with overlap the last sync may still be in flight here
            assert worker.stats.pushes_applied == rounds
            assert worker.stats.bytes_pushed == 4 * 4 + rounds * codec.wire_bytes  # the initial parameters went raw
    moved = float(srv.state.params[0]) - 1.0
    quantum = 1.0 / 127
    assert abs(moved - rounds * 1e-4) <= quantum + 1e-6, moved
    assert moved > 0.02


@pytest.mark.parametrize("name", ["bf16", "int8"])
def test_in_process_workers_train_through_a_codec(server, name):
    srv = server(
        local_steps=5, wire_codec=name, codec_block_size=64, outer=OuterConfig(optimizer="sgd", lr=0.7, momentum=0.0)
    )
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    w_true = torch.tensor([[1.0, -2.0, 0.5, 3.0]])
    start_error = float((model.weight.detach() - w_true).norm())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1)
    with AsyncDiLoCoWorker(model, opt, WorkerConfig(server=srv.address), tokens_per_step=16) as worker:
        for _ in range(100):
            x = torch.randn(16, 4, generator=gen)
            nn.functional.mse_loss(model(x), x @ w_true.T).backward()
            opt.step()
            opt.zero_grad()
        assert worker.stats.pushes_applied == 20
    assert float((srv.state.params[:4] - w_true.reshape(-1)).norm()) < 0.2 * start_error


@pytest.mark.multiprocess
@pytest.mark.heavy
@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", ["int8", "bf16"])
def test_demo_run_with_a_wire_codec_lowers_the_loss(tmp_path, name):
    from asyncdiloco.bench.demo import DemoConfig, run_demo
    from asyncdiloco.job.config import JobConfig

    job = JobConfig(n_embd=64, n_head=4)
    cfg = DemoConfig(
        num_workers=2,
        max_seconds=12.0,
        out_dir=str(tmp_path),
        slowdowns=(1.0, 1.5),
        job=job,
        eval_every_s=3.0,
        server_args=(
            "--local-steps",
            "10",
            "--outer-optimizer",
            "sgd",
            "--outer-lr",
            "0.5",
            "--outer-momentum",
            "0",
            "--wire-codec",
            name,
        ),
    )
    report = run_demo(cfg, progress=False)
    assert report["final_eval_loss"] < report["initial_eval_loss"] - 0.3
    assert [w["exit_code"] for w in report["workers"]] == [0, 0]
    from asyncdiloco.job.dataset import CharCorpus

    manifest = Manifest.from_module(job.build(CharCorpus.default()))
    assert report["applied_pushes"] > 0
    assert report["bytes_pushed"] == report["applied_pushes"] * make_codec(name, manifest).wire_bytes
    assert not math.isnan(report["final_eval_loss"])


@pytest.mark.parametrize(
    "outer",
    [
        OuterConfig(optimizer="sgd", lr=0.7, momentum=0.0),
        OuterConfig(optimizer="nesterov"),
        OuterConfig(optimizer="delayed_nesterov", dn_buffer=2),
        OuterConfig(optimizer="delayed_nesterov", dn_buffer=2, block_check=True),
    ],
    ids=["sgd", "nesterov", "delayed_nesterov", "dn_block_check"],
)
def test_bf16_pushes_decoded_per_block_in_the_step_match_a_whole_decode(outer, monkeypatch):
    """A bf16 run's Δ is decoded block by block inside the outer step (no fp32 (N,) decode
    buffer): θ and the optimizer state are bit-identical to decoding each push whole first,
    stale pushes (s(τ) ≠ 1) included, and the decode buffers are never taken."""
    numel = 2 * STEP_BLOCK_ELEMS + 77
    manifest = flat_manifest(numel)
    states = []
    for blocked in (True, False):
        state = ParameterServerState(ServerConfig(port=0, wire_codec="bf16", outer=outer))
        if not blocked:
            monkeypatch.setattr(state.model, "pseudo_gradient_blocks", lambda payload: None)
        wid, _, _ = state.join(manifest, "w")
        state.intake.push(
            manifest.pack_flat(torch.linspace(-1, 1, numel)),
            worker_id=wid,
            push_id=1,
            kind=pb.PUSH_KIND_INITIAL_PARAMETERS,
        )
        gen = torch.Generator().manual_seed(3)
        for push_id in range(2, 8):
            delta = (torch.randn(numel, generator=gen) * 0.01).to(torch.bfloat16).view(torch.uint8)
            base = max(0, state.version - push_id % 3)  # some pushes stale: s(τ) < 1
            assert state.intake.push(delta, worker_id=wid, push_id=push_id, base_version=base).applied
        states.append(state)
    blocked_state, whole = states
    assert torch.equal(blocked_state.params, whole.params)
    for name, buf in blocked_state.model.outer_buffers().items():
        assert torch.equal(buf, whole.model.outer_buffers()[name]), name
    decode = blocked_state.model._decode_buffers  # noqa: SLF001
    assert decode is None or (decode._out == 0 and not decode._free)  # noqa: SLF001 - never taken


def test_a_non_finite_bf16_push_is_refused_naming_the_element_and_changes_nothing():
    state = sgd_state("bf16")
    wid = initialize(state, torch.zeros(100))
    before = state.params.clone()
    bad = torch.zeros(100, dtype=torch.bfloat16)
    bad[41] = float("nan")
    with pytest.raises(InvalidPayloadError, match=r"1 non-finite values .*index \(41,\)"):
        state.intake.push(bad.view(torch.uint8), worker_id=wid, push_id=2, base_version=0)
    assert torch.equal(state.params, before) and state.version == 0
