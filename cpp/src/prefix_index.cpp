// PrefixIndex core: a compressed radix tree of block hashes with one owner bitset per node.
//
// Layout. Nodes live in an arena addressed by 32-bit ids (id 0 is the root, an empty run);
// each node is a run of consecutive blocks with one owner set, stored in a strided arena of
// 64-bit words. A global open-addressing table maps every block hash to (node, position);
// a node's `base` turns positions into run offsets, so dropping a run's prefix does not
// rewrite the table entries of the blocks that stay.
//
// Canonical form (check_invariants verifies it): a block shares a node with its parent iff
// it is the parent's only child and has the same owners. Hence only a node's last block has
// children, no node is without owners and children, and the node count is a function of the
// block set alone (the reference computes the same number). Every mutation changes a few
// nodes and then restores the form locally with fixup().
//
// Recency (only with a capacity or a ttl): one intrusive LRU list per replica in an entry
// arena, plus a (replica, hash) -> entry table, so eviction and expiry cost O(dropped).
#include "kvroute/prefix_index.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <new>
#include <set>
#include <shared_mutex>
#include <string>
#include <utility>

#include "kvroute/bitset.hpp"
#include "kvroute/errors.hpp"
#include "kvroute/support/big_array.hpp"
#include "kvroute/support/hash_map.hpp"
#include "kvroute/support/mix.hpp"

namespace kvroute {
namespace {

constexpr std::uint32_t kNil = 0xFFFFFFFFu;
constexpr std::uint32_t kRoot = 0;

using support::BigArray;
using support::mix64;

std::string hex(std::uint64_t h) {
    char buf[24];
    std::snprintf(buf, sizeof buf, "0x%016llx", static_cast<unsigned long long>(h));
    return buf;
}

[[noreturn]] void broken(const std::string& what) {
    throw StateError("PrefixIndex invariant broken: " + what);
}

/// A 16-byte slot; `a == kNil` marks it empty.
struct Slot {
    std::uint64_t hash;
    std::uint32_t a;  // block table: node id; pair table: replica id
    std::uint32_t b;  // block table: position; pair table: LRU entry id
};

/// Linear-probing hash table with backward-shift deletion and 1.5x growth (memory per
/// entry stays within 20-30 bytes instead of the 16-32 a power-of-two table swings over).
/// A parallel array of one-byte tags (0 = empty) is what probing scans: a lookup of an
/// absent key, common when a chain grows, reads one line of tags instead of a run of
/// 16-byte slots, and the tag array of a 1M-block index (~1.5 MB) stays in cache.
/// kPair keys on (hash, a); otherwise on hash alone.
template <bool kPair>
class Table {
public:
    std::size_t size() const noexcept { return count_; }
    std::size_t bytes() const noexcept { return slots_.bytes() + tags_.bytes(); }
    void clear() {
        BigArray<Slot>().swap(slots_);
        BigArray<std::uint8_t>().swap(tags_);
        count_ = 0;
    }
    Slot* find(std::uint64_t h, std::uint32_t a = 0) noexcept {
        return const_cast<Slot*>(static_cast<const Table*>(this)->find(h, a));
    }
    const Slot* find(std::uint64_t h, std::uint32_t a = 0) const noexcept {
        if (slots_.empty()) return nullptr;
        const std::uint64_t k = key(h, a);
        const std::uint8_t tag = tag_of(k);
        std::size_t i = range(k);
        const std::size_t n = slots_.size();
        for (;;) {
            const std::uint8_t t = tags_[i];
            if (t == 0) return nullptr;
            if (t == tag) {
                const Slot& s = slots_[i];
                if (s.hash == h && (!kPair || s.a == a)) return &s;
            }
            if (++i == n) i = 0;
        }
    }
    /// Adds a key that is not present.
    void insert(std::uint64_t h, std::uint32_t a, std::uint32_t b) {
        if ((count_ + 1) * 5 > slots_.size() * 4) {
            std::size_t want = std::max<std::size_t>(16, slots_.size() + slots_.size() / 2);
            while ((count_ + 1) * 5 > want * 4) want += want / 2;
            rehash(want);
        }
        place(Slot{h, a, b});
        ++count_;
    }
    /// Removes the slot `s` points at (found by find()).
    void erase(Slot* s) noexcept {
        const std::size_t n = slots_.size();
        std::size_t i = static_cast<std::size_t>(s - slots_.data());
        std::size_t j = i;
        tags_[i] = 0;
        slots_[i].a = kNil;
        for (;;) {
            if (++j == n) j = 0;
            if (tags_[j] == 0) break;
            const std::size_t k = range(key(slots_[j].hash, slots_[j].a));
            // Slot j may move back to i unless its home lies cyclically in (i, j].
            const bool stays = (i <= j) ? (i < k && k <= j) : (i < k || k <= j);
            if (stays) continue;
            slots_[i] = slots_[j];
            tags_[i] = tags_[j];
            slots_[j].a = kNil;
            tags_[j] = 0;
            i = j;
        }
        --count_;
    }
    /// Starts loading the lines a lookup of h will read, so several misses overlap.
    void prefetch(std::uint64_t h, std::uint32_t a = 0) const noexcept {
        if (slots_.empty()) return;
        const std::size_t i = range(key(h, a));
        __builtin_prefetch(&tags_[i]);
        __builtin_prefetch(&slots_[i]);
    }
    /// Shrinks when mostly empty, so memory follows what is held.
    void maybe_shrink() {
        if (slots_.size() > 64 && count_ * 8 < slots_.size()) {
            std::size_t want = std::max<std::size_t>(16, slots_.size() / 2);
            rehash(want);
        }
    }

private:
    static std::uint64_t key(std::uint64_t h, std::uint32_t a) noexcept {
        return kPair ? mix64(h ^ (std::uint64_t{a} * 0x9E3779B97F4A7C15ULL)) : mix64(h);
    }
    // The slot comes from the key's high bits, the tag from its low bits: independent.
    static std::uint8_t tag_of(std::uint64_t k) noexcept { return static_cast<std::uint8_t>(0x80u | (k & 0x7Fu)); }
    std::size_t range(std::uint64_t k) const noexcept {
        return static_cast<std::size_t>((static_cast<unsigned __int128>(k) * slots_.size()) >> 64);
    }
    void place(const Slot& s) noexcept {
        const std::uint64_t k = key(s.hash, s.a);
        std::size_t i = range(k);
        const std::size_t n = slots_.size();
        while (tags_[i] != 0)
            if (++i == n) i = 0;
        slots_[i] = s;
        tags_[i] = tag_of(k);
    }
    void rehash(std::size_t want) {
        BigArray<Slot> old;
        old.swap(slots_);
        BigArray<std::uint8_t> old_tags;
        old_tags.swap(tags_);
        slots_.assign(want, Slot{0, kNil, 0});
        tags_.assign(want, 0);
        for (std::size_t i = 0; i < old.size(); ++i)
            if (old_tags[i] != 0) place(old[i]);
    }
    BigArray<Slot> slots_;
    BigArray<std::uint8_t> tags_;
    std::size_t count_ = 0;
};

/// Length of the common prefix of a[0, m) and b[0, m).
inline std::size_t common_prefix(const std::uint64_t* a, const std::uint64_t* b, std::size_t m) noexcept {
    // Runs usually match in full: one memcmp (vectorized in libc) settles that case.
    if (std::memcmp(a, b, m * sizeof(std::uint64_t)) == 0) return m;
    std::size_t k = 0;
    while (a[k] == b[k]) ++k;
    return k;
}

/// A run of blocks with one owner set. 56 bytes; runs of one block are stored inline.
struct Node {
    union {
        std::uint64_t* ptr;  // malloc'd storage; the run starts `skip` hashes in
        std::uint64_t one;
    } run;
    std::uint32_t len;
    std::uint32_t cap;
    std::uint32_t skip;  // hashes dropped from the front without moving the rest
    std::uint32_t base;  // table position of run[0]; positions wrap modulo 2**32
    std::uint32_t parent;
    std::uint32_t first_child;
    std::uint32_t next_sib;  // also the free-list link
    std::uint32_t prev_sib;
    std::uint32_t nchildren;
    std::uint32_t nowners;
    std::uint32_t live;
};

/// One (replica, block) in its replica's LRU list.
struct LruEntry {
    std::uint64_t hash;
    double stamp;
    std::uint32_t prev;
    std::uint32_t next;  // also the free-list link
    std::uint32_t replica;
    std::uint32_t pad;
};

/// A stretch of the path a chain takes through the existing tree: run[s, e) of `node`.
struct Seg {
    std::uint32_t node;
    std::uint32_t s;
    std::uint32_t e;
    std::uint64_t first;  // hash at run[s], to find the segment again after splits/merges
};

thread_local std::vector<std::uint64_t> tl_active;

}  // namespace

struct PrefixIndex::Impl {
    mutable std::shared_mutex mu;

