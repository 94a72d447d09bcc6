// EventApplier (events.hpp): applying decoded batches. Twin of the "applying" half of
// python/kvroute/reference/events.py, whose module docstring is the contract; messages, counters
// and the order of every check match it.
#include <algorithm>
#include <deque>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>

#include "events_state.hpp"
#include "events_wire.hpp"
#include "kvroute/errors.hpp"
#include "kvroute/events.hpp"
#include "kvroute/hash.hpp"
#include "kvroute/support/hash_map.hpp"

namespace kvroute {
namespace {

using support::HashMap;
using namespace applier;

/// Chain state at the end of an entry (or at a root): where the next engine block continues.
struct ChainState {
    std::uint64_t pos = 0, seed = 0;
    std::vector<std::uint32_t> tail;
    std::vector<OwnedMm> tail_mm;

    void load(const Entry& e) {
        pos = e.end;
        seed = e.seed;
        tail.clear();
        tail_mm.clear();
        if (e.extra) {
            tail = e.extra->tail;
            tail_mm = e.extra->tail_mm;
        }
    }
};

/// A multimodal key of an event: engine block, identifier, offset relative to the block.
struct MmRel {
    std::uint32_t block;
    std::string_view id;
    std::int64_t rel;
};

/// lora / cache_salt / multimodal keys of one store, as the hash contract takes them.
struct EventKeys {
    std::string_view lora, salt;
    std::vector<MmRel> mm;
};

}  // namespace

struct EventApplier::Impl {
    std::shared_ptr<PrefixIndex> index;
    std::shared_ptr<PrefixIndex> tier;
    std::size_t block_size;
    std::string salt;
    std::uint64_t root;

    mutable std::mutex mu;
    std::vector<std::unique_ptr<ReplicaState>> replicas;
    EventApplierStats c;
    std::unordered_map<std::string, std::uint32_t> media{{"GPU", 0}};
    std::uint64_t seq = 0;
    // Scratch reused across calls, so a batch allocates nothing once warm.
    wire::Batch batch;
    EventKeys keys;
    ChainState cs;
    std::vector<std::uint64_t> chain, run, kvbuf, gone[2];
    std::vector<std::uint32_t> buf;
    std::vector<MmKey> items;
    std::vector<Entry*> span;

    // -- checks -----------------------------------------------------------------------------

    void check(std::int64_t r) const {
        const std::uint32_t n = index->num_replicas();
        if (r < 0 || r >= static_cast<std::int64_t>(n))
            throw IndexError("replica " + std::to_string(r) + " is out of range [0, " + std::to_string(n) + ")");
        if (!index->is_live(r)) throw IndexError("replica " + std::to_string(r) + " was removed");
    }

    /// check(), and for calls that change state, that the tier index did not retire r.
    void check_mutating(std::int64_t r) const {
        check(r);
        if (tier && r < static_cast<std::int64_t>(tier->num_replicas())) tier->check_replica(r);
    }

    ReplicaState& state(std::int64_t r) {
        const auto i = static_cast<std::size_t>(r);
        if (replicas.size() <= i) replicas.resize(i + 1);
        if (!replicas[i]) replicas[i] = std::make_unique<ReplicaState>();
        return *replicas[i];
    }

    static void grow(PrefixIndex& ix, std::int64_t r) {
        while (static_cast<std::int64_t>(ix.num_replicas()) <= r) ix.add_replica();
    }

    /// The id of a medium name (GPU is 0), registering it; -1 once kMaxMedia are known.
    std::int64_t medium_id(std::string_view s) {
        if (s == "GPU") return 0;
        auto it = media.find(std::string(s));
        if (it != media.end()) return it->second;
        if (media.size() >= kMaxMedia) return -1;
        const auto id = static_cast<std::uint32_t>(media.size());
        media.emplace(std::string(s), id);
        return id;
    }

    void skip(ReplicaState& st, SkipKind kind) {
        ++st.skipped[static_cast<std::size_t>(kind)];
        if (kind == SkipKind::UnknownParent) ++c.unknown_parents;
        else if (kind == SkipKind::UnknownRemoval) ++c.unknown_removals;
        else ++c.unsupported_events;
    }

    // -- keys -------------------------------------------------------------------------------

