// One replica's EventApplier state as bytes and back (snapshots). Twin of
// python/kvroute/reference/events_state.py; layout in docs/snapshot-format.md, "Applier state".
// Canonical: entries by seq, reference counts by hash, media bits over the applier's medium
// names sorted (GPU first), so both implementations write the same bytes.
#include <algorithm>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "binio.hpp"
#include "events_state.hpp"
#include "kvroute/errors.hpp"
#include "kvroute/hash.hpp"

namespace kvroute::applier {
namespace {

constexpr const char* kWhat = "applier state";
constexpr std::uint64_t kNoParent = ~std::uint64_t{0};
constexpr std::uint8_t kDep = 1, kOk0 = 2, kOk1 = 4, kExtra = 8;
constexpr std::size_t kEntryMin = 8 * 5 + 1 + 4;  // key, end, seed, seq, media, flags, n_kv

[[noreturn]] void corrupt(const std::string& what) { throw ValueError("applier state is corrupt: " + what); }

bool has_extra(const Entry& e) {
    const Extra* x = e.extra.get();
    return x && (x->lead || !x->tail.empty() || !x->tail_mm.empty() || !x->dependents.empty());
}

void put_opt(binio::Writer& w, const std::optional<std::uint64_t>& v) {
    w.u8(v.has_value());
    w.u64(v.value_or(0));
}

void encode_entry(binio::Writer& w, std::uint64_t key, const Entry& e, const std::vector<std::uint64_t>& bit) {
    const bool extra = has_extra(e);
    w.u64(key);
    w.u64(e.end);
    w.u64(e.seed);
    w.u64(e.seq);
    std::uint64_t media = 0;
    for (std::size_t id = 0; id < bit.size(); ++id)
        if ((e.media >> id) & 1) media |= bit[id];
    w.u64(media);
    w.u8(static_cast<std::uint8_t>((e.dep ? kDep : 0) | ((e.first_ok & 1) ? kOk0 : 0) | ((e.first_ok & 2) ? kOk1 : 0) |
                                   (extra ? kExtra : 0)));
    w.u32(e.n_kv);
    for (std::uint32_t q = 0; q < e.n_kv; ++q) w.u64(e.kv(q));
    if (!extra) return;
    const Extra& x = *e.extra;
    w.u64(x.start);
    w.u32(x.lead);
    w.u64(x.has_parent ? x.parent : kNoParent);
    w.u8(x.has_parent);
    w.u32(static_cast<std::uint32_t>(x.tail.size()));
    w.raw(x.tail.data(), x.tail.size() * 4);
    w.u32(static_cast<std::uint32_t>(x.tail_mm.size()));
    for (const OwnedMm& it : x.tail_mm) {
        w.text(it.id);
        w.u64(it.offset);
    }
    w.u32(static_cast<std::uint32_t>(x.dependents.size()));
    for (const std::uint64_t d : x.dependents) w.u64(d);
}

void encode_group(binio::Writer& w, std::uint32_t gid, const GroupState& g, const std::vector<std::uint64_t>& bit) {
    w.u32(gid);
    put_opt(w, g.engine_block_size);
    std::vector<std::pair<std::uint64_t, std::uint64_t>> order;  // (seq, key)
    order.reserve(g.entries.size());
    g.entries.for_each([&](std::uint64_t key, const Entry& e) { order.emplace_back(e.seq, key); });
    std::sort(order.begin(), order.end());
    w.u64(order.size());
    for (const auto& sk : order) encode_entry(w, sk.second, *g.entries.find(sk.second), bit);
    for (const auto& refs : g.refs) {
        std::vector<std::pair<std::uint64_t, std::uint32_t>> rs;
        rs.reserve(refs.size());
        refs.for_each([&](std::uint64_t x, std::uint32_t c) { rs.emplace_back(x, c); });
        std::sort(rs.begin(), rs.end());
        w.u64(rs.size());
        for (const auto& xc : rs) {
            w.u64(xc.first);
            w.u32(xc.second);
        }
    }
}

bool flag(binio::Reader& rd) {
    const std::uint8_t v = rd.u8();
    if (v > 1) corrupt("flag byte " + std::to_string(v));
    return v == 1;
}

std::optional<std::uint64_t> get_opt(binio::Reader& rd) {
    const bool has = flag(rd);
    const std::uint64_t v = rd.u64();
    return has ? std::optional<std::uint64_t>(v) : std::nullopt;
}

void decode_entry(binio::Reader& rd, std::size_t n_media, Entry& e, std::uint64_t& key) {
    key = rd.u64();
    e.end = rd.u64();
    e.seed = rd.u64();
    e.seq = rd.u64();
    e.media = rd.u64();
    const std::uint8_t flags = rd.u8();
    const bool beyond = n_media + 1 < 64 && (e.media >> (n_media + 1)) != 0;
    if (flags > 15 || e.media == 0 || beyond) corrupt("bad entry flags or media");
    const std::uint32_t n_kv = rd.u32();
    if (std::uint64_t{n_kv} * 8 > rd.left()) rd.truncated();
    e.n_kv = n_kv;
    e.dep = flags & kDep;
    e.first_ok = static_cast<std::uint8_t>(((flags & kOk0) ? 1 : 0) | ((flags & kOk1) ? 2 : 0));
    if (n_kv > 0) e.kv0 = rd.u64();
    if (n_kv > 1) {
        e.more = std::make_unique<std::uint64_t[]>(n_kv - 1);
        for (std::uint32_t q = 1; q < n_kv; ++q) e.more[q - 1] = rd.u64();
    }
    if (!(flags & kExtra)) return;
    auto x = std::make_unique<Extra>();
    x->start = rd.u64();
    x->lead = rd.u32();
    const std::uint64_t parent = rd.u64();
    x->has_parent = flag(rd);
    x->parent = x->has_parent ? parent : 0;
    const std::size_t n_tail = rd.u32();
    if (n_tail > rd.left() / 4) rd.truncated();
    x->tail.resize(n_tail);
    const std::uint8_t* tail = rd.raw(n_tail * 4);
    if (n_tail) std::memcpy(x->tail.data(), tail, n_tail * 4);  // data() may be null when empty
    for (std::uint32_t i = 0, n = rd.u32(); i < n; ++i) {
        OwnedMm it;
        it.id = rd.text();
        it.offset = rd.u64();
        x->tail_mm.push_back(std::move(it));
    }
    const std::uint32_t n_dep = rd.u32();
    if (std::uint64_t{n_dep} * 8 > rd.left()) rd.truncated();
    for (std::uint32_t i = 0; i < n_dep; ++i) x->dependents.push_back(rd.u64());
    e.extra = std::move(x);
}

void decode_group(binio::Reader& rd, std::size_t n_media, GroupState& g,
                  std::vector<std::pair<std::uint64_t, std::uint64_t>>& order, std::uint64_t max_seq) {
    g.engine_block_size = get_opt(rd);
    std::uint64_t last_seq = 0;
    for (std::uint64_t i = 0, n = rd.count(kEntryMin); i < n; ++i) {
        Entry e;
        std::uint64_t key = 0;
        decode_entry(rd, n_media, e, key);
        bool inserted = false;
        Entry& slot = g.entries.get(key, inserted);
        if (!inserted || e.seq <= last_seq || e.seq > max_seq) corrupt("entries repeat or are out of order");
        last_seq = e.seq;
        order.emplace_back(key, e.seq);
        slot = std::move(e);
    }
    for (auto& refs : g.refs) {
        bool first = true;
        std::uint64_t prev = 0;
        for (std::uint64_t i = 0, n = rd.count(12); i < n; ++i) {
            const std::uint64_t x = rd.u64();
            const std::uint32_t c = rd.u32();
            if ((!first && x <= prev) || c == 0) corrupt("reference counts out of order");
            bool added = false;
            refs.get(x, added) = c;
            prev = x;
            first = false;
        }
    }
}

}  // namespace

std::string encode_replica(const ReplicaState& st, std::size_t block_size, const std::string& salt,
                           std::uint64_t seq, const std::vector<std::string>& media_names) {
    binio::Writer w;
    w.u32(static_cast<std::uint32_t>(block_size));
    w.text(salt);
    w.u64(seq);
    w.u8(st.salt.has_value());
    w.text(st.salt.value_or(std::string()));
    w.u64(st.batches);
    for (const std::uint64_t s : st.skipped) w.u64(s);
    w.u64(st.k);
    put_opt(w, st.engine_block_size);
    w.u8(st.last_ts.has_value());
    w.f64(st.last_ts.value_or(0.0));
    std::vector<std::string> sorted;
    for (std::size_t id = 1; id < media_names.size(); ++id) sorted.push_back(media_names[id]);
    std::sort(sorted.begin(), sorted.end());
    w.u32(static_cast<std::uint32_t>(sorted.size()));
    for (const std::string& m : sorted) w.text(m);
    std::vector<std::uint64_t> bit(media_names.size(), 1);  // medium id -> its bit in the file
    for (std::size_t id = 1; id < media_names.size(); ++id) {
        const auto pos = std::lower_bound(sorted.begin(), sorted.end(), media_names[id]) - sorted.begin();
        bit[id] = std::uint64_t{1} << (pos + 1);
    }
    std::uint32_t n_groups = 0;
    st.each_group([&](const GroupState&) { ++n_groups; });
    w.u32(n_groups);
    for (std::size_t gid = 0; gid < st.groups.size(); ++gid)
        if ((st.group_mask >> gid) & 1) encode_group(w, static_cast<std::uint32_t>(gid), *st.groups[gid], bit);
    return std::move(w.buf);
}

DecodedReplica decode_replica(const std::uint8_t* data, std::size_t len, std::size_t block_size,
                              const std::string& salt) {
    binio::Reader rd(data, 0, len, kWhat);
    const std::uint32_t bs = rd.u32();
    if (bs != block_size)
        throw ValueError("applier state was written for block_size " + std::to_string(bs) + ", this applier has " +
                         std::to_string(block_size));
    if (rd.text() != salt) throw ValueError("applier state was written for another salt than this applier's");
    DecodedReplica out;
    out.max_seq = rd.u64();
    out.state = std::make_unique<ReplicaState>();
    ReplicaState& st = *out.state;
    const bool has_salt = flag(rd);
    std::string own = rd.text();
    if (has_salt) {
        st.root = root_hash(own.data(), own.size());
        st.salt = std::move(own);
    }
    st.batches = rd.u64();
    for (std::uint64_t& s : st.skipped) s = rd.u64();
    st.k = rd.u64();
    if (st.k < 1 || st.k > 65536) corrupt("engine block " + std::to_string(st.k) + " is out of range");
    st.engine_block_size = get_opt(rd);
    const bool has_ts = flag(rd);
    const double ts = rd.f64();
    if (has_ts) st.last_ts = ts;
    out.media.push_back("GPU");
    for (std::uint32_t i = 0, n = rd.u32(); i < n; ++i) {
        std::string m = rd.text();
        if (!binio::valid_utf8(m)) corrupt("a medium is not valid UTF-8");
        out.media.push_back(std::move(m));
    }
    std::vector<std::string> names(out.media.begin() + 1, out.media.end());
    std::sort(names.begin(), names.end());
    const bool dup = std::adjacent_find(names.begin(), names.end()) != names.end();
    if (out.media.size() > kMaxMedia || dup || std::binary_search(names.begin(), names.end(), std::string("GPU")))
        corrupt("bad media table");
    for (std::uint32_t i = 0, n = rd.u32(); i < n; ++i) {
        const std::uint32_t gid = rd.u32();
        if (gid >= kMaxGroups || ((st.group_mask >> gid) & 1)) corrupt("bad group " + std::to_string(gid));
        if (st.groups.size() <= gid) st.groups.resize(gid + 1);
        if (out.order.size() <= gid) out.order.resize(gid + 1);
        st.groups[gid] = std::make_unique<GroupState>();
        st.group_mask |= std::uint64_t{1} << gid;
        decode_group(rd, out.media.size() - 1, *st.groups[gid], out.order[gid], out.max_seq);
    }
    if (rd.left()) corrupt("trailing bytes");
    return out;
}

}  // namespace kvroute::applier
