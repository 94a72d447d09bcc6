// EventApplier's per-replica state (the maps of events_apply.cpp), shared with its export and
// import (events_state.cpp). Internal: not part of the public headers.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <deque>
#include <utility>
#include <vector>

#include "kvroute/events.hpp"
#include "kvroute/support/hash_map.hpp"

namespace kvroute::applier {

using support::HashMap;

/// Media bits of each tier: GPU (medium id 0) is tier 0, every other medium tier 1.
constexpr std::uint64_t kTierMask[2] = {1, ~std::uint64_t{1}};

/// A multimodal item carried past a router-block boundary: identifier and absolute offset.
struct OwnedMm {
    std::string id;
    std::uint64_t offset = 0;
};

/// What only pages that start or end inside a router block need: their place in the prompt and
/// parent (to walk the pages a router block spans), the tokens and items after their last
/// router-block boundary, and the later pages whose first router block spans them.
struct Extra {
    std::uint64_t start = 0, parent = 0;
    std::uint32_t lead = 0;
    bool has_parent = false;
    std::vector<std::uint32_t> tail;
    std::vector<OwnedMm> tail_mm;
    std::vector<std::uint64_t> dependents;
};

/// One engine block (engine hash, group) of one replica; see the reference's _Entry. Kept small
/// (the per-block table is the hot path): what pages need lives in `extra`.
struct Entry {
    std::uint64_t end = 0;   // token position after it in the prompt
    std::uint64_t seed = 0;  // chain hash at the last boundary <= end
    std::uint64_t seq = 0;   // store recency (map bound)
    std::uint64_t media = 0; // bit per medium id
    std::uint64_t kv0 = 0;
    std::unique_ptr<std::uint64_t[]> more;  // kv[1..n_kv)
    std::unique_ptr<Extra> extra;
    std::uint32_t n_kv = 0;
    bool dep = false;           // kv[0] spans earlier pages (extra->lead > 0)
    std::uint8_t first_ok = 0;  // bit t: kv[0] counted in tier t

    std::uint64_t kv(std::uint32_t i) const noexcept { return i == 0 ? kv0 : more[i - 1]; }
    bool has_tier(int t) const noexcept { return (media & kTierMask[t]) != 0; }
    bool first_counted(int t) const noexcept { return !dep || ((first_ok >> t) & 1); }
};

/// One KV-cache group of one replica: its engine blocks and per-tier router-block counts.
struct GroupState {
    HashMap<Entry> entries;
    HashMap<std::uint32_t> refs[2];  // kvroute hash -> entries holding it, per tier
    std::vector<std::uint64_t> dead;
    std::optional<std::uint64_t> engine_block_size;
    std::deque<std::pair<std::uint64_t, std::uint64_t>> order;  // (key, seq), with an index capacity
};

/// Everything an applier knows about one replica.
struct ReplicaState {
    std::vector<std::unique_ptr<GroupState>> groups;  // by group id; live where group_mask has its bit
    std::uint64_t group_mask = 0;
    std::optional<std::string> salt;  // set_salt(): this replica's own salt and chain root
    std::uint64_t root = 0;
    std::optional<double> last_ts;
    std::uint64_t batches = 0;
    std::uint64_t skipped[kSkipKinds] = {};
    std::uint64_t k = 1;
    std::optional<std::uint64_t> engine_block_size;

    GroupState* find_group(std::uint64_t g) const noexcept {
        return g < groups.size() && ((group_mask >> g) & 1) ? groups[g].get() : nullptr;
    }
    template <class F>
    void each_group(F&& f) const {
        for (std::size_t g = 0; g < groups.size(); ++g)
            if ((group_mask >> g) & 1) f(*groups[g]);
    }
};

/// A decoded EventApplier::export_replica() result (events_state.cpp), checked and ready to
/// install: the state, and the medium names its entries' media bits stand for (bit i: media[i]).
struct DecodedReplica {
    std::unique_ptr<ReplicaState> state;  ///< entries' media are bits over `media`
    std::vector<std::string> media;       ///< media[0] is "GPU"
    /// Per group id: (key, seq) of its entries, oldest stored first (the map bound's order).
    std::vector<std::vector<std::pair<std::uint64_t, std::uint64_t>>> order;
    std::uint64_t max_seq = 0;  ///< the exporting applier's store counter (>= every entry's seq)
};

/// The replica's state as bytes (docs/snapshot-format.md, "Applier state"); seq is the
/// applier's store counter, media_names[id] the name of its medium id `id`.
std::string encode_replica(const ReplicaState& st, std::size_t block_size, const std::string& salt,
                           std::uint64_t seq, const std::vector<std::string>& media_names);
/// Decodes and checks bytes of encode_replica; ValueError when cut short, malformed or written
/// for another block size or salt.
DecodedReplica decode_replica(const std::uint8_t* data, std::size_t len, std::size_t block_size,
                              const std::string& salt);

}  // namespace kvroute::applier
