"""The command line as a new user meets it: help texts, renamed flags and their old
spellings, start-up refusals (port in use, garbage PEM files, a GPU that is not there),
mode-mismatch words, the server's last line, the bench's and the demo's progress text,
and a worker used after ``close()``."""

from __future__ import annotations

import argparse
import datetime
import logging

import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from torch import nn

from asyncdiloco import AsyncDiLoCoWorker, WorkerConfig
from asyncdiloco.cli import app, bench, demo, server, worker
from asyncdiloco.errors import AsyncDiLoCoError, ConfigError, ModeMismatchError
from asyncdiloco.ps import ParameterServer, ParameterServerState
from asyncdiloco.ps.config import ServerConfig
from asyncdiloco.wire._proto import parameter_server_pb2 as pb
from asyncdiloco.wire.header_crc import seal
from asyncdiloco.wire.security import ClientSecurityConfig, ServerSecurityConfig, check_pem_files
from asyncdiloco.wire.tensors import Manifest

pytestmark = pytest.mark.timeout(60)


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in app.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


# ------------------------------------------------------------------ help texts
@pytest.mark.parametrize("command", sorted(_subparsers()))
def test_every_flag_that_takes_a_value_says_its_default(command):
    parser = _subparsers()[command]
    for action in parser._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS or action.nargs == 0 or action.required:
            continue
        if isinstance(action, argparse._HelpAction):
            continue
        text = action.help % {"default": action.default} if "%(" in (action.help or "") else action.help
        assert "default" in (text or ""), f"{command} {action.option_strings[0]}: say its default in --help"
        assert "default None" not in text and "(default )" not in text


def test_worker_help_names_both_modes():
    text = _subparsers()["worker"].format_help()
    assert "One asynchronous DiLoCo worker" not in text
    assert "--mode async" in text and "--mode sync" in text


# ------------------------------------------------------ renamed flags, old spellings
def _parse(argv: list[str]) -> argparse.Namespace:
    return app.build_parser().parse_args(argv)


def test_the_join_retry_and_quorum_wait_flags_are_named_for_what_they_do():
    args = _parse(["worker", "--server", "127.0.0.1:1", "--join-retry-s", "3", "--max-steps", "1"])
    assert worker.configs(args).worker.join_timeout_s == 3.0
    assert server.config(_parse(["server", "--quorum-wait-s", "4"])).sync.join_timeout_s == 4.0
    assert demo.server_config(_parse(["demo", "--mode", "sync", "--quorum-wait-s", "5"])).sync.join_timeout_s == 5.0
    worker_help = _subparsers()["worker"].format_help()
    server_help = _subparsers()["server"].format_help()
    assert "--join-retry-s" in worker_help and "--join-timeout " not in worker_help
    assert "--quorum-wait-s" in server_help and "--join-timeout-s" not in server_help


# ------------------------------------------------------------------ port in use
def test_a_port_in_use_is_one_clear_error_without_grpcs_raw_log_line(start_server, capfd):
    taken = start_server().port
    capfd.readouterr()
    with pytest.raises(ConfigError, match=f"cannot listen on 127.0.0.1:{taken} for the gRPC port: port in use"):
        ParameterServer(ServerConfig(port=taken)).start()
    err = capfd.readouterr().err
    assert "add_port.cc" not in err and "Failed to add port" not in err


# -------------------------------------------------------------- PEM validation
def _key():
    return ec.generate_private_key(ec.SECP256R1())


def _self_signed(key, name: str):
    now = datetime.datetime.now(datetime.timezone.utc)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )


@pytest.fixture(scope="module")
def pem(tmp_path_factory):
    """Paths: a good self-signed certificate and its key, another key, and garbage."""
    d = tmp_path_factory.mktemp("pem")
    key, other = _key(), _key()
    (d / "cert.pem").write_bytes(_self_signed(key, "localhost").public_bytes(serialization.Encoding.PEM))
    for name, k in (("key.pem", key), ("other.key", other)):
        (d / name).write_bytes(
            k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        )
    (d / "garbage.pem").write_text("this is not a certificate\n")
    return {name: str(d / name) for name in ("cert.pem", "key.pem", "other.key", "garbage.pem")}


