// Decoded KV event batches (private to the event applier): what events_decode.cpp produces and
// events_apply.cpp consumes. Field names and order: python/kvroute/reference/events.py.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace kvroute::wire {

/// Event fields in wire order: BlockStored position k + 1 holds field k; maps name them.
enum class Field : std::uint8_t {
    BlockHashes,
    ParentBlockHash,
    TokenIds,
    BlockSize,
    LoraId,
    Medium,
    LoraName,
    ExtraKeys,
    GroupIdx,
    SpecKind,
    SpecSlidingWindow,
    CacheSalt,
    kCount,
};

inline constexpr std::size_t kFields = static_cast<std::size_t>(Field::kCount);

/// The map key (and reference name) of each field.
inline constexpr std::array<std::string_view, kFields> kFieldNames = {
    "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
    "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window",
    "cache_salt",
};

/// BlockRemoved's positional fields (position k + 1 holds entry k).
inline constexpr std::array<Field, 3> kRemovedFields = {Field::BlockHashes, Field::Medium, Field::GroupIdx};

enum class Kind : std::uint8_t { Stored, Removed, Cleared };

/// One entry of a block's extra_keys: a str, an (identifier, relative offset) pair, or other.
enum class KeyKind : std::uint8_t { Str, Pair, Other };

struct ExtraKey {
    std::uint32_t block = 0;  ///< engine block (index into the event's block_hashes)
    KeyKind kind = KeyKind::Other;
    std::string_view text;    ///< Str value or Pair identifier (into the payload)
    std::int64_t rel = 0;     ///< Pair offset relative to the block start
};

struct Event {
    Kind kind = Kind::Cleared;
    std::size_t h_begin = 0, h_count = 0;  ///< engine hashes in Batch::hashes
    std::size_t t_begin = 0, t_count = 0;  ///< tokens in Batch::tokens
    std::size_t k_begin = 0, k_count = 0;  ///< extra keys in Batch::keys
    bool has_parent = false;
    std::uint64_t parent = 0;
    std::uint64_t engine_block_size = 0;
    bool has_medium = false;
    std::string_view medium;
    std::string_view lora_name;   ///< empty when none
    std::string_view cache_salt;  ///< empty when none
    bool has_extra = false;       ///< extra_keys was an array
    std::uint64_t group = 0;      ///< group_idx (nil: 0; negative: UINT64_MAX)
};

struct Batch {
    double ts = 0.0;
    std::uint64_t ignored = 0;
    std::vector<Event> events;
    std::vector<std::uint64_t> hashes;
    std::vector<std::uint32_t> tokens;
    std::vector<ExtraKey> keys;
    void reset() {
        ts = 0.0;
        ignored = 0;
        events.clear();
        hashes.clear();
        tokens.clear();
        keys.clear();
    }
};

/// Why a payload is not an event batch; the message is the reference's MalformedBatch text.
struct Malformed {
    std::string message;
};

/// Decodes one msgpack batch into `batch` (views point into data) or throws Malformed.
void decode(const std::uint8_t* data, std::size_t len, Batch& batch);

}  // namespace kvroute::wire
