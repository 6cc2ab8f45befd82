#!/usr/bin/env bash
# asyncdiloco's CUDA path on this machine's GPU, in under 5 minutes: the async demo with CUDA
# workers (overlap on), every wire codec over a real server, a sync allreduce over NCCL with two
# processes, and push/pull timings against pinned-memory copy speed. One JSON line per check,
# then a summary; the lines are also in OUT/gpu_check.jsonl (default gpu-check-out/).
#
#   bash benchmarks/gpu_check.sh [--out DIR] [--only demo,codecs,nccl,transfer] [--transfer-mib N]
#
# Without a GPU it prints "skipped: no GPU (torch.cuda.is_available() is False)" and exits 0.
# It installs nothing: it runs the torch the environment has (PYTHON, else .venv/bin/python,
# else python3); a CPU build of torch counts as no GPU. Exit status: 0 passed (or skipped),
# 1 a check failed, 124 the time limit (GPU_CHECK_TIMEOUT_S, default 290 s) ran out.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-}
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
if ! "$PY" -c "import torch, asyncdiloco" 2>/dev/null; then
    echo "gpu_check: $PY cannot import torch and asyncdiloco: run bash scripts/setup.sh first, or give PYTHON=<a python with both>" >&2
    exit 2
fi
LIMIT=${GPU_CHECK_TIMEOUT_S:-290}
timeout --signal=TERM --kill-after=20 "$LIMIT" "$PY" -m asyncdiloco.bench.gpu_check "$@"
rc=$?
if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    echo "gpu_check: stopped after the time limit of ${LIMIT} s (GPU_CHECK_TIMEOUT_S); the lines above are the checks that finished" >&2
fi
exit "$rc"
