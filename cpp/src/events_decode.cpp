// Decoding of engine KV event batches (vLLM positional arrays and tagged maps, SGLang); the
// messages are python/kvroute/reference/events.py's MalformedBatch texts, word for word.
#include <string>

#include "events_wire.hpp"
#include "kvroute/msgpack.hpp"

namespace kvroute::wire {
namespace {

namespace mp = msgpack;

std::string int_text(const mp::Item& it) {
    return it.negative ? std::to_string(static_cast<std::int64_t>(it.u)) : std::to_string(it.u);
}

bool is_str(const mp::Item& it, std::string_view s) noexcept { return it.type == mp::Type::Str && it.str() == s; }

std::uint64_t bin_hash(const mp::Item& x) noexcept {
    // The last 8 bytes big-endian (fewer: all of them), as llm-d normalizes digests.
    const std::uint32_t from = x.len > 8 ? x.len - 8 : 0;
    std::uint64_t v = 0;
    for (std::uint32_t b = from; b < x.len; ++b) v = (v << 8) | x.data[b];
    return v;
}

// Reads a header at q or, at a missing field (null), nil.
mp::Item item_or_nil(const std::uint8_t*& q) noexcept {
    if (!q) return mp::Item{};
    return mp::next(q);
}

/// Where each field of one event starts in the payload (null: missing).
using Slots = std::array<const std::uint8_t*, kFields>;

class Decoder {
public:
    explicit Decoder(Batch& batch) : batch_(batch) {}

    void run(const std::uint8_t* data, std::size_t len);

private:
    Batch& batch_;
    std::size_t i_ = 0;  // index of the event being decoded
    bool stored_ = false;
    // token_ids read while passing them (plain ints, most of the payload).
    const std::uint8_t* tokens_read_at_ = nullptr;
    std::size_t tokens_begin_ = 0, tokens_count_ = 0;

    std::string where() const {
        return "event " + std::to_string(i_) + (stored_ ? " (BlockStored)" : " (BlockRemoved)");
    }
    [[noreturn]] void fail(const std::string& what) const { throw Malformed{where() + " " + what}; }