    /// Fills `keys` from a store; false when a key cannot be reproduced (see _event_keys).
    bool event_keys(const wire::Event& ev) {
        keys.lora = ev.lora_name;
        keys.salt = ev.cache_salt;
        keys.mm.clear();
        if (!ev.has_extra) return true;
        const wire::ExtraKey* k = batch.keys.data() + ev.k_begin;
        const wire::ExtraKey* end = k + ev.k_count;
        while (k < end) {
            const std::uint32_t j = k->block;
            bool lora_seen = false;
            std::size_t strs = 0;
            std::string_view first;
            for (; k < end && k->block == j; ++k) {
                if (j >= ev.h_count) continue;  // keys beyond the event's blocks are ignored
                if (k->kind == wire::KeyKind::Other) return false;
                if (k->kind == wire::KeyKind::Pair) {
                    keys.mm.push_back(MmRel{j, k->text, k->rel});
                } else if (!keys.lora.empty() && k->text == keys.lora && !lora_seen) {
                    lora_seen = true;
                } else if (strs++ == 0) {
                    first = k->text;
                }
            }
            if (strs == 0) continue;
            // vLLM puts the cache_salt on the prompt's first block only.
            if (j == 0 && !ev.has_parent && strs == 1 && (keys.salt.empty() || keys.salt == first)) keys.salt = first;
            else return false;
        }
        return true;
    }

    // -- groups and block sizes -------------------------------------------------------------

    GroupState& group(std::int64_t r, ReplicaState& st, std::uint64_t gid) {
        if (!((st.group_mask >> gid) & 1)) {
            // A replica's index holds the blocks every group holds; a new group holds none.
            if (st.group_mask != 0) clear_indexes(r);
            if (st.groups.size() <= gid) st.groups.resize(gid + 1);
            if (!st.groups[gid]) st.groups[gid] = std::make_unique<GroupState>();  // else reset by drop_groups
            st.group_mask |= std::uint64_t{1} << gid;
        }
        return *st.groups[gid];
    }

    void learn_size(std::int64_t r, ReplicaState& st, GroupState& g, std::uint64_t size) {
        g.engine_block_size = size;
        st.engine_block_size = size;
        std::uint64_t k = 1;
        st.each_group([&](const GroupState& o) {
            if (!o.engine_block_size || *o.engine_block_size % block_size != 0) return;
            const std::uint64_t x = *o.engine_block_size / block_size;
            // lcm, saturating above the index's limit (it only grows from there).
            k = x > PrefixIndex::kMaxEngineBlock || k > PrefixIndex::kMaxEngineBlock
                    ? PrefixIndex::kMaxEngineBlock + 1
                    : k / std::__gcd(k, x) * x;
        });
        set_k(r, st, std::min<std::uint64_t>(k, PrefixIndex::kMaxEngineBlock));
    }

    void set_k(std::int64_t r, ReplicaState& st, std::uint64_t k) {
        st.k = k;
        if (k == index->engine_block(r)) return;  // learned before, or configured on the router
        index->set_engine_block(r, k);
        if (tier) {
            grow(*tier, r);
            tier->set_engine_block(r, k);
        }
    }

    // -- storing ----------------------------------------------------------------------------

    void stored_event(std::int64_t r, ReplicaState& st, const wire::Event& ev, double now) {
        if (ev.group >= kMaxGroups) return skip(st, SkipKind::UnsupportedGroup);
        const std::int64_t med = ev.has_medium ? medium_id(ev.medium) : 0;
        if (med < 0) return skip(st, SkipKind::UnsupportedMedium);
        if (!event_keys(ev)) return skip(st, SkipKind::UnsupportedKeys);
        GroupState* g = st.find_group(ev.group);
        if (ev.has_parent && (!g || !g->entries.find(ev.parent))) return skip(st, SkipKind::UnknownParent);
        if (ev.h_count == 0) return;
        GroupState& grp = group(r, st, ev.group);
        learn_size(r, st, grp, ev.engine_block_size);
        store(r, st, grp, batch.hashes.data() + ev.h_begin, ev.h_count, ev.has_parent, ev.parent,
              batch.tokens.data() + ev.t_begin, ev.engine_block_size, static_cast<std::uint32_t>(med), now);
    }

