// EventApplier (see events.hpp); messages match python/kvroute/reference/events.py exactly.
#include "kvroute/events.hpp"

#include <algorithm>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>

#include "kvroute/errors.hpp"
#include "kvroute/hash.hpp"
#include "kvroute/msgpack.hpp"

namespace kvroute {
namespace {

namespace mp = msgpack;

std::string int_text(const mp::Item& it) {
    return it.negative ? std::to_string(static_cast<std::int64_t>(it.u)) : std::to_string(it.u);
}

/// Open-addressing map from 64-bit hashes (linear probing, backward-shift deletion): the
/// per-block maps are the hot path, and node-based maps allocate per block. Key, flag and
/// value share a slot so that a lookup touches one cache line.
template <class V>
class HashMap {
public:
    std::size_t size() const noexcept { return size_; }

    V* find(std::uint64_t key) noexcept {
        if (size_ == 0) return nullptr;
        for (std::size_t i = slot(key);; i = (i + 1) & mask_) {
            Slot& s = slots_[i];
            if (!s.used) return nullptr;
            if (s.key == key) return &s.val;
        }
    }
    const V* find(std::uint64_t key) const noexcept {
        return const_cast<HashMap*>(this)->find(key);
    }
    /// The value for key, default-constructed (and `inserted` set) when new.
    V& get(std::uint64_t key, bool& inserted) {
        if ((size_ + 1) * 2 > slots_.size()) grow();
        for (std::size_t i = slot(key);; i = (i + 1) & mask_) {
            Slot& s = slots_[i];
            if (!s.used) {
                s.used = true;
                s.key = key;
                ++size_;
                inserted = true;
                return s.val;  // empty slots always hold V{}
            }
            if (s.key == key) {
                inserted = false;
                return s.val;
            }
        }
    }
    bool erase(std::uint64_t key) noexcept {
        if (size_ == 0) return false;
        std::size_t i = slot(key);
        for (;; i = (i + 1) & mask_) {
            if (!slots_[i].used) return false;
            if (slots_[i].key == key) break;
        }
        // Backward shift: move later members of the probe run into the hole.
        std::size_t hole = i;
        for (std::size_t j = (i + 1) & mask_; slots_[j].used; j = (j + 1) & mask_) {
            const std::size_t home = slot(slots_[j].key);
            const bool movable = hole <= j ? (home <= hole || home > j) : (home <= hole && home > j);
            if (movable) {
                slots_[hole].key = slots_[j].key;
                slots_[hole].val = std::move(slots_[j].val);
                hole = j;
            }
        }
        slots_[hole].used = false;
        slots_[hole].val = V{};
        --size_;
        return true;
    }
    /// Empties the map but keeps its slots: an engine that cleared its cache refills it.
    void clear() {
        if (size_ == 0) return;
        for (Slot& s : slots_) {
            if (s.used) {
                s.used = false;
                s.val = V{};
            }
        }
        size_ = 0;
    }

private:
    struct Slot {
        std::uint64_t key = 0;
        bool used = false;
        V val{};
    };

    static std::uint64_t mix(std::uint64_t x) noexcept {
        // splitmix64 finalizer: engine hashes in tests are small integers.
        x ^= x >> 30;
        x *= 0xbf58476d1ce4e5b9ULL;
        x ^= x >> 27;
        x *= 0x94d049bb133111ebULL;
        return x ^ (x >> 31);
    }
    std::size_t slot(std::uint64_t key) const noexcept {
        return static_cast<std::size_t>(mix(key)) & mask_;
    }
    void grow() {
        const std::size_t cap = slots_.empty() ? 16 : slots_.size() * 2;
        std::vector<Slot> old(cap);
        std::swap(old, slots_);
        mask_ = cap - 1;
        for (Slot& s : old) {
            if (!s.used) continue;
            std::size_t i = slot(s.key);
            while (slots_[i].used) i = (i + 1) & mask_;
            slots_[i].used = true;
            slots_[i].key = s.key;
            slots_[i].val = std::move(s.val);
        }
    }