    void event(const std::uint8_t*& p);
    void event_array(std::uint32_t len, const std::uint8_t*& p);
    void event_map(std::uint32_t len, const std::uint8_t*& p);
    void pass_field(Field f, Slots& at, const std::uint8_t*& p);
    void finish(std::string_view tag, Slots& at);
    void stored(Slots& at, Event& out);
    void hashes(const std::uint8_t* q, Event& out);
    void parent(const std::uint8_t* q, Event& out);
    void tokens(const std::uint8_t* q, Event& out);
    void block_size(const std::uint8_t* q, Event& out);
    void medium(const std::uint8_t* q, Event& out);
    void names(const Slots& at, Event& out);
    void extra_keys(const std::uint8_t* q, Event& out);
    void extra_key(std::uint32_t block, const std::uint8_t*& q);
    void group(const std::uint8_t* q, Event& out);
    bool read_plain_tokens(const std::uint8_t*& p);
};

void Decoder::hashes(const std::uint8_t* p, Event& out) {
    const mp::Item h = item_or_nil(p);
    if (h.type != mp::Type::Array) fail(std::string("block_hashes must be an array, got ") + mp::type_name(h.type));
    out.h_begin = batch_.hashes.size();
    for (std::uint32_t j = 0; j < h.len; ++j) {
        if (*p == 0xCF) {  // vLLM's int-mode hashes are mostly >= 2**63
            std::uint64_t v = 0;
            for (int b = 1; b <= 8; ++b) v = (v << 8) | p[b];
            batch_.hashes.push_back(v);
            p += 9;
            continue;
        }
        const mp::Item x = mp::next(p);
        if (x.type == mp::Type::Int) batch_.hashes.push_back(x.u);
        else if (x.type == mp::Type::Bin) batch_.hashes.push_back(bin_hash(x));
        else
            fail("block_hashes[" + std::to_string(j) + "] must be an int or bin, got " + mp::type_name(x.type));
    }
    out.h_count = batch_.hashes.size() - out.h_begin;
}

void Decoder::parent(const std::uint8_t* q, Event& out) {
    const mp::Item par = item_or_nil(q);
    if (par.type == mp::Type::Int) {
        out.has_parent = true;
        out.parent = par.u;
    } else if (par.type == mp::Type::Bin) {
        out.has_parent = true;
        out.parent = bin_hash(par);
    } else if (par.type != mp::Type::Nil) {
        fail(std::string("parent_block_hash must be nil, an int or bin, got ") + mp::type_name(par.type));
    }
}

void Decoder::tokens(const std::uint8_t* q, Event& out) {
    if (q && q == tokens_read_at_) {
        out.t_begin = tokens_begin_;
        out.t_count = tokens_count_;
        return;
    }
    const mp::Item toks = item_or_nil(q);
    if (toks.type != mp::Type::Array) fail(std::string("token_ids must be an array, got ") + mp::type_name(toks.type));
    out.t_begin = batch_.tokens.size();
    out.t_count = toks.len;
    batch_.tokens.resize(out.t_begin + toks.len);
    for (std::uint32_t j = 0; j < toks.len; ++j) {
        const mp::Item t = mp::next(q);
        if (t.type != mp::Type::Int)
            fail("token_ids[" + std::to_string(j) + "] must be an int, got " + mp::type_name(t.type));
        if (t.negative || t.u >= (std::uint64_t{1} << 32))
            fail("token_ids[" + std::to_string(j) + "] = " + int_text(t) + " is out of range [0, 2**32)");
        batch_.tokens[out.t_begin + j] = static_cast<std::uint32_t>(t.u);
    }
}

void Decoder::block_size(const std::uint8_t* q, Event& out) {
    const std::uint64_t n = out.h_count, m = out.t_count;
    const mp::Item bs = item_or_nil(q);
    if (bs.type == mp::Type::Nil) {
        if (n == 0 || m == 0 || m % n != 0)
            fail("has " + std::to_string(m) + " token_ids for " + std::to_string(n) + " blocks");
        out.engine_block_size = m / n;
        return;
    }
    if (bs.type != mp::Type::Int) fail(std::string("block_size must be nil or an int, got ") + mp::type_name(bs.type));
    if (bs.negative || bs.u == 0) fail("block_size must be positive, got " + int_text(bs));
    // n * size without overflow: sizes beyond the token count cannot match anyway.
    if (n == 0 ? m != 0 : (bs.u > m || n * bs.u != m))
        fail("has " + std::to_string(m) + " token_ids for " + std::to_string(n) + " blocks of " +
             std::to_string(bs.u) + " tokens");
    out.engine_block_size = bs.u;
}

void Decoder::medium(const std::uint8_t* q, Event& out) {
    const mp::Item m = item_or_nil(q);
    if (m.type == mp::Type::Nil) return;
    if (m.type != mp::Type::Str) fail(std::string("medium must be nil or a str, got ") + mp::type_name(m.type));
    out.has_medium = true;
    out.medium = m.str();
}

// lora_name (a str; SGLang 0.5.18 puts a {"cache_salt": ...} map there) and cache_salt; a
// cache_salt field that is present and not nil wins over the map's, as in the reference.
void Decoder::names(const Slots& at, Event& out) {
    const std::uint8_t* q = at[static_cast<std::size_t>(Field::LoraName)];
    const mp::Item lora = item_or_nil(q);
    const std::uint8_t* s = at[static_cast<std::size_t>(Field::CacheSalt)];
    mp::Item salt = item_or_nil(s);
    if (lora.type == mp::Type::Str) out.lora_name = lora.str();
    if (lora.type == mp::Type::Map && salt.type == mp::Type::Nil) {
        for (std::uint32_t k = 0; k < lora.len; ++k) {
            const std::uint8_t* key_at = q;
            mp::skip(q);
            const mp::Item key = item_or_nil(key_at);
            if (is_str(key, "cache_salt")) {
                const std::uint8_t* v = q;
                salt = mp::next(v);
            }
            mp::skip(q);
        }
    }
    if (salt.type == mp::Type::Str) out.cache_salt = salt.str();
}

void Decoder::extra_key(std::uint32_t block, const std::uint8_t*& q) {
    const std::uint8_t* start = q;
    const mp::Item it = mp::next(q);
    if (it.type == mp::Type::Str) {
        batch_.keys.push_back(ExtraKey{block, KeyKind::Str, it.str(), 0});
        return;
    }
    if (it.type == mp::Type::Array && it.len == 2) {
        const std::uint8_t* a = q;
        const mp::Item id = mp::next(a);
        if (id.type == mp::Type::Str) {
            const mp::Item off = mp::next(a);
            if (off.type == mp::Type::Int && (off.negative || off.u < (std::uint64_t{1} << 63))) {
                batch_.keys.push_back(ExtraKey{block, KeyKind::Pair, id.str(), static_cast<std::int64_t>(off.u)});
                q = a;
                return;
            }
        }
    }
    q = start;
    mp::skip(q);
    batch_.keys.push_back(ExtraKey{block, KeyKind::Other, {}, 0});
}

void Decoder::extra_keys(const std::uint8_t* q, Event& out) {
    const mp::Item ex = item_or_nil(q);
    if (ex.type == mp::Type::Nil) return;
    if (ex.type != mp::Type::Array) fail(std::string("extra_keys must be nil or an array, got ") + mp::type_name(ex.type));
    out.has_extra = true;
    out.k_begin = batch_.keys.size();
    for (std::uint32_t j = 0; j < ex.len; ++j) {
        const mp::Item keys = mp::next(q);
        if (keys.type == mp::Type::Nil) continue;
        if (keys.type != mp::Type::Array)
            fail("extra_keys[" + std::to_string(j) + "] must be nil or an array, got " + mp::type_name(keys.type));
        for (std::uint32_t k = 0; k < keys.len; ++k) extra_key(j, q);
    }
    out.k_count = batch_.keys.size() - out.k_begin;
}

void Decoder::group(const std::uint8_t* q, Event& out) {
    const mp::Item g = item_or_nil(q);
    if (g.type == mp::Type::Nil) return;
    if (g.type != mp::Type::Int) fail(std::string("group_idx must be nil or an int, got ") + mp::type_name(g.type));
    out.group = g.negative ? UINT64_MAX : g.u;
}

// Fields evaluated in the reference's order, so that the first problem reported is the same.
void Decoder::stored(Slots& at, Event& out) {
    auto slot = [&](Field f) { return at[static_cast<std::size_t>(f)]; };
    hashes(slot(Field::BlockHashes), out);
    parent(slot(Field::ParentBlockHash), out);
    tokens(slot(Field::TokenIds), out);
    block_size(slot(Field::BlockSize), out);
    medium(slot(Field::Medium), out);
    names(at, out);
    extra_keys(slot(Field::ExtraKeys), out);
    group(slot(Field::GroupIdx), out);
}

// Reads an array of ints in [0, 2**32) at p into batch.tokens and moves p past it; false
// (p unspecified, batch.tokens unchanged) when it is anything else.
bool Decoder::read_plain_tokens(const std::uint8_t*& p) {
    const mp::Item arr = mp::next(p);
    if (arr.type != mp::Type::Array) return false;
    const std::size_t begin = batch_.tokens.size();
    batch_.tokens.resize(begin + arr.len);
    std::uint32_t* dst = batch_.tokens.data() + begin;
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
            batch_.tokens.resize(begin);
            return false;
        }
    }
    tokens_begin_ = begin;
    tokens_count_ = arr.len;
    return true;
}