    void store(std::int64_t r, ReplicaState& st, GroupState& g, const std::uint64_t* hs, std::size_t n,
               bool has_parent, std::uint64_t parent, const std::uint32_t* tokens, std::uint64_t size,
               std::uint32_t medium, double now) {
        const int t = medium == 0 ? 0 : 1;
        const std::uint64_t bit = std::uint64_t{1} << medium;
        if (!has_parent) {
            cs.pos = 0;
            cs.seed = keyed_root(st.salt ? st.root : root, keys.lora, keys.salt);
            cs.tail.clear();
            cs.tail_mm.clear();
        } else {
            cs.load(*g.entries.find(parent));
        }
        const bool has_pred = cs.pos - cs.tail.size() != 0;
        const std::uint64_t pred = cs.seed;
        const bool bounded = index->capacity().has_value();
        chain.clear();
        bool all_counted = true;  // every router block of the chain is counted in this group
        std::size_t mm_next = 0;
        for (std::size_t j = 0; j < n; ++j) {
            bool inserted = false;
            Entry* e = &g.entries.get(hs[j], inserted);
            if (inserted) {
                const std::size_t mm_begin = mm_next;
                while (mm_next < keys.mm.size() && keys.mm[mm_next].block == j) ++mm_next;
                new_entry(*e, j == 0 ? has_parent : true, j == 0 ? parent : hs[j - 1],
                          tokens + j * size, size, mm_begin, mm_next);
            } else {
                while (mm_next < keys.mm.size() && keys.mm[mm_next].block == j) ++mm_next;
            }
            e->seq = ++seq;
            if (bounded) g.order.emplace_back(hs[j], e->seq);
            if (e->media & bit) {
                ++c.duplicate_stores;
            } else {
                const bool held = e->has_tier(t);
                e->media |= bit;
                if (!held) hold(g, hs[j], *e, t);
                ++c.stored_blocks;
            }
            all_counted = all_counted && e->first_counted(t);
            for (std::uint32_t q = 0; q < e->n_kv; ++q) chain.push_back(e->kv(q));
            cs.load(*e);
        }
        // One group that counts every block of the chain: all of it is indexable, no lookups.
        const bool whole = all_counted && (st.group_mask & (st.group_mask - 1)) == 0;
        index_chain(r, st, t, has_pred, pred, now, whole);
        bound(r, st, g);
    }

    /// Fills a new entry from the chain state `cs` and its tokens; the keys.mm[mm_begin,
    /// mm_end) are the multimodal keys of its block.
    void new_entry(Entry& e, bool has_parent, std::uint64_t parent, const std::uint32_t* tokens,
                   std::uint64_t size, std::size_t mm_begin, std::size_t mm_end) {
        const std::size_t bs = block_size;
        const std::size_t lead = cs.tail.size();
        const std::uint64_t b = cs.pos - lead;
        // By offset; ties: carried items first, then the block's keys in order (stable sort).
        items.clear();
        for (const OwnedMm& it : cs.tail_mm) items.push_back(MmKey{it.id, it.offset});
        for (std::size_t i = mm_begin; i < mm_end; ++i)
            if (keys.mm[i].rel >= 0)
                items.push_back(MmKey{keys.mm[i].id, cs.pos + static_cast<std::uint64_t>(keys.mm[i].rel)});
        std::stable_sort(items.begin(), items.end(), [](const MmKey& x, const MmKey& y) { return x.offset < y.offset; });
        const std::uint32_t* data = tokens;
        const std::size_t total = lead + size;
        if (lead > 0) {
            buf.assign(cs.tail.begin(), cs.tail.end());
            buf.insert(buf.end(), tokens, tokens + size);
            data = buf.data();
        }
        const std::size_t nkv = total / bs;
        if (kvbuf.size() < nkv) kvbuf.resize(nkv);
        if (items.empty()) chain_hashes(data, nkv * bs, bs, cs.seed, kvbuf.data());
        else chain_hashes_keyed(data, nkv * bs, bs, cs.seed, b, items.data(), items.size(), kvbuf.data());
        e.end = cs.pos + size;
        e.n_kv = static_cast<std::uint32_t>(nkv);
        e.dep = lead > 0 && nkv > 0;
        e.seed = nkv ? kvbuf[nkv - 1] : cs.seed;
        if (nkv > 0) e.kv0 = kvbuf[0];
        if (nkv > 1) {
            e.more = std::make_unique<std::uint64_t[]>(nkv - 1);
            std::copy(kvbuf.begin() + 1, kvbuf.begin() + static_cast<std::ptrdiff_t>(nkv), e.more.get());
        }
        const std::uint64_t next_b = b + nkv * bs;
        const bool carried = std::any_of(items.begin(), items.end(), [&](const MmKey& it) { return it.offset >= next_b; });
        if (lead > 0 || total > nkv * bs || carried) {
            e.extra = std::make_unique<Extra>();
            e.extra->start = cs.pos;
            e.extra->lead = static_cast<std::uint32_t>(lead);
            e.extra->has_parent = has_parent;
            e.extra->parent = parent;
            e.extra->tail.assign(data + nkv * bs, data + total);
            for (const MmKey& it : items)
                if (it.offset >= next_b) e.extra->tail_mm.push_back(OwnedMm{std::string(it.id), it.offset});
        }
    }

