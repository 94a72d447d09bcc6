// Router: chooses a replica per request by KV-cache affinity versus load, with sessions and
// lifecycle load accounting. Twin of python/kvroute/reference/router.py, whose module
// docstring is the contract (order of checks, policies, tie rotation, generator, errors).
#pragma once
#include <cstddef>
#include <cstdint>
#include <algorithm>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "kvroute/prefix_index.hpp"

namespace kvroute {

/// Routing rule (kvroute/config.py documents each).
enum class Policy {
    RoundRobin,
    Random,
    LeastLoaded,
    PowerOfTwo,
    Sticky,
    Linear,
    SGLang,
    Dynamo,
    LLMD,
    Preble,
    TTFT,
};

/// Where the index's contents come from.
enum class IndexMode { Approximate, Precise, Hybrid };

/// Settings of a Router; the binding fills them from a validated kvroute.RouterConfig.
struct RouterOptions {
    Policy policy = Policy::TTFT;                 ///< routing rule
    IndexMode mode = IndexMode::Approximate;      ///< who feeds the index
    std::size_t block_size = 16;                  ///< tokens per hashed block
    std::string salt;                             ///< bytes the hash chain's root is taken over
    std::optional<std::uint64_t> index_capacity;  ///< blocks per replica in the index
    std::optional<double> index_ttl;              ///< seconds a block lives untouched
    double speculative_ttl = 2.0;                 ///< hybrid: seconds of a route-time insertion
    double session_ttl = 600.0;                   ///< sliding session lifetime, seconds
    std::size_t max_sessions = 100000;            ///< session table size before LRU eviction
    std::uint64_t seed = 0;                       ///< splitmix64 seed
    double prefill_rate = 10000.0;                ///< tokens per second (ttft)
    double session_saturation = 2.0;              ///< generic session saturation factor
    std::uint32_t vnodes = 64;                    ///< sticky: virtual nodes per replica
    std::optional<double> bound;                  ///< sticky: bounded-load factor c
    double w_affinity = 1.0;                      ///< linear
    double w_load = 1.0;                          ///< linear
    std::int64_t min_match_tokens = 64;           ///< linear
    double escape_factor = 1.5;                   ///< linear
    double cache_threshold = 0.3;                 ///< sglang
    std::int64_t balance_abs_threshold = 64;      ///< sglang
    double balance_rel_threshold = 1.5;           ///< sglang
    double prefill_load_scale = 1.0;              ///< dynamo
    double temperature = 0.0;                     ///< dynamo
    double w_prefix = 3.0;                        ///< llmd
    double w_queue = 2.0;                         ///< llmd
    double w_kv = 2.0;                            ///< llmd
    double decode_weight = 32.0;                  ///< preble
};

/// Where one request goes and why.
struct Decision {
    std::string replica;               ///< chosen replica's name
    std::int64_t replica_id = 0;       ///< its dense id
    std::int64_t matched_blocks = 0;   ///< leading prompt blocks it holds (ttft: pending ones too)
    std::int64_t cached_tokens = 0;    ///< min(matched_blocks * block_size, prompt_tokens)
    std::int64_t prompt_tokens = 0;    ///< tokens of the prompt
    const char* reason = "";           ///< session/affinity/load/miss/balance/hash/overflow
    const char* binding = "none";      ///< none/new/kept/rebound
    std::int64_t stranded_blocks = 0;  ///< blocks a rebound session left behind
    std::int64_t handle = 0;           ///< for prefill_done() and finish()
};

/// Load terms of one replica.
struct ReplicaLoad {
    std::int64_t queued_prefill_tokens = 0;  ///< uncached tokens of requests before first token
    std::int64_t in_flight = 0;              ///< requests routed and not finished
    std::int64_t prefill_requests = 0;       ///< requests before their first token
    std::int64_t prefill_blocks = 0;         ///< uncached blocks of those requests
    std::int64_t decode_blocks = 0;          ///< prompt blocks of requests past their first token
    std::optional<std::int64_t> waiting;     ///< engine-reported queue
    std::optional<std::int64_t> running;     ///< engine-reported running sequences
    std::optional<double> kv_usage;          ///< engine-reported KV usage in [0, 1]
    bool healthy = true;                     ///< chosen only while healthy
    bool draining = false;                   ///< chosen only while not draining
};

/// Router-wide counters.
struct RouterStats {
    std::int64_t routed = 0;               ///< decisions made
    std::int64_t prompt_tokens = 0;        ///< tokens routed
    std::int64_t cached_tokens = 0;        ///< tokens expected cached
    std::int64_t rebinds = 0;              ///< sessions moved
    std::int64_t stranded_blocks = 0;      ///< blocks left behind by rebinds
    std::int64_t session_expirations = 0;  ///< sessions dropped by TTL
    std::int64_t session_evictions = 0;    ///< sessions dropped by LRU
    std::int64_t sessions = 0;             ///< sessions in the table
    std::int64_t in_flight = 0;            ///< requests not finished (released ones included)
    std::int64_t replicas = 0;             ///< live replicas
};

/// Affinity-versus-load router; every public method is safe from several threads.
class Router {
public:
    /// A router with no replicas.
    explicit Router(RouterOptions options);

    /// The index routing reads (approximate mode also writes it); events feed it.
    std::shared_ptr<PrefixIndex> index() const noexcept { return index_; }
    /// Hybrid mode's speculative index, else null.
    std::shared_ptr<PrefixIndex> speculative_index() const noexcept { return spec_; }
    /// The options it was built with.
    const RouterOptions& options() const noexcept { return opt_; }

