"""Regenerate the committed gRPC/protobuf stubs in ``asyncdiloco/wire/_proto/``.

Usage: ``python scripts/gen_proto.py [--out DIR]`` (needs the ``test`` extra, which pins
grpcio-tools so the output is reproducible). ``tests/test_proto_stubs.py`` runs this into
a temporary folder and fails when the committed stubs differ.

protoc names the generated modules after the proto's package path
(``asyncdiloco/v1/...``), which would clash with this library's own package, so the
stubs are written flat into ``asyncdiloco/wire/_proto/`` and the one cross-module import is
rewritten to point there.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROTO_ROOT = ROOT / "proto"
PROTO_FILE = "asyncdiloco/v1/parameter_server.proto"
STUBS = ("parameter_server_pb2.py", "parameter_server_pb2.pyi", "parameter_server_pb2_grpc.py")


def generate(out_dir: pathlib.Path) -> None:
    from grpc_tools import protoc

    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            str(PROTO_ROOT / PROTO_FILE),
        ]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed on {PROTO_FILE}")
        generated = pathlib.Path(tmp) / "asyncdiloco" / "v1"
        for name in STUBS:
            text = (generated / name).read_text()
            text = text.replace(
                "from asyncdiloco.v1 import parameter_server_pb2",
                "from asyncdiloco.wire._proto import parameter_server_pb2",
            )
            (out_dir / name).write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "asyncdiloco" / "wire" / "_proto")
    args = parser.parse_args()
    generate(args.out)
    print(f"wrote {', '.join(STUBS)} to {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
