"""Precise mode as a state machine: three simulated engines with engine blocks of 1 (SGLang
pages), 16 and 32 tokens, in the engines' encodings, serving prompts with LoRA adapters and
cache salts, storing duplicate copies, sending vLLM 0.33 reuse reports, evicting and clearing,
with one or two KV-cache groups. Their batches go through EventApplier on both
implementations; after every step, for every prompt served so far, each replica's match must
never exceed what that engine would reuse, and must equal what it would reuse counting only
blocks whose last event was a store (the duplicate rule: a second physical copy of a hash is
forgotten at the first removal). The subscriber's restarts, drops and replays are covered in
tests/test_events_zmq.py."""

from __future__ import annotations

from typing import Any

import msgspec
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from conftest import load_impl
from kv_keys import VLLM, removed, stored

import kvroute.reference as R

BS = 16
BASES = [[100 * (b + 1) + i for i in range(96)] for b in range(3)]
ENC = msgspec.msgpack.Encoder().encode


class SimEngine:
    """A prefix cache of engine blocks of `ebs` tokens per KV-cache group. Engine hashes are
    opaque ids of (LoRA, salt, token prefix), equal across groups as vLLM publishes them."""

    def __init__(self, fmt: str, ebs: int, groups: int) -> None:
        self.fmt, self.ebs, self.groups = fmt, ebs, groups
        self.count: list[dict[int, int]] = [{} for _ in range(groups)]  # physical copies
        self.announced: list[set[int]] = [set() for _ in range(groups)]  # last event a store
        self.prefix: dict[int, tuple[Any, Any, tuple[int, ...]]] = {}

    def _hash(self, lora: Any, salt: Any, tokens: list[int]) -> int:
        key = (lora, salt, tuple(tokens))
        h = R.xxh3_64(repr(key).encode(), 11)
        self.prefix[h] = key
        return h

    def _hashes(self, lora: Any, salt: Any, tokens: list[int]) -> list[int]:
        return [self._hash(lora, salt, tokens[: (i + 1) * self.ebs]) for i in range(len(tokens) // self.ebs)]

    def _group(self, g: int) -> int | None:
        return g if self.fmt in VLLM and self.groups > 1 else None

    def serve(self, lora: Any, salt: Any, tokens: list[int], dup: bool, report: bool) -> list[Any]:
        """Stores the prompt's blocks after its cached prefix (from block 0 with dup: a second
        physical copy); report re-announces the hit blocks as vLLM 0.33 does."""
        hs = self._hashes(lora, salt, tokens)
        events: list[Any] = []
        for g in range(self.groups):
            hit = 0
            while not dup and hit < len(hs) and self.count[g].get(hs[hit], 0) > 0:
                hit += 1
            keys = dict(lora=lora, salt=salt, group=self._group(g))
            if report and hit:
                events.append(stored(self.fmt, hs[:hit], None, tokens[: hit * self.ebs], self.ebs, **keys))
                self.announced[g].update(hs[:hit])
            if hit == len(hs):
                continue
            for h in hs[hit:]:
                self.count[g][h] = self.count[g].get(h, 0) + 1
                self.announced[g].add(h)
            events.append(stored(self.fmt, hs[hit:], hs[hit - 1] if hit else None,
                                 tokens[hit * self.ebs : len(hs) * self.ebs], self.ebs, **keys))
        return events

    def evictable(self, g: int) -> list[int]:
        """Held blocks; with pages smaller than a router block, only leaves (SGLang's radix
        cache evicts leaves first)."""
        held = sorted(h for h, c in self.count[g].items() if c > 0)
        if self.ebs >= BS:
            return held
        parents = {self._parent(h) for h in held}
        return [h for h in held if h not in parents]

    def _parent(self, h: int) -> int | None:
        lora, salt, toks = self.prefix[h]
        return self._hash(lora, salt, list(toks[: -self.ebs])) if len(toks) > self.ebs else None

    def evict(self, g: int, h: int) -> list[Any]:
        self.count[g][h] -= 1
        self.announced[g].discard(h)
        return [removed(self.fmt, [h], group=self._group(g))]

    def clear(self) -> list[Any]:
        for g in range(self.groups):
            self.count[g].clear()
            self.announced[g].clear()
        return [["AllBlocksCleared"]]

    def reuse(self, lora: Any, salt: Any, tokens: list[int], claimed: bool) -> int:
        """Router blocks the engine reuses for the prompt: the longest prefix of whole engine
        blocks every group holds (claimed: counting blocks whose last event was a store)."""
        hs = self._hashes(lora, salt, tokens)
        best = len(hs)
        for g in range(self.groups):
            held = self.announced[g] if claimed else {h for h, c in self.count[g].items() if c > 0}
            i = 0
            while i < len(hs) and hs[i] in held:
                i += 1
            best = min(best, i)
        return best * self.ebs // BS


SIZES = (1, 16, 32)
request = st.tuples(st.sampled_from([None, "adapter-a"]), st.sampled_from([None, "tenant"]),
                    st.integers(0, 2), st.integers(0, 6), st.lists(st.integers(0, 3), max_size=24))


class EngineTraffic(RuleBasedStateMachine):
    """Rules that drive three SimEngines (serve, evict, clear) and remember the last probes.
    A subclass's @initialize sets engines, probes and ts, and _deliver(r, payload) takes each
    encoded batch (tests/test_snapshot_precise.py drives restarted routers with the same rules)."""

    def _deliver(self, r: int, payload: bytes) -> None:
        raise NotImplementedError

    def _send(self, r: int, events: list[Any]) -> None:
        if not events:
            return
        self.ts += 1.0
        self._deliver(r, ENC([self.ts, events, 0]))

    @rule(r=st.integers(0, 2), req=request, dup=st.booleans(), report=st.booleans())
    def serve(self, r, req, dup, report):
        lora, salt, base, keep, tail = req
        if self.engines[r].fmt == "sglang":
            lora = None  # SGLang 0.5.18 publishes no LoRA name
        tokens = BASES[base][: keep * BS] + tail
        probe = (lora, salt, tokens)
        if probe not in self.probes:
            self.probes = (self.probes + [probe])[-10:]
        self._send(r, self.engines[r].serve(lora, salt, tokens, dup, report))

    @rule(r=st.integers(0, 2), g=st.integers(0, 1), pick=st.integers(0, 10**6), n=st.integers(1, 6))
    def evict(self, r, g, pick, n):
        eng = self.engines[r]
        g %= eng.groups
        events: list[Any] = []
        for _ in range(n):
            cands = eng.evictable(g)
            if not cands:
                break
            events += eng.evict(g, cands[pick % len(cands)])
        self._send(r, events)

    @rule(r=st.integers(0, 2))
    def clear(self, r):
        self._send(r, self.engines[r].clear())


class PreciseEngines(EngineTraffic):
    @initialize(fmts=st.tuples(st.sampled_from(["sglang", "sglang-map"]),
                               st.sampled_from(["vllm-array", "vllm-map", "sglang-map"]),
                               st.sampled_from(["vllm-array", "vllm-map"])),
                groups=st.tuples(st.just(1), st.integers(1, 2), st.integers(1, 2)))
    def setup(self, fmts, groups):
        self.engines = [SimEngine(f, s, g if f in VLLM else 1) for f, s, g in zip(fmts, SIZES, groups)]
        self.impls = []
        for name in ("native", "reference"):
            M = load_impl(name)
            idx = M.PrefixIndex(3)
            self.impls.append((idx, M.EventApplier(idx, BS)))
        self.probes: list[tuple[Any, Any, list[int]]] = []
        self.ts = 0.0

    def _deliver(self, r: int, payload: bytes) -> None:
        assert [a.apply(r, payload) for _, a in self.impls] == [True, True]

    @invariant()
    def never_above_the_engine_and_exact_under_the_rule(self):
        if not hasattr(self, "engines"):
            return
        ref = load_impl("reference")
        for lora, salt, tokens in self.probes:
            hashes = ref.block_hashes(tokens, BS, lora=lora, cache_salt=salt)
            got = [idx.match(hashes).tolist() for idx, _ in self.impls]
            assert got[0] == got[1]
            for r, eng in enumerate(self.engines):
                want = eng.reuse(lora, salt, tokens, claimed=True)
                assert want <= eng.reuse(lora, salt, tokens, claimed=False)
                assert got[0][r] == want, (r, eng.fmt, eng.ebs, lora, salt, len(tokens))
        (_, na), (_, ra) = self.impls
        assert na.stats() == ra.stats()
        for r in range(3):
            assert na.replica_stats(r) == ra.replica_stats(r)


TestPreciseEngines = PreciseEngines.TestCase
# Three engines, both implementations and every probe per step: an eighth of the profile keeps
# this file near 10 s under `ci` (thorough scales it 20x).
TestPreciseEngines.settings = settings(settings.default, max_examples=max(6, settings.default.max_examples // 8),
                                       stateful_step_count=min(30, settings.default.stateful_step_count))
