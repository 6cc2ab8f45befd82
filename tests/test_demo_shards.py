"""The main job through a sharded parameter server: the evaluator and the status path
across 2 in-process shards give what one server gives (tools/evaluator.py,
worker/global_model.py, worker/sharded.py ``combined_status``), and ``asyncdiloco demo
--shards 2`` (bench/demo.py) trains the job through ``asyncdiloco server --shards 2``."""

from __future__ import annotations

import json

import pytest
import torch

from asyncdiloco.bench.demo import DemoConfig, run_demo
from asyncdiloco.errors import ConfigError
from asyncdiloco.job.config import JobConfig
from asyncdiloco.job.dataset import CharCorpus
from asyncdiloco.tools.evaluator import Evaluator
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.tensors import Manifest
from asyncdiloco.worker.client import ParameterServerClient
from asyncdiloco.worker.sharded import ShardedClient

TINY = JobConfig(n_layer=1, n_embd=32, n_head=2, context_len=16, batch_size=8)
INITIAL, PSEUDO = pb.PUSH_KIND_INITIAL_PARAMETERS, pb.PUSH_KIND_PSEUDO_GRADIENT


def drive(client, manifest: Manifest, theta0: torch.Tensor, pushes: int = 4) -> None:
    """One worker: its initial parameters, then seeded pseudo-gradients, one version stale after the first."""
    me = client.join(manifest, "w").worker_id
    client.push(manifest.pack_flat(theta0), worker_id=me, push_id=1, base_version=0, kind=INITIAL)
    gen = torch.Generator().manual_seed(5)
    for k in range(pushes):
        delta = torch.randn(manifest.numel, generator=gen) * 0.05
        reply = client.push(
            manifest.pack_flat(delta), worker_id=me, push_id=k + 2, base_version=max(0, k - 1), num_tokens=100
        )
        assert reply.applied


@pytest.mark.timeout(120)
def test_the_evaluator_and_status_across_two_shards_equal_one_server(start_server, one_thread):
    job = JobConfig()
    model = job.build(CharCorpus.default())
    manifest = Manifest.from_module(model)
    theta0 = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    fields = dict(grouping="off", dylu=False)
    single = ParameterServerClient(start_server(**fields).address, bulk_channel=False)
    shards = [start_server(shard_index=i, shard_count=2, **fields) for i in range(2)]
    sharded = ShardedClient([s.address for s in shards])
    try:
        drive(single, manifest, theta0)
        drive(sharded, manifest, theta0)
        one, two = Evaluator(single, job, name="one"), Evaluator(sharded, job, name="two")
        a, b = one.evaluate_global(), two.evaluate_global()
        assert a.version == b.version == 4
        for p, q in zip(one.model.parameters(), two.model.parameters()):
            assert torch.equal(p, q)  # the model assembled from both shards is the single server's, bit for bit
        assert a.loss == b.loss and b.reported
        assert [e.loss for e in shards[0].state.status().evals] == [b.loss]  # reported to shard 0
        s1, s2 = single.status(), sharded.combined_status(manifest)
        assert Manifest.from_proto(s2.manifest) == manifest  # the whole model, not shard 0's part
        assert (s2.version, s2.tokens, s2.applied_pushes) == (s1.version, s1.tokens, s1.applied_pushes) == (4, 400, 4)
        per_shard = [s.state.status().bytes_pushed for s in shards]
        assert s2.bytes_pushed == sum(per_shard) > per_shard[0]
    finally:
        single.close()
        sharded.close()


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        (dict(shards=0), "shards=0 is invalid: use 1..16"),
        (dict(shards=2, mode="sync"), "a sharded server runs async mode only"),
        (dict(token_budget=0), "token_budget=0 is invalid"),
    ],
)
def test_bad_demo_shards_are_refused(fields, needle):
    with pytest.raises(ConfigError, match=needle):
        DemoConfig(num_workers=2, max_seconds=8.0, **fields)


@pytest.mark.multiprocess
@pytest.mark.heavy
@pytest.mark.timeout(240)
def test_a_demo_through_two_shards_trains_and_every_worker_exits_0(tmp_path):
    cfg = DemoConfig(
        num_workers=2,
        max_seconds=60.0,
        out_dir=str(tmp_path),
        slowdowns=(1.0, 1.5),
        server_args=("--local-steps", "5", "--outer-optimizer", "sgd", "--outer-lr", "0.7", "--outer-momentum", "0"),
        job=TINY,
        eval_every_s=2.0,
        shards=2,
        token_budget=20 * 5 * 8 * 16,  # 20 pushes of H = 5 steps of 8 x 16 tokens: the run ends on tokens
    )
    report = run_demo(cfg, progress=False)
    assert len(report["shard_addresses"]) == 2
    assert json.loads((tmp_path / "shards.json").read_text())["shards"] == report["shard_addresses"]
    assert report["server"] == report["shard_addresses"][0]
    assert report["final_eval_loss"] < report["initial_eval_loss"]
    assert [w["exit_code"] for w in report["workers"]] == [0, 0]
    assert report["tokens_applied"] >= cfg.token_budget
    assert report["num_parameters"] == Manifest.from_module(TINY.build(CharCorpus.default())).numel
    log = (tmp_path / "server.log").read_text()
    assert "shard 1 of 2 listening" in log, log[-2000:]


def test_demo_cli_passes_shards_and_token_budget(monkeypatch, tmp_path):
    from asyncdiloco.bench import demo as bench_demo
    from asyncdiloco.cli import app, demo

    seen = {}

    def fake_run_demo(cfg, progress=True):
        seen["cfg"] = cfg
        return {"final_eval_loss": 1.0, "initial_eval_loss": 2.0}

    monkeypatch.setattr(bench_demo, "run_demo", fake_run_demo)
    monkeypatch.setattr(demo.signal, "signal", lambda *_: None)
    argv = ["demo", "--shards", "2", "--token-budget", "800000", "--out", str(tmp_path), "--no-progress"]
    assert demo.run(app.build_parser().parse_args(argv)) == 0
    assert (seen["cfg"].shards, seen["cfg"].token_budget) == (2, 800000)
    argv = ["demo", "--max-tokens", "0", "--max-seconds", "30", "--out", str(tmp_path), "--no-progress"]
    assert demo.run(app.build_parser().parse_args(argv)) == 0
    assert (seen["cfg"].token_budget, seen["cfg"].max_seconds) == (None, 30.0)  # 0: only the cap
    default = app.build_parser().parse_args(["demo"])
    assert demo.run(default) == 0  # one unsharded server, the default budget and cap
    assert (seen["cfg"].shards, seen["cfg"].token_budget) == (1, bench_demo.DEFAULT_TOKEN_BUDGET)
    assert seen["cfg"].max_seconds == bench_demo.DEFAULT_MAX_SECONDS


def test_demo_cli_refuses_shards_in_sync_mode(cli_exit):
    code, err = cli_exit(["demo", "--shards", "2", "--mode", "sync"])
    assert code != 0 and "a sharded server runs async mode only" in err