    std::vector<Slot> slots_;
    std::size_t size_ = 0;
    std::size_t mask_ = 0;
};

/// One engine hash: its kvroute hashes and live count per medium (0 is "GPU").
struct Entry {
    std::uint64_t kv0 = 0;
    std::unique_ptr<std::uint64_t[]> more;  // kv[1..k) when an engine block spans k > 1
    std::uint32_t k = 0;
    std::uint32_t gpu = 0;
    std::unique_ptr<std::vector<std::pair<std::uint32_t, std::uint32_t>>> others;

    std::uint64_t kv(std::uint32_t i) const noexcept { return i == 0 ? kv0 : more[i - 1]; }
    std::uint64_t last() const noexcept { return kv(k - 1); }
    bool alive() const noexcept { return gpu > 0 || (others && !others->empty()); }
    std::uint32_t* count(std::uint32_t medium, bool create) {
        if (medium == 0) return &gpu;
        if (!others) {
            if (!create) return nullptr;
            others = std::make_unique<std::vector<std::pair<std::uint32_t, std::uint32_t>>>();
        }
        for (auto& mc : *others)
            if (mc.first == medium) return &mc.second;
        if (!create) return nullptr;
        others->emplace_back(medium, 0);
        return &others->back().second;
    }
    void drop(std::uint32_t medium) {
        if (medium == 0 || !others) return;
        for (std::size_t i = 0; i < others->size(); ++i)
            if ((*others)[i].first == medium) {
                others->erase(others->begin() + static_cast<std::ptrdiff_t>(i));
                return;
            }
    }
};

struct ReplicaState {
    HashMap<Entry> entries;
    std::vector<std::uint64_t> dead;  // entries whose last count went; purged after the batch
    HashMap<std::uint32_t> refs[2];   // kvroute hash -> engine blocks mapping to it, per tier
    std::optional<std::uint64_t> engine_block_size;
    std::optional<std::string> unusable;
    std::optional<double> last_ts;
    std::uint64_t batches = 0;
    std::optional<std::string> salt;  // set_salt(): this replica's own salt and chain root
    std::uint64_t root = 0;
};

enum class Kind : std::uint8_t { Stored, Removed, Cleared };

struct Event {
    Kind kind = Kind::Cleared;
    std::size_t h_begin = 0, h_count = 0;
    std::size_t t_begin = 0, t_count = 0;
    bool has_parent = false;
    std::uint64_t parent = 0;
    std::uint64_t engine_block_size = 0;
    std::uint32_t medium = 0;
};

struct Batch {
    double ts = 0.0;
    std::uint64_t ignored = 0;
    std::vector<Event> events;
    std::vector<std::uint64_t> hashes;
    std::vector<std::uint32_t> tokens;
    void reset() {
        ts = 0.0;
        ignored = 0;
        events.clear();
        hashes.clear();
        tokens.clear();
    }
};

struct Malformed {
    std::string message;
};

// Reads one whole value: its header, with a container's elements skipped.
mp::Item value_at(const std::uint8_t* p) noexcept {
    const mp::Item it = mp::next(p);
    return it;
}

bool is_str(const mp::Item& it, std::string_view s) noexcept {
    return it.type == mp::Type::Str && it.str() == s;
}

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
    std::vector<std::string> reports;
    std::unordered_map<std::string, std::uint32_t> media{{"GPU", 0}};
    // Scratch reused across calls, so a batch allocates nothing once warm.
    Batch batch;
    std::vector<std::uint64_t> chain, gone, kvbuf;

    std::uint32_t medium_id(std::string_view s) {
        if (s == "GPU") return 0;
        auto it = media.find(std::string(s));
        if (it != media.end()) return it->second;
        const auto id = static_cast<std::uint32_t>(media.size());
        media.emplace(std::string(s), id);
        return id;
    }

    ReplicaState& state(std::int64_t r) {
        const auto i = static_cast<std::size_t>(r);
        if (replicas.size() <= i) replicas.resize(i + 1);
        if (!replicas[i]) replicas[i] = std::make_unique<ReplicaState>();
        return *replicas[i];
    }

    void check(std::int64_t r) const {
        const std::uint32_t n = index->num_replicas();
        if (r < 0 || r >= static_cast<std::int64_t>(n))
            throw IndexError("replica " + std::to_string(r) + " is out of range [0, " +
                             std::to_string(n) + ")");
        if (!index->is_live(r)) throw IndexError("replica " + std::to_string(r) + " was removed");
    }