    std::optional<std::uint64_t> capacity;
    std::optional<double> ttl;
    bool record = false;
    bool tracks = false;

    std::uint32_t num = 0;
    std::set<std::uint32_t> retired;
    std::vector<std::uint64_t> count;  // blocks per replica
    std::vector<std::uint32_t> engine_block;  // C2: a replica's answers round down to these; 0 is 1

    std::vector<Node> nodes;
    std::uint32_t free_nodes = kNil;
    std::uint64_t live_nodes = 0;  // excluding the root
    std::vector<std::uint64_t> owners;
    std::size_t stride = 1;
    Table<false> table;
    std::uint64_t held_blocks = 0;
    std::uint64_t held_pairs = 0;
    std::uint64_t run_bytes = 0;
    double clock = -std::numeric_limits<double>::infinity();

    std::vector<LruEntry> lru;
    std::uint32_t free_entries = kNil;
    std::vector<std::uint32_t> lru_head, lru_tail;
    Table<true> pairs;

    std::vector<std::int32_t> log_r;
    std::vector<std::uint64_t> log_h;
    std::uint64_t log_dropped = 0;
    std::uint64_t unknown_removals = 0;
    std::uint64_t evictions = 0;
    std::uint64_t expirations = 0;

    std::vector<Seg> segs;
    std::vector<std::pair<std::uint64_t, std::size_t>> sorted_tail;
    std::vector<std::uint32_t> touched;

    Impl() { reset_tree(); }
    ~Impl() { release_runs(); }

    // -- small accessors ------------------------------------------------------------------

    std::uint64_t* run(std::uint32_t n) noexcept {
        Node& x = nodes[n];
        return x.cap <= 1 ? &x.run.one : x.run.ptr + x.skip;
    }
    const std::uint64_t* run(std::uint32_t n) const noexcept {
        const Node& x = nodes[n];
        return x.cap <= 1 ? &x.run.one : x.run.ptr + x.skip;
    }
    std::uint64_t* own(std::uint32_t n) noexcept { return owners.data() + std::size_t{n} * stride; }
    const std::uint64_t* own(std::uint32_t n) const noexcept {
        return owners.data() + std::size_t{n} * stride;
    }
    std::uint32_t offset_of(const Slot* s) const noexcept { return s->b - nodes[s->a].base; }

    std::uint32_t check_replica(std::int64_t r) const {
        if (r < 0 || r >= static_cast<std::int64_t>(num))
            throw IndexError("replica " + std::to_string(r) + " is out of range [0, " +
                             std::to_string(num) + ")");
        const auto id = static_cast<std::uint32_t>(r);
        if (retired.count(id)) throw IndexError("replica " + std::to_string(r) + " was removed");
        return id;
    }
    double advance(double now) noexcept {
        if (now > clock) clock = now;
        return clock;
    }

    // -- arenas ---------------------------------------------------------------------------

    void release_runs() noexcept {
        for (Node& x : nodes)
            if (x.live && x.cap > 1) std::free(x.run.ptr);
    }
    void reset_tree() {
        release_runs();
        nodes.clear();
        nodes.shrink_to_fit();
        owners.clear();
        owners.shrink_to_fit();
        free_nodes = kNil;
        live_nodes = 0;
        run_bytes = 0;
        table.clear();
        nodes.push_back(Node{});
        Node& root = nodes[0];
        root.len = root.cap = root.base = root.skip = 0;
        root.parent = root.first_child = root.next_sib = root.prev_sib = kNil;
        root.nchildren = root.nowners = 0;
        root.live = 1;
        owners.assign(stride, 0);
        held_blocks = held_pairs = 0;
    }
    void ensure_stride(std::uint32_t n_replicas) {
        const std::size_t need = bits::words_for(n_replicas);
        if (need <= stride) return;
        // Doubling keeps the cost of adding replicas one by one amortized O(1) per word.
        const std::size_t ns = std::max(need, stride * 2);
        std::vector<std::uint64_t> next(nodes.size() * ns, 0);
        for (std::size_t i = 0; i < nodes.size(); ++i)
            std::memcpy(next.data() + i * ns, owners.data() + i * stride, stride * sizeof(std::uint64_t));
        owners.swap(next);
        stride = ns;
    }
    std::uint32_t new_node() {
        std::uint32_t id;
        if (free_nodes != kNil) {
            id = free_nodes;
            free_nodes = nodes[id].next_sib;
        } else {
            if (nodes.size() >= kNil - 1) throw StateError("PrefixIndex: too many nodes");
            id = static_cast<std::uint32_t>(nodes.size());
            nodes.push_back(Node{});
            owners.resize(owners.size() + stride, 0);
        }
        Node& x = nodes[id];
        x.run.ptr = nullptr;
        x.len = x.cap = x.base = x.skip = 0;
        x.parent = x.first_child = x.next_sib = x.prev_sib = kNil;
        x.nchildren = x.nowners = 0;
        x.live = 1;
        std::memset(own(id), 0, stride * sizeof(std::uint64_t));
        ++live_nodes;
        return id;
    }
    /// Releases an unlinked, childless node whose table entries are gone or moved.
    void free_node(std::uint32_t n) noexcept {
        Node& x = nodes[n];
        if (x.cap > 1) {
            std::free(x.run.ptr);
            run_bytes -= std::uint64_t{x.cap} * sizeof(std::uint64_t);
        }
        x.cap = x.len = x.skip = 0;
        x.live = 0;
        x.next_sib = free_nodes;
        free_nodes = n;
        --live_nodes;
    }
    /// Makes room for `want` hashes in n's run, keeping its contents. A run that grows again
    /// grows by half, so repeated appends and merges cost amortized O(1) per hash.
    void reserve_run(std::uint32_t n, std::uint32_t want) {
        Node& x = nodes[n];
        if (x.cap <= 1 && want <= 1) {
            x.cap = 1;
            return;
        }
        if (x.cap > 1 && std::uint64_t{x.skip} + want <= x.cap) return;
        std::uint32_t cap = want;
        if (x.cap > 1) cap = std::max(want, x.len + x.len / 2);
        move_run(n, cap, 0);
    }
    /// Moves n's run into fresh heap storage of `cap` hashes, starting at offset `at`, and
    /// releases the old storage (inline storage, cap <= 1, has nothing to release).
    void move_run(std::uint32_t n, std::uint32_t cap, std::uint32_t at) {
        Node& x = nodes[n];
        auto* p = static_cast<std::uint64_t*>(std::malloc(std::size_t{cap} * sizeof(std::uint64_t)));
        if (!p) throw std::bad_alloc();
        std::memcpy(p + at, run(n), std::size_t{x.len} * sizeof(std::uint64_t));
        if (x.cap > 1) {
            std::free(x.run.ptr);
            run_bytes -= std::uint64_t{x.cap} * sizeof(std::uint64_t);
        }
        x.run.ptr = p;
        x.cap = cap;
        x.skip = 0;
        run_bytes += std::uint64_t{cap} * sizeof(std::uint64_t);
    }
    /// Gives back run storage after a run got much shorter.
    void shrink_run(std::uint32_t n) {
        Node& x = nodes[n];
        if (x.cap <= 1 || std::uint64_t{x.len} * 2 >= x.cap) return;
        std::uint64_t* old = x.run.ptr;
        const std::uint64_t* data = old + x.skip;
        const std::uint32_t oldcap = x.cap;
        if (x.len <= 1) {
            x.run.one = data[0];
            x.cap = 1;
        } else {
            auto* p = static_cast<std::uint64_t*>(std::malloc(std::size_t{x.len} * sizeof(std::uint64_t)));
            if (!p) return;  // keeping the larger buffer is correct, only wasteful
            std::memcpy(p, data, std::size_t{x.len} * sizeof(std::uint64_t));
            x.run.ptr = p;
            x.cap = x.len;
            run_bytes += std::uint64_t{x.len} * sizeof(std::uint64_t);
        }
        x.skip = 0;
        std::free(old);
        run_bytes -= std::uint64_t{oldcap} * sizeof(std::uint64_t);
    }

