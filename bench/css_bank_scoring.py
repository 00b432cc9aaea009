"""CSS-LM retrieval-bank scoring throughput: query × bank-row scores per second at 40k and 1M rows.

    python bench/css_bank_scoring.py [--queries 16] [--dim 384] [--rows 40000 1000000] [--repeats 3]

Each step of CSS-LM's stage C scores every labelled query of the batch against the whole bank with
the frozen pair scorers C (class view u) and D (domain view v), then keeps the top K. Measured here,
in one run on the same random bank (float32, CPU, all threads):

- clsys: ``clsys.recipes.css_lm.bank.top_k``, the Linear on [query; row] split into one matmul per side
  and a broadcast sum, the bank scanned in chunks of 65,536 rows with a running top-k;
- pair concat: what a direct implementation does (and the original's per-pair linear layer amounts
  to): form every [u_q; u_d] and [v_q; v_d] pair, apply the Linear, take top-k. It needs
  B × N × 2d floats at once, so it is measured on the 40k bank in chunks of 4,096 rows.

Prints a table, then ``ratio <name> <value>`` lines. Not part of the test suite.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from clsys.recipes.css_lm.bank import RetrievalBank, top_k  # noqa: E402

K = 16


def best_of(repeats: int, fn) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


@torch.no_grad()
def pair_concat_top_k(qu, qv, bank_u, bank_v, c: nn.Linear, d: nn.Linear, k: int, chunk: int = 4096):
    """Every pair's features materialised, then the Linear: the direct way."""
    best_scores, best_index = None, None
    for start in range(0, len(bank_u), chunk):
        bu, bv = bank_u[start:start + chunk], bank_v[start:start + chunk]
        pairs_u = torch.cat([qu[:, None, :].expand(-1, len(bu), -1), bu[None].expand(len(qu), -1, -1)], -1)
        pairs_v = torch.cat([qv[:, None, :].expand(-1, len(bv), -1), bv[None].expand(len(qv), -1, -1)], -1)
        scores = -F.log_softmax(c(pairs_u), -1)[..., 0] - 0.5 * F.log_softmax(d(pairs_v), -1)[..., 0]
        index = torch.arange(start, start + len(bu)).expand(len(qu), -1)
        if best_scores is not None:
            scores, index = torch.cat([best_scores, scores], 1), torch.cat([best_index, index], 1)
        best_scores, order = scores.topk(k, dim=1)
        best_index = index.gather(1, order)
    return best_scores, best_index


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queries", type=int, default=16)
    parser.add_argument("--dim", type=int, default=384, help="all-MiniLM-L6-v2's hidden size")
    parser.add_argument("--rows", type=int, nargs="+", default=[40_000, 1_000_000])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    torch.manual_seed(0)
    c, d = nn.Linear(2 * args.dim, 2), nn.Linear(2 * args.dim, 2)
    qu, qv = torch.randn(args.queries, args.dim), torch.randn(args.queries, args.dim)
    print(f"{args.queries} queries, d={args.dim}, top-{K}, float32, {torch.get_num_threads()} threads")
    print(f"{'method':<12} {'rows':>10} {'seconds':>9} {'pairs/s':>14}")
    rates = {}
    for rows in args.rows:
        bank = RetrievalBank(u=torch.randn(rows, args.dim), v=torch.randn(rows, args.dim), texts=[""] * rows)
        seconds = best_of(args.repeats, lambda: top_k(qu, qv, bank, c, d, K))
        rates[("clsys", rows)] = args.queries * rows / seconds
        print(f"{'clsys':<12} {rows:>10,} {seconds:>9.3f} {rates[('clsys', rows)]:>14,.0f}")
        if rows <= 40_000:
            ours = top_k(qu, qv, bank, c, d, K)[1]
            seconds = best_of(args.repeats, lambda: pair_concat_top_k(qu, qv, bank.u, bank.v, c, d, K))
            rates[("concat", rows)] = args.queries * rows / seconds
            print(f"{'pair concat':<12} {rows:>10,} {seconds:>9.3f} {rates[('concat', rows)]:>14,.0f}")
            theirs = pair_concat_top_k(qu, qv, bank.u, bank.v, c, d, K)[1]
            agree = (ours == theirs).float().mean().item()
            print(f"{'':<12} top-{K} agreement with pair concat: {agree:.4f}")
    for rows in args.rows:
        if ("concat", rows) in rates:
            print(f"ratio bank_scoring_vs_pair_concat_{rows} {rates[('clsys', rows)] / rates[('concat', rows)]:.1f}")
    if len(args.rows) > 1:
        small, large = min(args.rows), max(args.rows)
        print(f"ratio pairs_per_s_{large}_vs_{small} {rates[('clsys', large)] / rates[('clsys', small)]:.2f}")


if __name__ == "__main__":
    main()
