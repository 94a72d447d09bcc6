"""How much kvroute's duplicate rule under-claims (README, "Precise mode": a repeated store of
one (engine hash, medium, group) counts once, so when an engine holds two physical copies of a
hash and evicts one, kvroute forgets the block although the other copy is still cached).

Run: python benchmarks/measure_duplicate_underclaim.py [--steps N] [--seed S]

A simulated vLLM-like engine (tests/kv_wire.Engine: LRU of free physical blocks, no
de-duplication, so two requests of one step that share a new prefix store it twice) serves
steps of 1-4 requests drawn from a few shared prefixes; after every step every prompt served
so far is probed. Reported: the share of probe answers below the engine's true reuse, and the
router blocks missed as a share of the blocks the engine would reuse.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from kv_wire import Engine, batch  # noqa: E402

import kvroute.reference as R  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--capacity", type=int, default=48)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    bases = [[1000 * (b + 1) + i for i in range(256)] for b in range(6)]
    eng = Engine("vllm-map", args.capacity, 16, 16)
    idx = R.PrefixIndex(1)
    app = R.EventApplier(idx, 16)
    probes: list[list[int]] = []
    answers = under = claimed_blocks = true_blocks = 0
    for _ in range(args.steps):
        reqs = []
        for _ in range(rng.randint(1, 4)):
            b = rng.randrange(len(bases))
            tokens = bases[b][: 16 * rng.randint(2, 12)] + [rng.randrange(50) for _ in range(rng.randint(0, 40))]
            reqs.append(tokens)
            probes = (probes + [tokens])[-40:]
        app.apply(0, batch(eng.step(reqs)))
        for p in probes:
            got = int(idx.match(R.block_hashes(p, 16))[0])
            truth = eng.reuse(p)
            assert got <= truth
            answers += 1
            under += got < truth
            claimed_blocks += got
            true_blocks += truth
    s = app.stats()
    print(f"steps {args.steps}, capacity {args.capacity} blocks, seed {args.seed}")
    print(f"duplicate stores: {s['stored_blocks']} stored, {s['removed_blocks']} removed, "
          f"{s['unknown_removals']} removals of hashes already forgotten")
    print(f"probe answers below the engine's reuse: {under}/{answers} = {under / answers:.1%}")
    print(f"router blocks missed: {true_blocks - claimed_blocks}/{true_blocks} = "
          f"{(true_blocks - claimed_blocks) / max(1, true_blocks):.1%}")


if __name__ == "__main__":
    main()
