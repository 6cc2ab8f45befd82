"""``asyncdiloco server --shards S`` on one host: the shard map written for the workers,
the manifest naming every shard's version, and a restart with another S refused."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest
import torch
from helpers import wait_until
from torch import nn

from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.shards import load_shard_addresses
from asyncdiloco.wire.tensors import Manifest
from asyncdiloco.worker.sharded import ShardedClient

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]


def _server(tmp_path, shards: int) -> subprocess.Popen:
    argv = [sys.executable, "-m", "asyncdiloco", "server", "--port", "0", "--shards", str(shards)]
    argv += ["--shard-map", str(tmp_path / "map.json"), "--checkpoint-dir", str(tmp_path / "ckpt"), "--drain-s", "0"]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _reap(proc: subprocess.Popen) -> str:
    if proc.poll() is None:
        proc.kill()
    out, _ = proc.communicate(timeout=30)
    return out


def test_two_shards_on_one_host_then_a_restart_with_three_is_refused(tmp_path):
    proc = _server(tmp_path, 2)
    try:
        addresses = wait_until(
            lambda: (tmp_path / "map.json").exists() and load_shard_addresses(tmp_path / "map.json"),
            "the shard map",
            timeout_s=60,
        )
        assert len(addresses) == 2
        model = nn.Linear(8, 8)
        manifest = Manifest.from_module(model)
        with ShardedClient(addresses) as client:
            w = client.join(manifest, "w")
            theta = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            client.push(
                manifest.pack_flat(theta),
                worker_id=w.worker_id,
                push_id=1,
                base_version=0,
                kind=pb.PUSH_KIND_INITIAL_PARAMETERS,
            )
            reply = client.push(manifest.pack_flat(theta * 0.01), worker_id=w.worker_id, push_id=2, base_version=0)
            assert reply.version == 1
            assert client.pull(manifest, w.worker_id).version == 1
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        out = _reap(proc)
    assert proc.returncode == 0, out
    manifest_file = json.loads((tmp_path / "ckpt" / "shards.json").read_text())
    assert manifest_file["shard_count"] == 2
    assert [s["version"] for s in manifest_file["shards"]] == [1, 1]
    again = _server(tmp_path, 3)
    try:
        again.wait(timeout=60)
    finally:
        out = _reap(again)
    assert again.returncode != 0
    assert "2 shard(s) but this one starts with 3" in out and "--shards 2" in out


def test_the_worker_takes_the_shard_map_and_refuses_a_server_that_is_not_its_shard_0(tmp_path):
    from asyncdiloco.cli.worker import _shard_servers
    from asyncdiloco.errors import ConfigError
    from asyncdiloco.wire.shards import write_shard_addresses

    path = tmp_path / "map.json"
    write_shard_addresses(path, ["127.0.0.1:7001", "127.0.0.1:7002"])
    assert _shard_servers(str(path), "127.0.0.1:7001") == "127.0.0.1:7001,127.0.0.1:7002"
    with pytest.raises(ConfigError, match="not shard 0 .*give --server 127.0.0.1:7001"):
        _shard_servers(str(path), "127.0.0.1:7002")