    static void grow(PrefixIndex& ix, std::int64_t r) {
        while (static_cast<std::int64_t>(ix.num_replicas()) <= r) ix.add_replica();
    }

    // -- decoding ---------------------------------------------------------------------------

    static std::string where(std::size_t i, bool stored) {
        return "event " + std::to_string(i) + (stored ? " (BlockStored)" : " (BlockRemoved)");
    }

    // Consumes the block_hashes value at p (null: missing).
    void hashes_field(std::size_t i, bool stored, const std::uint8_t*& p) {
        const mp::Item h = item_or_nil(p);
        if (h.type != mp::Type::Array)
            throw Malformed{where(i, stored) + " block_hashes must be an array, got " + mp::type_name(h.type)};
        for (std::uint32_t j = 0; j < h.len; ++j) {
            const std::uint8_t c = *p;
            if (c == 0xCF) {  // vLLM's int-mode hashes are mostly >= 2**63
                std::uint64_t v = 0;
                for (int b = 1; b <= 8; ++b) v = (v << 8) | p[b];
                batch.hashes.push_back(v);
                p += 9;
                continue;
            }
            const mp::Item x = mp::next(p);
            if (x.type == mp::Type::Int) {
                batch.hashes.push_back(x.u);
            } else if (x.type == mp::Type::Bin) {
                const std::uint32_t from = x.len > 8 ? x.len - 8 : 0;
                std::uint64_t v = 0;
                for (std::uint32_t b = from; b < x.len; ++b) v = (v << 8) | x.data[b];
                batch.hashes.push_back(v);
            } else {
                throw Malformed{where(i, stored) + " block_hashes[" + std::to_string(j) +
                                "] must be an int or bin, got " + mp::type_name(x.type)};
            }
        }
    }

    std::uint32_t medium_field(std::size_t i, bool stored, const std::uint8_t*& at) {
        if (!at) return 0;
        const mp::Item m = mp::next(at);
        if (m.type == mp::Type::Nil) return 0;
        if (m.type != mp::Type::Str)
            throw Malformed{where(i, stored) + " medium must be nil or a str, got " + mp::type_name(m.type)};
        return medium_id(m.str());
    }

    // Reads a Str/Int/... header or, at a missing field (null), nil.
    static mp::Item item_or_nil(const std::uint8_t*& q) noexcept {
        if (!q) return mp::Item{};
        return mp::next(q);
    }

