"""The flag table (flags/settings.py): config → argv → parse → config is the identity, every
config field has a flag or a stated reason not to, --help says what each default means,
and every flag the command had keeps its name."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from asyncdiloco.algo.config import OuterConfig
from asyncdiloco.cli import app, demo, server, worker
from asyncdiloco.errors import ConfigError
from asyncdiloco.flags.settings import (
    JOB,
    JOB_EXCLUDED,
    SERVER,
    SERVER_EXCLUDED,
    SERVER_RUN,
    SYNC_WORKER,
    SYNC_WORKER_EXCLUDED,
    WORKER,
    WORKER_EXCLUDED,
    WORKER_JOB,
)
from asyncdiloco.flags.table import FlagTable, all_fields
from asyncdiloco.job.config import JobConfig
from asyncdiloco.ps.config import DEFAULT_SYNC_LOCAL_STEPS, SYNC_LOCAL_STEPS, DurabilityConfig, ServerConfig, SyncConfig
from asyncdiloco.wire.security import ClientSecurityConfig, ServerSecurityConfig
from asyncdiloco.worker.config import SyncWorkerConfig, WorkerConfig


@pytest.fixture
def files(tmp_path):
    """name -> path of an existing file (the security configs check that theirs exist)."""

    def make(name: str) -> str:
        path = tmp_path / name
        path.write_text("x\n")
        return str(path)

    return make


def _async_server(files) -> ServerConfig:
    """Every field the table covers away from its default (mode: see _sync_server)."""
    return ServerConfig(
        host="0.0.0.0",
        port=0,
        bulk_port=0,
        metrics_port=0,
        outer=OuterConfig(
            optimizer="nesterov",
            lr=0.5,
            momentum=0.8,
            staleness="hinge",
            staleness_a=0.25,
            staleness_b=2,
            max_staleness=50,
            dn_buffer=3,
            dn_c=0.125,
            block_check=True,
            lr_schedule="cosine",
            lr_warmup_versions=5,
            lr_total_versions=50,
            lr_min_ratio=0.25,
        ),
        local_steps=7,
        chunk_bytes=2**20,
        max_payload_bytes=2**30,
        lease_s=12.5,
        max_abs_value=1e6,
        receive_buffer_bytes=3 * 2**20 + 1,  # not a whole number of MiB, the flag's unit
        pull_snapshots=3,
        dylu=False,
        grouping="off",
        grace_s=2.5,
        group_max_wait_s=7.0,
        durability=DurabilityConfig(
            checkpoint_dir=files("ckpt"), checkpoint_every=7, fallback_to_previous=True, fsync=False
        ),
        security=ServerSecurityConfig(
            token_file=files("token"),
            tls_cert=files("cert"),
            tls_key=files("key"),
            tls_client_ca=files("ca"),
            insecure_trusted_network=True,
        ),
        sync=SyncConfig(min_workers=2, join_timeout_s=3.5, round_timeout_s=20.0, weighting="tokens"),
        wire_codec="int8",
        codec_block_size=128,
    )


#: --sync-local-steps other than its default, whichever that is (so the round trip writes it).
_NOT_DEFAULT_SYNC_LOCAL_STEPS = next(v for v in SYNC_LOCAL_STEPS if v != DEFAULT_SYNC_LOCAL_STEPS)


def _sync_server() -> ServerConfig:
    return ServerConfig(
        mode="sync",
        outer=OuterConfig(optimizer="sgd", lr=1.0, momentum=0.0),
        sync=SyncConfig(min_workers=3, join_timeout_s=30.0, local_steps=_NOT_DEFAULT_SYNC_LOCAL_STEPS),
        grouping="off",
    )


def _round_trip(table: FlagTable, config, prefix: tuple[str, ...] = ()):
    parser = argparse.ArgumentParser()
    table.add_to(parser)
    return table.build(table.given(parser.parse_args([*prefix, *table.argv(config)])))


def test_a_server_config_survives_config_to_argv_to_parse_to_config(files):
    for config in (_async_server(files), _sync_server(), ServerConfig(), ServerConfig(mode="sync")):
        args = app.build_parser().parse_args(["server", *SERVER.argv(config)])  # what `asyncdiloco server` sees
        assert server.config(args) == config


def test_every_flag_of_the_server_table_is_exercised_by_the_round_trip(files):
    written = {*SERVER.argv(_async_server(files)), *SERVER.argv(_sync_server())}
    written |= {"--" + a.removeprefix("--no-") for a in written if a == "--no-dylu"}  # the pair --dylu / --no-dylu
    assert {f.flag for f in SERVER.flags} <= written


def test_the_mode_defaults_are_not_written_but_a_change_of_them_is():
    assert SERVER.argv(ServerConfig()) == ()
    assert SERVER.argv(ServerConfig(mode="sync")) == ("--mode", "sync")  # the sync outer step is sync's own
    sync_with_async_momentum = ServerConfig(mode="sync", outer=OuterConfig(optimizer="nesterov", lr=0.7, momentum=0.6))
    assert SERVER.argv(sync_with_async_momentum) == ("--mode", "sync", "--outer-momentum", "0.6")


def test_the_demos_server_flags_rebuild_the_demos_server(files):
    config = dataclasses.replace(_async_server(files), host="127.0.0.1", port=0, bulk_port=None, metrics_port=None)
    config = dataclasses.replace(config, durability=None, security=None)
    args = app.build_parser().parse_args(["demo", *SERVER_RUN.argv(config)])
    assert demo.server_config(args) == config
    again = app.build_parser().parse_args(["server", "--port", "0", *SERVER_RUN.argv(demo.server_config(args))])
    assert server.config(again) == config  # what the demo's server process builds


def test_the_demo_has_its_own_join_timeout_unless_the_flag_is_given():
    parse = app.build_parser().parse_args
    assert demo.server_config(parse(["demo"])).sync.join_timeout_s == demo.DEMO_JOIN_TIMEOUT_S["async"]
    assert demo.server_config(parse(["demo", "--mode", "sync"])).sync.join_timeout_s == 30.0
    assert demo.server_config(parse(["demo", "--mode", "sync", "--quorum-wait-s", "4"])).sync.join_timeout_s == 4.0


def test_worker_sync_worker_and_job_configs_survive_the_round_trip(files):
    wcfg = WorkerConfig(
        server="10.1.2.3:4567",
        worker_name="w7",
        join_timeout_s=3.0,
        overlap=True,
        max_dropped_in_a_row=9,
        bulk_channel=False,
        state_dir="w7-state",  # read only if it holds a state (none here)
        security=ClientSecurityConfig(
            token_file=files("token"),
            tls_ca=files("ca"),
            tls_cert=files("cert"),
            tls_key=files("key"),
            tls_server_name="localhost",
            insecure_trusted_network=True,
        ),
    )
    sync = SyncWorkerConfig(allreduce_timeout_s=2.5, quorum_timeout_s=11.0, collective_host="127.0.0.2")
    job = JobConfig(
        batch_size=4,
        context_len=16,
        n_layer=1,
        n_embd=32,
        n_head=2,
        inner_lr=1e-3,
        seed=3,
        inner_lr_schedule="cosine",
        inner_warmup_steps=2,
        inner_total_steps=10,
        inner_min_ratio=0.3,
    )
    assert _round_trip(WORKER, wcfg) == wcfg
    assert _round_trip(SYNC_WORKER, sync) == sync
    assert _round_trip(WORKER_JOB, job) == job
    assert {f.flag for f in (*WORKER.flags, *SYNC_WORKER.flags, *WORKER_JOB.flags)} <= {
        *WORKER.argv(wcfg),
        *SYNC_WORKER.argv(sync),
        *WORKER_JOB.argv(job),
    }
    argv = ["worker", *WORKER.argv(wcfg), *WORKER_JOB.argv(job), "--max-steps", "1"]
    built = worker.configs(app.build_parser().parse_args(argv))  # the worker command, end to end
    assert (built.worker, built.job, built.sync) == (wcfg, job, None)


@pytest.mark.parametrize(
    "config, table, excluded",
    [
        (ServerConfig, SERVER, SERVER_EXCLUDED),
        (WorkerConfig, WORKER, WORKER_EXCLUDED),
        (SyncWorkerConfig, SYNC_WORKER, SYNC_WORKER_EXCLUDED),
        (JobConfig, WORKER_JOB, JOB_EXCLUDED),
    ],
)
def test_every_config_field_has_a_flag_or_is_excluded_on_purpose(config, table, excluded):
    fields = all_fields(config)
    missing = fields - table.fields() - excluded
    assert not missing, f"{config.__name__} fields without a flag: add them to flags/settings.py or its exclusions"
    assert not table.fields() & excluded
    assert table.fields() <= fields


#: Every flag the command had before the table, per subcommand (users and scripts use them).
FLAGS_BEFORE = {
    "server": "--host --port --port-file --bulk-port --mode --min-workers --quorum-wait-s --round-timeout-s "
    "--sync-weighting --local-steps -H --outer-optimizer --outer-lr --outer-momentum --staleness "
    "--staleness-a --staleness-b --max-staleness --dn-buffer --dn-c --outer-lr-schedule --outer-warmup-versions "
    "--outer-total-versions --outer-min-lr-ratio --chunk-bytes --lease-s --max-payload-bytes --max-abs-value "
    "--receive-buffer-mib --pull-snapshots --dylu --no-dylu --grouping --grace-s --group-max-wait-s --block-check "
    "--wire-codec --codec-block-size --checkpoint-dir --checkpoint-every --fallback-to-previous --no-fsync "
    "--token-file --tls-cert --tls-key --tls-client-ca",
    "worker": "--server --worker-index --name --slowdown --slowdown-changes --join-when-file --max-steps "
    "--max-seconds --join-retry-s --threads --stats-file --overlap --no-bulk-channel --token-file --tls-ca "
    "--tls-cert --tls-key --tls-server-name --mode --allreduce-timeout-s --quorum-timeout-s --collective-host "
    "--batch-size --context-len --n-layer --n-embd --n-head "
    "--inner-lr --seed --inner-lr-schedule --inner-warmup-steps --inner-total-steps --inner-min-lr-ratio",
    "demo": "--workers --max-seconds --out --slowdowns --eval-every --no-progress --overlap --mode --min-workers "
    "--quorum-wait-s --round-timeout-s --sync-weighting --local-steps -H --outer-optimizer "
    "--outer-lr --outer-momentum --staleness --staleness-a --staleness-b --max-staleness --dn-buffer --dn-c "
    "--outer-lr-schedule --outer-warmup-versions --outer-total-versions --outer-min-lr-ratio --chunk-bytes "
    "--lease-s --max-payload-bytes --max-abs-value --receive-buffer-mib --pull-snapshots --dylu --no-dylu "
    "--grouping --grace-s --group-max-wait-s --block-check --wire-codec --codec-block-size --batch-size "
    "--context-len --n-layer --n-embd --n-head --inner-lr --seed",
    "bench": "--suite --clock --out --sizes --no-progress",
}


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in app.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@pytest.mark.parametrize("command", sorted(FLAGS_BEFORE))
def test_every_flag_keeps_its_name(command):
    parser = _subparsers()[command]
    have = {s for a in parser._actions for s in a.option_strings}
    assert set(FLAGS_BEFORE[command].split()) <= have


@pytest.mark.parametrize("command", sorted(FLAGS_BEFORE))
def test_help_says_what_a_default_of_none_means(command):
    text = _subparsers()[command].format_help()
    assert "default None" not in text and "(default )" not in text and "MISSING" not in text
    assert "default: the mode's own" in text or command in ("worker", "bench")


def test_a_durability_flag_without_the_checkpoint_folder_is_refused_naming_both():
    args = app.build_parser().parse_args(["server", "--fallback-to-previous"])
    with pytest.raises(ConfigError, match="--fallback-to-previous needs --checkpoint-dir DIR"):
        server.config(args)
    args = app.build_parser().parse_args(["server", "--checkpoint-every", "3", "--no-fsync"])
    with pytest.raises(ConfigError, match="--checkpoint-every, --no-fsync need --checkpoint-dir DIR"):
        server.config(args)


def test_a_bad_value_is_refused_by_the_configs_own_check():
    with pytest.raises(ConfigError, match="outer lr"):
        server.config(app.build_parser().parse_args(["server", "--outer-lr", "-1"]))
    with pytest.raises(ConfigError, match="n_head"):
        JOB.build(JOB.given(app.build_parser().parse_args(["demo", "--n-head", "0"])))