    /// The earlier pages e's first router block spans, into `span` (nullptr where broken).
    void walk_span(GroupState& g, const Entry& e) {
        span.clear();
        // Every page a router block spans, but the last one's start, lies inside it, so each
        // has an `extra` (it starts, or ends, off a boundary); e itself is dep, so has one.
        const Extra* x = e.extra.get();
        const std::uint64_t b = x->start - x->lead;
        while (x && x->start > b) {
            Entry* p = x->has_parent ? g.entries.find(x->parent) : nullptr;
            span.push_back(p);
            if (!p) break;
            x = p->extra.get();
        }
    }

    /// e gained tier t: count its router blocks there (kv[0] only if all its pages are).
    void hold(GroupState& g, std::uint64_t key, Entry& e, int t) {
        if (e.dep) {
            walk_span(g, e);
            const bool ok = std::all_of(span.begin(), span.end(), [&](const Entry* a) { return a && a->has_tier(t); });
            if (ok) {
                e.first_ok |= static_cast<std::uint8_t>(1u << t);
                for (Entry* a : span) {
                    if (!a->extra) a->extra = std::make_unique<Extra>();
                    auto& deps = a->extra->dependents;  // a's loss must uncount e's first block
                    if (std::find(deps.begin(), deps.end(), key) == deps.end()) deps.push_back(key);
                }
            } else {
                e.first_ok &= static_cast<std::uint8_t>(~(1u << t));
            }
        }
        for (std::uint32_t q = 0; q < e.n_kv; ++q) {
            if (q == 0 && !e.first_counted(t)) continue;
            bool added = false;
            ++g.refs[t].get(e.kv(q), added);
        }
    }

    bool held_everywhere(const ReplicaState& st, int t, std::uint64_t x) const {
        bool all = true;
        st.each_group([&](const GroupState& o) { all = all && o.refs[t].find(x) != nullptr; });
        return all;
    }

    /// Hands the index the chain's blocks this replica now holds in every group, in runs.
    void index_chain(std::int64_t r, const ReplicaState& st, int t, bool has_pred, std::uint64_t pred, double now,
                     bool whole) {
        PrefixIndex* target = t == 0 ? index.get() : tier.get();
        if (!target || chain.empty()) return;
        grow(*target, r);
        if (whole) {
            run.swap(chain);
            insert(*target, r, has_pred, pred, now);
            run.swap(chain);
            return;
        }
        run.clear();
        bool run_has = has_pred, last_has = has_pred;
        std::uint64_t run_pred = pred, last = pred;
        for (const std::uint64_t x : chain) {
            if (held_everywhere(st, t, x)) {
                if (run.empty()) {
                    run_has = last_has;
                    run_pred = last;
                }
                run.push_back(x);
            } else if (!run.empty()) {
                insert(*target, r, run_has, run_pred, now);
                run.clear();
            }
            last = x;
            last_has = true;
        }
        if (!run.empty()) insert(*target, r, run_has, run_pred, now);
    }

    void insert(PrefixIndex& target, std::int64_t r, bool has_pred, std::uint64_t pred, double now) {
        try {
            if (has_pred) target.store_after(r, pred, run.data(), run.size(), now);
            else target.insert(r, run.data(), run.size(), now);
        } catch (const KeyError&) {
            ++c.index_conflicts;
        } catch (const ValueError&) {
            ++c.index_conflicts;
        }
    }

