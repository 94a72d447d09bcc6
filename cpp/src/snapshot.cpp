// Router snapshots (snapshot.hpp): encode and restore. Twin of
// python/kvroute/reference/snapshot.py: same bytes, same checks in the same order, same messages.
#include "kvroute/snapshot.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "binio.hpp"
#include "events_state.hpp"
#include "kvroute/errors.hpp"
#include "kvroute/hash.hpp"
#include "kvroute/support/hash_map.hpp"

namespace kvroute {
namespace {

constexpr char kMagic[] = "KVRSNAP";
constexpr std::size_t kMagicLen = 7;
constexpr std::size_t kHead = kMagicLen + 2;
constexpr std::size_t kSum = 8;
constexpr std::uint64_t kRootParent = ~std::uint64_t{0};
constexpr std::uint64_t kClamp = std::uint64_t{1} << 62;
constexpr const char* kModes[3] = {"approximate", "precise", "hybrid"};
constexpr const char* kWhat = "snapshot";

[[noreturn]] void corrupt(const std::string& what) { throw ValueError("snapshot is corrupt: " + what); }

std::string hex64(std::uint64_t h) {
    char buf[24];
    std::snprintf(buf, sizeof buf, "0x%016llx", static_cast<unsigned long long>(h));
    return buf;
}

std::string tag_hex(const std::uint8_t* tag) {
    char buf[9];
    std::snprintf(buf, sizeof buf, "%02x%02x%02x%02x", tag[0], tag[1], tag[2], tag[3]);
    return buf;
}

void section(binio::Writer& w, const char* tag, const binio::Writer& body) {
    w.raw(tag, 4);
    w.u64(body.buf.size());
    w.raw(body.buf.data(), body.buf.size());
}

void encode_replica(binio::Writer& w, const std::string& name, std::uint64_t k, const ReplicaContents& c) {
    w.text(name);
    w.u32(static_cast<std::uint32_t>(k));
    w.u64(c.hashes.size());
    for (std::size_t i = 0; i < c.hashes.size(); ++i) {
        w.u64(c.hashes[i]);
        w.u64(static_cast<std::uint64_t>(c.parents[i]));  // -1 -> 2**64 - 1: the root
    }
    w.u64(c.held.size());
    for (std::size_t j = 0; j < c.held.size(); ++j) {
        w.u64(static_cast<std::uint64_t>(c.held[j]));
        w.f64(c.ages[j]);
    }
}

/// One REPL section, read.
struct FileReplica {
    std::string name;
    std::uint32_t k = 1;
    ReplicaContents contents;
};

/// Everything a snapshot holds, read and checked section by section.
struct Decoded {
    double written = 0;
    std::vector<FileReplica> replicas;
    std::vector<std::shared_ptr<applier::DecodedReplica>> appl;  // by replica ordinal
    std::vector<char> has_appl;
    bool has_sessions = false, has_cursors = false;
    std::vector<SessionRecord> sessions;  // replica: ordinal in the file
    std::vector<SnapshotCursor> cursors;
};

std::string utf8(std::string s, const std::string& what) {
    if (!binio::valid_utf8(s)) corrupt(what + " is not valid UTF-8");
    return s;
}

double read_conf(binio::Reader& rd, const Router& router) {
    const std::uint8_t mode = rd.u8();
    const std::uint32_t bs = rd.u32();
    const std::string salt = rd.text();
    const double written = rd.f64();
    const RouterOptions& o = router.options();
    const std::string name = mode < 3 ? kModes[mode] : "#" + std::to_string(mode);
    const std::string mine = kModes[static_cast<int>(o.mode)];
    if (name != mine) throw ValueError("snapshot was written for mode '" + name + "', this router runs '" + mine + "'");
    if (bs != o.block_size)
        throw ValueError("snapshot was written for block_size " + std::to_string(bs) + ", this router has " +
                         std::to_string(o.block_size));
    if (salt != o.salt) throw ValueError("snapshot was written for another salt than this router's");
    return written;
}

FileReplica read_replica(binio::Reader& rd, std::size_t i) {
    FileReplica x;
    x.name = utf8(rd.text(), "replica " + std::to_string(i) + "'s name");
    if (x.name.empty()) corrupt("replica " + std::to_string(i) + " has an empty name");
    x.k = rd.u32();
    if (x.k < 1 || x.k > PrefixIndex::kMaxEngineBlock)
        corrupt("replica '" + x.name + "' has engine block " + std::to_string(x.k));
    ReplicaContents& c = x.contents;
    const std::uint64_t n = rd.count(16);
    c.hashes.resize(n);
    c.parents.resize(n);
    for (std::uint64_t i2 = 0; i2 < n; ++i2) {
        c.hashes[i2] = rd.u64();
        const std::uint64_t p = rd.u64();
        c.parents[i2] = p == kRootParent ? -1 : static_cast<std::int64_t>(std::min(p, kClamp));
    }
    const std::uint64_t m = rd.count(16);
    c.held.resize(m);
    c.ages.resize(m);
    for (std::uint64_t j = 0; j < m; ++j) {
        c.held[j] = static_cast<std::int64_t>(std::min(rd.u64(), kClamp));
        c.ages[j] = rd.f64();
    }
    return x;
}

void read_sessions(binio::Reader& rd, Decoded& d) {
    const std::uint64_t n = rd.count(24);
    for (std::uint64_t j = 0; j < n; ++j) {
        SessionRecord s;
        s.key = utf8(rd.text(), "session " + std::to_string(j));
        s.replica = rd.u32();
        const std::uint64_t blocks = rd.u64();
        s.age = rd.f64();
        if (blocks >= (std::uint64_t{1} << 63) || !(std::isfinite(s.age) && s.age >= 0))
            corrupt("session " + std::to_string(j) + " has a bad block count or age");
        s.blocks = static_cast<std::int64_t>(blocks);
        d.sessions.push_back(std::move(s));
    }
}

void read_cursors(binio::Reader& rd, Decoded& d) {
    const std::uint64_t n = rd.count(20);
    std::unordered_map<std::string, std::size_t> place;  // name -> its index in d.cursors
    for (std::uint64_t j = 0; j < n; ++j) {
        SnapshotCursor c;
        c.name = utf8(rd.text(), "cursor " + std::to_string(j));
        c.seq = rd.u64();
        c.digest = rd.u64();
        const auto [it, fresh] = place.emplace(c.name, d.cursors.size());
        if (fresh) d.cursors.push_back(std::move(c));
        else d.cursors[it->second] = std::move(c);  // a dict keeps the first place, the last value
    }
}

void read_section(const std::uint8_t* tag, binio::Reader& rd, Decoded& d, const Router& router,
                  const EventApplier* applier) {
    const std::string t(reinterpret_cast<const char*>(tag), 4);
    if (t == "CONF") {
        d.written = read_conf(rd, router);
    } else if (t == "REPL") {
        d.replicas.push_back(read_replica(rd, d.replicas.size()));
        d.appl.emplace_back();
        d.has_appl.push_back(0);
    } else if (t == "APPL") {
        const std::uint32_t i = rd.u32();
        if (i >= d.replicas.size() || d.has_appl[i]) corrupt("applier state for an unknown or repeated replica");
        const std::size_t n = rd.left();
        const std::uint8_t* blob = rd.raw(n);
        d.has_appl[i] = 1;
        if (applier) d.appl[i] = applier->decode_replica(blob, n);
    } else if (t == "SESS" && !d.has_sessions) {
        d.has_sessions = true;
        read_sessions(rd, d);
    } else if (t == "CURS" && !d.has_cursors) {
        d.has_cursors = true;
        read_cursors(rd, d);
    } else if (t == "SESS" || t == "CURS") {
        corrupt("section " + tag_hex(tag) + " is repeated");
    } else if (!(tag[0] >= 0x61 && tag[0] <= 0x7A)) {  // a lowercase first letter marks a section readers may skip
        throw ValueError("snapshot has an unknown required section " + tag_hex(tag));
    } else {
        rd.raw(rd.left());
    }
}

void check_whole(const Decoded& d, const Router& router, const EventApplier* applier) {
    std::vector<std::string> names;
    for (const FileReplica& x : d.replicas) names.push_back(x.name);
    std::sort(names.begin(), names.end());
    if (std::adjacent_find(names.begin(), names.end()) != names.end()) corrupt("a replica name is repeated");
    for (std::size_t j = 0; j < d.sessions.size(); ++j)
        if (d.sessions[j].replica >= d.replicas.size())
            corrupt("session " + std::to_string(j) + " names replica " + std::to_string(d.sessions[j].replica) +
                    " of " + std::to_string(d.replicas.size()));
    if (applier) {
        std::vector<const applier::DecodedReplica*> states;
        for (std::size_t i = 0; i < d.replicas.size(); ++i) {
            if (!d.appl[i])
                throw ValueError("snapshot has no event applier state for replica '" + d.replicas[i].name + "'");
            states.push_back(d.appl[i].get());
        }
        applier->check_media(states);
    }
    const PrefixIndex& index = *router.index();
    for (const FileReplica& x : d.replicas) {
        try {
            index.check_import(x.contents);
        } catch (const ValueError& e) {
            throw ValueError("snapshot replica '" + x.name + "': " + e.what());
        }
    }
    support::HashMap<std::uint64_t> parent_of;  // the root: 2**64 - 1
    for (const FileReplica& x : d.replicas) {
        const ReplicaContents& c = x.contents;
        for (std::size_t j = 0; j < c.hashes.size(); ++j) {
            const std::int64_t pi = c.parents[j];
            const std::uint64_t p = pi < 0 ? kRootParent : c.hashes[static_cast<std::size_t>(pi)];
            bool fresh = false;
            std::uint64_t& have = parent_of.get(c.hashes[j], fresh);
            if (fresh) have = p;
            else if (have != p) corrupt("block " + hex64(c.hashes[j]) + " has two parents");
        }
    }
}

Decoded decode(const std::uint8_t* data, std::size_t len, const Router& router, const EventApplier* applier) {
    if (len < kMagicLen || std::memcmp(data, kMagic, kMagicLen) != 0)
        throw ValueError("not a kvroute snapshot (bad magic)");
    if (len < kHead) throw ValueError("snapshot is truncated");
    const unsigned version = data[kMagicLen] | (unsigned{data[kMagicLen + 1]} << 8);
    if (version != kSnapshotVersion)
        throw ValueError("snapshot version " + std::to_string(version) + " is not supported (this kvroute reads version " +
                         std::to_string(kSnapshotVersion) + ")");
    if (len < kHead + kSum) throw ValueError("snapshot is truncated");
    std::uint64_t sum = 0;
    std::memcpy(&sum, data + len - kSum, kSum);
    if (xxh3_64(data, len - kSum, 0) != sum)
        throw ValueError("snapshot checksum does not match: the file is corrupt or truncated");
    binio::Reader rd(data, kHead, len - kSum, kWhat);
    Decoded d;
    bool first = true;
    while (rd.left()) {
        const std::uint8_t* tag = rd.raw(4);
        const std::uint64_t length = rd.u64();
        if (length > rd.left()) rd.truncated();
        binio::Reader body(data, rd.pos(), rd.pos() + length, kWhat);
        rd.raw(length);
        if (first != (std::memcmp(tag, "CONF", 4) == 0)) corrupt("the CONF section must come first, once");
        first = false;
        read_section(tag, body, d, router, applier);
        if (body.left()) corrupt("section " + tag_hex(tag) + " has trailing bytes");
    }
    if (first || !d.has_sessions || !d.has_cursors) corrupt("a required section is missing");
    check_whole(d, router, applier);
    return d;
}

}  // namespace

void check_snapshot_applier(const Router& router, const EventApplier* applier) {
    if (!applier) return;
    if (applier->index() != router.index())
        throw ValueError("applier must feed this router's index (EventApplier(router.index, ...))");
    if (applier->tier_index())
        throw ValueError("an applier with a tier_index cannot be exported or imported "
                         "(the tier index is not part of a snapshot)");
    if (applier->block_size() != router.options().block_size)
        throw ValueError("applier block_size " + std::to_string(applier->block_size()) + " differs from the router's " +
                         std::to_string(router.options().block_size));
}

SnapshotWritten encode_snapshot(const Router& router, const EventApplier* applier,
                                const std::vector<SnapshotCursor>& cursors, double now, double wall_now) {
    check_snapshot_applier(router, applier);
    const RouterOptions& o = router.options();
    PrefixIndex& index = *router.index();
    SnapshotWritten out;
    binio::Writer w;
    w.raw(kMagic, kMagicLen);
    w.u16(kSnapshotVersion);
    binio::Writer conf;
    conf.u8(static_cast<std::uint8_t>(o.mode));
    conf.u32(static_cast<std::uint32_t>(o.block_size));
    conf.text(o.salt);
    conf.f64(wall_now);
    section(w, "CONF", conf);
    out.replicas = router.replicas();
    std::vector<std::uint32_t> ids;
    std::unordered_map<std::uint32_t, std::uint32_t> ordinal;
    for (const std::string& name : out.replicas) {
        const std::uint32_t r = router.replica_id(name);
        ordinal.emplace(r, static_cast<std::uint32_t>(ids.size()));
        ids.push_back(r);
        binio::Writer rep;
        const ReplicaContents c = index.export_replica(r, now);
        encode_replica(rep, name, index.engine_block(r), c);
        out.blocks += c.held.size();
        section(w, "REPL", rep);
    }
    if (applier) {
        for (std::size_t i = 0; i < ids.size(); ++i) {
            binio::Writer ap;
            ap.u32(static_cast<std::uint32_t>(i));
            const std::string blob = applier->export_replica(ids[i]);
            ap.raw(blob.data(), blob.size());
            section(w, "APPL", ap);
        }
    }
    const std::vector<SessionRecord> sessions = router.export_sessions(now);
    binio::Writer ss;
    ss.u64(sessions.size());
    for (const SessionRecord& s : sessions) {
        ss.text(s.key);
        ss.u32(ordinal.at(s.replica));
        ss.u64(static_cast<std::uint64_t>(s.blocks));
        ss.f64(s.age);
    }
    section(w, "SESS", ss);
    out.sessions = sessions.size();
    binio::Writer cw;
    cw.u64(cursors.size());
    for (const SnapshotCursor& c : cursors) {
        cw.text(c.name);
        cw.u64(c.seq);
        cw.u64(c.digest);
    }
    section(w, "CURS", cw);
    w.u64(xxh3_64(w.buf.data(), w.buf.size(), 0));
    out.bytes = std::move(w.buf);
    return out;
}

SnapshotRestored restore_snapshot(Router& router, EventApplier* applier, const std::uint8_t* data, std::size_t len,
                                  double now) {
    check_snapshot_applier(router, applier);
    Decoded d = decode(data, len, router, applier);
    PrefixIndex& index = *router.index();
    SnapshotRestored out;
    std::vector<std::uint32_t> ids;
    const std::vector<std::string> have = router.replicas();
    for (std::size_t i = 0; i < d.replicas.size(); ++i) {
        const FileReplica& x = d.replicas[i];
        const bool known = std::find(have.begin(), have.end(), x.name) != have.end();
        const std::uint32_t r = known ? router.replica_id(x.name) : router.add_replica(x.name);
        ids.push_back(r);
        index.set_engine_block(r, x.k);
        out.blocks += index.import_replica(r, x.contents, now);
        if (applier) applier->install_replica(r, *d.appl[i]);
        out.replicas.push_back(x.name);
    }
    for (SessionRecord& s : d.sessions) s.replica = ids[s.replica];
    out.sessions = router.import_sessions(ids, d.sessions, now);
    out.cursors = std::move(d.cursors);
    out.written = d.written;
    return out;
}

}  // namespace kvroute
