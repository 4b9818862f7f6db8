"""One seeded draw over a vocabulary row: the old sequential ``torch.multinomial`` with the request's
generator against the position-keyed draw (layers/seeded_draw.py: splitmix64 uniform + inverse CDF).
Interleaved rounds in one process, 1 thread, CPU clock (thread_time), medians; prints the ratio.

    python benchmarks/bench_seeded_draw.py [--vocab 49152] [--rounds 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ratchetlm.layers.seeded_draw import inverse_cdf, position_uniform


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--draws", type=int, default=200)
    a = ap.parse_args()
    torch.set_num_threads(1)
    p = torch.softmax(torch.randn(1, a.vocab, generator=torch.Generator().manual_seed(0)) * 3, -1)  # [1, V]
    gen = torch.Generator().manual_seed(0)
    index = [0]

    def sequential() -> int:
        return int(torch.multinomial(p, 1, generator=gen)[0])

    def keyed() -> int:
        index[0] += 1
        return inverse_cdf(p[0], position_uniform(7, index[0]))

    times: dict[str, list[float]] = {"multinomial": [], "position-keyed": []}
    for _ in range(a.rounds):
        for name, f in (("multinomial", sequential), ("position-keyed", keyed)):
            t = time.thread_time()
            for _ in range(a.draws):
                f()
            times[name].append((time.thread_time() - t) / a.draws * 1e6)
    old, new = (statistics.median(times[k]) for k in ("multinomial", "position-keyed"))
    print(f"vocab {a.vocab}: multinomial {old:.1f} us/draw, position-keyed {new:.1f} us/draw, ratio {new / old:.2f}")


if __name__ == "__main__":
    main()