    /// Keeps the group's map within the index capacity times the pages per router block.
    void bound(std::int64_t r, ReplicaState& st, GroupState& g) {
        const std::optional<std::uint64_t> cap = index->capacity();
        if (!cap || !g.engine_block_size) return;
        const std::uint64_t per = std::max<std::uint64_t>(1, (block_size + *g.engine_block_size - 1) / *g.engine_block_size);
        const std::uint64_t limit = *cap > UINT64_MAX / per ? UINT64_MAX : *cap * per;
        if (g.entries.size() <= limit) return;
        gone[0].clear();
        gone[1].clear();
        while (g.entries.size() > limit && !g.order.empty()) {
            const auto [key, s] = g.order.front();
            g.order.pop_front();
            Entry* e = g.entries.find(key);
            if (!e || e->seq != s) continue;  // re-stored later, or gone
            for (int t = 0; t < 2; ++t)
                if (e->has_tier(t)) release(st, g, *e, t, gone[t]);
            g.entries.erase(key);
            ++c.map_evictions;
        }
        drop(r);
        compact(g);
    }

    static void compact(GroupState& g) {
        if (g.order.size() <= 2 * g.entries.size() + 1024) return;
        std::deque<std::pair<std::uint64_t, std::uint64_t>> live;
        for (const auto& ks : g.order) {
            const Entry* e = g.entries.find(ks.first);
            if (e && e->seq == ks.second) live.push_back(ks);
        }
        g.order.swap(live);
    }

    // -- removing ---------------------------------------------------------------------------

    std::size_t removed(std::int64_t r, ReplicaState& st, std::uint64_t gid, const std::uint64_t* hs, std::size_t n,
                        std::uint32_t medium) {
        const int t = medium == 0 ? 0 : 1;
        const std::uint64_t bit = std::uint64_t{1} << medium;
        GroupState* g = st.find_group(gid);
        gone[0].clear();
        gone[1].clear();
        std::size_t done = 0;
        for (std::size_t j = 0; j < n; ++j) {
            Entry* e = g ? g->entries.find(hs[j]) : nullptr;
            if (!e || !(e->media & bit)) {
                skip(st, SkipKind::UnknownRemoval);
                continue;
            }
            e->media &= ~bit;
            if (!e->has_tier(t)) release(st, *g, *e, t, gone[t]);
            if (!e->media) g->dead.push_back(hs[j]);
            ++done;
        }
        c.removed_blocks += done;
        drop(r);
        return done;
    }

    /// e lost tier t: uncount its router blocks there, and the first router block of every later
    /// page that spans it.
    void release(const ReplicaState& st, GroupState& g, Entry& e, int t, std::vector<std::uint64_t>& out) {
        for (std::uint32_t q = 0; q < e.n_kv; ++q) {
            if (q == 0 && !e.first_counted(t)) continue;
            unref(st, g, t, e.kv(q), out);
        }
        e.first_ok &= static_cast<std::uint8_t>(~(1u << t));
        if (!e.extra) return;
        for (const std::uint64_t d : e.extra->dependents) {
            Entry* de = g.entries.find(d);
            if (de && de->dep && ((de->first_ok >> t) & 1)) {
                unref(st, g, t, de->kv0, out);
                de->first_ok &= static_cast<std::uint8_t>(~(1u << t));
            }
        }
    }

    void unref(const ReplicaState& st, GroupState& g, int t, std::uint64_t x, std::vector<std::uint64_t>& out) {
        std::uint32_t* cnt = g.refs[t].find(x);
        if (*cnt > 1) {
            --*cnt;
            return;
        }
        g.refs[t].erase(x);
        bool others = true;  // it was in the index: every other group holds it
        st.each_group([&](const GroupState& o) { others = others && (&o == &g || o.refs[t].find(x) != nullptr); });
        if (others) out.push_back(x);
    }

    void drop(std::int64_t r) {
        for (int t = 0; t < 2; ++t) {
            PrefixIndex* target = t == 0 ? index.get() : tier.get();
            if (gone[t].empty() || !target) continue;
            grow(*target, r);
            target->remove(r, gone[t].data(), gone[t].size());
        }
    }

    void clear(std::int64_t r, ReplicaState& st) {
        drop_groups(st);
        clear_indexes(r);
    }

