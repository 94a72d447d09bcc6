"""Precise mode across restarts: three simulated engines (pages of 1 token, engine blocks of 16
and 32, one or two KV-cache groups, LoRA and salts, duplicates, evictions, clears; see
tests/test_events_precise_machine.py) feed two router+applier pairs per implementation. One
runs uninterrupted; the other is snapshotted and restored into a fresh Router and
EventApplier (of the same or the other implementation) at random points. After every step
the restarted pair must answer every probe like the uninterrupted one, hold the same index
contents and export byte-identical applier state: removals of blocks stored before a restart
resolve as if it never happened."""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, rule

from conftest import load_impl
from kv_keys import VLLM
from test_events_precise_machine import BS, SIZES, EngineTraffic, SimEngine

from kvroute import RouterConfig

NAMES = ["e0", "e1", "e2"]
IMPLS = ("native", "reference")


class RestartedEngines(EngineTraffic):
    @initialize(fmts=st.tuples(st.sampled_from(["sglang", "sglang-map"]),
                               st.sampled_from(["vllm-array", "vllm-map", "sglang-map"]),
                               st.sampled_from(["vllm-array", "vllm-map"])),
                groups=st.tuples(st.just(1), st.integers(1, 2), st.integers(1, 2)),
                capacity=st.sampled_from([None, 24]))
    def setup(self, fmts, groups, capacity):
        self.engines = [SimEngine(f, s, g if f in VLLM else 1) for f, s, g in zip(fmts, SIZES, groups)]
        self.cfg = RouterConfig(block_size=BS, mode="precise", index_capacity=capacity)
        self.plain = [self._pair(name) for name in IMPLS]
        self.restarted = [self._pair(name) for name in IMPLS]
        self.dir = tempfile.mkdtemp(prefix="kvroute-snap-")
        self.probes: list[tuple[Any, Any, list[int]]] = []
        self.ts = 0.0
        self.restarts = 0

    def teardown(self) -> None:
        shutil.rmtree(getattr(self, "dir", ""), ignore_errors=True)

    def _pair(self, name: str) -> tuple[Any, Any]:
        M = load_impl(name)
        router = M.Router(self.cfg, NAMES)
        return router, M.EventApplier(router.index, BS)

    def _deliver(self, r: int, payload: bytes) -> None:
        for _, applier in self.plain + self.restarted:
            assert applier.apply(r, payload)

    @rule(cross=st.booleans())
    def restart(self, cross):
        self.restarts += 1
        out = []
        for i, (router, applier) in enumerate(self.restarted):
            path = os.path.join(self.dir, f"{i}-{self.restarts}")
            cursors = {n: {"seq": self.restarts, "digest": j} for j, n in enumerate(NAMES)}
            router.snapshot(path, applier=applier, cursors=cursors)
            fresh = self._pair(IMPLS[1 - i] if cross else IMPLS[i])
            res = fresh[0].restore(path, applier=fresh[1])
            assert res["replicas"] == NAMES and res["cursors"] == cursors
            os.remove(path)
            out.append(fresh)
        self.restarted = out

    @invariant()
    def restarted_pairs_answer_like_uninterrupted_ones(self):
        if not hasattr(self, "engines"):
            return
        ref = load_impl("reference")
        pairs = self.plain + self.restarted
        for lora, salt, tokens in self.probes:
            hashes = ref.block_hashes(tokens, BS, lora=lora, cache_salt=salt)
            got = [router.index.match(hashes).tolist() for router, _ in pairs]
            assert all(g == got[0] for g in got), got
        for r in range(3):
            states = [applier.export_replica(r) for _, applier in pairs]
            assert all(s == states[0] for s in states)
            contents = [[a.tolist() for a in router.index.export_replica(r)[:3]] for router, _ in pairs]
            assert all(c == contents[0] for c in contents)
            assert len({router.engine_block(NAMES[r]) for router, _ in pairs}) == 1


TestRestartedEngines = RestartedEngines.TestCase
# Four router+applier pairs and every probe per step: an eighth of the profile keeps this file
# near 10 s under `ci` (thorough scales it 20x).
TestRestartedEngines.settings = settings(settings.default, max_examples=max(5, settings.default.max_examples // 8),
                                         stateful_step_count=min(30, settings.default.stateful_step_count))
