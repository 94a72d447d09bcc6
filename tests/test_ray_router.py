"""KvrouteRequestRouter (kvroute inside Ray Serve).

Unit tests of the Ray-free core (ray_keys, ray_core) with fake Ray objects always run;
the RequestRouter subclass and the real local Ray cluster need `ray[serve]` (skipped
only when ray is not installed).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from kvroute.integrations.ray_core import RayRouterSettings, RayRoutingCore, rank_replicas, replica_name
from kvroute.integrations.ray_engine import SimEngineReplica
from kvroute.integrations.ray_keys import KeyExtractor


@dataclass(frozen=True)
class FakeReplicaID:
    unique_id: str


@dataclass
class FakeMeta:
    internal_request_id: str
    multiplexed_model_id: str = ""
    session_id: str = ""
    request_id: str = ""


@dataclass
class FakeRoutingContext:
    multiplexed_start_matching_time: float | None = None
    tried_fewest_multiplexed_models: bool = False
    tried_first_multiplexed_models: bool = False
    tried_same_node: bool = False
    tried_same_az: bool = False
    should_backoff: bool = False


@dataclass
class FakePending:
    args: list[Any]
    kwargs: dict[str, Any]
    metadata: FakeMeta
    routing_context: FakeRoutingContext = field(default_factory=FakeRoutingContext)


@dataclass
class FakeReplica:
    replica_id: FakeReplicaID
    node_id: str = "node"
    availability_zone: str | None = None
    multiplexed_model_ids: set[str] = field(default_factory=set)
    max_ongoing_requests: int = 100
    is_cross_language: bool = False

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return 0

    def push_proxy_handle(self, handle: Any) -> None:
        pass


IDS = [FakeReplicaID(f"rep{i}") for i in range(4)]


def words(seed: int, n: int) -> str:
    rng = np.random.default_rng(seed)
    return " ".join(f"w{v}" for v in rng.integers(0, 10**6, n))


def make_core(**kw: Any) -> RayRoutingCore:
    core = RayRoutingCore(RayRouterSettings(**kw))
    core.sync_replicas(IDS)
    return core


def test_unrelated_prompts_spread_and_shared_prefix_sticks() -> None:
    core = make_core()
    chosen = []
    for i in range(4):  # concurrency 1: each finishes before the next
        rid = core.decide(f"u{i}", [{"prompt": words(i, 300)}], {})
        chosen.append(rid)
        core.completed(rid, f"u{i}")
    assert sorted(chosen, key=str) == sorted(IDS, key=str)
    system = words(99, 400)
    first = core.decide("s0", [{"prompt": system + " question one"}], {})
    core.completed(first, "s0")
    for i in range(1, 4):
        rid = core.decide(f"s{i}", [{"prompt": system + f" question {i} more"}], {})
        assert rid == first
        core.completed(rid, f"s{i}")
    s = core.stats()
    assert s["router_cached_tokens"] > 3 * 1500  # ~2.4k bytes shared, 64-byte blocks
    assert s["in_flight"] == 0 and s["router_in_flight"] == 0 and s["tracked"] == 0


def test_retry_releases_the_previous_reservation() -> None:
    core = make_core()
    core.decide("a", [{"prompt": words(1, 200)}], {})
    assert core.router.stats()["in_flight"] == 1
    rid = core.decide("a", [{"prompt": words(1, 200)}], {})
    assert core.router.stats()["in_flight"] == 1
    assert core.stats()["retried"] == 1
    core.completed(rid, "a")
    assert core.router.stats()["in_flight"] == 0 and core.in_flight() == 0


def test_override_releases_and_is_counted() -> None:
    core = make_core()
    rid = core.decide("a", [{"prompt": words(1, 200)}], {})
    other = next(r for r in IDS if r != rid)
    core.routed("a", other)
    assert core.stats()["overridden"] == 1
    assert core.router.stats()["in_flight"] == 0
    assert core.router.load(replica_name(rid))["in_flight"] == 0
    core.completed(other, "a")  # the real replica's completion: nothing more to free
    assert core.stats()["completed"] == 1 and core.stats()["tracked"] == 0
    rid2 = core.decide("b", [{"prompt": words(2, 200)}], {})
    core.routed("b", rid2)  # Ray used kvroute's choice: nothing changes
    assert core.stats()["overridden"] == 1 and core.router.stats()["in_flight"] == 1


def test_late_completion_of_a_rejected_attempt_is_ignored() -> None:
    core = make_core()
    first = core.decide("a", [{"prompt": words(1, 200)}], {})
    core.completed(first, "a")  # rejected attempt's completion
    second = core.decide("a", [{"prompt": words(1, 200)}], {})
    stale = next(r for r in IDS if r != second)
    core.completed(stale, "a")
    assert core.stats()["stale_completions"] == 1 and core.router.stats()["in_flight"] == 1
    core.completed(second, "a")
    assert core.router.stats()["in_flight"] == 0


def test_replica_death_and_updates_follow_ray() -> None:
    core = make_core()
    rid = core.decide("a", [{"prompt": words(1, 200)}], {})
    core.replica_gone(rid)
    core.replica_gone(rid)  # idempotent
    assert replica_name(rid) not in core.router.replicas
    core.completed(rid, "a")  # its request ends after the death: no error, nothing leaks
    assert core.router.stats()["in_flight"] == 0
    for i in range(12):
        assert core.decide(f"b{i}", [{"prompt": words(10 + i, 100)}], {}) != rid
    new = FakeReplicaID("rep9")
    core.sync_replicas([r for r in IDS if r != rid] + [new])
    assert set(core.router.replicas) == {replica_name(r) for r in IDS if r != rid} | {"rep9"}
    core.sync_replicas([])
    assert core.router.replicas == [] and core.decide("c", [{"prompt": "x"}], {}) is None


def test_sessions_from_ray_metadata_or_a_request_field() -> None:
    core = make_core(session_key="user")
    for sess_kw, meta in (({"user": "alice"}, None), ({}, "bob")):
        seen = set()
        for i in range(6):
            req = {"prompt": words(100 + i, 120), **sess_kw}
            rid = core.decide(f"{meta}{i}", [req], {}, session_id=meta)
            seen.add(rid)
            core.completed(rid, f"{meta}{i}")
        assert len(seen) == 1
    assert core.router.stats()["sessions"] == 2


def test_multiplexed_model_ids_never_share_affinity() -> None:
    core = make_core(params={"min_match_tokens": 0})
    prompt = {"prompt": words(5, 300)}
    a = core.decide("a", [prompt], {}, model_id="lora-a")
    core.completed(a, "a")
    before = core.router.stats()["cached_tokens"]
    b = core.decide("b", [prompt], {}, model_id="lora-b")
    core.completed(b, "b")
    assert core.router.stats()["cached_tokens"] == before  # no match across adapters
    c = core.decide("c", [prompt], {}, model_id="lora-a")
    assert c == a and core.router.stats()["cached_tokens"] > before


def test_keys_tokens_text_and_none() -> None:
    ex = KeyExtractor(None)
    k = ex.key([{"prompt_token_ids": [1, 2, 3]}], {})
    assert k.kind == "tokens" and k.ids.tolist() == [1, 2, 3]
    k = ex.key([], {"prompt": "héllo"})
    assert k.kind == "text" and k.ids.tolist() == list("héllo".encode())
    msgs = [{"role": "user", "content": "hi"}]
    k = ex.key([type("Req", (), {"messages": msgs})()], {})
    assert k.kind == "text" and bytes(k.ids.astype(np.uint8)).decode().count("hi") == 1
    assert ex.key([object()], {}).kind == "none"
    tok = KeyExtractor("builtin")
    assert tok.key([{"prompt": "abc"}], {}).kind == "tokens"
    assert tok.key([{"messages": msgs}], {}).kind == "tokens"
    with pytest.raises(TypeError, match="prompt"):
        ex.key([{"prompt": 3.5}], {})
    with pytest.raises(TypeError, match="messages"):
        ex.key([{"messages": "hi"}], {})


def test_text_mode_blocks_are_bytes_and_token_mode_uses_block_size() -> None:
    assert RayRoutingCore(RayRouterSettings(text_block_bytes=32)).router.config.block_size == 32
    assert RayRoutingCore(RayRouterSettings(tokenizer="builtin", block_size=8)).router.config.block_size == 8


def test_bad_settings_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="text_block_bytes"):
        RayRoutingCore(RayRouterSettings(text_block_bytes=0))
    with pytest.raises(TypeError, match="max_requests"):
        RayRoutingCore(RayRouterSettings(max_requests=1.5))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="policy"):
        RayRoutingCore(RayRouterSettings(policy="nope"))
    with pytest.raises(TypeError):
        RayRouterSettings(bogus=1)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="tokenizer"):
        KeyExtractor(5)  # type: ignore[arg-type]


def test_reservation_table_is_bounded_and_ttl_pruned() -> None:
    now = [0.0]
    core = RayRoutingCore(RayRouterSettings(max_requests=3, request_ttl=10.0), clock=lambda: now[0])
    core.sync_replicas(IDS)
    for i in range(6):
        core.decide(f"r{i}", [{"prompt": words(i, 50)}], {})
        assert core.stats()["tracked"] <= 3
    assert core.stats()["dropped"] == 3 and core.router.stats()["in_flight"] == 3
    now[0] = 11.0
    core.decide("late", [{"prompt": "x" * 100}], {})
    assert core.stats()["tracked"] == 1 and core.stats()["dropped"] == 6


def test_queue_len_reports_waiting() -> None:
    core = make_core(policy="llmd")
    core.queue_len(IDS[2], 7)
    assert core.router.load("rep2")["waiting"] == 7
    core.queue_len(FakeReplicaID("unknown"), 3)  # a replica kvroute dropped: ignored


def test_rank_replicas() -> None:
    reps = [FakeReplica(r) for r in IDS]
    assert rank_replicas(reps, IDS[1], set()) == [[reps[1]], [reps[0], reps[2], reps[3]]]
    assert rank_replicas(reps, IDS[1], {IDS[3]}) == [[reps[1]], [reps[3]], [reps[0], reps[2]]]
    assert rank_replicas(reps, None, set()) == [reps]


def test_sim_engine_replica_hits_its_own_prefix() -> None:
    rep = SimEngineReplica(num_kv_blocks=512, time_scale=0.0)

    async def go() -> list[dict[str, Any]]:
        text = words(3, 200)
        a = await rep({"prompt": text, "max_tokens": 2})
        b = await rep({"prompt": text + " more", "max_tokens": 2})
        return [a, b]

    a, b = asyncio.run(go())
    assert a["cached_tokens"] == 0 and b["cached_tokens"] >= a["prompt_tokens"] - 16
    assert b["ttft"] >= 0 and rep.stats()["num_running"] == 0


# -- the RequestRouter subclass, with fake Ray objects -------------------------------------


def make_ray_router(**kwargs: Any) -> Any:
    pytest.importorskip("ray.serve")
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    from kvroute.integrations.ray import KvrouteRequestRouter

    router = KvrouteRequestRouter(
        deployment_id=DeploymentID(name="llm", app_name="app"),
        handle_source=DeploymentHandleSource.UNKNOWN,
        self_node_id="node",
        use_replica_queue_len_cache=True,
    )
    router.initialize_state(**kwargs)
    return router


def test_ray_router_lifecycle_with_fakes() -> None:
    async def go() -> None:
        router = make_ray_router(policy="ttft")
        reps = [FakeReplica(r) for r in IDS]
        router.update_replicas(reps)
        assert sorted(router.core.router.replicas) == [f"rep{i}" for i in range(4)]
        pr = FakePending([{"prompt": words(1, 300)}], {}, FakeMeta("req-1"))
        ranks = await router.choose_replicas(reps, pr)
        assert len(ranks) == 2 and len(ranks[0]) == 1 and len(ranks[1]) == 3
        chosen = ranks[0][0].replica_id
        router.on_new_queue_len_info(chosen, 1)
        router.on_request_routed(pr, chosen, None)
        assert router.core.router.stats()["in_flight"] == 1
        router.on_request_completed(chosen, "req-1")
        assert router.core.router.stats()["in_flight"] == 0
        router.on_replica_actor_died(chosen)
        assert replica_name(chosen) not in router.core.router.replicas
        assert chosen not in router.curr_replicas
        left = list(router.curr_replicas.values())
        ranks = await router.choose_replicas(left, FakePending([{"prompt": "x"}], {}, FakeMeta("req-2")))
        assert ranks[0][0].replica_id != chosen
        router.update_replicas(left[:1])
        assert router.core.router.replicas == [replica_name(left[0].replica_id)]

    asyncio.run(go())


def test_ray_router_multiplexed_candidates_rank_second() -> None:
    async def go() -> None:
        router = make_ray_router()
        reps = [FakeReplica(r, multiplexed_model_ids={"m1"} if i == 3 else set()) for i, r in enumerate(IDS)]
        router.update_replicas(reps)
        pr = FakePending([{"prompt": words(2, 100)}], {}, FakeMeta("x", multiplexed_model_id="m1"))
        ranks = await router.choose_replicas(reps, pr)
        flat = [r.replica_id for rank in ranks for r in rank]
        assert sorted(flat, key=str) == sorted(IDS, key=str)
        if ranks[0][0].replica_id != IDS[3]:
            assert ranks[1] == [reps[3]]

    asyncio.run(go())


# -- a real local Ray cluster -----------------------------------------------------------------


def test_real_ray_cluster() -> None:
    """tests/ray_cluster_check.py in its own interpreter: Ray's global state (and this
    suite's warnings-as-errors, which Ray's lazy imports trip over) stay out of pytest's
    process; the script starts and stops the local cluster itself."""
    pytest.importorskip("ray.serve")
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ray_cluster_check.py")
    proc = subprocess.run([sys.executable, script], capture_output=True, text=True)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_estimated_first_token_moves_a_request_from_prefill_to_decode() -> None:
    now = [0.0]
    core = RayRoutingCore(RayRouterSettings(prefill_rate=1000.0), clock=lambda: now[0])
    core.sync_replicas(IDS[:1])
    rid = core.decide("a", [{"prompt": "x" * 640}], {})  # 640 bytes at 1000/s: done at 0.64 s
    name = replica_name(rid)
    assert core.router.load(name)["queued_prefill_tokens"] == 640
    now[0] = 0.5
    core.decide("b", [{"prompt": "y" * 640}], {})  # queued behind a: done at 0.5 + 1.28 - 0.0
    assert core.router.load(name)["prefill_requests"] == 2
    now[0] = 0.7
    core.decide("c", [{"prompt": "z" * 64}], {})
    load = core.router.load(name)
    assert load["prefill_requests"] == 2 and load["decode_blocks"] == 10  # a is decoding now
    assert core.stats()["estimated_prefills"] == 1
    core.completed(rid, "a")
    now[0] = 10.0
    core.decide("d", [{"prompt": "w" * 64}], {})
    assert core.stats()["estimated_prefills"] == 3  # b and c; a's entry was stale
    for r in "bcd":
        core.completed(rid, r)
    assert core.router.stats()["in_flight"] == 0


def test_estimate_prefill_off_keeps_requests_prefilling() -> None:
    now = [0.0]
    core = RayRoutingCore(RayRouterSettings(estimate_prefill=False), clock=lambda: now[0])
    core.sync_replicas(IDS[:1])
    rid = core.decide("a", [{"prompt": "x" * 640}], {})
    now[0] = 100.0
    core.decide("b", [{"prompt": "y" * 64}], {})
    assert core.router.load(replica_name(rid))["prefill_requests"] == 2
    assert core.stats()["estimated_prefills"] == 0