def test_good_pem_files_pass_the_check(pem):
    check_pem_files(
        ServerSecurityConfig(tls_cert=pem["cert.pem"], tls_key=pem["key.pem"], tls_client_ca=pem["cert.pem"])
    )
    check_pem_files(ClientSecurityConfig(tls_ca=pem["cert.pem"], tls_cert=pem["cert.pem"], tls_key=pem["key.pem"]))


@pytest.mark.parametrize(
    "flags, named",
    [
        ({"--tls-ca": "garbage.pem"}, "--tls-ca"),
        ({"--tls-ca": "cert.pem", "--tls-cert": "garbage.pem", "--tls-key": "key.pem"}, "--tls-cert"),
        ({"--tls-ca": "cert.pem", "--tls-cert": "cert.pem", "--tls-key": "garbage.pem"}, "--tls-key"),
        ({"--tls-ca": "cert.pem", "--tls-cert": "cert.pem", "--tls-key": "other.key"}, "--tls-key"),
    ],
)
def test_the_worker_refuses_a_garbage_or_mismatched_pem_file_before_it_starts(cli_exit, pem, flags, named):
    argv = ["worker", "--server", "127.0.0.1:1", "--max-steps", "1"]
    for flag, name in flags.items():
        argv += [flag, pem[name]]
    code, err = cli_exit(argv)
    assert code == 2
    assert f"{named} '{pem[flags[named]]}' is invalid" in err and "PEM" in err


@pytest.mark.parametrize(
    "security, named",
    [
        ({"tls_cert": "garbage.pem", "tls_key": "key.pem"}, "--tls-cert"),
        ({"tls_cert": "cert.pem", "tls_key": "other.key"}, "--tls-key"),
        ({"tls_cert": "cert.pem", "tls_key": "key.pem", "tls_client_ca": "garbage.pem"}, "--tls-client-ca"),
    ],
)
def test_the_server_refuses_a_garbage_or_mismatched_pem_file_at_start(pem, security, named):
    config = ServerConfig(port=0, security=ServerSecurityConfig(**{k: pem[v] for k, v in security.items()}))
    with pytest.raises(ConfigError, match=f"{named} '.*' is invalid: it does not hold"):
        ParameterServer(config).start()


# ------------------------------------------------------------- mode mismatch words
def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(4, 1)


def test_mode_mismatch_messages_speak_in_flags_not_classes(start_server):
    srv = start_server(mode="sync")
    model = _model()
    w = AsyncDiLoCoWorker(model, torch.optim.SGD(model.parameters(), lr=0.1), WorkerConfig(server=srv.address))
    with pytest.raises(ModeMismatchError) as refused:
        w.join()
    w.close()
    text = str(refused.value)
    assert "runs --mode sync but this worker runs --mode async; start the worker with --mode sync" in text
    assert "DiLoCoWorker" not in text
    state = ParameterServerState(ServerConfig(port=0))
    wid = state.join(Manifest.from_module(model), "w")[0]
    header = pb.PushHeader(worker_id=wid, push_id=1, kind=pb.PUSH_KIND_ROUND_RESULT, quorum_id=1)
    with pytest.raises(ModeMismatchError) as server_side:
        state.intake.refuse(seal(header))
    assert "this server runs --mode async; start the worker with --mode async" in str(server_side.value)
    assert "DiLoCoWorker" not in str(server_side.value)


def test_join_after_close_is_a_clear_library_error(start_server):
    srv = start_server()
    model = _model()
    w = AsyncDiLoCoWorker(model, torch.optim.SGD(model.parameters(), lr=0.1), WorkerConfig(server=srv.address))
    w.join()
    w.close()
    with pytest.raises(AsyncDiLoCoError, match=r"join\(\) after close\(\): .* create a new AsyncDiLoCoWorker"):
        w.join()


