"""How much of the seed-to-seed spread of the suite's final loss is its held-out set's:
METHOD runs once per seed on the suite's profile, model and budget, and each final model
is evaluated on several held-out sets (random windows of 4,096 to 65,536 characters with
three generator seeds, and the whole validation split). One JSON line per seed and per
set. Measures, asserts nothing. docs/algorithms.md, "The benchmark suite" ("Held-out set").

    python -m asyncdiloco.bench.heldout_spread METHOD [--profile uneven] [--seeds 0,1,2] [--steps 4000]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

import torch

from asyncdiloco.bench import simulate as simulator
from asyncdiloco.bench.sim import METHODS
from asyncdiloco.bench.suite_config import SuiteConfig, sim_config
from asyncdiloco.job.dataset import CharCorpus, eval_batches, split_batches
from asyncdiloco.job.models import evaluate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("method", choices=sorted(METHODS))
    parser.add_argument("--profile", default="uneven")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=4000)
    args = parser.parse_args()
    cfg = SuiteConfig(profiles=(args.profile,), total_steps=args.steps)
    job, corpus = cfg.job, CharCorpus.default()
    sets = {
        f"random {n * job.tokens_per_step} chars, seed {s}": eval_batches(
            corpus, job.batch_size, job.context_len, n, seed=s
        )
        for n in (8, 32, 128)
        for s in (1234, 7, 8)
    }
    sets["whole validation split"] = split_batches(corpus, job.batch_size, job.context_len)
    split_len = len(sets["whole validation split"])
    finals: list[torch.Tensor] = []
    evaluate_as_sim = simulator.evaluate

    def keep_final(model, batches):  # the simulator scores the final model on the split last
        if len(batches) == split_len:
            finals.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
        return evaluate_as_sim(model, batches)

    simulator.evaluate = keep_final
    losses: dict[str, list[float]] = {name: [] for name in sets}
    for seed in (int(s) for s in args.seeds.split(",")):
        simulator.simulate(dataclasses.replace(sim_config(cfg, args.profile, args.method, seed), final_on_split=True))
        torch.set_num_threads(1)
        model = job.build(corpus)
        pos = 0
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(finals[-1][pos : pos + p.numel()].view_as(p))
                pos += p.numel()
        row = {name: evaluate(model, batches) for name, batches in sets.items()}
        for name, loss in row.items():
            losses[name].append(loss)
        print(json.dumps({"method": args.method, "profile": args.profile, "seed": seed, "losses": row}), flush=True)
    for name, xs in losses.items():
        mean, std = statistics.mean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0
        print(json.dumps({"set": name, "mean": mean, "std": std, "relative_std": std / mean}), flush=True)


if __name__ == "__main__":
    main()