// Records where field f starts and moves p past its value (reading plain token_ids on the way).
void Decoder::pass_field(Field f, Slots& at, const std::uint8_t*& p) {
    const std::uint8_t* start = p;
    at[static_cast<std::size_t>(f)] = start;
    if (f == Field::TokenIds) {
        if (read_plain_tokens(p)) {
            tokens_read_at_ = start;
            return;
        }
        p = start;
    }
    mp::skip(p);
}

void Decoder::finish(std::string_view tag, Slots& at) {
    stored_ = tag == "BlockStored";
    if (!stored_ && tag != "BlockRemoved") {
        if (tag == "AllBlocksCleared") batch_.events.push_back(Event{});
        else ++batch_.ignored;
        return;
    }
    Event out;
    if (stored_) {
        out.kind = Kind::Stored;
        stored(at, out);
    } else {
        out.kind = Kind::Removed;
        hashes(at[static_cast<std::size_t>(Field::BlockHashes)], out);
        medium(at[static_cast<std::size_t>(Field::Medium)], out);
        group(at[static_cast<std::size_t>(Field::GroupIdx)], out);
    }
    batch_.events.push_back(out);
}

// Positional event [tag, fields...]; missing trailing fields are nil, extra ones ignored.
void Decoder::event_array(std::uint32_t len, const std::uint8_t*& p) {
    if (len == 0) throw Malformed{"event " + std::to_string(i_) + " is an empty array"};
    const mp::Item tag = mp::next(p);
    if (tag.type != mp::Type::Str)
        throw Malformed{"event " + std::to_string(i_) + " type must be a str, got " + mp::type_name(tag.type)};
    const bool is_stored = tag.str() == "BlockStored", is_removed = tag.str() == "BlockRemoved";
    Slots at{};
    for (std::uint32_t k = 1; k < len; ++k) {
        const std::size_t pos = k - 1;
        if (is_stored && pos < kFields) pass_field(static_cast<Field>(pos), at, p);
        else if (is_removed && pos < kRemovedFields.size()) pass_field(kRemovedFields[pos], at, p);
        else mp::skip(p);
    }
    finish(tag.str(), at);
}