    // Evaluates BlockStored field `slot` (0 hashes, 1 parent, 2 tokens, 3 block_size with the
    // length check, 4 lora_id, 5 medium) at q (null: missing), in the reference's order.
    // On success q is past the value.
    void stored_slot(std::size_t i, int slot, const std::uint8_t*& q, Event& out) {
        switch (slot) {
            case 0:
                out.h_begin = batch.hashes.size();
                hashes_field(i, true, q);
                out.h_count = batch.hashes.size() - out.h_begin;
                return;
            case 1: {
                const mp::Item par = item_or_nil(q);
                if (par.type == mp::Type::Int) {
                    out.has_parent = true;
                    out.parent = par.u;
                } else if (par.type == mp::Type::Bin) {
                    out.has_parent = true;
                    const std::uint32_t from = par.len > 8 ? par.len - 8 : 0;
                    for (std::uint32_t b = from; b < par.len; ++b) out.parent = (out.parent << 8) | par.data[b];
                } else if (par.type != mp::Type::Nil) {
                    throw Malformed{where(i, true) + " parent_block_hash must be nil, an int or bin, got " +
                                    mp::type_name(par.type)};
                }
                return;
            }
            case 2: {
                const mp::Item toks = item_or_nil(q);
                if (toks.type != mp::Type::Array)
                    throw Malformed{where(i, true) + " token_ids must be an array, got " + mp::type_name(toks.type)};
                out.t_begin = batch.tokens.size();
                out.t_count = toks.len;
                batch.tokens.resize(out.t_begin + toks.len);
                std::uint32_t* dst = batch.tokens.data() + out.t_begin;
                for (std::uint32_t j = 0; j < toks.len; ++j) {
                    // Token ids are non-negative ints below 2**32: the common encodings first.
                    const std::uint8_t c = *q;
                    if (c <= 0x7F) {
                        dst[j] = c;
                        q += 1;
                    } else if (c == 0xCD) {
                        dst[j] = static_cast<std::uint32_t>((q[1] << 8) | q[2]);
                        q += 3;
                    } else if (c == 0xCE) {
                        dst[j] = (std::uint32_t{q[1]} << 24) | (std::uint32_t{q[2]} << 16) |
                                 (std::uint32_t{q[3]} << 8) | q[4];
                        q += 5;
                    } else if (c == 0xCC) {
                        dst[j] = q[1];
                        q += 2;
                    } else {
                        const mp::Item t = mp::next(q);
                        if (t.type != mp::Type::Int)
                            throw Malformed{where(i, true) + " token_ids[" + std::to_string(j) +
                                            "] must be an int, got " + mp::type_name(t.type)};
                        if (t.negative || t.u >= (std::uint64_t{1} << 32))
                            throw Malformed{where(i, true) + " token_ids[" + std::to_string(j) + "] = " +
                                            int_text(t) + " is out of range [0, 2**32)"};
                        dst[j] = static_cast<std::uint32_t>(t.u);
                    }
                }
                return;
            }
            case 3: {
                const std::uint64_t n = out.h_count, m = out.t_count;
                const mp::Item bs = item_or_nil(q);
                if (bs.type != mp::Type::Nil) {
                    if (bs.type != mp::Type::Int)
                        throw Malformed{where(i, true) + " block_size must be nil or an int, got " +
                                        mp::type_name(bs.type)};
                    if (bs.negative || bs.u == 0)
                        throw Malformed{where(i, true) + " block_size must be positive, got " + int_text(bs)};
                    // n * size without overflow: sizes beyond the token count cannot match anyway.
                    if (n == 0 ? m != 0 : (bs.u > m || n * bs.u != m))
                        throw Malformed{where(i, true) + " has " + std::to_string(m) + " token_ids for " +
                                        std::to_string(n) + " blocks of " + std::to_string(bs.u) + " tokens"};
                    out.engine_block_size = bs.u;
                } else {
                    if (n == 0 || m == 0 || m % n != 0)
                        throw Malformed{where(i, true) + " has " + std::to_string(m) + " token_ids for " +
                                        std::to_string(n) + " blocks"};
                    out.engine_block_size = m / n;
                }
                return;
            }
            case 4:
                if (q) mp::skip(q);
                return;
            default:
                out.medium = medium_field(i, true, q);
                return;
        }
    }

    // BlockRemoved fields: 0 hashes, 1 medium.
    void removed_slot(std::size_t i, int slot, const std::uint8_t*& q, Event& out) {
        if (slot == 0) {
            out.h_begin = batch.hashes.size();
            hashes_field(i, false, q);
            out.h_count = batch.hashes.size() - out.h_begin;
        } else {
            out.medium = medium_field(i, false, q);
        }
    }

    // Positional event [tag, fields...]: one pass, evaluating fields in position order, which is
    // the reference's order; missing trailing fields are nil.
    void event_array(std::size_t i, std::uint32_t len, const std::uint8_t*& p) {
        if (len == 0) throw Malformed{"event " + std::to_string(i) + " is an empty array"};
        const mp::Item tag = mp::next(p);
        if (tag.type != mp::Type::Str) {
            throw Malformed{"event " + std::to_string(i) + " type must be a str, got " +
                            mp::type_name(tag.type)};
        }
        const std::string_view name = tag.str();
        const bool stored = name == "BlockStored";
        if (!stored && name != "BlockRemoved") {
            for (std::uint32_t k = 1; k < len; ++k) mp::skip(p);
            if (name == "AllBlocksCleared") batch.events.push_back(Event{});
            else ++batch.ignored;
            return;
        }
        Event out;
        out.kind = stored ? Kind::Stored : Kind::Removed;
        const int want = stored ? 6 : 2;
        int slot = 0;
        for (std::uint32_t k = 1; k < len; ++k) {
            if (slot < want) {
                if (stored) stored_slot(i, slot, p, out);
                else removed_slot(i, slot, p, out);
                ++slot;
            } else {
                mp::skip(p);
            }
        }
        for (const std::uint8_t* none = nullptr; slot < want; ++slot) {
            if (stored) stored_slot(i, slot, none, out);
            else removed_slot(i, slot, none, out);
        }
        batch.events.push_back(out);
    }

