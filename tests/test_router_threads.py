"""Several Python threads routing, finishing and mutating the index of one native Router."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from conftest import load_impl
from kvroute.config import RouterConfig

NATIVE = load_impl("native")
ROUNDS = 8000


@pytest.mark.usefixtures("gil_released")
def test_threads_route_finish_and_mutate_index():
    names = [f"r{i}" for i in range(8)]
    router = NATIVE.Router(RouterConfig(policy="ttft", block_size=16, index_capacity=2000), names)
    rng = np.random.default_rng(7)
    shared = rng.integers(0, 50_000, 512).astype(np.int32)
    prompts = [np.concatenate([shared[: 64 * (i % 8)], rng.integers(0, 50_000, 256).astype(np.int32)]) for i in range(64)]
    errors: list[BaseException] = []
    stop = threading.Event()

    def worker(k: int) -> None:
        try:
            pending = []
            for i in range(ROUNDS):
                d = router.route(prompts[(i * 7 + k) % len(prompts)], session=f"t{k}-{i % 5}")
                pending.append(d.handle)
                if i % 3 == 0:
                    router.prefill_done(d.handle)  # some finish before their first token
                if len(pending) > 4:
                    router.finish(pending.pop(0))
            for h in pending:
                router.finish(h)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    def mutator() -> None:
        try:
            index = router.index
            i = 0
            while not stop.is_set():
                r = i % len(names)
                hashes = NATIVE.block_hashes(prompts[i % len(prompts)], 16)
                index.insert(r, hashes[: 1 + i % len(hashes)])
                index.remove(r, hashes[i % len(hashes) :])
                if i % 50 == 0:
                    index.clear_replica((r + 1) % len(names))
                i += 1
                if i % 8 == 0:
                    # Hand the GIL over: a Python loop that never waits starves the routing threads,
                    # each of which needs the GIL back after every native call (a convoy: 250 s).
                    time.sleep(0)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    mut = threading.Thread(target=mutator)
    mut.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    mut.join()
    assert not errors, errors
    stats = router.stats()
    assert stats["routed"] == 4 * ROUNDS and stats["in_flight"] == 0
    for name in names:
        load = router.load(name)
        assert (load["in_flight"], load["queued_prefill_tokens"], load["prefill_blocks"], load["decode_blocks"]) == (0, 0, 0, 0)
    router.index.check_invariants()