    // -- child lists ----------------------------------------------------------------------

    void link_child(std::uint32_t p, std::uint32_t c) noexcept {
        Node& pc = nodes[p];
        Node& cc = nodes[c];
        cc.parent = p;
        cc.prev_sib = kNil;
        cc.next_sib = pc.first_child;
        if (pc.first_child != kNil) nodes[pc.first_child].prev_sib = c;
        pc.first_child = c;
        ++pc.nchildren;
    }
    void unlink_child(std::uint32_t c) noexcept {
        Node& cc = nodes[c];
        Node& pc = nodes[cc.parent];
        if (cc.prev_sib != kNil)
            nodes[cc.prev_sib].next_sib = cc.next_sib;
        else
            pc.first_child = cc.next_sib;
        if (cc.next_sib != kNil) nodes[cc.next_sib].prev_sib = cc.prev_sib;
        --pc.nchildren;
        cc.parent = cc.prev_sib = cc.next_sib = kNil;
    }
    /// `nw` takes `old`'s place among its parent's children.
    void replace_child(std::uint32_t old, std::uint32_t nw) noexcept {
        Node& o = nodes[old];
        Node& w = nodes[nw];
        w.parent = o.parent;
        w.prev_sib = o.prev_sib;
        w.next_sib = o.next_sib;
        if (o.prev_sib != kNil)
            nodes[o.prev_sib].next_sib = nw;
        else
            nodes[o.parent].first_child = nw;
        if (o.next_sib != kNil) nodes[o.next_sib].prev_sib = nw;
        o.parent = o.prev_sib = o.next_sib = kNil;
    }
    /// All of `from`'s children become `to`'s (which has none).
    void move_children(std::uint32_t from, std::uint32_t to) noexcept {
        for (std::uint32_t c = nodes[from].first_child; c != kNil; c = nodes[c].next_sib) nodes[c].parent = to;
        nodes[to].first_child = nodes[from].first_child;
        nodes[to].nchildren = nodes[from].nchildren;
        nodes[from].first_child = kNil;
        nodes[from].nchildren = 0;
    }
    void update_positions(std::uint32_t n, std::uint32_t from, std::uint32_t to) noexcept {
        const std::uint64_t* h = run(n);
        const std::uint32_t base = nodes[n].base;
        for (std::uint32_t i = from; i < to; ++i) {
            Slot* s = table.find(h[i]);
            KVROUTE_DCHECK(s != nullptr);
            s->a = n;
            s->b = base + i;
        }
    }

    // -- owners ---------------------------------------------------------------------------

    void set_owner(std::uint32_t n, std::uint32_t r) noexcept {
        bits::set(own(n), r);
        const std::uint64_t len = nodes[n].len;
        if (nodes[n].nowners++ == 0) held_blocks += len;
        count[r] += len;
        held_pairs += len;
    }
    void clear_owner(std::uint32_t n, std::uint32_t r) noexcept {
        bits::clear(own(n), r);
        const std::uint64_t len = nodes[n].len;
        if (--nodes[n].nowners == 0) held_blocks -= len;
        count[r] -= len;
        held_pairs -= len;
    }
    bool same_owners(std::uint32_t a, std::uint32_t b) const noexcept {
        return nodes[a].nowners == nodes[b].nowners && bits::equal(own(a), own(b), stride);
    }

    // -- split / merge / fixup ------------------------------------------------------------

