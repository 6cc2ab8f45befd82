"""``python _faulty_sync_worker.py FAULT ROUND MIN_WORLD_SIZE worker --server ... --mode sync ...``

The CLI worker (everything after the first three arguments is ``asyncdiloco``'s command
line), with its sync worker failing once as ``faults.FailAt(Fault(FAULT), ROUND,
MIN_WORLD_SIZE)`` says: e.g. ``kill 3 3`` SIGKILLs this process with its allreduce in
flight, in the first round >= 3 whose quorum has all three members.
"""

from __future__ import annotations

import sys

from faults import FailAt, Fault, faulty_sync_worker_class

import asyncdiloco.cli.train
from asyncdiloco.cli.app import main


def run(argv: list[str]) -> None:
    fault, round_, min_world_size, *cli_argv = argv
    fail_at = FailAt(Fault(fault), round=int(round_), min_world_size=int(min_world_size))
    asyncdiloco.cli.train.SyncDiLoCoWorker = faulty_sync_worker_class(fail_at)  # what run_worker builds
    main(cli_argv)


if __name__ == "__main__":
    run(sys.argv[1:])
