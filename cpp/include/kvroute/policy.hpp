// Routing policies by name. Adding a policy touches four files: this one (enum value and
// name), cpp/src/policies.cpp (its function and one factory case), the reference's
// python/kvroute/reference/policies.py and python/kvroute/config.py (parameters, docs).
#pragma once
#include <array>
#include <string_view>
#include <utility>

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

/// Every policy with the name RouterConfig.policy spells it.
inline constexpr std::array<std::pair<Policy, std::string_view>, 11> kPolicyNames{{
    {Policy::RoundRobin, "round_robin"},
    {Policy::Random, "random"},
    {Policy::LeastLoaded, "least_loaded"},
    {Policy::PowerOfTwo, "power_of_two"},
    {Policy::Sticky, "sticky"},
    {Policy::Linear, "linear"},
    {Policy::SGLang, "sglang"},
    {Policy::Dynamo, "dynamo"},
    {Policy::LLMD, "llmd"},
    {Policy::Preble, "preble"},
    {Policy::TTFT, "ttft"},
}};

/// The policy of a name; ValueError "unknown policy 'x'" for any other.
Policy policy_from_name(std::string_view name);

}  // namespace kvroute
