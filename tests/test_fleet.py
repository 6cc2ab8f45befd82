"""A fleet on Ray (asyncdiloco/fleet/, ``asyncdiloco launch``): the spec and the flags
without Ray, and a real fleet on a local Ray of 2 CPUs on 127.0.0.1: a server and 3 CPU
workers of the default job, one worker's actor killed after its first applied push,
which comes back in a new actor as the same worker and the fleet ends with its report.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from asyncdiloco.cli import app
from asyncdiloco.cli import launch as launch_cli
from asyncdiloco.cli import worker as worker_cli
from asyncdiloco.errors import ConfigError
from asyncdiloco.fleet import FleetSpec, WorkerGroup
from asyncdiloco.fleet.actors import worker_launcher
from asyncdiloco.fleet.ray_env import LOCAL_RAY_ENV, local_ray_kwargs, ray_module
from asyncdiloco.job.config import JobConfig
from asyncdiloco.ps.config import ServerConfig

pytestmark = pytest.mark.timeout(60)


# ------------------------------------------------------------------ without Ray
def test_a_group_reads_from_name_count_cpus_gpus_and_slowdown():
    big = WorkerGroup.parse("big:4:8:8")
    assert (big.name, big.count, big.num_cpus, big.num_gpus, big.slowdown) == ("big", 4, 8.0, 8.0, 1.0)
    assert big.worker_names() == ["big-0", "big-1", "big-2", "big-3"]
    assert big.worker_device == "cuda"
    slow = WorkerGroup.parse("cpu:3:0.5:0:2")
    assert (slow.num_cpus, slow.num_gpus, slow.slowdown, slow.worker_device) == (0.5, 0.0, 2.0, "cpu")


def test_a_worker_of_several_gpus_is_a_torchrun_group_of_one_rank_per_gpu():
    from asyncdiloco.fleet.actors import worker_launcher

    assert WorkerGroup.parse("big:4:8:8").ranks == 8
    assert WorkerGroup.parse("small:8:2:2").ranks == 2
    assert WorkerGroup.parse("one:2:4:1").ranks == 1 and WorkerGroup.parse("cpu:3:1:0").ranks == 1
    assert WorkerGroup(name="pair", num_gpus=0, nproc_per_worker=2).ranks == 2  # explicit, also on CPUs
    assert "--nproc-per-node=8" in worker_launcher(WorkerGroup.parse("big:4:8:8").ranks)


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("big:4:8", "NAME:COUNT:CPUS:GPUS"),
        ("big:four:8:8", "COUNT is a whole number"),
        ("big:0:8:8", "count=0"),
        ("big:1:-1:0", "num_cpus=-1.0"),
        ("big:1:1:0:0.5", "slowdown=0.5"),
        ("b/ad:1:1:0", "name 'b/ad'"),
    ],
)
def test_a_bad_group_is_refused_naming_the_value(text, named):
    with pytest.raises(ConfigError, match=named):
        WorkerGroup.parse(text)


def test_a_fleet_spec_refuses_what_cannot_run():
    with pytest.raises(ConfigError, match="repeat"):
        FleetSpec(groups=(WorkerGroup(name="a"), WorkerGroup(name="a")))
    with pytest.raises(ConfigError, match="max_seconds or max_steps"):
        FleetSpec(max_seconds=None, max_steps=None)
    with pytest.raises(ConfigError, match="max_restarts=-1"):
        FleetSpec(max_restarts=-1)
    with pytest.raises(ConfigError, match="at least one worker group"):
        FleetSpec(groups=())


def test_launch_without_ray_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(ConfigError, match=r"pip install 'asyncdiloco\[ray\]'"):
        ray_module()


def test_a_local_ray_stays_on_loopback_without_dashboard_or_usage_stats():
    assert local_ray_kwargs(2) == {
        "address": "local",
        "include_dashboard": False,
        "_node_ip_address": "127.0.0.1",
        "configure_logging": False,
        "num_cpus": 2,
    }
    assert LOCAL_RAY_ENV == {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_DISABLE_USAGE_STATS": "1"}


def test_a_worker_of_several_processes_runs_under_torchrun():
    assert worker_launcher(1) == [sys.executable, "-m", "asyncdiloco"]
    assert worker_launcher(8) == [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=8",
        "-m",
        "asyncdiloco",
    ]


def test_the_launch_flags_build_the_fleet(tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    argv = ["launch", "--address", "head:6379", "--group", "big:4:8:8", "--group", "small:8:2:2:1.5"]
    argv += ["--token-file", str(token), "--max-restarts", "1", "--local-steps", "7", "--n-layer", "1"]
    argv += ["--worker-args", "--overlap --log-every 5", "--insecure-trusted-network"]
    spec = launch_cli.spec(app.build_parser().parse_args(argv))
    assert [(g.name, g.count, g.num_cpus, g.num_gpus, g.slowdown) for g in spec.groups] == [
        ("big", 4, 8.0, 8.0, 1.0),
        ("small", 8, 2.0, 2.0, 1.5),
    ]
    assert all(g.worker_args == ("--overlap", "--log-every", "5") for g in spec.groups)
    assert (spec.server.host, spec.server.port, spec.server.local_steps) == ("0.0.0.0", 0, 7)
    assert (spec.token, spec.max_restarts, spec.job.n_layer, spec.num_workers) == ("s3cret", 1, 1, 12)
    local = launch_cli.spec(app.build_parser().parse_args(["launch", "--workers", "2"]))
    assert (local.server.host, [(g.name, g.count) for g in local.groups]) == ("127.0.0.1", [("cpu", 2)])


def test_a_fleet_beyond_the_loopback_needs_the_trusted_network_opt_in():
    """The fleet has no TLS: its token crosses the cluster's network in clear only when the
    operator says that network is trusted (issue 32)."""
    argv = ["launch", "--address", "head:6379", "--workers", "2"]
    with pytest.raises(ConfigError, match="add --insecure-trusted-network") as info:
        launch_cli.spec(app.build_parser().parse_args(argv))
    assert "a fleet's server on 0.0.0.0 (not a loopback address)" in str(info.value)
    spec = launch_cli.spec(app.build_parser().parse_args([*argv, "--insecure-trusted-network"]))
    assert spec.insecure_trusted_network


def test_the_workers_flags_are_the_worker_commands_own(tmp_path):
    """What the fleet hands each actor parses as ``asyncdiloco worker`` into the job and bounds."""
    from asyncdiloco.fleet.launch import Fleet
    from asyncdiloco.fleet.report import FleetWorker

    job = JobConfig(n_layer=1, n_embd=32, n_head=2)
    spec = FleetSpec(job=job, max_steps=40, out_dir=str(tmp_path), groups=(WorkerGroup(worker_args=("--overlap",)),))
    fleet = Fleet.__new__(Fleet)  # the argv only: no Ray, no actors
    fleet.spec, fleet.address = spec, "127.0.0.1:1"
    w = FleetWorker("cpu-0", "cpu", 5, 2.0, {})
    args = app.build_parser().parse_args(["worker", *fleet.worker_argv(w, 12.5), "--worker-name", "cpu-0"])
    cfg = worker_cli.configs(args)
    assert (cfg.job, cfg.worker.server, cfg.worker.overlap, cfg.device) == (job, "127.0.0.1:1", True, "cpu")
    assert (args.worker_index, args.slowdown, args.max_seconds, args.max_steps) == (5, 2.0, 12.5, 40)
    assert cfg.worker.security is None  # the actor adds the token; a loopback fleet needs no opt-in
    fleet.spec = FleetSpec(job=job, max_steps=40, server=ServerConfig(host="0.0.0.0"), insecure_trusted_network=True)
    fleet.address = "10.0.0.7:1"
    args = app.build_parser().parse_args(["worker", *fleet.worker_argv(w, 12.5), "--worker-name", "cpu-0"])
    assert worker_cli.configs(args).worker.security.insecure_trusted_network  # the fleet's opt-in reaches it


# ------------------------------------------------------------------ resources, deadlines, the end
def test_a_local_ray_gets_as_many_logical_cpus_as_the_fleet_reserves():
    from asyncdiloco.fleet.resources import local_num_cpus

    spec = FleetSpec()  # the server's 1 CPU and 3 workers of 1
    assert local_num_cpus(spec, None, cores=2) == 4  # oversubscribed: the default runs on 2 cores
    assert local_num_cpus(spec, None, cores=16) == 16
    assert local_num_cpus(spec, 4, cores=2) == 4
    with pytest.raises(ConfigError, match=r"--local-cpus 2 is too few.*4 in all; give --local-cpus 4 or more"):
        local_num_cpus(spec, 2, cores=16)


def test_a_request_no_node_holds_is_refused_and_a_fleet_too_big_queues():
    from asyncdiloco.fleet.resources import check_fits

    gpu = FleetSpec(groups=(WorkerGroup.parse("gpu:1:0.5:1"),))
    refusal = r"group gpu asks 1 GPU per worker; the Ray cluster has 0 GPUs: drop the GPUs from --group"
    with pytest.raises(ConfigError, match=refusal):
        check_fits(gpu, [{"CPU": 2.0, "memory": 1e9}])
    big = FleetSpec(groups=(WorkerGroup.parse("big:1:4:0"),))
    with pytest.raises(ConfigError, match=r"asks 4 CPUs per worker; the Ray cluster has 4 CPUs, at most 2 on one node"):
        check_fits(big, [{"CPU": 2.0}, {"CPU": 2.0}])
    both = FleetSpec(groups=(WorkerGroup(name="g", num_cpus=2, num_gpus=1),))
    with pytest.raises(ConfigError, match="no node of the Ray cluster has all of it"):
        check_fits(both, [{"CPU": 4.0}, {"CPU": 1.0, "GPU": 1.0}])
    custom = FleetSpec(groups=(WorkerGroup(name="c", resources={"node:big": 1}),))
    with pytest.raises(ConfigError, match=r"""ray start --resources '\{"node:big": N\}'"""):
        check_fits(custom, [{"CPU": 8.0}])
    (line,) = check_fits(FleetSpec(), [{"CPU": 2.0}])  # 4 CPUs asked, every actor fits alone
    assert "reserves 4 CPUs in all and the Ray cluster has 2" in line and "queue" in line
    assert check_fits(gpu, [{"CPU": 2.0, "GPU": 1.0}]) == []


def test_an_address_where_no_ray_listens_is_one_line_and_exit_1(capsys):
    import socket

    pytest.importorskip("ray", reason="Ray is not installed: pip install 'asyncdiloco[ray]'")
    with socket.socket() as s:  # a port of 127.0.0.1 that nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code, _ = app._run(
        [
            "launch",
            "--address",
            f"127.0.0.1:{port}",
            "--server-host",
            "127.0.0.1",
            "--max-seconds",
            "5",
            "--out",
            "/nonexistent/x",
        ]
    )
    err = capsys.readouterr().err
    assert code == 1, err
    assert err == (
        f"asyncdiloco launch: error: no Ray cluster at 127.0.0.1:{port} (connection refused): start one with "
        f"ray start --head --port {port}, or drop --address to run a local one\n"
    )


def test_an_address_that_accepts_a_connection_passes_the_check():
    import socket

    from asyncdiloco.fleet.ray_env import check_reachable

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        check_reachable(f"127.0.0.1:{s.getsockname()[1]}", timeout_s=2.0)
        check_reachable("auto")  # left to Ray


class _Ray:
    """The part of Ray the driver's deadline and Ctrl-C code call, recording the kills;
    no run ever returns and no actor answers (a queue of actors Ray never places)."""

    class exceptions:
        class RayError(Exception):
            pass

        class GetTimeoutError(RayError):
            pass

    def __init__(self):
        self.killed = []

    def kill(self, actor, no_restart=True):
        self.killed.append(actor)

    def wait(self, refs, num_returns, timeout):
        return [], list(refs)

    def get(self, ref, timeout=None):
        raise self.exceptions.GetTimeoutError


class _Actor:
    def __init__(self, name):
        self.name, self.stops = name, 0
        self.stop = self

    def remote(self, *_):  # actor.stop.remote()
        self.stops += 1
        return f"stop-{self.name}"


def _fleet(tmp_path, names):
    """A Fleet after start(), without Ray: one run per worker, none placed yet."""
    from asyncdiloco.fleet.launch import Fleet
    from asyncdiloco.fleet.report import FleetWorker
    from asyncdiloco.fleet.stopping import WorkerRun

    fleet = Fleet.__new__(Fleet)
    fleet.ray, fleet.run_id, fleet.spec = _Ray(), "t", FleetSpec(out_dir=str(tmp_path / "out"))
    fleet.out, fleet.state_root = tmp_path / "out", str(tmp_path / "asyncdiloco-fleet-t")
    fleet.out.mkdir()
    fleet.workers, fleet.actors, fleet.runs, fleet.ready = [], {}, {}, {}
    fleet.last_end, fleet.server, fleet.where, fleet.watcher = 0.0, None, {}, None
    for name in names:
        w = FleetWorker(name, "cpu", len(fleet.workers), 1.0, {"num_cpus": 1})
        w.state = "running"
        fleet.workers.append(w)
        fleet.actors[name] = _Actor(name)
        run = WorkerRun(w, fleet.actors[name], f"ready-{name}", 30.0, requested_at=0.0)
        fleet.runs[f"run-{name}"], fleet.ready[run.ready] = run, run
        (tmp_path / "asyncdiloco-fleet-t" / name).mkdir(parents=True)
        (tmp_path / "asyncdiloco-fleet-t" / name / "worker.log").write_text(f"{name} trained\n")
    return fleet


def test_an_actor_never_placed_is_killed_once_nothing_of_the_fleet_runs(tmp_path):
    from asyncdiloco.fleet.stopping import OVERDUE_S, overdue

    fleet = _fleet(tmp_path, ["cpu-0", "cpu-1"])
    actors = dict(fleet.actors)
    fleet.ready.pop("ready-cpu-0").placed_at = 1.0  # cpu-0 trains (as watch() marks it); cpu-1 waits
    overdue(fleet, OVERDUE_S + 10)
    assert fleet.ray.killed == [] and len(fleet.runs) == 2  # cpu-0 may still free a CPU
    fleet.runs.pop("run-cpu-0")
    fleet.last_end = 5.0  # cpu-0's run ended at 5 s
    overdue(fleet, OVERDUE_S + 4.0)
    assert fleet.ray.killed == []
    overdue(fleet, OVERDUE_S + 6.0)
    assert fleet.ray.killed == [actors["cpu-1"]] and fleet.runs == {} and fleet.ready == {}
    w = fleet.workers[1]
    assert w.state == "stopped" and "never placed" in w.causes[0] and actors["cpu-1"].stops == 0
    assert (fleet.out / "worker-cpu-1.log").read_text() == "cpu-1 trained\n"


def test_a_worker_past_its_budget_is_stopped_then_killed(tmp_path):
    from asyncdiloco.fleet.stopping import OVERDUE_S, STOP_GRACE_S, overdue

    fleet = _fleet(tmp_path, ["cpu-0"])
    actor, run = fleet.actors["cpu-0"], fleet.runs["run-cpu-0"]
    fleet.ready.pop(run.ready).placed_at = 10.0  # its budget of 30 s counts from here
    overdue(fleet, 10.0 + 30.0 + OVERDUE_S - 1)
    assert actor.stops == 0
    overdue(fleet, 10.0 + 30.0 + OVERDUE_S + 1)
    assert actor.stops == 1 and fleet.ray.killed == []  # SIGTERM: its last push, then Leave
    overdue(fleet, 10.0 + 30.0 + OVERDUE_S + 1 + STOP_GRACE_S + 1)
    assert fleet.ray.killed == [actor] and fleet.runs == {} and fleet.workers[0].state == "stopped"
    assert "after SIGTERM" in fleet.workers[0].causes[0]


def test_ctrl_c_keeps_the_logs_and_the_servers_log_and_removes_the_temp_folder(tmp_path, caplog):
    from asyncdiloco.fleet import stopping

    fleet = _fleet(tmp_path, ["cpu-0", "cpu-1"])
    server_log = tmp_path / "asyncdiloco-server-x" / "server.log"
    server_log.parent.mkdir()
    server_log.write_text("server served\n")
    fleet.server, fleet.where = _Actor("server"), {"log_path": str(server_log)}
    fleet.workers[0].state = "failed"  # a failed worker does not keep the temp folder either
    monkey = pytest.MonkeyPatch()
    monkey.setattr(stopping, "INTERRUPT_GRACE_S", 0.01)
    try:
        stopping.interrupted(fleet)
    finally:
        monkey.undo()
    assert "interrupted: stopping the fleet" in caplog.text
    assert all(a.stops == 1 for a in fleet.ray.killed[:2])  # each was asked first
    assert [w.state for w in fleet.workers] == ["stopped", "stopped"] and fleet.runs == {}
    assert (fleet.out / "worker-cpu-0.log").read_text() == "cpu-0 trained\n"
    assert (fleet.out / "server.log").read_text() == "server served\n"  # the actor never answered
    fleet.close()
    assert not os.path.exists(fleet.state_root) and not server_log.parent.exists()


def test_a_worker_without_a_stats_file_is_counted_by_the_server(tmp_path, capsys):
    from asyncdiloco.bench.demo import Outcome
    from asyncdiloco.fleet.report import FleetWorker, ReportSettings, print_summary, write
    from asyncdiloco.wire._proto import parameter_server_pb2 as pb

    workers = [FleetWorker("cpu-0", "cpu", 0, 1.0, {}), FleetWorker("cpu-1", "cpu", 1, 1.0, {})]
    workers[0].state, workers[1].state = "done", "failed"
    (tmp_path / "worker-cpu-0.json").write_text(json.dumps({"inner_steps": 100, "tokens": 25600}))
    status = pb.StatusReply(initialized=True, applied_pushes=31)
    status.workers.add(worker_name="cpu-0", applied_pushes=20, tokens=25600, local_steps=100)
    status.workers.add(worker_name="cpu-1", applied_pushes=6, tokens=7680, local_steps=30)  # two sessions
    status.workers.add(worker_name="cpu-1", applied_pushes=5, tokens=6400, local_steps=25)
    outcome = Outcome("127.0.0.1:1", status, [], 4.2, 3.0, 10.0, workers, [0, None], 0.0, None)
    result = write(ReportSettings("async", (), _JOB, 30.0), tmp_path, outcome, {})
    print_summary(result)
    by_name = {w["name"]: w for w in result.report["workers"]}
    assert (by_name["cpu-1"]["inner_steps"], by_name["cpu-1"]["pushes"], by_name["cpu-1"]["tokens"]) == (55, 11, 14080)
    assert [by_name[n]["fleet"]["counted_by"] for n in ("cpu-0", "cpu-1")] == ["worker", "server"]
    out = capsys.readouterr().out
    assert "cpu-1: 55 steps, 11 pushes, 14,080 tokens" in out and "cpu-1: no stats file" in out


# ------------------------------------------------------------------ on a local Ray
#: The fleet's test job: small, so 3 workers and the server share 2 cores.
_JOB = JobConfig(n_layer=1, n_embd=32, n_head=2, batch_size=8, context_len=32)

_FLEET = """
import json, sys
import ray
from asyncdiloco.fleet import FleetSpec, WorkerGroup, launch
from asyncdiloco.job.config import JobConfig
from asyncdiloco.ps.config import ServerConfig