    /// Forgets every group; their tables keep their slots, since an engine that cleared its
    /// cache refills it (and a fresh table would grow and rehash all over again).
    static void drop_groups(ReplicaState& st) {
        for (auto& g : st.groups) {
            if (!g) continue;
            g->entries.clear();
            g->refs[0].clear();
            g->refs[1].clear();
            g->dead.clear();
            g->order.clear();
            g->engine_block_size.reset();
        }
        st.group_mask = 0;
    }

    void clear_indexes(std::int64_t r) {
        index->clear_replica(r);
        if (tier) {
            grow(*tier, r);
            tier->clear_replica(r);
        }
    }

    /// An index refused r midway (remove_replica raced the call): forget r entirely.
    void forget(std::int64_t r, ReplicaState& st) {
        drop_groups(st);
        for (PrefixIndex* ix : {index.get(), tier.get()}) {
            if (!ix || r >= static_cast<std::int64_t>(ix->num_replicas())) continue;
            try {
                ix->clear_replica(r);
            } catch (const IndexError&) {
                // removed: it holds nothing of r
            }
        }
    }

    static void purge(ReplicaState& st) {
        // Entries whose last medium went stay until the call ends (a later store of the same
        // batch may name them as parent); then they go.
        for (auto& gp : st.groups) {
            if (!gp) continue;  // a dropped group has nothing dead
            for (const std::uint64_t h : gp->dead) {
                const Entry* e = gp->entries.find(h);
                if (e && !e->media) gp->entries.erase(h);
            }
            gp->dead.clear();
        }
    }