# ------------------------------------------------------------------ last lines
def test_the_sync_servers_last_line_counts_rounds_and_member_contributions():
    st = pb.StatusReply(version=3, applied_pushes=6, rounds_committed=3, rounds_failed=1, pulls=2)
    line = server._final_line(st, "sync")
    assert "3 rounds committed, 1 aborted, 6 member contributions applied" in line
    assert "pushes applied" not in line
    assert "6 pushes applied" in server._final_line(pb.StatusReply(version=6, applied_pushes=6), "async")


# ------------------------------------------------------------- --device
def test_device_cuda_is_refused_cleanly_where_torch_sees_no_gpu(cli_exit):
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for value in (["cuda"] if count == 0 else []) + [f"cuda:{count}"]:
        code, err = cli_exit(["worker", "--server", "127.0.0.1:1", "--max-steps", "1", "--device", value])
        assert code == 2
        assert f"--device {value} is invalid: torch {torch.__version__} here sees" in err and "--device cpu" in err
    code, err = cli_exit(["worker", "--server", "127.0.0.1:1", "--max-steps", "1", "--device", "tpu"])
    assert code == 2 and "choose cpu, cuda, cuda:N" in err
    args = _parse(["worker", "--server", "127.0.0.1:1", "--max-steps", "1", "--device", "auto"])
    assert worker.configs(args).device == ("cuda" if count else "cpu")
    assert worker.configs(_parse(["worker", "--server", "127.0.0.1:1", "--max-steps", "1"])).device == "cpu"


# --------------------------------------------------------- bench and demo text
def test_bench_keeps_the_librarys_info_lines_out_unless_verbose():
    ps_log = logging.getLogger("asyncdiloco.ps.server")
    with bench._library_logs(verbose=0):
        assert not ps_log.isEnabledFor(logging.INFO) and ps_log.isEnabledFor(logging.WARNING)
    root = logging.getLogger()
    before = root.level
    root.setLevel(logging.INFO)
    try:
        with bench._library_logs(verbose=1):
            assert ps_log.isEnabledFor(logging.INFO)
        assert ps_log.isEnabledFor(logging.INFO)  # restored after the bench
    finally:
        root.setLevel(before)


class _Bar:
    total, n, postfix = 60, 0, ""

    def set_postfix_str(self, text: str) -> None:
        self.postfix = text


def test_the_demo_bar_says_what_it_waits_for_before_training(tmp_path):
    from asyncdiloco.bench.demo import DemoConfig, _Watch

    watch = _Watch(DemoConfig(num_workers=3, out_dir=str(tmp_path)), None, [object()] * 3, 0.0, initial_loss=4.2)
    bar = _Bar()
    watch.show(bar, pb.StatusReply(initialized=False))
    assert bar.postfix.startswith("starting 3 worker processes (loading torch") and "workers 0" not in bar.postfix
    watch.show(bar, pb.StatusReply(initialized=False, workers=[pb.WorkerStatus(alive=True)]))
    assert bar.postfix == "waiting for the initial model"
    watch.show(bar, pb.StatusReply(initialized=True, version=2, workers=[pb.WorkerStatus(alive=True)]))
    assert "version 2" in bar.postfix and "workers 1" in bar.postfix


def test_a_second_demo_run_in_the_same_folder_says_it_overwrites(tmp_path, caplog):
    demo._warn_if_overwriting(str(tmp_path))
    assert not caplog.records
    (tmp_path / "report.json").write_text("{}\n")
    with caplog.at_level(logging.WARNING):
        demo._warn_if_overwriting(str(tmp_path))
    assert "holds an earlier demo run" in caplog.text and "give --out DIR to keep it" in caplog.text


def test_eval_help_lists_the_model_shape_flags_only():
    text = _subparsers()["eval"].format_help()
    assert all(flag in text for flag in ("--n-layer", "--n-embd", "--n-head", "--context-len"))
    assert not any(flag in text for flag in ("--inner-lr", "--batch-size", "--seed", "--inner-lr-schedule"))


@pytest.mark.parametrize("command", ["server", "demo", "bench"])
def test_every_command_help_says_what_it_does(command):
    usage, _, rest = _subparsers()[command].format_help().partition("\n\n")
    first = rest.splitlines()[0]
    assert not first.startswith(("options", "positional")) and len(first) > 20, first
