"""The engine model (kvroute.sim.engine) against hand-computed vLLM V1 schedules, and a
state machine for its KV memory: pinned vs free blocks, ref counts, events vs cache."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvroute.sim.engine import Engine, EngineConfig, EngineRequest
from kvroute.sim.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, replay

# Round costs so step times are exact to compare: 10 ms + 1 ms/token + 0.1 ms/KV token.
COST = dict(step_fixed_s=0.01, per_token_s=0.001, per_kv_token_s=0.0001)


def cfg(**kw):
    base = dict(block_size=4, num_kv_blocks=64, max_num_batched_tokens=10, **COST)
    base.update(kw)
    return EngineConfig(**base)


def req(rid, prompt, max_tokens=1, **kw):
    return EngineRequest(rid, np.asarray(prompt, dtype=np.int64), max_tokens, **kw)


def distinct(n, base):
    return list(range(base, base + n))


def test_a_steps_batch_decodes_first_then_chunked_prefill():
    e = Engine(cfg())
    e.add_request(req("a", distinct(5, 0), 5), 0.0)
    e.add_request(req("b", distinct(5, 100), 5), 0.0)
    s1 = e.step(0.0)
    assert s1.scheduled == (("a", 5), ("b", 5))  # budget 10 shared FCFS
    assert [o.is_first_token for o in s1.outputs] == [True, True]
    assert s1.duration == pytest.approx(0.01 + 10 * 0.001)
    e.add_request(req("c", distinct(20, 200), 1), s1.end)
    s2 = e.step(s1.end)
    # Running decodes first (1 token each, reading 6 KV tokens each), then c's chunk of 8.
    assert s2.scheduled == (("a", 1), ("b", 1), ("c", 8))
    assert s2.duration == pytest.approx(0.01 + 10 * 0.001 + 12 * 0.0001)
    assert [o.request_id for o in s2.outputs] == ["a", "b"]
    s3 = e.step(s2.end)
    assert s3.scheduled == (("a", 1), ("b", 1), ("c", 8))
    s4 = e.step(s3.end)
    assert s4.scheduled == (("a", 1), ("b", 1), ("c", 4))
    assert [(o.request_id, o.is_first_token, o.finished) for o in s4.outputs] == [
        ("a", False, False), ("b", False, False), ("c", True, True)]
    assert e.progress("a") == (8, 9, 4)


def test_long_prefill_threshold_chunks_across_steps():
    e = Engine(cfg(max_num_batched_tokens=100, long_prefill_token_threshold=6))
    e.add_request(req("a", distinct(14, 0)), 0.0)
    e.add_request(req("b", distinct(3, 50)), 0.0)
    assert e.step(0.0).scheduled == (("a", 6), ("b", 3))
    assert e.step(1.0).scheduled == (("a", 6),)
    last = e.step(2.0)
    assert last.scheduled == (("a", 2),)
    assert last.outputs[0].finished and last.outputs[0].is_first_token


def test_blocks_are_cached_chunk_by_chunk_with_chained_parents():
    e = Engine(cfg(max_num_batched_tokens=6))
    tokens = distinct(13, 0)
    e.add_request(req("a", tokens, 2), 0.0)
    from kvroute import block_hashes

    full = block_hashes(np.array(tokens + [1000, 1001]), 4).tolist()
    s1 = e.step(0.0)  # 6 tokens: block 0 full
    assert s1.events == [BlockStored((full[0],), None, tuple(tokens[:4]), 4)]
    s2 = e.step(1.0)  # 12 tokens: blocks 1 and 2
    assert s2.events == [BlockStored((full[1], full[2]), full[0], tuple(tokens[4:12]), 4)]
    s3 = e.step(2.0)  # token 13 (prompt done), samples the first output token
    assert s3.events == [] and s3.outputs[0].is_first_token
    s4 = e.step(3.0)  # the decode fills block 3 (12, 1000, 1001 sampled later...)
    assert s4.outputs[0].finished
    # Block 3 = tokens 12..15 = 12, 1000, 1001, ?: only 14 tokens computed, not full.
    assert s4.events == []
    assert e.cached_hashes() == {h: 1 for h in full[:3]}


def test_later_duplicate_hits_and_reports_cached_tokens():
    e = Engine(cfg(max_num_batched_tokens=100))
    e.add_request(req("a", distinct(10, 0)), 0.0)
    e.step(0.0)
    e.add_request(req("b", distinct(10, 0) + [77, 78]), 1.0)
    s = e.step(1.0)
    assert s.scheduled == (("b", 4),)  # 8 cached tokens (2 blocks), 4 computed
    assert s.outputs[0].cached_tokens == 8
    st_ = e.stats()
    assert (st_["prefix_queries"], st_["prefix_hits"]) == (22, 8)


def test_a_full_hit_recomputes_the_last_token():
    e = Engine(cfg(max_num_batched_tokens=100))
    e.add_request(req("a", distinct(8, 0)), 0.0)
    e.step(0.0)
    e.add_request(req("b", distinct(8, 0)), 1.0)
    s = e.step(1.0)
    # 8 tokens all cached, but at most num_tokens - 1 = 7 may hit: whole blocks -> 4.
    assert s.scheduled == (("b", 4),) and s.outputs[0].cached_tokens == 4


def test_duplicates_admitted_in_one_step_both_miss():
    e = Engine(cfg(max_num_batched_tokens=100))
    e.add_request(req("a", distinct(12, 0)), 0.0)
    e.add_request(req("b", distinct(12, 0)), 0.0)
    s = e.step(0.0)
    assert s.scheduled == (("a", 12), ("b", 12))
    assert [o.cached_tokens for o in s.outputs] == [0, 0]
    # Two copies of each block: stored twice, as vLLM (no de-duplication).
    assert set(e.cached_hashes().values()) == {2}


def test_cache_on_schedule_is_vllms_rule_the_second_twin_hits():
    e = Engine(cfg(max_num_batched_tokens=100, cache_on_schedule=True))
    e.add_request(req("a", distinct(12, 0)), 0.0)
    e.add_request(req("b", distinct(12, 0)), 0.0)
    s = e.step(0.0)
    assert s.scheduled == (("a", 12), ("b", 4))
    assert [o.cached_tokens for o in s.outputs] == [0, 8]


def test_eviction_is_lru_over_freed_blocks_tail_first():
    e = Engine(cfg(num_kv_blocks=6, max_num_batched_tokens=100))
    from kvroute import block_hashes

    ha = block_hashes(np.arange(8), 4).tolist()
    hb = block_hashes(np.arange(100, 108), 4).tolist()
    e.add_request(req("a", distinct(8, 0)), 0.0)
    e.step(0.0)  # a: blocks 0, 1 -> freed tail first: queue 2 3 4 5 1 0
    e.add_request(req("b", distinct(8, 100)), 1.0)
    e.step(1.0)  # b: blocks 2, 3 -> queue 4 5 1 0 3 2
    assert e.block_state()["free"] == [4, 5, 1, 0, 3, 2]
    e.add_request(req("c", distinct(15, 200)), 2.0)
    s = e.step(2.0)  # c needs 4 blocks: 4, 5, then a's tail, then a's head
    assert s.events[0] == BlockRemoved((ha[1], ha[0]))
    assert all(h in e.cached_hashes() for h in hb)
    e.add_request(req("d", distinct(8, 100) + [5]), 3.0)
    assert e.step(3.0).outputs[0].cached_tokens == 8  # b's blocks survived


def test_waiting_when_memory_is_full_then_admitted():
    e = Engine(cfg(num_kv_blocks=5, max_num_batched_tokens=100))
    e.add_request(req("a", distinct(12, 0), 4), 0.0)  # 3 blocks now, 4 at the end
    e.add_request(req("b", distinct(9, 100), 1), 0.0)  # 3 blocks
    s = e.step(0.0)
    assert s.scheduled == (("a", 12),)  # b needs 3 blocks, 2 are left: it waits
    assert e.request_ids() == (["a"], ["b"])
    t = s.end
    while "a" in e.request_ids()[0]:
        s = e.step(t)
        assert not s.preempted
        t = s.end
    s = e.step(t)
    assert s.scheduled == (("b", 9),)


def test_preemption_by_recompute_of_the_last_running_request():
    e = Engine(cfg(num_kv_blocks=4, max_num_batched_tokens=100))
    e.add_request(req("a", distinct(7, 0), 3), 0.0)
    e.add_request(req("b", distinct(7, 100), 3), 0.0)
    s1 = e.step(0.0)  # both prefill 7 tokens: 2 blocks each, memory full
    assert s1.scheduled == (("a", 7), ("b", 7))
    s2 = e.step(s1.end)  # both decode token 8 inside their second block
    assert s2.scheduled == (("a", 1), ("b", 1))
    s3 = e.step(s2.end)  # a needs a third block: b (the last) is preempted
    assert s3.preempted == ("b",) and s3.scheduled == (("a", 1),)
    assert e.request_ids() == ([], ["b"])  # a finished in this step
    assert e.progress("b") == (0, 9, 2)  # recompute prompt + its 2 tokens later
    assert s3.outputs[0].finished
    # b's blocks were freed tail first; a's new block evicted b's tail (block 1).
    assert len([ev for ev in s3.events if isinstance(ev, BlockRemoved)]) == 1
    s4 = e.step(s3.end)
    # b's head block kept its hash and hits: 4 cached, 5 recomputed (9 known tokens).
    assert s4.scheduled == (("b", 5),)
    assert [(o.request_id, o.finished) for o in s4.outputs] == [("b", True)]
    assert e.stats()["preemptions"] == 1


def test_run_decodes_equals_step_by_step():
    rng = np.random.default_rng(7)
    batched = 0
    for trial in range(60):
        c = cfg(num_kv_blocks=int(rng.integers(12, 40)), max_num_batched_tokens=int(rng.integers(8, 40)))
        reqs = [req(f"r{i}", rng.integers(0, 5, int(rng.integers(2, 20))).tolist(), int(rng.integers(1, 30)))
                for i in range(int(rng.integers(1, 6)))]
        logs = []
        for fast in (False, True):
            e = Engine(c)
            for r in reqs:
                e.add_request(EngineRequest(r.request_id, r.prompt, r.max_tokens), 0.0)
            t = 0.0
            log = []
            while e.has_work():
                res = e.run_decodes(t, t + 0.5) if fast else None
                batched += res is not None and res.steps > 1
                if res is None:
                    res = e.step(t)
                for o in res.outputs:
                    if o.is_first_token or o.finished:
                        log.append((o.request_id, o.is_first_token, o.finished, round(res.end, 9)))
                t = res.end
            logs.append((log, e.cached_hashes(), e.block_state()["free"], e.stats()["steps"]))
        slow, fast_ = logs
        assert slow[0] == fast_[0], trial
        assert slow[1] == fast_[1] and slow[3] == fast_[3]
    assert batched > 20  # the batched path really ran


def test_run_decodes_stops_before_until_and_at_a_finish():
    e = Engine(cfg())
    e.add_request(req("a", distinct(4, 0), 50), 0.0)
    e.add_request(req("b", distinct(4, 50), 5), 0.0)
    s = e.step(0.0)
    assert e.run_decodes(s.end, s.end) is None  # not even one step fits
    r = e.run_decodes(s.end, 100.0)
    assert r.steps == 4 and [o.finished for o in r.outputs] == [False, True]
    r2 = e.run_decodes(r.end, r.end + 0.05)
    one = 0.01 + 0.001 + 0.0001 * 9  # a alone with a 9-token context
    assert r2.steps == 4 and r2.duration <= 0.05 and r2.duration == pytest.approx(4 * one + 0.0001 * 6)


def test_errors_leave_the_engine_unchanged():
    e = Engine(cfg(num_kv_blocks=4))
    e.add_request(req("a", [1, 2, 3]), 0.0)
    with pytest.raises(ValueError, match="already in the engine"):
        e.add_request(req("a", [1, 2, 3]), 0.0)
    with pytest.raises(ValueError, match="num_kv_blocks"):
        e.add_request(req("big", distinct(16, 0), 1), 0.0)
    with pytest.raises(ValueError, match="max_tokens"):
        e.add_request(req("z", [1], 0), 0.0)
    with pytest.raises(TypeError, match="prompt"):
        e.add_request(EngineRequest("f", np.array([1.5]), 1), 0.0)
    with pytest.raises(KeyError, match="nope"):
        e.abort_request("nope", 0.0)
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(block_size=0)
    with pytest.raises(TypeError, match="per_token_s"):
        EngineConfig(per_token_s="x")
    assert e.request_ids() == ([], ["a"])


def test_hash_only_requests_and_reset():
    e = Engine(cfg(max_num_batched_tokens=100))
    e.add_request(EngineRequest("a", None, 1, block_hashes=np.array([11, 12, 13], dtype=np.uint64),
                                num_prompt_tokens=10), 0.0)
    s = e.step(0.0)
    assert s.events == [BlockStored((11, 12), None, (), 4)]
    assert e.reset_prefix_cache()
    assert e.take_events() == [AllBlocksCleared()] and e.cached_hashes() == {}


# -- state machine ----------------------------------------------------------------------------

PREFIXES = [list(range(b, b + 12)) for b in (0, 100, 200)]


class EngineMachine(RuleBasedStateMachine):
    """Random arrivals (sharing prefixes), steps, decode batches, aborts and resets."""

    def __init__(self) -> None:
        super().__init__()
        self.engine = Engine(cfg(num_kv_blocks=24, max_num_batched_tokens=16, long_prefill_token_threshold=0))
        self.events: list = []
        self.now = 0.0
        self.next_id = 0
        self.live: set[str] = set()

    @rule(prefix=st.integers(0, 2), cut=st.integers(1, 12), tail=st.lists(st.integers(0, 9), max_size=12),
          max_tokens=st.integers(1, 20))
    def add(self, prefix, cut, tail, max_tokens):
        rid = f"r{self.next_id}"
        self.next_id += 1
        self.engine.add_request(req(rid, PREFIXES[prefix][:cut] + tail, max_tokens), self.now)
        self.live.add(rid)

    @precondition(lambda self: self.engine.has_work())
    @rule()
    def step(self):
        res = self.engine.step(self.now)
        self._absorb(res)

    @precondition(lambda self: self.engine.decode_only())
    @rule(span=st.floats(0.0, 1.0))
    def decodes(self, span):
        res = self.engine.run_decodes(self.now, self.now + span)
        if res is not None:
            self._absorb(res)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.live)))
        self.engine.abort_request(rid, self.now)
        self.live.discard(rid)

    @rule()
    def reset(self):
        if self.engine.reset_prefix_cache():
            self.events += self.engine.take_events()

    def _absorb(self, res):
        assert res.duration > 0
        self.now = res.end
        self.events += res.events
        for o in res.outputs:
            if o.finished:
                self.live.discard(o.request_id)

    @invariant()
    def memory_is_consistent(self):
        s = self.engine.block_state()
        n = self.engine.config.num_kv_blocks
        free = s["free"]
        assert len(set(free)) == len(free)
        pinned = Counter(b for blocks in s["requests"].values() for b in blocks)
        # No block both free and pinned; every block is one or the other: memory <= configured.
        assert not set(free) & set(pinned)
        assert len(free) + len(pinned) == n
        for b in range(n):
            assert s["ref"][b] == pinned.get(b, 0)

    @invariant()
    def events_replay_to_the_cache(self):
        assert dict(replay(self.events)) == self.engine.cached_hashes()


TestEngineMachine = EngineMachine.TestCase
TestEngineMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