    // Reads an array of ints in [0, 2**32) at p into batch.tokens and moves p past it; false
    // (p unspecified, batch.tokens unchanged) when it is anything else.
    bool read_plain_tokens(const std::uint8_t*& p, std::size_t& begin, std::size_t& count) {
        const mp::Item arr = mp::next(p);
        if (arr.type != mp::Type::Array) return false;
        begin = batch.tokens.size();
        count = arr.len;
        batch.tokens.resize(begin + count);
        std::uint32_t* dst = batch.tokens.data() + begin;
        for (std::uint32_t j = 0; j < arr.len; ++j) {
            const std::uint8_t c = *p;
            if (c <= 0x7F) {
                dst[j] = c;
                p += 1;
            } else if (c == 0xCD) {
                dst[j] = static_cast<std::uint32_t>((p[1] << 8) | p[2]);
                p += 3;
            } else if (c == 0xCE) {
                dst[j] = (std::uint32_t{p[1]} << 24) | (std::uint32_t{p[2]} << 16) | (std::uint32_t{p[3]} << 8) | p[4];
                p += 5;
            } else if (c == 0xCC) {
                dst[j] = p[1];
                p += 2;
            } else {
                batch.tokens.resize(begin);
                return false;
            }
        }
        return true;
    }

    // Map event {"type": ..., field: ...}: keys in any order, so positions first, then the
    // fields in the reference's order.
    void event_map(std::size_t i, std::uint32_t len, const std::uint8_t*& p) {
        const std::uint8_t* type_at = nullptr;
        const std::uint8_t* at[7] = {nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr};
        // token_ids are read while passing them when they are all plain ints (they are most of
        // the payload); anything else is left for the ordered evaluation below.
        const std::uint8_t* tokens_read_at = nullptr;
        std::size_t tokens_begin = 0, tokens_count = 0;
        for (std::uint32_t k = 0; k < len; ++k) {
            const std::uint8_t* key_at = p;
            mp::skip(p);
            const mp::Item key = value_at(key_at);
            if (key.type == mp::Type::Str) {
                const std::string_view s = key.str();
                if (s == "type") type_at = p;
                else if (s == "block_hashes") at[0] = p;
                else if (s == "parent_block_hash") at[1] = p;
                else if (s == "token_ids") {
                    at[2] = p;
                    if (read_plain_tokens(p, tokens_begin, tokens_count)) {
                        tokens_read_at = at[2];
                        continue;
                    }
                    p = at[2];
                }
                else if (s == "block_size") at[3] = p;
                else if (s == "medium") at[5] = p;
            }
            mp::skip(p);
        }
        const mp::Item tag = type_at ? value_at(type_at) : mp::Item{};
        if (tag.type != mp::Type::Str)
            throw Malformed{"event " + std::to_string(i) + " type must be a str, got " + mp::type_name(tag.type)};
        const std::string_view name = tag.str();
        const bool stored = name == "BlockStored";
        if (!stored && name != "BlockRemoved") {
            if (name == "AllBlocksCleared") batch.events.push_back(Event{});
            else ++batch.ignored;
            return;
        }
        Event out;
        out.kind = stored ? Kind::Stored : Kind::Removed;
        if (stored) {
            for (int slot = 0; slot < 6; ++slot) {
                const std::uint8_t* q = slot == 4 ? nullptr : at[slot];
                if (slot == 2 && q && q == tokens_read_at) {
                    out.t_begin = tokens_begin;
                    out.t_count = tokens_count;
                    continue;
                }
                stored_slot(i, slot, q, out);
            }
        } else {
            const std::uint8_t* q0 = at[0];
            removed_slot(i, 0, q0, out);
            const std::uint8_t* q1 = at[5];
            removed_slot(i, 1, q1, out);
        }
        batch.events.push_back(out);
    }

    void event(std::size_t i, const std::uint8_t*& p) {
        const mp::Item ev = mp::next(p);
        if (ev.type == mp::Type::Array) return event_array(i, ev.len, p);
        if (ev.type == mp::Type::Map) return event_map(i, ev.len, p);
        throw Malformed{"event " + std::to_string(i) + " must be an array or map, got " + mp::type_name(ev.type)};
    }

