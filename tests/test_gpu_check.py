"""``python -m asyncdiloco.bench.gpu_check`` where no GPU is: the command
skips cleanly, and the check's own logic (arguments, codec error bounds, NCCL's refusal,
the summary, a codec check run on the CPU against a real server) is right."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
import torch

from asyncdiloco.bench import gpu_check
from asyncdiloco.wire.codec import WIRE_CODECS, make_codec
from asyncdiloco.wire.tensors import Manifest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the script would run the checks")
def test_the_script_skips_cleanly_without_a_gpu(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "asyncdiloco.bench.gpu_check", "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == gpu_check.SKIP_LINE
    assert not (tmp_path / "out").exists()  # nothing ran, nothing written


def test_main_skips_in_process(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--only", "codecs"]) == 0
    assert capsys.readouterr().out.strip() == "skipped: no GPU (torch.cuda.is_available() is False)"


def test_arguments():
    args = gpu_check.parse_args([])
    assert args.checks == list(gpu_check.CHECKS) and args.transfer_mib == 256
    assert gpu_check.parse_args(["--only", "nccl, transfer"]).checks == ["nccl", "transfer"]
    for bad in (["--only", "nccl,warp"], ["--only", ","], ["--transfer-mib", "0"], ["--demo-seconds", "-1"]):
        with pytest.raises(SystemExit) as exc:
            gpu_check.parse_args(bad)
        assert exc.value.code == 2


@pytest.mark.parametrize("name", WIRE_CODECS)
def test_codec_tolerance_holds_for_the_real_codec_and_is_tight(name):
    """The bound the codec check applies holds for the codec's actual error on mixed
    magnitudes, and is no looser than the codec's documented error (2x it at most)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(10_000, generator=gen) * torch.logspace(-6, 2, 10_000)  # (N,)
    model = torch.nn.Linear(10_000, 1, bias=False)
    codec = make_codec(name, Manifest.from_module(model))
    decoded = codec.decode(codec.encode(x, torch.empty(codec.wire_bytes, dtype=torch.uint8)), torch.empty_like(x))
    bound = gpu_check.codec_tolerance(name, x)
    assert bool(((decoded - x).abs() <= bound).all())
    if name == "bf16":
        assert bool((bound <= 2 * 2.0**-8 * x.abs() + 1e-30).all())
    if name == "int8":
        assert float(bound.max()) <= 2 * float(x[-4096:].abs().max()) / 254
    with pytest.raises(ValueError, match="codec_tolerance"):
        gpu_check.codec_tolerance("fp8", x)


def test_nccls_refusal_of_two_ranks_on_one_gpu_is_recognised():
    msg = (
        "DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, invalid usage, NCCL version 2.27.5\n"
        "ncclInvalidUsage: This usually reflects invalid usage of NCCL library.\n"
        "Last error:\nDuplicate GPU detected : rank 1 and rank 0 both on CUDA device 1b000"
    )
    assert gpu_check.nccl_refusal(msg)
    assert not gpu_check.nccl_refusal("RuntimeError: NCCL error: remote process exited or there was a network error")


def test_summary_and_exit_status():
    results = [
        {"check": "demo", "ok": True, "summary": "loss 4.1 -> 2.9"},
        {"check": "nccl", "ok": None, "summary": "NCCL refuses two ranks on one GPU"},
    ]
    lines = gpu_check.summary_lines(results)
    assert lines[0].split() == ["demo", "ok", "loss", "4.1", "->", "2.9"]
    assert lines[1].split()[:2] == ["nccl", "refused"]
    assert lines[-1] == "result: 1 ok, 0 failed, 1 refused by NCCL (not possible on this machine)"
    assert gpu_check.exit_status(results) == 0
    assert gpu_check.exit_status(results + [{"check": "transfer", "ok": False}]) == 1


@pytest.mark.parametrize("name", WIRE_CODECS)
def test_the_codec_check_passes_on_the_cpu(name, one_thread):
    """The codec check's comparison against a real server, with the worker on the CPU."""
    result = gpu_check.check_codec(name, syncs=3, local_steps=2, device="cpu")
    assert result["ok"], result
    assert result["pushes_applied"] == 3 and result["host_buffers_pinned"] is False
    assert (result["max_abs_error"] == 0.0) == (name == "raw")
