"""Per-request cache keys (issue 10 section 3, contract C1): route() hashes a prompt with the
request's LoRA adapter, cache_salt and multimodal items exactly as block_hashes does, so a
request is never predicted cached on a replica that holds the same tokens under other keys."""

from __future__ import annotations

import numpy as np
import pytest

from common import same
from kvroute.config import RouterConfig

BS = 16
PROMPT = np.random.default_rng(7).integers(0, 50_000, 512).astype(np.int32)  # 32 blocks
IMAGE = [("sha256:image-1", 64, 48)]
KEYS = {
    "base": {},
    "lora-a": {"lora": "adapter-a"},
    "lora-b": {"lora": "adapter-b"},
    "salt-1": {"cache_salt": "tenant-1"},
    "salt-2": {"cache_salt": "tenant-2"},
    "image": {"mm": IMAGE},
    "lora-a+salt-1+image": {"lora": "adapter-a", "cache_salt": "tenant-1", "mm": IMAGE},
}


@pytest.mark.parametrize("keys", list(KEYS.values()), ids=list(KEYS))
def test_route_hashes_as_block_hashes_does(impl, keys):
    r = impl.Router(RouterConfig(policy="round_robin", block_size=BS, salt="fleet"), ["a"])
    r.route(PROMPT, **keys)  # approximate: the prompt's blocks go into the index under a
    expected = impl.block_hashes(PROMPT, BS, salt="fleet", **keys)
    assert sorted(r.index.held(0).tolist()) == sorted(expected.tolist())


def test_a_mixed_fleet_predicts_cache_only_under_the_same_keys(impl):
    names = list(KEYS)
    r = impl.Router(RouterConfig(policy="ttft", block_size=BS, mode="precise"), names)
    for rid, name in enumerate(names):  # every replica holds the prompt, each under its own keys
        r.index.insert(rid, impl.block_hashes(PROMPT, BS, **KEYS[name]))
    for name, keys in KEYS.items():
        d = r.route(PROMPT, **keys)
        r.finish(d.handle)
        assert (d.replica, d.matched_blocks, d.reason) == (name, 32, "affinity")
        expected = {n: 0 for n in names}
        expected[name] = 32
        if name in ("base", "image"):  # the image starts in block 4: blocks 0-3 are the same
            expected["image" if name == "base" else "base"] = 4
        assert r.index.match(impl.block_hashes(PROMPT, BS, **keys)).tolist() == list(expected.values())


def test_keys_change_the_chain_from_the_first_block_except_mm(impl):
    r = impl.Router(RouterConfig(policy="ttft", block_size=BS, mode="approximate"), ["a", "b"])
    first = r.route(PROMPT, lora="adapter-a")
    r.finish(first.handle)
    for keys in ({"lora": "adapter-b"}, {}, {"cache_salt": "adapter-a"}):
        d = r.route(PROMPT, **keys)
        r.finish(d.handle)
        assert d.matched_blocks == 0, keys
    d = r.route(PROMPT, lora="adapter-a")
    assert (d.replica, d.matched_blocks) == (first.replica, 32)


@pytest.mark.parametrize(
    "keys, exc, msg",
    [
        ({"lora": 5}, TypeError, "lora must be a str or None, got int"),
        ({"cache_salt": b"x"}, TypeError, "cache_salt must be a str or None, got bytes"),
        ({"mm": "img"}, TypeError, "mm must be a list or tuple"),
        ({"mm": [("img", -1, 4)]}, ValueError, "mm[0] offset must be in [0, 2**63), got -1"),
        ({"mm": [("img", 0, 0)]}, ValueError, "mm[0] length must be in [1, 2**63), got 0"),
    ],
)
def test_bad_keys_are_the_hashing_errors_and_change_nothing(impl, keys, exc, msg):
    r = impl.Router(RouterConfig(block_size=BS), ["a"])
    before = (r.stats(), r.load("a"), r.index.num_blocks)
    with pytest.raises(exc) as info:
        r.route(PROMPT, **keys)
    assert msg in str(info.value)
    with pytest.raises(exc):
        impl.block_hashes(PROMPT, BS, **keys)
    assert (r.stats(), r.load("a"), r.index.num_blocks) == before


def test_keyed_routes_decide_identically_in_both():
    def run(m):
        r = m.Router(RouterConfig(policy="dynamo", block_size=BS, params={"min_match_tokens": 0}), ["a", "b", "c"])
        out = []
        for i in range(30):
            keys = list(KEYS.values())[i % len(KEYS)]
            d = r.route(PROMPT[: 64 + 16 * (i % 5)], **keys)
            out.append((d.replica, d.matched_blocks))
        return out

    assert same(run)[0] == "ok"


# -- the event applier's hashes for the same requests --------------------------------------

ENGINE_PROMPT = list(range(5000, 5128))  # 8 router blocks


def _batch(events):
    import msgspec

    return msgspec.msgpack.Encoder().encode([1.0, events, 0])


@pytest.mark.parametrize("fmt", ["vllm-array", "vllm-map", "sglang-map"])
def test_router_matches_what_the_event_applier_stored_under_the_same_keys(impl, fmt):
    from kv_keys import stored

    r = impl.Router(RouterConfig(policy="ttft", block_size=BS, mode="precise", salt="fleet",
                                 params={"min_match_tokens": 0}), ["plain", "lora", "salted"])
    applier = impl.EventApplier(r.index, BS, salt="fleet")
    lora = None if fmt.startswith("sglang") else "adapter-a"  # SGLang events carry no LoRA name
    applier.apply(0, _batch([stored(fmt, [1], None, ENGINE_PROMPT, 128)]))
    applier.apply(1, _batch([stored(fmt, [2], None, ENGINE_PROMPT, 128, lora=lora)]))
    applier.apply(2, _batch([stored(fmt, [3], None, ENGINE_PROMPT, 128, salt="tenant-1")]))
    holders = {"plain": 8, "lora": 0 if lora else 8, "salted": 0}  # who holds the unkeyed chain
    cases = [({}, holders), ({"cache_salt": "tenant-1"}, {"plain": 0, "lora": 0, "salted": 8})]
    if lora:
        cases.append(({"lora": lora}, {"plain": 0, "lora": 8, "salted": 0}))
    for keys, want in cases:
        d = r.route(ENGINE_PROMPT, **keys)
        r.finish(d.handle)
        assert want[d.replica] == d.matched_blocks == 8, keys
        hashes = impl.block_hashes(ENGINE_PROMPT, BS, salt="fleet", **keys).tolist()
        assert r.index.match(hashes).tolist() == list(want.values())
    # Learned from the events: engine blocks of 128 tokens are 8 router blocks.
    assert [r.engine_block(n) for n in ("plain", "lora", "salted")] == [8, 8, 8]
    d = r.route(ENGINE_PROMPT[:120], cache_salt="tenant-1")  # 7 router blocks: no whole engine block
    assert d.matched_blocks == 0
