// Router: chooses a replica per request by KV-cache affinity versus load, with sessions and
// lifecycle load accounting. Twin of python/kvroute/reference/router.py, whose module
// docstring is the contract (order of checks, policies, tie rotation, generator, errors).
#pragma once
#include <cstddef>
#include <cstdint>
#include <algorithm>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvroute/hash.hpp"
#include "kvroute/policy.hpp"
#include "kvroute/prefix_index.hpp"

namespace kvroute {

/// Where the index's contents come from.
enum class IndexMode { Approximate, Precise, Hybrid };

/// Settings of a Router; the binding fills them from kvroute.config.validated(config), and
/// the Router checks them again (ValueError), whatever filled them.
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
    std::size_t max_session_bytes = 16777216;     ///< bytes of session ids held before LRU eviction
    double request_ttl = 3600.0;                  ///< seconds before an unfinished request expires
    std::uint64_t seed = 0;                       ///< splitmix64 seed
    double prefill_rate = 10000.0;                ///< tokens per second (ttft)
    double session_saturation = 2.0;              ///< generic session saturation factor
    /// The policy's parameters by name (RouterConfig.params; a None value is left out).
    std::map<std::string, double, std::less<>> params;

    /// params[key]; ValueError naming the key if it is missing.
    double param(std::string_view key) const;
    /// params[key], or `fallback` if the policy has no such parameter.
    double param_or(std::string_view key, double fallback) const;
    /// ValueError naming the first field out of range (a crash or UB guard in the core).
    void check() const;
};

/// Where one request goes and why.
struct Decision {
    std::string replica;               ///< chosen replica's name
    std::int64_t replica_id = 0;       ///< its dense id
    std::int64_t matched_blocks = 0;   ///< leading prompt blocks it holds (ttft: pending ones too), whole engine blocks
    std::int64_t cached_tokens = 0;    ///< min(matched_blocks * block_size, prompt_tokens)
    std::int64_t prompt_tokens = 0;    ///< tokens of the prompt
    const char* reason = "";           ///< session/affinity/load/miss/balance/hash/overflow
    const char* binding = "none";      ///< none/new/kept/rebound
    std::int64_t stranded_blocks = 0;  ///< blocks a rebound session left behind
    std::int64_t handle = 0;           ///< for prefill_done() and finish()
};

/// Load that other routers (gateways sharing the fleet) put on one replica: the terms a
/// router adds to its own accounting (Router::set_external_load).
struct ExternalLoad {
    std::int64_t in_flight = 0;              ///< their requests routed and not finished
    std::int64_t queued_prefill_tokens = 0;  ///< their uncached tokens before first token
    std::int64_t prefill_requests = 0;       ///< their requests before first token
    std::int64_t prefill_blocks = 0;         ///< uncached blocks of those
    std::int64_t decode_blocks = 0;          ///< prompt blocks of theirs past first token
};

/// Largest value of each ExternalLoad term: sums stay far from int64 overflow.
inline constexpr std::int64_t kMaxExternalLoad = std::int64_t{1} << 40;

/// Load terms of one replica (the counts are own + external).
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
    ExternalLoad external;                   ///< the part of the counts set_external_load() set
};

/// Router-wide counters.
struct RouterStats {
    std::int64_t routed = 0;               ///< decisions made
    std::int64_t prompt_tokens = 0;        ///< tokens routed (saturates at 2**63 - 1)
    std::int64_t cached_tokens = 0;        ///< tokens expected cached (saturates likewise)
    std::int64_t rebinds = 0;              ///< sessions moved
    std::int64_t stranded_blocks = 0;      ///< blocks left behind by rebinds
    std::int64_t session_expirations = 0;  ///< sessions dropped by TTL
    std::int64_t session_evictions = 0;    ///< sessions dropped by LRU (count or bytes)
    std::int64_t request_expirations = 0;  ///< requests released by request_ttl, never finished
    std::int64_t sessions = 0;             ///< sessions in the table
    std::int64_t session_bytes = 0;        ///< bytes of the session ids in the table
    std::int64_t in_flight = 0;            ///< requests not finished (released ones included)
    std::int64_t replicas = 0;             ///< live replicas
};

/// Per-request cache keys of the hash contract (C1, README "Block hashing"): a request's KV
/// is reusable only under the same LoRA adapter, cache salt and multimodal inputs.
struct CacheKeys {
    std::string_view lora;        ///< UTF-8 adapter name; empty: none
    std::string_view cache_salt;  ///< UTF-8 cache salt; empty: none
    const MmKey* mm = nullptr;    ///< multimodal items, sorted by offset (stable)
    std::size_t mm_count = 0;     ///< how many
};