    /// Cuts n's run before offset `off` (0 < off < len); returns {head, tail}, head the
    /// parent of tail. Moves whichever side costs fewer table updates to a new node.
    std::pair<std::uint32_t, std::uint32_t> split(std::uint32_t n, std::uint32_t off) {
        const std::uint32_t len = nodes[n].len;
        KVROUTE_DCHECK(off > 0 && off < len);
        const std::uint64_t cost_head = off;
        const std::uint64_t cost_tail = std::uint64_t{len - off} + nodes[n].nchildren;
        const std::uint32_t m = new_node();
        std::memcpy(own(m), own(n), stride * sizeof(std::uint64_t));
        nodes[m].nowners = nodes[n].nowners;
        if (cost_head <= cost_tail) {
            reserve_run(m, off);
            std::memcpy(run(m), run(n), std::size_t{off} * sizeof(std::uint64_t));
            nodes[m].len = off;
            update_positions(m, 0, off);
            nodes[n].skip += off;  // n is on the heap: a run of len >= 2
            nodes[n].len = len - off;
            nodes[n].base += off;
            shrink_run(n);
            replace_child(n, m);
            link_child(m, n);
            return {m, n};
        }
        reserve_run(m, len - off);
        std::memcpy(run(m), run(n) + off, std::size_t{len - off} * sizeof(std::uint64_t));
        nodes[m].len = len - off;
        update_positions(m, 0, len - off);
        nodes[n].len = off;
        shrink_run(n);
        move_children(n, m);
        link_child(n, m);
        return {n, m};
    }
    /// Joins p with its only child c (same owners); returns the surviving node.
    std::uint32_t merge(std::uint32_t p, std::uint32_t c) {
        const std::uint32_t pl = nodes[p].len;
        const std::uint32_t cl = nodes[c].len;
        const std::uint64_t cost_down = std::uint64_t{cl} + nodes[c].nchildren;
        const std::uint64_t cost_up = pl;
        if (cost_down <= cost_up) {
            reserve_run(p, pl + cl);
            std::memcpy(run(p) + pl, run(c), std::size_t{cl} * sizeof(std::uint64_t));
            nodes[p].len = pl + cl;
            update_positions(p, pl, pl + cl);
            unlink_child(c);
            move_children(c, p);
            free_node(c);
            return p;
        }
        const std::uint32_t total = pl + cl;
        Node& cn = nodes[c];
        if (cn.cap > 1 && cn.skip >= pl) {
            cn.skip -= pl;  // the dropped front has room for p's run
        } else if (cn.cap > 1 && total <= cn.cap) {
            std::memmove(cn.run.ptr + pl, cn.run.ptr + cn.skip, std::size_t{cl} * sizeof(std::uint64_t));
            cn.skip = 0;
        } else {
            move_run(c, total, pl);  // room for p's run in front
        }
        std::memcpy(run(c), run(p), std::size_t{pl} * sizeof(std::uint64_t));
        nodes[c].len = total;
        nodes[c].base -= pl;
        update_positions(c, 0, pl);
        unlink_child(c);
        replace_child(p, c);
        free_node(p);
        return c;
    }
    /// Drops an ownerless, childless node and its blocks.
    void free_leaf(std::uint32_t n) {
        const std::uint64_t* h = run(n);
        for (std::uint32_t i = 0; i < nodes[n].len; ++i) table.erase(table.find(h[i]));
        unlink_child(n);
        free_node(n);
        table.maybe_shrink();
    }
    /// Restores canonical form around n after its owners or children changed.
    void fixup(std::uint32_t n) {
        while (n != kRoot) {
            Node& x = nodes[n];
            if (x.nowners == 0 && x.nchildren == 0) {
                const std::uint32_t p = x.parent;
                free_leaf(n);
                n = p;
                continue;
            }
            if (x.nchildren == 1 && same_owners(n, x.first_child)) {
                n = merge(n, x.first_child);
                continue;
            }
            const std::uint32_t p = x.parent;
            if (p != kRoot && nodes[p].nchildren == 1 && same_owners(p, n)) {
                n = merge(p, n);
                continue;
            }
            return;
        }
    }
    /// Makes run[s, e) of n a node of its own; returns it.
    std::uint32_t isolate(std::uint32_t n, std::uint32_t s, std::uint32_t e) {
        if (s > 0) {
            n = split(n, s).second;
            e -= s;
        }
        if (e < nodes[n].len) n = split(n, e).first;
        return n;
    }
    /// r stops holding block h (which it holds); the tree part only.
    void drop_block(std::uint32_t r, std::uint64_t h) {
        const Slot* s = table.find(h);
        KVROUTE_DCHECK(s != nullptr);
        const std::uint32_t i = offset_of(s);
        const std::uint32_t n = isolate(s->a, i, i + 1);
        clear_owner(n, r);
        fixup(n);
    }

    // -- LRU ------------------------------------------------------------------------------

    void lru_unlink(std::uint32_t e) noexcept {
        LruEntry& x = lru[e];
        if (x.prev != kNil)
            lru[x.prev].next = x.next;
        else
            lru_head[x.replica] = x.next;
        if (x.next != kNil)
            lru[x.next].prev = x.prev;
        else
            lru_tail[x.replica] = x.prev;
    }
    void lru_push_back(std::uint32_t e) noexcept {
        LruEntry& x = lru[e];
        const std::uint32_t r = x.replica;
        x.next = kNil;
        x.prev = lru_tail[r];
        if (x.prev != kNil)
            lru[x.prev].next = e;
        else
            lru_head[r] = e;
        lru_tail[r] = e;
    }
    void refresh(std::uint32_t r, std::uint64_t h, double t) {
        Slot* s = pairs.find(h, r);
        std::uint32_t e;
        if (s) {
            e = s->b;
            lru_unlink(e);
        } else {
            if (free_entries != kNil) {
                e = free_entries;
                free_entries = lru[e].next;
            } else {
                if (lru.size() >= kNil - 1) throw StateError("PrefixIndex: too many LRU entries");
                e = static_cast<std::uint32_t>(lru.size());
                lru.push_back(LruEntry{});
            }
            lru[e].hash = h;
            lru[e].replica = r;
            pairs.insert(h, r, e);
        }
        lru[e].stamp = t;
        lru_push_back(e);
    }
    void free_entry(std::uint32_t e) noexcept {
        lru[e].replica = kNil;
        lru[e].next = free_entries;
        free_entries = e;
    }
    /// Forgets (r, h)'s LRU entry.
    void drop_pair(std::uint32_t r, std::uint64_t h) noexcept {
        Slot* s = pairs.find(h, r);
        KVROUTE_DCHECK(s != nullptr);
        const std::uint32_t e = s->b;
        pairs.erase(s);
        lru_unlink(e);
        free_entry(e);
    }
    /// Drops r's least recent block (capacity eviction or expiry) and logs it.
    void drop_oldest(std::uint32_t r) {
        const std::uint32_t e = lru_head[r];
        const std::uint64_t h = lru[e].hash;
        pairs.erase(pairs.find(h, r));
        lru_unlink(e);
        free_entry(e);
        drop_block(r, h);
        if (record) {
            if (log_r.size() >= kEvictionLogLimit) {
                ++log_dropped;
            } else {
                log_r.push_back(static_cast<std::int32_t>(r));
                log_h.push_back(h);
            }
        }
    }
    void forget_replica_lru(std::uint32_t r) noexcept {
        for (std::uint32_t e = lru_head[r]; e != kNil;) {
            const std::uint32_t next = lru[e].next;
            pairs.erase(pairs.find(lru[e].hash, r));
            free_entry(e);
            e = next;
        }
        lru_head[r] = lru_tail[r] = kNil;
    }

    // -- operations -----------------------------------------------------------------------

    /// Walks hashes from (cur, nx) (the next run offset to compare) through the existing
    /// tree, filling segs; returns how many leading hashes exist there, then validates the
    /// rest (none may exist or repeat). Changes nothing.
    std::size_t plan_chain(std::uint32_t cur, std::uint32_t nx, const std::uint64_t* hs, std::size_t n) {
        segs.clear();
        std::size_t i = 0;
        while (i < n) {
            if (nx < nodes[cur].len) {
                const std::uint64_t* h = run(cur);
                const std::uint32_t len = nodes[cur].len;
                const std::uint32_t start = nx;
                if (i + (len - nx) < n) table.prefetch(hs[i + (len - nx)]);
                const std::size_t k = common_prefix(h + nx, hs + i, std::min<std::size_t>(len - nx, n - i));
                nx += static_cast<std::uint32_t>(k);
                i += k;
                if (nx > start) segs.push_back(Seg{cur, start, nx, h[start]});
                if (nx < len) break;
            } else {
                const Slot* s = table.find(hs[i]);
                if (!s || offset_of(s) != 0 || nodes[s->a].parent != cur) break;
                cur = s->a;
                nx = 0;
            }
        }
        const std::size_t k = i;
        for (std::size_t j = k; j < n; ++j) table.prefetch(hs[j]);
        std::size_t bad = n;
        for (std::size_t j = k; j < n; ++j)
            if (table.find(hs[j])) {
                bad = j;
                break;
            }
        if (n - k > 1) {
            sorted_tail.clear();
            for (std::size_t j = k; j < std::min(n, bad); ++j) sorted_tail.emplace_back(hs[j], j);
            std::sort(sorted_tail.begin(), sorted_tail.end());
            for (std::size_t q = 1; q < sorted_tail.size(); ++q)
                if (sorted_tail[q].first == sorted_tail[q - 1].first) bad = std::min(bad, sorted_tail[q].second);
        }
        if (bad < n)
            throw ValueError("block " + hex(hs[bad]) + " at index " + std::to_string(bad) +
                             " is already in the index under a different parent");
        return k;
    }