    /// Adds a healthy replica; ValueError if the name is empty or taken. Returns its id.
    std::uint32_t add_replica(const std::string& name);
    /// Removes a replica, its index blocks and the accounting of its in-flight requests.
    void remove_replica(const std::string& name);
    /// Marks a replica draining (never chosen) or not.
    void drain(const std::string& name, bool draining);
    /// Marks a replica healthy or not (unhealthy: never chosen).
    void set_healthy(const std::string& name, bool healthy);
    /// Names of live replicas in id order.
    std::vector<std::string> replicas() const;
    /// Id of a replica; KeyError if unknown.
    std::uint32_t replica_id(const std::string& name) const;

    /// Routes a prompt of tokens (hashed here with block_size and salt).
    Decision route_tokens(const std::uint32_t* tokens, std::size_t n,
                          const std::optional<std::string>& session, std::optional<double> now);
    /// Routes a prompt given as n block hashes covering num_tokens tokens.
    Decision route_hashes(const std::uint64_t* hashes, std::size_t n, std::int64_t num_tokens,
                          const std::optional<std::string>& session, std::optional<double> now);
    /// The request produced its first token.
    void prefill_done(std::int64_t handle);
    /// The request ended.
    void finish(std::int64_t handle);

    /// Sets the given engine-reported figures (already validated).
    void report_load(const std::string& name, std::optional<std::int64_t> waiting,
                     std::optional<std::int64_t> running, std::optional<double> kv_usage);
    /// Load terms of a replica.
    ReplicaLoad load(const std::string& name) const;
    /// Counters.
    RouterStats stats() const;

private:
    struct Request {
        std::int64_t replica;  // -1 once its replica was removed
        std::int64_t uncached;
        std::int64_t blocks;
        std::int64_t uncached_blocks;
        bool prefilled;
        std::vector<std::uint64_t> hashes;  // ttft, before its first token: its prompt's blocks
    };
    // ttft: a request before its first token, on the list of its replica.
    struct Pending {
        std::int64_t handle;
        const std::uint64_t* hashes;  // its Request's hashes (stable: map nodes do not move)
        std::size_t len;
    };
    struct Session {
        std::string key;
        std::uint32_t replica;
        std::uint64_t gen;
        std::int64_t blocks;
        double last_seen;
    };
    using SessionList = std::list<Session>;

    Decision route_locked(const std::uint64_t* hashes, std::size_t n, std::int64_t num_tokens,
                          const std::optional<std::string>& session, double now);
    std::uint32_t lookup(const std::string& name) const;
    Request& request(std::int64_t handle);
    void rebuild_ring();
    void reset_slot(std::uint32_t r);
    void release_pending(std::int64_t handle, Request& req);

    // Policy evaluation over the candidate list (rotated); returns (replica, reason).
    std::pair<std::uint32_t, const char*> choose(const std::vector<std::uint32_t>& cands,
                                                 std::uint64_t& rng, std::size_t n,
                                                 std::int64_t num_tokens,
                                                 const std::optional<std::string>& session,
                                                 const std::uint64_t* hashes);
    bool saturated(std::uint32_t b, const std::vector<std::uint32_t>& eligible) const;
    std::int64_t capacity(const std::vector<std::uint32_t>& cands) const;
    std::int64_t mtok(std::uint32_t r, std::int64_t num_tokens) const {
        return std::min(static_cast<std::int64_t>(match_[r]) * bs_, num_tokens);
    }
    bool eligible(std::uint32_t r) const {
        return live_[r] && loads_[r].healthy && !loads_[r].draining;
    }
    const char* generic_reason(const std::vector<std::uint32_t>& order, std::uint32_t chosen) const;

    const RouterOptions opt_;
    const std::int64_t bs_;
    std::uint64_t root_ = 0;
    std::shared_ptr<PrefixIndex> index_;
    std::shared_ptr<PrefixIndex> spec_;

    mutable std::mutex mu_;
    std::vector<std::string> names_;
    std::vector<char> live_;
    std::unordered_map<std::string, std::uint32_t> ids_;
    std::vector<std::uint64_t> gen_;
    std::vector<ReplicaLoad> loads_;  // in_flight and queued_prefill_tokens live in the two below
    std::vector<std::int64_t> inflight_;  // hot in every decision: kept contiguous
    std::vector<std::int64_t> queued_;
    bool eligible_dirty_ = true;  // eligible_ is rebuilt only after a membership/flag change
    std::unordered_map<std::int64_t, Request> requests_;
    std::vector<std::vector<Pending>> pending_;  // per replica, ttft only
    std::size_t pending_count_ = 0;              // entries in pending_: 0 skips the scan
    std::int64_t next_handle_ = 1;
    std::uint64_t rot_ = 0;
    std::uint64_t rng_;
    SessionList lru_;  // front: least recently used
    std::unordered_map<std::string, SessionList::iterator> sessions_;
    std::vector<std::pair<std::uint64_t, std::uint32_t>> ring_;
    RouterStats stats_;

    // Scratch reused across decisions (guarded by mu_).
    std::vector<std::int32_t> match_;
    std::vector<std::int32_t> spec_match_;
    std::vector<std::uint32_t> eligible_;
    std::vector<std::uint32_t> order_;
    std::vector<std::uint32_t> pool_;
    std::vector<double> scratch_;
    std::vector<char> allowed_;
};

/// splitmix64 finalizer (bijective 64-bit mix), shared with the reference.
std::uint64_t mix64(std::uint64_t z) noexcept;
/// FNV-1a 64-bit of bytes: ring positions of names and sessions.
std::uint64_t fnv1a64(const void* data, std::size_t len) noexcept;

}  // namespace kvroute