/// A session binding as a snapshot holds it (Router::export_sessions / import_sessions).
struct SessionRecord {
    std::string key;            ///< session id (UTF-8)
    std::uint32_t replica = 0;  ///< replica id
    std::int64_t blocks = 0;    ///< blocks of its last prompt
    double age = 0;             ///< seconds since its last use
};

/// Largest num_tokens a request may claim: keeps every load sum far from int64 overflow.
inline constexpr std::int64_t kMaxPromptTokens = (std::int64_t{1} << 32) - 1;

/// Affinity-versus-load router; every public method is safe from several threads.
class Router {
public:
    /// A router with no replicas; ValueError if the options are out of range.
    explicit Router(RouterOptions options);
    ~Router();
    Router(const Router&) = delete;
    Router& operator=(const Router&) = delete;

    /// The index routing reads (approximate mode also writes it); events feed it.
    std::shared_ptr<PrefixIndex> index() const noexcept;
    /// Hybrid mode's speculative index, else null.
    std::shared_ptr<PrefixIndex> speculative_index() const noexcept;
    /// The options it was built with.
    const RouterOptions& options() const noexcept;

    /// Adds a healthy replica whose engine caches whole blocks of engine_block_size tokens
    /// (a multiple of block_size, or smaller: then any router block is whole); ValueError if
    /// the name is empty or taken, or the size is neither. Returns its id.
    std::uint32_t add_replica(const std::string& name,
                              std::optional<std::int64_t> engine_block_size = std::nullopt);
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
    /// Router blocks per engine block of a replica, as the index holds it (set by add_replica
    /// or learned from events; 1: any router block is whole).
    std::int64_t engine_block(const std::string& name) const;

    /// Routes a prompt of tokens hashed with block_size, the salt and the request's keys.
    Decision route_tokens(const std::uint32_t* tokens, std::size_t n, const CacheKeys& keys,
                          const std::optional<std::string>& session, std::optional<double> now);
    /// Routes a prompt given as n block hashes covering num_tokens tokens (ValueError above
    /// kMaxPromptTokens).
    Decision route_hashes(const std::uint64_t* hashes, std::size_t n, std::int64_t num_tokens,
                          const std::optional<std::string>& session, std::optional<double> now);
    /// The request produced its first token.
    void prefill_done(std::int64_t handle);
    /// The request ended.
    void finish(std::int64_t handle);

    /// Sets the given engine-reported figures (already validated).
    void report_load(const std::string& name, std::optional<std::int64_t> waiting,
                     std::optional<std::int64_t> running, std::optional<double> kv_usage);
    /// Load terms of a replica: counts are own + external, `external` the external part.
    ReplicaLoad load(const std::string& name) const;
    /// Replaces the load other routers put on a replica (KeyError unknown name, ValueError a
    /// term outside [0, kMaxExternalLoad], naming it; nothing changes on error).
    void set_external_load(const std::string& name, const ExternalLoad& load);
    /// Binds (or rebinds) a session to a replica as if this router had routed it there at
    /// `now` (KeyError unknown name; ValueError an id over max_session_bytes).
    void bind_session(const std::string& session, const std::string& name, std::optional<double> now);
    /// The replica a live session is bound to, without refreshing it; nullopt if none.
    std::optional<std::string> session(const std::string& session, std::optional<double> now) const;
    /// Another router's route-time insert of n block hashes on replica `name`: approximate
    /// mode inserts into the index, hybrid into the speculative index, precise does nothing.
    /// Returns blocks newly held; reserves no load and touches no session or tie order.
    std::size_t observe_route(const std::string& name, const std::uint64_t* hashes, std::size_t n,
                              std::optional<double> now);
    /// Counters.
    RouterStats stats() const;

    /// Sessions bound to a live replica and not expired at `now`, least recently used first;
    /// age = max(0, now - last use). For snapshots.
    std::vector<SessionRecord> export_sessions(double now) const;
    /// Drops the sessions bound to `replicas`, then binds each record (least recent first) as
    /// last used `age` seconds before now unless that has expired or the id is longer than
    /// max_session_bytes; evicts beyond the table's
    /// bounds (session_evictions). Record replica ids must be live. Returns records bound.
    std::size_t import_sessions(const std::vector<std::uint32_t>& replicas, const std::vector<SessionRecord>& sessions,
                                double now);

private:
    struct Impl;
    std::unique_ptr<Impl> impl_;
};

/// splitmix64 finalizer (bijective 64-bit mix), shared with the reference.
std::uint64_t mix64(std::uint64_t z) noexcept;
/// FNV-1a 64-bit of bytes: ring positions of names and sessions.
std::uint64_t fnv1a64(const void* data, std::size_t len) noexcept;

}  // namespace kvroute
