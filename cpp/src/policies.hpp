// What a routing policy sees and owns (private to the core). Each policy is one class in
// policies.cpp over one read-only DecisionView; the Router owns one instance and calls it
// under its lock. Twin: python/kvroute/reference/policies.py.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kvroute/router.hpp"

namespace kvroute {

/// One decision's inputs, read-only to every policy. Arrays are indexed by replica id. The
/// load counts (inflight, queued, loads' prefill/decode terms) are the router's own plus
/// the external load other routers reported (Router::set_external_load).
struct DecisionView {
    const std::uint64_t* hashes = nullptr;  ///< the prompt's block hashes
    std::size_t blocks = 0;                 ///< how many
    std::int64_t tokens = 0;                ///< prompt tokens
    std::int64_t block_size = 16;           ///< tokens per block
    const std::optional<std::string>* session = nullptr;  ///< session id, if any
    /// Blocks each replica is scored as holding: index (and speculative, pending) match,
    /// rounded down to whole engine blocks, 0 when shorter than min_match_tokens.
    const std::int32_t* match = nullptr;
    const std::int64_t* inflight = nullptr;  ///< requests routed and not finished
    const std::int64_t* queued = nullptr;    ///< uncached tokens before first token
    const ReplicaLoad* loads = nullptr;      ///< block counts and reported figures
    const std::vector<std::uint32_t>* eligible = nullptr;  ///< live, healthy, not draining

    /// Matched tokens of replica r, at most the prompt.
    std::int64_t match_tokens(std::uint32_t r) const {
        const std::int64_t m = static_cast<std::int64_t>(match[r]) * block_size;
        return m < tokens ? m : tokens;
    }
};

/// A policy's answer: the replica and Decision.reason.
struct Choice {
    std::uint32_t replica;
    const char* reason;
};

/// One routing rule and the state it owns; every call is made under the Router's lock.
class RoutingPolicy {
public:
    explicit RoutingPolicy(double session_saturation) : saturation_(session_saturation) {}
    virtual ~RoutingPolicy() = default;

    /// The replica among `order` (candidates, least recently chosen first: ties go to the
    /// earliest). `rng` is a copy of the router's generator, kept only if the route succeeds.
    virtual Choice choose(const DecisionView& v, const std::vector<std::uint32_t>& order,
                          std::uint64_t& rng) = 0;
    /// Whether a session's bound replica b is too loaded to keep it (default: in flight >
    /// max(1, session_saturation * eligible mean)).
    virtual bool saturated(const DecisionView& v, std::uint32_t b) const;
    /// Whether extend_match may change anything now (false skips it and its rounding).
    virtual bool extends_match() const { return false; }
    /// Raises match[r] (eligible r) with what the policy knows beyond the index.
    virtual void extend_match(const std::uint64_t*, std::size_t, const std::vector<std::uint32_t>&,
                              std::vector<std::int32_t>&) const {}
    /// A replica joined (r is its id) or left the fleet.
    virtual void replica_added(std::uint32_t, const std::string&) {}
    virtual void replica_removed(std::uint32_t, const std::string&) {}
    /// A request was reserved on replica r / stopped waiting for its first token there.
    virtual void reserved(std::int64_t, std::uint32_t, const std::uint64_t*, std::size_t) {}
    virtual void released(std::int64_t, std::uint32_t) {}

private:
    double saturation_;
};

/// The policy options.policy names, built from options.params (ValueError if one is missing
/// or out of range).
std::unique_ptr<RoutingPolicy> make_policy(const RouterOptions& options);

/// splitmix64 step: the generator both implementations share.
std::uint64_t next_u64(std::uint64_t& state) noexcept;

}  // namespace kvroute