// Map event {"type": ..., field: ...}: keys in any order (the last of a repeated key wins).
void Decoder::event_map(std::uint32_t len, const std::uint8_t*& p) {
    const std::uint8_t* type_at = nullptr;
    Slots at{};
    for (std::uint32_t k = 0; k < len; ++k) {
        const std::uint8_t* key_at = p;
        mp::skip(p);
        const mp::Item key = item_or_nil(key_at);
        if (key.type == mp::Type::Str) {
            const std::string_view s = key.str();
            if (s == "type") {
                type_at = p;
            } else {
                bool known = false;
                for (std::size_t f = 0; f < kFields && !known; ++f) {
                    if (kFieldNames[f] != s) continue;
                    pass_field(static_cast<Field>(f), at, p);
                    known = true;
                }
                if (known) continue;
            }
        }
        mp::skip(p);
    }
    const mp::Item tag = item_or_nil(type_at);
    if (tag.type != mp::Type::Str)
        throw Malformed{"event " + std::to_string(i_) + " type must be a str, got " + mp::type_name(tag.type)};
    finish(tag.str(), at);
}

void Decoder::event(const std::uint8_t*& p) {
    const mp::Item ev = mp::next(p);
    tokens_read_at_ = nullptr;
    if (ev.type == mp::Type::Array) return event_array(ev.len, p);
    if (ev.type == mp::Type::Map) return event_map(ev.len, p);
    throw Malformed{"event " + std::to_string(i_) + " must be an array or map, got " + mp::type_name(ev.type)};
}

void Decoder::run(const std::uint8_t* data, std::size_t len) {
    batch_.reset();
    if (!mp::validate(data, len)) throw Malformed{"payload is not valid msgpack"};
    const std::uint8_t* p = data;
    const mp::Item top = mp::next(p);
    const std::uint8_t* ts_at = nullptr;
    const std::uint8_t* events_at = nullptr;
    if (top.type == mp::Type::Array) {
        if (top.len < 2)
            throw Malformed{"batch array has " + std::to_string(top.len) + " elements, expected at least 2"};
        ts_at = p;
        mp::skip(p);
        events_at = p;
    } else if (top.type == mp::Type::Map) {
        for (std::uint32_t k = 0; k < top.len; ++k) {
            const std::uint8_t* key_at = p;
            mp::skip(p);
            const mp::Item key = item_or_nil(key_at);
            if (is_str(key, "ts")) ts_at = p;
            else if (is_str(key, "events")) events_at = p;
            mp::skip(p);
        }
    } else {
        throw Malformed{std::string("batch must be an array or map, got ") + mp::type_name(top.type)};
    }
    const mp::Item ts = item_or_nil(ts_at);
    if (ts.type == mp::Type::Int)
        batch_.ts = ts.negative ? static_cast<double>(static_cast<std::int64_t>(ts.u)) : static_cast<double>(ts.u);
    else if (ts.type == mp::Type::Float)
        batch_.ts = ts.f;
    else
        throw Malformed{std::string("batch ts must be a number, got ") + mp::type_name(ts.type)};
    const std::uint8_t* q = events_at;
    const mp::Item evs = item_or_nil(q);
    if (evs.type != mp::Type::Array)
        throw Malformed{std::string("batch events must be an array, got ") + mp::type_name(evs.type)};
    for (std::uint32_t i = 0; i < evs.len; ++i) {
        i_ = i;
        event(q);
    }
}

}  // namespace

void decode(const std::uint8_t* data, std::size_t len, Batch& batch) { Decoder(batch).run(data, len); }

}  // namespace kvroute::wire