seen = {}

def on_status(fleet, st):
    by_name = {w.worker_name: w for w in st.workers}
    w = by_name.get("cpu-1")
    if "killed_id" not in seen and w is not None and w.applied_pushes >= 1:
        seen.update(killed_id=w.worker_id, pushes_at_kill=w.applied_pushes)
        seen["child_pid"] = ray.get(fleet.actor("cpu-1").pid.remote())
        ray.kill(fleet.actor("cpu-1"))  # the actor's process dies: no last push, no Leave
    elif "killed_id" in seen and "back" not in seen and w is not None:
        # training again as the same worker: its pushes go on under its id (the tiny job's
        # last steps may take less than a poll, so it may already have left again)
        if w.applied_pushes > seen["pushes_at_kill"] and w.state in ("training", "left"):
            seen.update(back=True, back_id=w.worker_id, back_state=w.state)

spec = FleetSpec(
    server=ServerConfig(host="127.0.0.1", port=0, local_steps=5),
    server_num_cpus=0.5,
    # slowed down (each step ~20 times its compute) so the tiny job outlasts a status poll on a fast machine
    groups=(WorkerGroup(name="cpu", count=3, num_cpus=0.5, slowdown=20.0),),
    job=JobConfig(**json.loads(sys.argv[2])),
    max_seconds=None,
    max_steps=40,
    max_restarts=2,
    out_dir=sys.argv[1],
    eval_every_s=2.0,
)
result = launch(spec, local_cpus=2, on_status=on_status)
print("SEEN " + json.dumps(seen), flush=True)
"""


@pytest.mark.multiprocess
@pytest.mark.heavy  # about 50 s on 2 cores: 4 actors and 4 Python processes start, one twice
@pytest.mark.timeout(240)
def test_a_fleet_survives_a_killed_worker_actor_that_resumes_as_itself(tmp_path):
    """Runs the fleet in its own interpreter (Ray's processes are its children and end
    with its ray.shutdown); the drill syncs on the server's status, never on sleeps."""
    pytest.importorskip("ray", reason="Ray is not installed: pip install 'asyncdiloco[ray]'")
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    job = json.dumps({k: getattr(_JOB, k) for k in ("n_layer", "n_embd", "n_head", "batch_size", "context_len")})
    done = subprocess.run(
        [sys.executable, "-c", _FLEET, str(out), job], capture_output=True, text=True, timeout=220, env=env
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    seen = json.loads(done.stdout.split("SEEN ", 1)[1].splitlines()[0])
    assert seen.get("back") and seen["back_id"] == seen["killed_id"], seen  # the same worker id, training again
    assert not os.path.exists(f"/proc/{seen['child_pid']}"), "the killed actor's worker process outlived it"
    report = json.loads((out / "report.json").read_text())
    workers = {w["name"]: w for w in report["workers"]}
    assert sorted(workers) == ["cpu-0", "cpu-1", "cpu-2"]
    assert workers["cpu-1"]["worker_ids"] == [seen["killed_id"]]  # one registration, resumed
    assert workers["cpu-1"]["fleet"]["restarts"] == 1 and "actor died" in workers["cpu-1"]["fleet"]["restart_causes"][0]
    assert all(w["fleet"]["state"] == "done" and w["exit_code"] == 0 for w in workers.values())
    assert all(w["pushes"] >= 1 for w in workers.values())
    assert "resumed its registration" in (out / "worker-cpu-1.log").read_text()
    assert report["final_eval_loss"] < report["initial_eval_loss"]
    assert report["fleet"]["max_restarts"] == 2 and report["mode"] == "async"
    assert (out / "server.log").exists() and (out / "worker-cpu-0.json").exists()


def test_a_fleet_spec_holds_the_servers_settings():
    spec = FleetSpec(server=ServerConfig(host="127.0.0.1", port=0, mode="sync"))
    names = spec.groups[0].worker_names()
    assert (spec.server.mode, spec.num_workers, names) == ("sync", 3, ["cpu-0", "cpu-1", "cpu-2"])


def test_the_server_actor_leaves_no_copy_of_the_token_on_disk(tmp_path, monkeypatch):
    """The server reads the token at start; the file it was handed is gone right after,
    and calls without the token are refused."""
    import grpc

    from asyncdiloco.fleet.actors import ServerActor
    from asyncdiloco.ps.config import ServerConfig
    from asyncdiloco.wire._proto import parameter_server_pb2 as pb
    from asyncdiloco.wire._proto import parameter_server_pb2_grpc as pb_grpc

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    actor = ServerActor(ServerConfig(host="127.0.0.1", port=0), "s3cret")
    try:
        assert not list(tmp_path.glob("asyncdiloco-token-*")), "the token file outlived the server's start"
        with grpc.insecure_channel(f"127.0.0.1:{actor.server.port}") as channel:
            with pytest.raises(grpc.RpcError) as refused:
                pb_grpc.ParameterServerStub(channel).Status(pb.StatusRequest(), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        actor.stop(grace_s=0)
