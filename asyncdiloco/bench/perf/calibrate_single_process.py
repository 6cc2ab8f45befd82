"""Calibrate the demo: single-process training speed and held-out loss of the default model.

Trains ``CharTransformer`` (default config) on the embedded Tiny Shakespeare in one
process, with no parameter server: the baseline that asynchronous DiLoCo runs are
compared against. Prints one JSON line per eval point:

    {"step": 100, "elapsed_s": 6.9, "steps_per_s": 14.5, "eval_loss": 2.49}

``elapsed_s`` is cumulative training wall time (evaluation excluded);
``steps_per_s`` is step / elapsed_s; ``eval_loss`` is in nats per character over a
fixed set of validation batches. Asserts nothing.

Run:

    python -m asyncdiloco.bench.perf.calibrate_single_process --threads 1
"""

import argparse
import json
import time

import torch

from asyncdiloco.job.dataset import BatchStream, CharCorpus, eval_batches
from asyncdiloco.job.models import CharTransformerConfig, build_model, evaluate, lm_loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--eval-at", default="0,100,200,400,800", help="comma-separated steps to evaluate at")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--context-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    parser.add_argument("--eval-batches", type=int, default=8, help="fixed validation batches per eval")
    parser.add_argument("--eval-batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    eval_at = sorted({int(s) for s in args.eval_at.split(",")})
    corpus = CharCorpus.default()
    config = CharTransformerConfig(vocab_size=corpus.vocab_size, context_len=args.context_len)
    model = build_model(config, seed=args.seed)
    batches = eval_batches(corpus, args.eval_batch_size, args.context_len, args.eval_batches)
    stream = BatchStream(corpus, args.batch_size, args.context_len, seed=args.seed, worker_index=0)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    print(json.dumps({"num_parameters": model.num_parameters(), **vars(args)}), flush=True)

    step, elapsed_s = 0, 0.0
    for target in eval_at:
        t0 = time.perf_counter()
        while step < target:
            x, y = next(stream)  # (B, T), (B, T)
            loss = lm_loss(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
        elapsed_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        eval_loss = evaluate(model, batches)
        record = {
            "step": step,
            "elapsed_s": round(elapsed_s, 3),
            "steps_per_s": round(step / elapsed_s, 2) if step > 0 else None,
            "eval_loss": round(eval_loss, 4),
            "eval_s": round(time.perf_counter() - t0, 3),
        }
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