    // Fills `batch` or throws Malformed.
    void decode(const std::uint8_t* data, std::size_t len) {
        batch.reset();
        if (!mp::validate(data, len)) throw Malformed{"payload is not valid msgpack"};
        const std::uint8_t* p = data;
        const mp::Item top = mp::next(p);
        const std::uint8_t* ts_at = nullptr;
        const std::uint8_t* events_at = nullptr;
        if (top.type == mp::Type::Array) {
            if (top.len < 2)
                throw Malformed{"batch array has " + std::to_string(top.len) +
                                " elements, expected at least 2"};
            ts_at = p;
            mp::skip(p);
            events_at = p;
        } else if (top.type == mp::Type::Map) {
            for (std::uint32_t k = 0; k < top.len; ++k) {
                const mp::Item key = mp::next(p);
                if (key.type == mp::Type::Array || key.type == mp::Type::Map) {
                    for (std::uint64_t e = 0; e < (key.type == mp::Type::Map ? 2ull : 1ull) * key.len; ++e)
                        mp::skip(p);
                }
                if (is_str(key, "ts")) ts_at = p;
                else if (is_str(key, "events")) events_at = p;
                mp::skip(p);
            }
        } else {
            throw Malformed{std::string("batch must be an array or map, got ") + mp::type_name(top.type)};
        }
        mp::Item ts;
        if (ts_at) ts = value_at(ts_at);
        if (ts.type == mp::Type::Int)
            batch.ts = ts.negative ? static_cast<double>(static_cast<std::int64_t>(ts.u))
                                   : static_cast<double>(ts.u);
        else if (ts.type == mp::Type::Float)
            batch.ts = ts.f;
        else
            throw Malformed{std::string("batch ts must be a number, got ") + mp::type_name(ts.type)};
        mp::Item evs;
        const std::uint8_t* q = events_at;
        if (q) evs = mp::next(q);
        if (evs.type != mp::Type::Array)
            throw Malformed{std::string("batch events must be an array, got ") + mp::type_name(evs.type)};
        for (std::uint32_t i = 0; i < evs.len; ++i) event(i, q);
    }

    // The first unknown parent of the batch as a message, or empty. A parent is known when
    // the map has it (unless the batch cleared the replica before) or an earlier store of
    // the batch announced it; the latter is searched backwards, as parents are usually recent.
    std::string unknown_parent(std::int64_t r, ReplicaState& st) const {
        bool map_valid = true;
        std::size_t since = 0;  // stores before this event index were cleared by the batch
        for (std::size_t e = 0; e < batch.events.size(); ++e) {
            const Event& ev = batch.events[e];
            if (ev.kind == Kind::Cleared) {
                map_valid = false;
                since = e + 1;
                continue;
            }
            if (ev.kind != Kind::Stored || !ev.has_parent) continue;
            if (map_valid && st.entries.find(ev.parent)) continue;
            bool found = false;
            for (std::size_t b = e; b-- > since && !found;) {
                const Event& prev = batch.events[b];
                if (prev.kind != Kind::Stored) continue;
                for (std::size_t j = prev.h_count; j-- > 0;)
                    if (batch.hashes[prev.h_begin + j] == ev.parent) {
                        found = true;
                        break;
                    }
            }
            if (!found)
                return "BlockStored parent_block_hash " + std::to_string(ev.parent) +
                       " is unknown on replica " + std::to_string(r);
        }
        return {};
    }

    // -- applying ---------------------------------------------------------------------------

    bool mismatch(std::int64_t r, ReplicaState& st, std::uint64_t size) {
        st.engine_block_size = size;
        if (size % block_size == 0) return false;
        clear(r, st);
        st.unusable = "replica " + std::to_string(r) + ": engine block_size " + std::to_string(size) +
                      " is not a multiple of block_size " + std::to_string(block_size) +
                      "; its KV events are ignored and it gets no cache affinity";
        reports.push_back(*st.unusable);
        return true;
    }

