"""Wire codec cost (docs/performance.md, "Codecs"): per (codec, model size) one JSON line
with ``ratio`` = seconds of a plain ``copy_`` of the fp32 bytes ÷ (encode + decode
seconds), ``encode_gb_s`` / ``decode_gb_s`` (fp32 GB/s), ``wire_ratio`` (encoded ÷ fp32
bytes) and ``breakeven_link_gb_s`` (the link speed below which a codec saves time).
Single-threaded torch, preallocated buffers, medians of repeats.

    python -m asyncdiloco.bench.perf.bench_codec [--sizes 4,64,256] [--repeats 5] [--out FILE]
"""

from __future__ import annotations

import argparse

import torch

from asyncdiloco.bench.perf.harness import emit, median_seconds, parse_sizes
from asyncdiloco.wire.codec import make_codec
from asyncdiloco.wire.tensors import Manifest


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="4,64,256", help="fp32 model sizes in MiB (default 4,64,256)")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats per measurement (default 5)")
    p.add_argument("--block-size", type=int, default=4096, help="int8 elements per block (default 4096)")
    p.add_argument("--out", default=None, help="also append the JSON lines to this file")
    args = p.parse_args()
    torch.set_num_threads(1)
    for nbytes in parse_sizes(args.sizes):
        n = nbytes // 4
        manifest = Manifest.from_named_tensors([("w", torch.empty(n))])
        x = torch.randn(n)  # (N,) fp32
        decoded = torch.empty(n)
        copy_s = median_seconds(lambda d=decoded, x=x: d.copy_(x), args.repeats)
        for name in ("bf16", "int8"):
            codec = make_codec(name, manifest, args.block_size)
            wire = torch.empty(codec.wire_bytes, dtype=torch.uint8)
            enc_s = median_seconds(lambda c=codec, x=x, w=wire: c.encode(x, w), args.repeats)
            dec_s = median_seconds(lambda c=codec, w=wire, d=decoded: c.decode(w, d), args.repeats)
            emit(
                {
                    "measure": "codec encode+decode throughput / copy_ throughput",
                    "codec": name,
                    "block_size": args.block_size if name == "int8" else 0,
                    "model_mib": nbytes / 2**20,
                    "ratio": copy_s / (enc_s + dec_s),
                    "encode_gb_s": nbytes / enc_s / 1e9,
                    "decode_gb_s": nbytes / dec_s / 1e9,
                    "copy_gb_s": nbytes / copy_s / 1e9,
                    "wire_ratio": codec.wire_bytes / nbytes,
                    "max_abs_error": float((decoded - x).abs().max()),
                    # the codec saves time on links slower than this: bytes saved ÷ (encode + decode) seconds
                    "breakeven_link_gb_s": (nbytes - codec.wire_bytes) / (enc_s + dec_s) / 1e9,
                },
                args.out,
            )


if __name__ == "__main__":
    main()