    /// r holds hs, continuing after (cur, nx) (root: kRoot, 0). Validates, then mutates.
    std::size_t store(std::uint32_t r, std::uint32_t cur, std::uint32_t nx, const std::uint64_t* hs,
                      std::size_t n, double now, bool track = true) {
        if (n > kNil / 2) throw ValueError("a chain of " + std::to_string(n) + " blocks is too long");
        const std::size_t k = plan_chain(cur, nx, hs, n);
        const double t = advance(now);
        std::size_t fresh = 0;
        touched.clear();
        for (const Seg& g : segs) {
            if (bits::test(own(g.node), r)) continue;
            const std::uint32_t m = isolate(g.node, g.s, g.e);
            set_owner(m, r);
            fresh += g.e - g.s;
            touched.push_back(static_cast<std::uint32_t>(&g - segs.data()));
        }
        if (k < n) {
            std::uint32_t a = cur;
            std::uint32_t after = nx;  // blocks of `a` up to the attach point
            if (k > 0 || cur != kRoot) {
                const Slot* s = table.find(k > 0 ? hs[k - 1] : run(cur)[nx - 1]);
                a = s->a;
                after = offset_of(s) + 1;
            }
            if (a != kRoot && after < nodes[a].len) a = split(a, after).first;
            const auto m_len = static_cast<std::uint32_t>(n - k);
            if (a != kRoot && nodes[a].nchildren == 0 && nodes[a].nowners == 1 && bits::test(own(a), r)) {
                const std::uint32_t len = nodes[a].len;
                reserve_run(a, len + m_len);
                std::memcpy(run(a) + len, hs + k, std::size_t{m_len} * sizeof(std::uint64_t));
                nodes[a].len = len + m_len;
                const std::uint32_t base = nodes[a].base;
                for (std::uint32_t j = 0; j < m_len; ++j) table.insert(hs[k + j], a, base + len + j);
                count[r] += m_len;
                held_pairs += m_len;
                held_blocks += m_len;
            } else {
                const std::uint32_t m = new_node();
                reserve_run(m, m_len);
                std::memcpy(run(m), hs + k, std::size_t{m_len} * sizeof(std::uint64_t));
                nodes[m].len = m_len;
                for (std::uint32_t j = 0; j < m_len; ++j) table.insert(hs[k + j], m, j);
                link_child(a, m);
                set_owner(m, r);
                fixup(m);
            }
            fresh += m_len;
        }
        for (std::uint32_t gi : touched) {
            const Slot* s = table.find(segs[gi].first);
            fixup(s->a);
        }
        if (tracks && track) {
            for (std::size_t j = n; j-- > 0;) refresh(r, hs[j], t);
            if (capacity) {
                while (count[r] > *capacity) {
                    drop_oldest(r);
                    ++evictions;
                }
            }
        }
        return fresh;
    }

    /// The hash of h's parent block (whose slot is s), or nullopt at the root.
    std::optional<std::uint64_t> parent_of(const Slot* s) const noexcept {
        const std::uint32_t off = offset_of(s);
        if (off > 0) return run(s->a)[off - 1];
        const std::uint32_t p = nodes[s->a].parent;
        if (p == kRoot) return std::nullopt;
        return run(p)[nodes[p].len - 1];
    }