    void stored(std::int64_t r, ReplicaState& st, const std::uint64_t* hs, std::size_t n,
                const std::uint64_t* parent, const std::uint32_t* tokens, std::uint64_t size,
                std::uint32_t medium, double now) {
        if (n == 0 || mismatch(r, st, size)) return;
        const int t = medium == 0 ? 0 : 1;
        auto& refs = st.refs[t];
        std::uint64_t seed = st.salt ? st.root : root;
        bool has_pred = false;
        if (parent) {
            seed = st.entries.find(*parent)->last();
            has_pred = true;
        }
        const std::uint64_t pred = seed;
        const auto k = static_cast<std::uint32_t>(size / block_size);
        chain.clear();
        if (kvbuf.size() < k) kvbuf.resize(k);
        bool fresh = false;
        for (std::size_t j = 0; j < n; ++j) {
            bool inserted = false;
            Entry& e = st.entries.get(hs[j], inserted);
            if (inserted) {
                chain_hashes(tokens + j * size, static_cast<std::size_t>(size), block_size, seed,
                             kvbuf.data());
                e.k = k;
                e.kv0 = kvbuf[0];
                if (k > 1) {
                    e.more = std::make_unique<std::uint64_t[]>(k - 1);
                    for (std::uint32_t q = 1; q < k; ++q) e.more[q - 1] = kvbuf[q];
                }
            }
            ++*e.count(medium, true);
            for (std::uint32_t q = 0; q < e.k; ++q) {
                const std::uint64_t x = e.kv(q);
                chain.push_back(x);
                bool added = false;
                std::uint32_t& cnt = refs.get(x, added);
                if (cnt++ == 0) fresh = true;
            }
            seed = e.last();
        }
        c.stored_blocks += n;
        PrefixIndex* target = t == 0 ? index.get() : tier.get();
        if (!fresh || !target) return;
        grow(*target, r);
        try {
            if (has_pred)
                target->store_after(r, pred, chain.data(), chain.size(), now);
            else
                target->insert(r, chain.data(), chain.size(), now);
        } catch (const KeyError&) {
            ++c.index_conflicts;
        } catch (const ValueError&) {
            ++c.index_conflicts;
        }
    }

    std::size_t removed(std::int64_t r, ReplicaState& st, const std::uint64_t* hs, std::size_t n,
                        std::uint32_t medium) {
        const int t = medium == 0 ? 0 : 1;
        auto& refs = st.refs[t];
        gone.clear();
        std::size_t done = 0;
        for (std::size_t j = 0; j < n; ++j) {
            Entry* e = st.entries.find(hs[j]);
            std::uint32_t* cnt = e ? e->count(medium, false) : nullptr;
            if (!cnt || *cnt == 0) {
                ++c.unknown_removals;
                continue;
            }
            if (--*cnt == 0) {
                e->drop(medium);
                if (!e->alive()) st.dead.push_back(hs[j]);
            }
            for (std::uint32_t q = 0; q < e->k; ++q) {
                const std::uint64_t x = e->kv(q);
                std::uint32_t* rc = refs.find(x);
                if (*rc == 1) {
                    refs.erase(x);
                    gone.push_back(x);
                } else {
                    --*rc;
                }
            }
            ++done;
        }
        c.removed_blocks += done;
        PrefixIndex* target = t == 0 ? index.get() : tier.get();
        if (!gone.empty() && target) {
            grow(*target, r);
            target->remove(r, gone.data(), gone.size());
        }
        return done;
    }

    void clear(std::int64_t r, ReplicaState& st) {
        st.entries.clear();
        st.dead.clear();
        st.refs[0].clear();
        st.refs[1].clear();
        index->clear_replica(r);
        if (tier) {
            grow(*tier, r);
            tier->clear_replica(r);
        }
    }