    /// Runs f, then purges; on IndexError from an index (a race), forgets r and rethrows.
    template <class F>
    auto guarded(std::int64_t r, ReplicaState& st, F&& f) {
        try {
            if constexpr (std::is_void_v<decltype(f())>) {
                f();
                purge(st);
            } else {
                auto out = f();
                purge(st);
                return out;
            }
        } catch (const IndexError&) {
            forget(r, st);
            purge(st);
            throw;
        }
    }
};

EventApplier::EventApplier(std::shared_ptr<PrefixIndex> index, std::size_t block_size, std::string salt,
                           std::shared_ptr<PrefixIndex> tier_index)
    : impl_(std::make_unique<Impl>()) {
    if (!index) throw TypeError("index must be a PrefixIndex, got NoneType");
    if (tier_index && tier_index == index) throw ValueError("tier_index must be a different PrefixIndex than index");
    if (block_size < 1 || block_size > kMaxBlockSize)
        throw ValueError("block_size must be in [1, " + std::to_string(kMaxBlockSize) + "], got " +
                         std::to_string(block_size));
    impl_->index = std::move(index);
    impl_->tier = std::move(tier_index);
    impl_->block_size = block_size;
    impl_->salt = std::move(salt);
    impl_->root = root_hash(impl_->salt.data(), impl_->salt.size());
}

EventApplier::~EventApplier() = default;

void EventApplier::check_replica(std::int64_t r) const { impl_->check(r); }

bool EventApplier::apply(std::int64_t r, const std::uint8_t* data, std::size_t len) {
    Impl& m = *impl_;
    std::lock_guard<std::mutex> lock(m.mu);
    m.check_mutating(r);
    try {
        wire::decode(data, len, m.batch);
    } catch (const wire::Malformed& bad) {
        ++m.c.malformed;
        m.c.last_error = bad.message;
        return false;
    }
    ReplicaState& st = m.state(r);
    ++m.c.batches;
    m.c.ignored_events += m.batch.ignored;
    ++st.batches;
    st.last_ts = m.batch.ts;
    const double now = PrefixIndex::monotonic_now();
    m.guarded(r, st, [&] {
        for (const wire::Event& ev : m.batch.events) {
            ++m.c.events;
            if (ev.kind == wire::Kind::Stored) {
                m.stored_event(r, st, ev, now);
            } else if (ev.kind == wire::Kind::Removed) {
                if (ev.group >= kMaxGroups) {
                    m.skip(st, SkipKind::UnsupportedGroup);
                    continue;
                }
                const std::int64_t med = ev.has_medium ? m.medium_id(ev.medium) : 0;
                if (med < 0) {
                    m.skip(st, SkipKind::UnsupportedMedium);
                    continue;
                }
                m.removed(r, st, ev.group, m.batch.hashes.data() + ev.h_begin, ev.h_count, static_cast<std::uint32_t>(med));
            } else {
                m.clear(r, st);
                ++m.c.clears;
            }
        }
    });
    return true;
}

namespace {
[[noreturn]] void too_many_media() {
    throw ValueError("medium is one too many: an applier tells at most " + std::to_string(kMaxMedia) + " media apart");
}
}  // namespace

std::size_t EventApplier::apply_stored(std::int64_t r, const std::uint64_t* hashes, std::size_t n,
                                       const std::uint64_t* parent, const std::uint32_t* tokens, std::size_t n_tokens,
                                       std::size_t engine_block_size, const std::string* medium) {
    Impl& m = *impl_;
    std::lock_guard<std::mutex> lock(m.mu);
    m.check_mutating(r);
    if (medium && *medium != "GPU" && !m.media.count(*medium) && m.media.size() >= kMaxMedia) too_many_media();
    std::size_t size = engine_block_size;
    if (size == 0 && n > 0 && n_tokens > 0 && n_tokens % n == 0) size = n_tokens / n;
    if (size == 0 || n_tokens != n * size)
        throw ValueError(std::to_string(n_tokens) + " token_ids do not make " + std::to_string(n) + " blocks" +
                         (size ? " of " + std::to_string(size) + " tokens" : std::string()));
    ReplicaState& st = m.state(r);
    GroupState* g = st.find_group(0);
    if (parent && (!g || !g->entries.find(*parent)))
        throw KeyError("parent block hash " + std::to_string(*parent) + " is unknown on replica " + std::to_string(r));
    const auto med = static_cast<std::uint32_t>(medium ? m.medium_id(*medium) : 0);
    m.guarded(r, st, [&] {
        GroupState& grp = m.group(r, st, 0);
        m.learn_size(r, st, grp, size);
        m.keys = EventKeys{};
        m.store(r, st, grp, hashes, n, parent != nullptr, parent ? *parent : 0, tokens, size, med,
                PrefixIndex::monotonic_now());
    });
    return n;
}

std::size_t EventApplier::apply_removed(std::int64_t r, const std::uint64_t* hashes, std::size_t n,
                                        const std::string* medium) {
    Impl& m = *impl_;
    std::lock_guard<std::mutex> lock(m.mu);
    m.check_mutating(r);
    if (medium && *medium != "GPU" && !m.media.count(*medium) && m.media.size() >= kMaxMedia) too_many_media();
    const auto med = static_cast<std::uint32_t>(medium ? m.medium_id(*medium) : 0);
    ReplicaState& st = m.state(r);
    return m.guarded(r, st, [&] { return m.removed(r, st, 0, hashes, n, med); });
}

void EventApplier::set_salt(std::int64_t r, const std::string* salt) {
    Impl& m = *impl_;
    std::lock_guard<std::mutex> lock(m.mu);
    m.check(r);
    ReplicaState& st = m.state(r);
    if (salt) {
        st.salt = *salt;
        st.root = root_hash(salt->data(), salt->size());
    } else {
        st.salt.reset();
        st.root = 0;
    }
}

void EventApplier::clear_replica(std::int64_t r) {
    Impl& m = *impl_;
    std::lock_guard<std::mutex> lock(m.mu);
    m.check_mutating(r);
    ReplicaState& st = m.state(r);
    m.clear(r, st);
}

namespace {
void refuse_tier(const std::shared_ptr<PrefixIndex>& tier) {
    if (tier)
        throw ValueError("an applier with a tier_index cannot be exported or imported "
                         "(the tier index is not part of a snapshot)");
}
}  // namespace

std::string EventApplier::export_replica(std::int64_t r) const {
    const Impl& m = *impl_;
    std::lock_guard<std::mutex> lock(m.mu);
    m.check(r);
    refuse_tier(m.tier);
    std::vector<std::string> names(m.media.size());
    for (const auto& kv : m.media) names[kv.second] = kv.first;
    const auto i = static_cast<std::size_t>(r);
    static const ReplicaState fresh;
    const ReplicaState& st = i < m.replicas.size() && m.replicas[i] ? *m.replicas[i] : fresh;
    return applier::encode_replica(st, m.block_size, m.salt, m.seq, names);
}

std::shared_ptr<applier::DecodedReplica> EventApplier::decode_replica(const std::uint8_t* data, std::size_t len) const {
    const Impl& m = *impl_;
    refuse_tier(m.tier);
    return std::make_shared<applier::DecodedReplica>(applier::decode_replica(data, len, m.block_size, m.salt));
}

void EventApplier::check_media(const std::vector<const applier::DecodedReplica*>& states) const {
    const Impl& m = *impl_;
    std::lock_guard<std::mutex> lock(m.mu);
    std::set<std::string> known;
    for (const auto& kv : m.media) known.insert(kv.first);
    for (const applier::DecodedReplica* d : states) known.insert(d->media.begin(), d->media.end());
    if (known.size() > kMaxMedia)
        throw ValueError("applier state names too many media: an applier tells at most " + std::to_string(kMaxMedia) +
                         " apart");
}

void EventApplier::install_replica(std::int64_t r, applier::DecodedReplica& d) {
    Impl& m = *impl_;
    std::lock_guard<std::mutex> lock(m.mu);
    m.check_mutating(r);
    std::vector<std::uint64_t> bit(d.media.size());  // file bit i -> this applier's medium bit
    for (std::size_t i = 0; i < d.media.size(); ++i)
        bit[i] = std::uint64_t{1} << static_cast<std::uint64_t>(m.medium_id(d.media[i]));
    const bool bounded = m.index->capacity().has_value();
    ReplicaState& st = *d.state;
    for (std::size_t gid = 0; gid < st.groups.size(); ++gid) {
        if (!((st.group_mask >> gid) & 1)) continue;
        GroupState& g = *st.groups[gid];
        g.entries.for_each([&](std::uint64_t, Entry& e) {
            std::uint64_t media = 0;
            for (std::size_t i = 0; i < bit.size(); ++i)
                if ((e.media >> i) & 1) media |= bit[i];
            e.media = media;
        });
        if (bounded) g.order.assign(d.order[gid].begin(), d.order[gid].end());
    }
    m.seq = std::max(m.seq, d.max_seq);
    m.state(r);
    m.replicas[static_cast<std::size_t>(r)] = std::move(d.state);
}

void EventApplier::import_replica(std::int64_t r, const std::uint8_t* data, std::size_t len) {
    impl_->check_mutating(r);
    refuse_tier(impl_->tier);
    const auto d = decode_replica(data, len);
    check_media({d.get()});
    install_replica(r, *d);
}

EventApplierStats EventApplier::stats() const {
    std::lock_guard<std::mutex> lock(impl_->mu);
    return impl_->c;
}

ReplicaEventStats EventApplier::replica_stats(std::int64_t r) const {
    const Impl& m = *impl_;
    std::lock_guard<std::mutex> lock(m.mu);
    m.check(r);
    ReplicaEventStats out;
    out.salt = m.salt;
    out.index_blocks = m.index->blocks(r);
    out.engine_block = m.index->engine_block(r);
    if (m.tier && r < static_cast<std::int64_t>(m.tier->num_replicas()) && m.tier->is_live(r))
        out.tier_blocks = m.tier->blocks(r);
    const auto i = static_cast<std::size_t>(r);
    if (i >= m.replicas.size() || !m.replicas[i]) return out;
    const ReplicaState& st = *m.replicas[i];
    if (st.salt) out.salt = *st.salt;
    out.batches = st.batches;
    st.each_group([&](const GroupState& g) { out.engine_blocks += g.entries.size(); });
    for (std::size_t g = 0; g < st.groups.size(); ++g)
        if ((st.group_mask >> g) & 1) out.groups.push_back(static_cast<std::uint32_t>(g));
    std::copy(std::begin(st.skipped), std::end(st.skipped), std::begin(out.skipped));
    out.engine_block_size = st.engine_block_size;
    out.last_ts = st.last_ts;
    return out;
}

std::size_t EventApplier::block_size() const noexcept { return impl_->block_size; }
const std::string& EventApplier::salt() const noexcept { return impl_->salt; }
const std::shared_ptr<PrefixIndex>& EventApplier::index() const noexcept { return impl_->index; }
const std::shared_ptr<PrefixIndex>& EventApplier::tier_index() const noexcept { return impl_->tier; }

}  // namespace kvroute
