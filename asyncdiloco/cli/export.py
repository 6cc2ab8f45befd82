"""``asyncdiloco export``: the newest durable global model of a checkpoint folder as a
safetensors file (tools/export.py; docs/operations.md "Getting the model out").
"""

from __future__ import annotations

import argparse

from asyncdiloco.cli.bench import quiet_logs
from asyncdiloco.flags.settings import EXPORT


def add_parser(sub: argparse._SubParsersAction) -> None:
    from asyncdiloco.tools.export import EXPORT_DTYPES

    p = sub.add_parser(
        "export",
        help="write the global model of a checkpoint folder as a safetensors file",
        description="The newest durable global model of a server's --checkpoint-dir (its newest checkpoint plus "
        "the pushes logged after it) as a safetensors file, one tensor per parameter by its name.",
    )
    EXPORT.add_to(p)
    g = p.add_argument_group("the file")
    g.add_argument("--out", required=True, metavar="FILE", help="the safetensors file to write (replaced if there)")
    g.add_argument(
        "--dtype",
        choices=EXPORT_DTYPES,
        default="manifest",
        help="each parameter in its dtype in the manifest (what the workers train in), or all float32 "
        "(the server's master copy) (default %(default)s)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from asyncdiloco.tools.export import export_global_model

    durability = EXPORT.build(EXPORT.given(args)).durability
    with quiet_logs(("asyncdiloco.ps",), args.verbose):  # the restore's INFO lines only with -v
        done = export_global_model(durability.checkpoint_dir, args.out, dtype=args.dtype)
    print(
        f"asyncdiloco export: wrote {done.path}: version {done.version}, {len(done.manifest.tensors)} parameters "
        f"({done.manifest.numel} values, {done.num_bytes} bytes)",
        flush=True,
    )
    return 0