    static void purge(ReplicaState& st) {
        for (const std::uint64_t h : st.dead) {
            const Entry* e = st.entries.find(h);
            if (e && !e->alive()) st.entries.erase(h);
        }
        st.dead.clear();
    }
};

EventApplier::EventApplier(std::shared_ptr<PrefixIndex> index, std::size_t block_size,
                           std::string salt, std::shared_ptr<PrefixIndex> tier_index)
    : impl_(std::make_unique<Impl>()) {
    if (!index) throw TypeError("index must be a PrefixIndex, got NoneType");
    if (tier_index && tier_index == index)
        throw ValueError("tier_index must be a different PrefixIndex than index");
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
    m.check(r);
    try {
        m.decode(data, len);
    } catch (const Malformed& bad) {
        ++m.c.malformed;
        m.c.last_error = bad.message;
        return false;
    }
    ReplicaState& st = m.state(r);
    if (st.unusable) {
        ++m.c.ignored_batches;
        st.last_ts = m.batch.ts;
        return true;
    }
    std::string problem = m.unknown_parent(r, st);
    if (!problem.empty()) {
        ++m.c.malformed;
        m.c.last_error = std::move(problem);
        return false;
    }
    ++m.c.batches;
    m.c.ignored_events += m.batch.ignored;
    ++st.batches;
    st.last_ts = m.batch.ts;
    const double now = PrefixIndex::monotonic_now();
    for (const Event& ev : m.batch.events) {
        if (st.unusable) break;
        ++m.c.events;
        if (ev.kind == Kind::Stored) {
            m.stored(r, st, m.batch.hashes.data() + ev.h_begin, ev.h_count,
                     ev.has_parent ? &ev.parent : nullptr, m.batch.tokens.data() + ev.t_begin,
                     ev.engine_block_size, ev.medium, now);
        } else if (ev.kind == Kind::Removed) {
            m.removed(r, st, m.batch.hashes.data() + ev.h_begin, ev.h_count, ev.medium);
        } else {
            m.clear(r, st);
            ++m.c.clears;
        }
    }
    Impl::purge(st);
    return true;
}

std::size_t EventApplier::apply_stored(std::int64_t r, const std::uint64_t* hashes, std::size_t n,
                                       const std::uint64_t* parent, const std::uint32_t* tokens,
                                       std::size_t n_tokens, std::size_t engine_block_size,
                                       const std::string* medium) {
    Impl& m = *impl_;
    std::lock_guard<std::mutex> lock(m.mu);
    m.check(r);
    std::size_t size = engine_block_size;
    if (size == 0 && n > 0 && n_tokens > 0 && n_tokens % n == 0) size = n_tokens / n;
    if (size == 0 || n_tokens != n * size)
        throw ValueError(std::to_string(n_tokens) + " token_ids do not make " + std::to_string(n) +
                         " blocks" + (size ? " of " + std::to_string(size) + " tokens" : std::string()));
    const std::uint32_t med = medium ? m.medium_id(*medium) : 0;
    ReplicaState& st = m.state(r);
    if (st.unusable) return 0;
    if (parent && !st.entries.find(*parent))
        throw KeyError("parent block hash " + std::to_string(*parent) + " is unknown on replica " +
                       std::to_string(r));
    if (m.mismatch(r, st, size)) return 0;
    m.stored(r, st, hashes, n, parent, tokens, size, med, PrefixIndex::monotonic_now());
    return n;
}

std::size_t EventApplier::apply_removed(std::int64_t r, const std::uint64_t* hashes, std::size_t n,
                                        const std::string* medium) {
    Impl& m = *impl_;
    std::lock_guard<std::mutex> lock(m.mu);
    m.check(r);
    const std::uint32_t med = medium ? m.medium_id(*medium) : 0;
    ReplicaState& st = m.state(r);
    if (st.unusable) return 0;
    const std::size_t done = m.removed(r, st, hashes, n, med);
    Impl::purge(st);
    return done;
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
    m.check(r);
    ReplicaState& st = m.state(r);
    m.clear(r, st);
    st.unusable.reset();
    st.engine_block_size.reset();
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
    const auto i = static_cast<std::size_t>(r);
    if (i >= m.replicas.size() || !m.replicas[i]) return out;
    const ReplicaState& st = *m.replicas[i];
    if (st.salt) out.salt = *st.salt;
    out.batches = st.batches;
    out.engine_blocks = st.entries.size();
    out.index_blocks = st.refs[0].size();
    out.tier_blocks = st.refs[1].size();
    out.engine_block_size = st.engine_block_size;
    out.unusable = st.unusable;
    out.last_ts = st.last_ts;
    return out;
}

std::vector<std::string> EventApplier::take_reports() {
    std::lock_guard<std::mutex> lock(impl_->mu);
    std::vector<std::string> out;
    out.swap(impl_->reports);
    return out;
}

std::size_t EventApplier::block_size() const noexcept { return impl_->block_size; }
const std::string& EventApplier::salt() const noexcept { return impl_->salt; }
const std::shared_ptr<PrefixIndex>& EventApplier::index() const noexcept { return impl_->index; }
const std::shared_ptr<PrefixIndex>& EventApplier::tier_index() const noexcept { return impl_->tier; }

}  // namespace kvroute