    void drop_replica_blocks(std::uint32_t r) {
        touched.clear();
        for (std::uint32_t n = 1; n < nodes.size(); ++n)
            if (nodes[n].live && bits::test(own(n), r)) touched.push_back(n);
        for (std::uint32_t n : touched) clear_owner(n, r);
        // Fixups only free or merge, never allocate, so a freed id is never reused here.
        for (std::uint32_t n : touched)
            if (nodes[n].live) fixup(n);
        if (tracks) forget_replica_lru(r);
    }
};

// -- public API -------------------------------------------------------------------------

PrefixIndex::PrefixIndex(std::uint32_t num_replicas, std::optional<std::uint64_t> capacity,
                         std::optional<double> ttl, bool record_evictions)
    : impl_(std::make_unique<Impl>()) {
    if (num_replicas > kMaxReplicas)
        throw ValueError("num_replicas must be in [0, " + std::to_string(kMaxReplicas) + "], got " +
                         std::to_string(num_replicas));
    if (capacity && (*capacity < 1 || *capacity >= (std::uint64_t{1} << 63)))
        throw ValueError("capacity must be in [1, 2**63), got " + std::to_string(*capacity));
    if (ttl && !(std::isfinite(*ttl) && *ttl > 0))
        throw ValueError("ttl must be positive and finite, got " + std::to_string(*ttl));
    Impl& d = *impl_;
    d.capacity = capacity;
    d.ttl = ttl;
    d.record = record_evictions;
    d.tracks = capacity.has_value() || ttl.has_value();
    d.num = num_replicas;
    d.ensure_stride(num_replicas);
    d.count.assign(num_replicas, 0);
    if (d.tracks) {
        d.lru_head.assign(num_replicas, kNil);
        d.lru_tail.assign(num_replicas, kNil);
    }
}

PrefixIndex::~PrefixIndex() = default;

double PrefixIndex::monotonic_now() noexcept {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::uint32_t PrefixIndex::num_replicas() const {
    std::shared_lock lock(impl_->mu);
    return impl_->num;
}

bool PrefixIndex::is_live(std::int64_t r) const {
    std::shared_lock lock(impl_->mu);
    return r >= 0 && r < static_cast<std::int64_t>(impl_->num) &&
           !impl_->retired.count(static_cast<std::uint32_t>(r));
}

void PrefixIndex::check_replica(std::int64_t r) const {
    std::shared_lock lock(impl_->mu);
    impl_->check_replica(r);
}

std::optional<std::uint64_t> PrefixIndex::capacity() const noexcept { return impl_->capacity; }
std::optional<double> PrefixIndex::ttl() const noexcept { return impl_->ttl; }
bool PrefixIndex::record_evictions() const noexcept { return impl_->record; }

std::uint32_t PrefixIndex::add_replica() {
    Impl& d = *impl_;
    std::unique_lock lock(d.mu);
    if (!d.retired.empty()) {
        const std::uint32_t r = *d.retired.begin();
        d.retired.erase(d.retired.begin());
        return r;
    }
    if (d.num >= kMaxReplicas)
        throw StateError("cannot add a replica: the index already has the maximum of " +
                         std::to_string(kMaxReplicas));
    d.ensure_stride(d.num + 1);
    d.count.push_back(0);
    if (d.tracks) {
        d.lru_head.push_back(kNil);
        d.lru_tail.push_back(kNil);
    }
    return d.num++;
}

void PrefixIndex::remove_replica(std::int64_t r) {
    Impl& d = *impl_;
    std::unique_lock lock(d.mu);
    const std::uint32_t id = d.check_replica(r);
    d.drop_replica_blocks(id);
    d.retired.insert(id);
    if (id < d.engine_block.size()) d.engine_block[id] = 0;  // a reused id starts at 1 again
}

void PrefixIndex::set_engine_block(std::int64_t r, std::uint64_t k) {
    Impl& d = *impl_;
    std::unique_lock lock(d.mu);
    const std::uint32_t id = d.check_replica(r);
    if (k < 1 || k > kMaxEngineBlock)
        throw ValueError("k must be in [1, " + std::to_string(kMaxEngineBlock) + "], got " + std::to_string(k));
    if (d.engine_block.size() <= id) d.engine_block.resize(id + 1, 0);
    d.engine_block[id] = static_cast<std::uint32_t>(k);
}

std::uint64_t PrefixIndex::engine_block(std::int64_t r) const {
    const Impl& d = *impl_;
    std::shared_lock lock(d.mu);
    const std::uint32_t id = d.check_replica(r);
    return id < d.engine_block.size() && d.engine_block[id] > 0 ? d.engine_block[id] : 1;
}

void PrefixIndex::clear_replica(std::int64_t r) {
    Impl& d = *impl_;
    std::unique_lock lock(d.mu);
    d.drop_replica_blocks(d.check_replica(r));
}

void PrefixIndex::clear() {
    Impl& d = *impl_;
    std::unique_lock lock(d.mu);
    d.reset_tree();
    std::fill(d.count.begin(), d.count.end(), 0);
    if (d.tracks) {
        d.lru.clear();
        d.lru.shrink_to_fit();
        d.free_entries = kNil;
        d.pairs.clear();
        std::fill(d.lru_head.begin(), d.lru_head.end(), kNil);
        std::fill(d.lru_tail.begin(), d.lru_tail.end(), kNil);
    }
}

std::size_t PrefixIndex::insert(std::int64_t r, const std::uint64_t* hashes, std::size_t n, double now) {
    Impl& d = *impl_;
    std::unique_lock lock(d.mu);
    const std::uint32_t id = d.check_replica(r);
    return d.store(id, kRoot, 0, hashes, n, now);
}

std::size_t PrefixIndex::store_after(std::int64_t r, std::uint64_t parent, const std::uint64_t* hashes,
                                     std::size_t n, double now) {
    Impl& d = *impl_;
    std::unique_lock lock(d.mu);
    const std::uint32_t id = d.check_replica(r);
    const Slot* s = d.table.find(parent);
    if (!s) throw KeyError("parent block " + hex(parent) + " is unknown");
    return d.store(id, s->a, d.offset_of(s) + 1, hashes, n, now);
}

void PrefixIndex::match(const std::uint64_t* hashes, std::size_t n, std::vector<std::int32_t>& out) const {
    const Impl& d = *impl_;
    std::shared_lock lock(d.mu);
    match_locked(hashes, n, out);
    // C2: engines reuse whole engine blocks only, so a replica's answer rounds down to them.
    for (std::size_t r = 0; r < d.engine_block.size() && r < out.size(); ++r) {
        const auto k = static_cast<std::int32_t>(d.engine_block[r]);
        if (k > 1) out[r] -= out[r] % k;
    }
}

void PrefixIndex::match_locked(const std::uint64_t* hashes, std::size_t n, std::vector<std::int32_t>& out) const {
    const Impl& d = *impl_;
    const std::uint32_t num = d.num;
    out.assign(num, 0);
    if (n == 0 || num == 0) return;
    const std::size_t w = bits::words_for(num);
    std::vector<std::uint64_t>& active = tl_active;
    active.assign(w, ~std::uint64_t{0});
    if (num % 64) active[w - 1] = (std::uint64_t{1} << (num % 64)) - 1;
    std::uint32_t cur = kRoot;
    std::size_t i = 0;
    for (;;) {
        const Slot* s = d.table.find(hashes[i]);
        if (!s || d.offset_of(s) != 0 || d.nodes[s->a].parent != cur) break;
        const std::uint32_t c = s->a;
        const std::uint32_t len = d.nodes[c].len;
        const std::uint64_t* h = d.run(c);
        if (i + len < n) d.table.prefetch(hashes[i + len]);  // the next child lookup, if the run matches
        const std::size_t k = 1 + common_prefix(h + 1, hashes + i + 1, std::min<std::size_t>(len, n - i) - 1);
        const std::uint64_t* o = d.own(c);
        std::uint64_t any = 0;
        const auto depth = static_cast<std::int32_t>(i);
        for (std::size_t q = 0; q < w; ++q) {
            const std::uint64_t gone = active[q] & ~o[q];
            // out is zeroed: at depth 0 the (many) replicas that hold nothing need no write.
            if (gone && depth > 0) bits::for_each(&gone, 1, [&](std::size_t b) { out[q * 64 + b] = depth; });
            active[q] &= o[q];
            any |= active[q];
        }
        if (!any) return;
        i += k;
        if (k < len || i == n) break;
        cur = c;
    }
    const auto depth = static_cast<std::int32_t>(i);
    bits::for_each(active.data(), w, [&](std::size_t b) { out[b] = depth; });
}

std::size_t PrefixIndex::remove(std::int64_t r, const std::uint64_t* hashes, std::size_t n) {
    Impl& d = *impl_;
    std::unique_lock lock(d.mu);
    const std::uint32_t id = d.check_replica(r);
    std::size_t removed = 0;
    for (std::size_t j = 0; j < n; ++j) {
        const Slot* s = d.table.find(hashes[j]);
        if (s && bits::test(d.own(s->a), id)) {
            if (d.tracks) d.drop_pair(id, hashes[j]);
            d.drop_block(id, hashes[j]);
            ++removed;
        } else {
            ++d.unknown_removals;
        }
    }
    return removed;
}

std::size_t PrefixIndex::touch(std::int64_t r, const std::uint64_t* hashes, std::size_t n, double now) {
    Impl& d = *impl_;
    std::unique_lock lock(d.mu);
    const std::uint32_t id = d.check_replica(r);
    const double t = d.advance(now);
    std::size_t held = 0;
    for (std::size_t j = n; j-- > 0;) {
        const Slot* s = d.table.find(hashes[j]);
        if (s && bits::test(d.own(s->a), id)) {
            ++held;
            if (d.tracks) d.refresh(id, hashes[j], t);
        }
    }
    return held;
}

std::size_t PrefixIndex::expire(double now) {
    Impl& d = *impl_;
    std::unique_lock lock(d.mu);
    const double t = d.advance(now);
    if (!d.ttl) return 0;
    const double limit = t - *d.ttl;
    std::size_t dropped = 0;
    for (std::uint32_t r = 0; r < d.num; ++r) {
        while (d.lru_head[r] != kNil && d.lru[d.lru_head[r]].stamp < limit) {
            d.drop_oldest(r);
            ++dropped;
        }
    }
    d.expirations += dropped;
    return dropped;
}

std::vector<std::uint64_t> PrefixIndex::held(std::int64_t r) const {
    const Impl& d = *impl_;
    std::shared_lock lock(d.mu);
    const std::uint32_t id = d.check_replica(r);
    std::vector<std::uint64_t> out;
    out.reserve(d.count[id]);
    for (std::uint32_t n = 1; n < d.nodes.size(); ++n)
        if (d.nodes[n].live && bits::test(d.own(n), id)) out.insert(out.end(), d.run(n), d.run(n) + d.nodes[n].len);
    std::sort(out.begin(), out.end());
    return out;
}

std::size_t PrefixIndex::blocks(std::int64_t r) const {
    const Impl& d = *impl_;
    std::shared_lock lock(d.mu);
    return d.count[d.check_replica(r)];
}

std::size_t PrefixIndex::num_blocks() const {
    std::shared_lock lock(impl_->mu);
    return impl_->held_blocks;
}

void PrefixIndex::pop_evictions(std::vector<std::int32_t>& replicas, std::vector<std::uint64_t>& hashes) {
    Impl& d = *impl_;
    std::unique_lock lock(d.mu);
    replicas.clear();
    hashes.clear();
    replicas.swap(d.log_r);
    hashes.swap(d.log_h);
}

PrefixIndexStats PrefixIndex::stats() const {
    const Impl& d = *impl_;
    std::shared_lock lock(d.mu);
    PrefixIndexStats s;
    s.blocks = d.held_blocks;
    s.placeholders = d.table.size() - d.held_blocks;
    s.nodes = d.live_nodes;
    s.held = d.held_pairs;
    s.num_replicas = d.num;
    s.live_replicas = d.num - static_cast<std::uint32_t>(d.retired.size());
    s.replica_blocks = d.count;
    s.unknown_removals = d.unknown_removals;
    s.evictions = d.evictions;
    s.expirations = d.expirations;
    s.eviction_log = d.log_r.size();
    s.evictions_dropped = d.log_dropped;
    s.bytes = sizeof(PrefixIndex) + sizeof(Impl) + d.nodes.capacity() * sizeof(Node) +
              d.owners.capacity() * sizeof(std::uint64_t) + d.table.bytes() + d.run_bytes +
              d.count.capacity() * sizeof(std::uint64_t) + d.retired.size() * 40 +
              d.lru.capacity() * sizeof(LruEntry) + d.pairs.bytes() +
              (d.lru_head.capacity() + d.lru_tail.capacity()) * sizeof(std::uint32_t) +
              d.log_r.capacity() * sizeof(std::int32_t) + d.log_h.capacity() * sizeof(std::uint64_t);
    return s;
}

void PrefixIndex::check_invariants() const {
    const Impl& d = *impl_;
    std::shared_lock lock(d.mu);
    const Node& root = d.nodes[kRoot];
    if (!root.live || root.len != 0 || root.parent != kNil) broken("the root is not an empty run");
    std::vector<std::uint64_t> live_mask(d.stride, 0);
    for (std::uint32_t r = 0; r < d.num; ++r)
        if (!d.retired.count(r)) bits::set(live_mask.data(), r);
    std::vector<std::uint64_t> count(d.num, 0);
    std::uint64_t blocks = 0, held = 0, held_pairs = 0, live = 0;
    for (std::uint32_t n = 1; n < d.nodes.size(); ++n) {
        const Node& x = d.nodes[n];
        if (!x.live) continue;
        ++live;
        const std::string name = "node " + std::to_string(n);
        if (x.len == 0) broken(name + " has an empty run");
        if (x.parent == kNil || x.parent >= d.nodes.size() || !d.nodes[x.parent].live)
            broken(name + " has no live parent");
        const std::uint64_t* o = d.own(n);
        if (bits::count(o, d.stride) != x.nowners) broken(name + " miscounts its owners");
        for (std::size_t q = 0; q < d.stride; ++q)
            if (o[q] & ~live_mask[q]) broken(name + " is owned by a retired or unknown replica");
        if (x.nowners == 0 && x.nchildren == 0) broken(name + " has neither owners nor children");
        if (x.nchildren == 1 && d.same_owners(n, x.first_child))
            broken(name + " and its only child have the same owners and should have merged");
        std::uint32_t kids = 0;
        std::uint32_t prev = kNil;
        for (std::uint32_t c = x.first_child; c != kNil; c = d.nodes[c].next_sib) {
            if (d.nodes[c].parent != n || d.nodes[c].prev_sib != prev) broken(name + " has a broken child list");
            prev = c;
            if (++kids > d.nodes.size()) broken(name + " has a cyclic child list");
        }
        if (kids != x.nchildren) broken(name + " miscounts its children");
        const std::uint64_t* h = d.run(n);
        for (std::uint32_t i = 0; i < x.len; ++i) {
            const Slot* s = d.table.find(h[i]);
            if (!s || s->a != n || s->b != x.base + i)
                broken("the hash table disagrees with the tree at block " + hex(h[i]));
        }
        blocks += x.len;
        if (x.nowners) held += x.len;
        held_pairs += std::uint64_t{x.len} * x.nowners;
        bits::for_each(o, d.stride, [&](std::size_t r) {
            if (r < d.num) count[r] += x.len;
        });
    }
    // Root children: the list must be well formed too.
    {
        std::uint32_t kids = 0;
        for (std::uint32_t c = root.first_child; c != kNil; c = d.nodes[c].next_sib) {
            if (d.nodes[c].parent != kRoot) broken("the root has a broken child list");
            if (++kids > d.nodes.size()) broken("the root has a cyclic child list");
        }
        if (kids != root.nchildren) broken("the root miscounts its children");
    }
    if (live != d.live_nodes) broken("the live node count is wrong");
    // Every live node hangs below the root (no detached cycles).
    {
        std::uint64_t seen = 0;
        std::vector<std::uint32_t> stack{kRoot};
        while (!stack.empty()) {
            const std::uint32_t n = stack.back();
            stack.pop_back();
            for (std::uint32_t c = d.nodes[n].first_child; c != kNil; c = d.nodes[c].next_sib) {
                ++seen;
                stack.push_back(c);
                if (seen > live) broken("the tree has a cycle");
            }
        }
        if (seen != live) broken("some nodes are not reachable from the root");
    }
    if (blocks != d.table.size()) broken("the hash table holds blocks that are not in the tree");
    if (held != d.held_blocks || held_pairs != d.held_pairs) broken("block totals disagree with the tree");
    if (count != d.count) broken("per-replica block counts disagree with the tree");
    std::uint64_t run_bytes = 0;
    for (std::uint32_t n = 1; n < d.nodes.size(); ++n)
        if (d.nodes[n].live && d.nodes[n].cap > 1) run_bytes += std::uint64_t{d.nodes[n].cap} * 8;
    if (run_bytes != d.run_bytes) broken("run bytes are misaccounted");
    if (d.tracks) {
        std::uint64_t entries = 0;
        for (std::uint32_t r = 0; r < d.num; ++r) {
            std::uint64_t len = 0;
            double last = -std::numeric_limits<double>::infinity();
            std::uint32_t prev = kNil;
            for (std::uint32_t e = d.lru_head[r]; e != kNil; e = d.lru[e].next) {
                const LruEntry& x = d.lru[e];
                const std::string name = "LRU list of replica " + std::to_string(r);
                if (x.replica != r || x.prev != prev) broken(name + " is broken");
                if (x.stamp < last) broken(name + " is not in time order");
                last = x.stamp;
                const Slot* p = d.pairs.find(x.hash, r);
                if (!p || p->b != e) broken(name + " disagrees with the pair table");
                const Slot* s = d.table.find(x.hash);
                if (!s || !bits::test(d.own(s->a), r)) broken(name + " lists a block the replica does not hold");
                prev = e;
                if (++len > d.lru.size()) broken(name + " is cyclic");
            }
            if (prev != d.lru_tail[r]) broken("LRU list of replica " + std::to_string(r) + " has a wrong tail");
            if (len != d.count[r]) broken("LRU list of replica " + std::to_string(r) + " disagrees with its blocks");
            entries += len;
        }
        if (entries != d.pairs.size()) broken("the pair table holds entries that are in no LRU list");
    }
}

}  // namespace kvroute

// -- export / import (snapshots; twin of the reference's export_replica/import_replica) ----

namespace kvroute {
namespace {

void check_contents_shape(const ReplicaContents& c) {
    const std::size_t n = c.hashes.size();
    if (c.parents.size() != n)
        throw ValueError("parents must have one entry per hash, got " + std::to_string(c.parents.size()) + " for " +
                         std::to_string(n) + " hashes");
    if (c.ages.size() != c.held.size())
        throw ValueError("ages must have one entry per held block, got " + std::to_string(c.ages.size()) + " for " +
                         std::to_string(c.held.size()));
    support::HashMap<char> seen;
    for (std::size_t i = 0; i < n; ++i) {
        const std::int64_t p = c.parents[i];
        if (p < -1 || p >= static_cast<std::int64_t>(i))
            throw ValueError("parents[" + std::to_string(i) + "] must be -1 or an index below " + std::to_string(i) +
                             ", got " + std::to_string(p));
        bool fresh = false;
        seen.get(c.hashes[i], fresh);
        if (!fresh)
            throw ValueError("hash " + hex(c.hashes[i]) + " at index " + std::to_string(i) + " is repeated");
    }
    std::vector<char> taken(n, 0);
    for (std::size_t j = 0; j < c.held.size(); ++j) {
        const std::int64_t i = c.held[j];
        if (i < 0 || i >= static_cast<std::int64_t>(n))
            throw ValueError("held[" + std::to_string(j) + "] must be an index into hashes, got " + std::to_string(i));
        if (taken[static_cast<std::size_t>(i)])
            throw ValueError("held[" + std::to_string(j) + "] repeats index " + std::to_string(i));
        taken[static_cast<std::size_t>(i)] = 1;
        const double a = c.ages[j];
        if (!(std::isfinite(a) && a >= 0)) throw ValueError("ages[" + std::to_string(j) + "] must be finite and >= 0");
        if (j > 0 && a > c.ages[j - 1])
            throw ValueError("ages must not increase along held (least recent first), ages[" + std::to_string(j) +
                             "] > ages[" + std::to_string(j - 1) + "]");
    }
}

}  // namespace

ReplicaContents PrefixIndex::export_replica(std::int64_t r, double now) const {
    const Impl& d = *impl_;
    std::shared_lock lock(d.mu);
    const std::uint32_t id = d.check_replica(r);
    const double t = std::max(now, d.clock);
    // The nodes r owns and every ancestor: a needed node is needed whole (a held descendant
    // hangs from its last block, or r owns all of it).
    std::vector<char> need(d.nodes.size(), 0);
    for (std::uint32_t n = 1; n < d.nodes.size(); ++n) {
        if (!d.nodes[n].live || !bits::test(d.own(n), id)) continue;
        for (std::uint32_t x = n; x != kRoot && !need[x]; x = d.nodes[x].parent) need[x] = 1;
    }
    ReplicaContents out;
    std::vector<std::int64_t> first(d.nodes.size(), -1);  // index of each node's first block
    std::vector<char> owned;
    std::vector<std::pair<std::uint64_t, std::uint32_t>> kids;
    std::vector<std::uint32_t> stack{kRoot};
    while (!stack.empty()) {
        const std::uint32_t n = stack.back();
        stack.pop_back();
        if (n != kRoot) {
            const std::uint32_t p = d.nodes[n].parent;
            std::int64_t prev = p == kRoot ? -1 : first[p] + d.nodes[p].len - 1;
            first[n] = static_cast<std::int64_t>(out.hashes.size());
            const bool mine = bits::test(d.own(n), id);
            for (std::uint32_t j = 0; j < d.nodes[n].len; ++j) {
                out.hashes.push_back(d.run(n)[j]);
                out.parents.push_back(prev);
                owned.push_back(mine);
                prev = static_cast<std::int64_t>(out.hashes.size()) - 1;
            }
        }
        kids.clear();
        for (std::uint32_t c = d.nodes[n].first_child; c != kNil; c = d.nodes[c].next_sib)
            if (need[c]) kids.emplace_back(d.run(c)[0], c);
        std::sort(kids.begin(), kids.end(), std::greater<>());  // the smallest hash is visited first
        for (const auto& k : kids) stack.push_back(k.second);
    }
    if (d.tracks) {
        for (std::uint32_t e = d.lru_head[id]; e != kNil; e = d.lru[e].next) {
            const Slot* s = d.table.find(d.lru[e].hash);
            out.held.push_back(first[s->a] + d.offset_of(s));
            out.ages.push_back(t - d.lru[e].stamp);
        }
    } else {
        for (std::size_t i = out.hashes.size(); i-- > 0;)
            if (owned[i]) {
                out.held.push_back(static_cast<std::int64_t>(i));
                out.ages.push_back(0.0);
            }
    }
    return out;
}

void PrefixIndex::check_import(const ReplicaContents& c) const {
    std::shared_lock lock(impl_->mu);
    check_import_locked(c);
}

void PrefixIndex::check_import_locked(const ReplicaContents& c) const {
    const Impl& d = *impl_;
    check_contents_shape(c);
    for (std::size_t i = 0; i < c.hashes.size(); ++i) {
        const Slot* s = d.table.find(c.hashes[i]);
        if (!s) continue;
        const std::optional<std::uint64_t> have = d.parent_of(s);
        const std::int64_t p = c.parents[i];
        const bool same = p < 0 ? !have : (have && *have == c.hashes[static_cast<std::size_t>(p)]);
        if (!same)
            throw ValueError("block " + hex(c.hashes[i]) + " at index " + std::to_string(i) +
                             " is already in the index under a different parent");
    }
}

std::size_t PrefixIndex::import_replica(std::int64_t r, const ReplicaContents& c, double now) {
    Impl& d = *impl_;
    std::unique_lock lock(d.mu);
    const std::uint32_t id = d.check_replica(r);
    check_import_locked(c);
    d.drop_replica_blocks(id);
    const double t = d.advance(now);
    const std::size_t n = c.hashes.size();
    // Runs of consecutive blocks whose parent is the block before them: one store each.
    for (std::size_t a = 0; a < n;) {
        std::size_t b = a + 1;
        while (b < n && c.parents[b] == static_cast<std::int64_t>(b) - 1) ++b;
        const std::int64_t p = c.parents[a];
        if (p < 0) {
            d.store(id, kRoot, 0, c.hashes.data() + a, b - a, t, false);
        } else {
            const Slot* s = d.table.find(c.hashes[static_cast<std::size_t>(p)]);
            d.store(id, s->a, d.offset_of(s) + 1, c.hashes.data() + a, b - a, t, false);
        }
        a = b;
    }
    std::vector<char> keep(n, 0);
    for (const std::int64_t i : c.held) keep[static_cast<std::size_t>(i)] = 1;
    for (std::size_t i = n; i-- > 0;)
        if (!keep[i]) d.drop_block(id, c.hashes[i]);
    if (d.tracks) {
        for (std::size_t j = 0; j < c.held.size(); ++j)
            d.refresh(id, c.hashes[static_cast<std::size_t>(c.held[j])], t - c.ages[j]);
        if (d.capacity) {
            while (d.count[id] > *d.capacity) {
                d.drop_oldest(id);
                ++d.evictions;
            }
        }
    }
    return d.count[id];
}

}  // namespace kvroute
