"""``asyncdiloco eval``: the held-out loss of a running server's global model, printed and
reported to the server, once or ``--every S`` seconds (tools/evaluator.py;
docs/operations.md, "Held-out loss").
"""

from __future__ import annotations

import argparse
import json
import os
import threading

from asyncdiloco.errors import ConfigError, ServerUnavailableError, unreachable_message
from asyncdiloco.flags.settings import EVAL, EVAL_MODEL


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval",
        help="measure the global model's held-out loss and report it to the server",
        description="Pull the global model as an observer, measure its loss on the default corpus's held-out "
        "split (nats/char) and report it to the server's status and dashboard.",
    )
    EVAL.add_to(p)
    g = p.add_argument_group("evaluations")
    g.add_argument(
        "--every",
        type=float,
        default=None,
        metavar="S",
        help="evaluate every S seconds, skipping a version already evaluated, until Ctrl-C (default: once)",
    )
    g.add_argument(
        "--max-evals",
        type=int,
        default=None,
        metavar="N",
        help="with --every: stop after N evaluations (default: no limit)",
    )
    g.add_argument("--name", default=None, help="this evaluator's name in the server's status (default: eval@HOST)")
    g.add_argument("--json", action="store_true", help="print each evaluation as one JSON line")
    EVAL_MODEL.add_to(p)
    p.set_defaults(func=run)


def _check(args: argparse.Namespace) -> None:
    if args.every is not None and not args.every > 0:
        raise ConfigError(f"--every {args.every:g} is invalid: give seconds > 0 between evaluations, e.g. --every 30")
    if args.max_evals is not None and args.max_evals < 1:
        raise ConfigError(f"--max-evals {args.max_evals} is invalid: give 1 or more")
    if args.max_evals is not None and args.every is None:
        raise ConfigError("--max-evals needs --every S (without it, eval evaluates once)")


def run(args: argparse.Namespace) -> int:
    from asyncdiloco.tools.evaluator import Evaluation, Evaluator, evaluate_every
    from asyncdiloco.worker.client import ParameterServerClient

    _check(args)
    cfg = EVAL.build(EVAL.given(args))
    job = EVAL_MODEL.build(EVAL_MODEL.given(args))

    def show(e: Evaluation) -> None:
        if args.json:
            line = {"version": e.version, "loss_nats_per_char": e.loss, "num_tokens": e.num_tokens}
            print(json.dumps({**line, "reported": e.reported}), flush=True)
        else:
            print(f"version {e.version}: held-out loss {e.loss:.4f} nats/char", flush=True)

    with ParameterServerClient(cfg.server, security=cfg.security) as client:
        evaluator = Evaluator(client, job, name=args.name or f"eval@{os.uname().nodename}")
        if args.every is None:
            try:
                show(evaluator.evaluate_global())
            except ServerUnavailableError as exc:
                line = unreachable_message(cfg.server, exc, tls=getattr(cfg.security, "tls_ca", None) is not None)
                raise ServerUnavailableError(line) from None
            return 0
        try:
            evaluate_every(evaluator, args.every, show, max_evals=args.max_evals, wait=threading.Event().wait)
        except KeyboardInterrupt:
            pass
    return 0
