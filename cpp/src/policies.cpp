// The routing policies, one class each over a DecisionView (policies.hpp). Each mirrors the
// function of the same name in python/kvroute/reference/policies.py expression for
// expression, so that both implementations decide bit for bit alike. kvroute/config.py
// documents the rules; the comments here say why a step is written the way it is.
#include "policies.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>
#include <utility>

#include "kvroute/errors.hpp"

// A Policy value without a case in make_policy() is a compile error, not a silent default.
#pragma GCC diagnostic error "-Wswitch"

namespace kvroute {

namespace {

constexpr std::uint64_t kGolden = 0x9E3779B97F4A7C15ULL;

double next_unit(std::uint64_t& state) noexcept {
    return static_cast<double>(next_u64(state) >> 11) * (1.0 / 9007199254740992.0);
}

// First candidate with the best key; a later one wins only when strictly better, so ties
// go to the earliest in `order` (the least recently chosen).
template <class Key, class Better>
std::uint32_t arg_best(const std::vector<std::uint32_t>& order, Key key, Better better) {
    std::uint32_t best = order[0];
    auto best_key = key(best);
    for (std::size_t i = 1; i < order.size(); ++i) {
        auto k = key(order[i]);
        if (better(k, best_key)) {
            best = order[i];
            best_key = k;
        }
    }
    return best;
}

template <class Key>
std::uint32_t argmin(const std::vector<std::uint32_t>& order, Key key) {
    return arg_best(order, key, [](const auto& a, const auto& b) { return a < b; });
}

template <class Key>
std::uint32_t argmax(const std::vector<std::uint32_t>& order, Key key) {
    return arg_best(order, key, [](const auto& a, const auto& b) { return a > b; });
}

std::int32_t top_match(const DecisionView& v, const std::vector<std::uint32_t>& order) {
    std::int32_t top = 0;
    for (std::uint32_t r : order) top = std::max(top, v.match[r]);
    return top;
}

// "miss" when nobody matched, "affinity" when the choice holds the longest match, else "load".
const char* generic_reason(const DecisionView& v, const std::vector<std::uint32_t>& order,
                           std::uint32_t chosen) {
    const std::int32_t top = top_match(v, order);
    if (top == 0) return "miss";
    return v.match[chosen] == top ? "affinity" : "load";
}

double mean_of(const std::int64_t* values, const std::vector<std::uint32_t>& rs) {
    std::int64_t sum = 0;
    for (std::uint32_t r : rs) sum += values[r];
    return static_cast<double>(sum) / static_cast<double>(rs.size());
}

class RoundRobin final : public RoutingPolicy {
public:
    using RoutingPolicy::RoutingPolicy;
    Choice choose(const DecisionView&, const std::vector<std::uint32_t>& order, std::uint64_t&) override {
        return {order[0], "balance"};
    }
};

class Random final : public RoutingPolicy {
public:
    using RoutingPolicy::RoutingPolicy;
    Choice choose(const DecisionView&, const std::vector<std::uint32_t>& order, std::uint64_t& rng) override {
        return {order[static_cast<std::size_t>(next_u64(rng) % order.size())], "balance"};
    }
};

class LeastLoaded final : public RoutingPolicy {
public:
    using RoutingPolicy::RoutingPolicy;
    Choice choose(const DecisionView& v, const std::vector<std::uint32_t>& order, std::uint64_t&) override {
        return {argmin(order, [&](std::uint32_t r) { return v.inflight[r]; }), "balance"};
    }
};

class PowerOfTwo final : public RoutingPolicy {
public:
    using RoutingPolicy::RoutingPolicy;
    Choice choose(const DecisionView& v, const std::vector<std::uint32_t>& order, std::uint64_t& rng) override {
        const std::size_t n = order.size();
        if (n == 1) return {order[0], "balance"};
        const std::size_t i = static_cast<std::size_t>(next_u64(rng) % n);
        std::size_t j = static_cast<std::size_t>(next_u64(rng) % (n - 1));
        if (j >= i) ++j;
        const std::uint32_t a = order[i], b = order[j];
        return {v.inflight[b] < v.inflight[a] ? b : a, "balance"};
    }
};

// Consistent hashing on a ring kept sorted incrementally (O(vnodes log ring) per membership
// change), with Mirrokni-Thorup-Zadimoghaddam bounded loads.
class Sticky final : public RoutingPolicy {
public:
    Sticky(double saturation, const RouterOptions& o)
        : RoutingPolicy(saturation), vnodes_(static_cast<std::uint32_t>(o.param("vnodes"))),
          bound_(o.params.count("bound") ? std::optional<double>(o.param("bound")) : std::nullopt) {}

    Choice choose(const DecisionView& v, const std::vector<std::uint32_t>& order, std::uint64_t&) override {
        std::uint64_t key;
        if (*v.session) {
            key = mix64(fnv1a64((*v.session)->data(), (*v.session)->size()));
        } else if (v.blocks > 0) {
            key = mix64(v.hashes[0]);
        } else {
            return {order[0], "balance"};
        }
        allowed_.assign(allowed_.size(), 0);
        for (std::uint32_t r : order) allowed_[r] = 1;
        // Capacity over every eligible replica, also when a saturated bound one is excluded.
        const std::int64_t cap = bound_ ? capacity(v) : 0;
        auto it = ring_.lower_bound({key, 0});
        bool first = true;
        for (std::size_t i = 0; i < ring_.size(); ++i, ++it) {
            if (it == ring_.end()) it = ring_.begin();
            const std::uint32_t r = it->second;
            if (!allowed_[r]) continue;
            if (!bound_ || v.inflight[r] < cap) return {r, first ? "hash" : "overflow"};
            first = false;
        }
        throw StateError("Router invariant broken: bounded loads found no replica below capacity");
    }

    bool saturated(const DecisionView& v, std::uint32_t b) const override {
        return bound_ && v.inflight[b] >= capacity(v);
    }

    void replica_added(std::uint32_t r, const std::string& name) override {
        if (allowed_.size() <= r) allowed_.resize(r + 1, 0);
        const std::uint64_t base = fnv1a64(name.data(), name.size());
        for (std::uint32_t k = 0; k < vnodes_; ++k) ring_.emplace(position(base, k), r);
    }

    void replica_removed(std::uint32_t r, const std::string& name) override {
        const std::uint64_t base = fnv1a64(name.data(), name.size());
        for (std::uint32_t k = 0; k < vnodes_; ++k) ring_.erase({position(base, k), r});
    }

private:
    static std::uint64_t position(std::uint64_t base, std::uint32_t k) {
        return mix64(base + static_cast<std::uint64_t>(k) * kGolden);
    }
    std::int64_t capacity(const DecisionView& v) const {
        std::int64_t total = 0;
        for (std::uint32_t r : *v.eligible) total += v.inflight[r];
        return static_cast<std::int64_t>(std::ceil(*bound_ * static_cast<double>(total + 1) /
                                                   static_cast<double>(v.eligible->size())));
    }

    std::uint32_t vnodes_;
    std::optional<double> bound_;
    std::set<std::pair<std::uint64_t, std::uint32_t>> ring_;
    std::vector<char> allowed_;  // scratch: candidates of this decision, by replica id
};

class Linear final : public RoutingPolicy {
public:
    Linear(double saturation, const RouterOptions& o)
        : RoutingPolicy(saturation), wa_(o.param("w_affinity")), wl_(o.param("w_load")),
          escape_(o.param("escape_factor")) {}

    Choice choose(const DecisionView& v, const std::vector<std::uint32_t>& order, std::uint64_t&) override {
        auto aff = [&](std::uint32_t r) { return v.match_tokens(r); };
        auto queued = [&](std::uint32_t r) { return v.queued[r]; };
        auto score = [&](std::uint32_t r) {
            return wa_ * static_cast<double>(aff(r)) - wl_ * static_cast<double>(queued(r));
        };
        std::int64_t top = 0;
        for (std::uint32_t r : order) top = std::max(top, aff(r));
        if (top == 0) return {argmax(order, score), "miss"};
        std::uint32_t best_aff = order[0];
        for (std::uint32_t r : order)
            if (aff(r) == top) {
                best_aff = r;
                break;
            }
        if (static_cast<double>(queued(best_aff)) > escape_ * mean_of(v.queued, order))
            return {argmin(order, queued), "load"};
        const std::uint32_t chosen = argmax(order, score);
        return {chosen, aff(chosen) == top ? "affinity" : "load"};
    }

    bool saturated(const DecisionView& v, std::uint32_t b) const override {
        return static_cast<double>(v.queued[b]) > escape_ * mean_of(v.queued, *v.eligible);
    }

private:
    double wa_, wl_, escape_;
};

class SGLang final : public RoutingPolicy {
public:
    SGLang(double saturation, const RouterOptions& o)
        : RoutingPolicy(saturation), threshold_(o.param("cache_threshold")),
          abs_(static_cast<std::int64_t>(o.param("balance_abs_threshold"))),
          rel_(o.param("balance_rel_threshold")) {}

    Choice choose(const DecisionView& v, const std::vector<std::uint32_t>& order, std::uint64_t&) override {
        auto inflight = [&](std::uint32_t r) { return v.inflight[r]; };
        std::int64_t lo = std::numeric_limits<std::int64_t>::max(), hi = 0;
        for (std::uint32_t r : order) {
            lo = std::min(lo, v.inflight[r]);
            hi = std::max(hi, v.inflight[r]);
        }
        if (imbalanced(hi, lo)) return {argmin(order, inflight), "load"};
        const std::int32_t top = top_match(v, order);
        const std::int64_t mt = std::min(static_cast<std::int64_t>(top) * v.block_size, v.tokens);
        const double rate = v.tokens > 0 ? static_cast<double>(mt) / static_cast<double>(v.tokens) : 0.0;
        if (rate > threshold_) {
            for (std::uint32_t r : order)
                if (v.match[r] == top) return {r, "affinity"};
        }
        return {argmin(order, inflight), "miss"};
    }

    bool saturated(const DecisionView& v, std::uint32_t b) const override {
        std::int64_t lo = std::numeric_limits<std::int64_t>::max();
        for (std::uint32_t r : *v.eligible) lo = std::min(lo, v.inflight[r]);
        return imbalanced(v.inflight[b], lo);
    }

private:
    bool imbalanced(std::int64_t hi, std::int64_t lo) const {
        return hi - lo > abs_ && static_cast<double>(hi) > static_cast<double>(lo) * rel_;
    }
    double threshold_;
    std::int64_t abs_;
    double rel_;
};

class Dynamo final : public RoutingPolicy {
public:
    Dynamo(double saturation, const RouterOptions& o)
        : RoutingPolicy(saturation), scale_(o.param("prefill_load_scale")), temp_(o.param("temperature")) {}

    Choice choose(const DecisionView& v, const std::vector<std::uint32_t>& order, std::uint64_t& rng) override {
        const auto pb = static_cast<std::int64_t>(v.blocks);
        const std::size_t n = order.size();
        costs_.resize(n);
        for (std::size_t i = 0; i < n; ++i) {
            const std::uint32_t r = order[i];
            const std::int64_t adj = std::max<std::int64_t>(v.loads[r].prefill_blocks + pb - v.match[r], 0);
            costs_[i] = scale_ * static_cast<double>(adj) + static_cast<double>(v.loads[r].decode_blocks + pb);
        }
        const std::uint32_t chosen = order[temp_ > 0.0 ? sample(rng) : cheapest()];
        return {chosen, generic_reason(v, order, chosen)};
    }

private:
    std::size_t cheapest() const {
        std::size_t best = 0;
        for (std::size_t i = 1; i < costs_.size(); ++i)
            if (costs_[i] < costs_[best]) best = i;
        return best;
    }
    // Softmax over -normalized cost / temperature.
    std::size_t sample(std::uint64_t& rng) {
        double lo = costs_[0], hi = costs_[0];
        for (double c : costs_) {
            lo = std::min(lo, c);
            hi = std::max(hi, c);
        }
        const double span = hi - lo;
        double total = 0.0;
        for (double& c : costs_) {
            const double norm = span > 0.0 ? (c - lo) / span : 0.0;
            c = std::exp(-norm / temp_);
            total += c;
        }
        const double u = next_unit(rng) * total;
        double acc = 0.0;
        for (std::size_t i = 0; i < costs_.size(); ++i) {
            acc += costs_[i];
            if (u < acc) return i;
        }
        return costs_.size() - 1;
    }
    double scale_, temp_;
    std::vector<double> costs_;  // scratch
};

class LLMD final : public RoutingPolicy {
public:
    LLMD(double saturation, const RouterOptions& o)
        : RoutingPolicy(saturation), wp_(o.param("w_prefix")), wq_(o.param("w_queue")), wk_(o.param("w_kv")) {}

    Choice choose(const DecisionView& v, const std::vector<std::uint32_t>& order, std::uint64_t&) override {
        auto q = [&](std::uint32_t r) {
            return v.loads[r].waiting ? *v.loads[r].waiting : v.loads[r].prefill_requests;
        };
        std::int64_t qmax = q(order[0]), qmin = qmax;
        for (std::uint32_t r : order) {
            qmax = std::max(qmax, q(r));
            qmin = std::min(qmin, q(r));
        }
        const std::size_t pb = v.blocks;
        auto score = [&](std::uint32_t r) {
            const double prefix = pb > 0 ? static_cast<double>(v.match[r]) / static_cast<double>(pb) : 0.0;
            const double queue =
                qmax > qmin ? static_cast<double>(qmax - q(r)) / static_cast<double>(qmax - qmin) : 1.0;
            const double kv = 1.0 - (v.loads[r].kv_usage ? *v.loads[r].kv_usage : 0.0);
            return wp_ * prefix + wq_ * queue + wk_ * kv;
        };
        const std::uint32_t chosen = argmax(order, score);
        return {chosen, generic_reason(v, order, chosen)};
    }

private:
    double wp_, wq_, wk_;
};

class Preble final : public RoutingPolicy {
public:
    Preble(double saturation, const RouterOptions& o)
        : RoutingPolicy(saturation), dw_(o.param("decode_weight")) {}

    Choice choose(const DecisionView& v, const std::vector<std::uint32_t>& order, std::uint64_t&) override {
        auto cost = [&](std::uint32_t r) {
            return static_cast<double>(v.queued[r] + v.tokens - v.match_tokens(r)) +
                   dw_ * static_cast<double>(v.inflight[r]);
        };
        const std::int32_t top = top_match(v, order);
        const std::int64_t mt = std::min(static_cast<std::int64_t>(top) * v.block_size, v.tokens);
        std::uint32_t chosen;
        if (mt > v.tokens - mt) {  // exploit: the cheapest among the longest-match holders
            pool_.clear();
            for (std::uint32_t r : order)
                if (v.match[r] == top) pool_.push_back(r);
            chosen = argmin(pool_, cost);
        } else {
            chosen = argmin(order, cost);
        }
        return {chosen, generic_reason(v, order, chosen)};
    }

private:
    double dw_;
    std::vector<std::uint32_t> pool_;  // scratch
};

// Lowest estimated time to first token. Owns the pending cache: prompts routed to a replica
// that have not produced their first token.
class TTFT final : public RoutingPolicy {
public:
    TTFT(double saturation, const RouterOptions& o)
        : RoutingPolicy(saturation),
          step_(o.param("step_tokens")),
          kvw_(o.param("kv_weight")),
          batch_(static_cast<std::int64_t>(o.param("batch_tokens"))),
          fleet_(o.param("fleet_weight")) {}

    Choice choose(const DecisionView& v, const std::vector<std::uint32_t>& order, std::uint64_t&) override {
        // Estimated time to first token in tokens at the prefill rate (kvroute/config.py):
        // the prefill ahead of and including this request, the engine steps it waits through
        // (fixed cost, decodes, their KV reads), and the prefill it adds to the fleet beyond
        // the best-cached candidate. Ties: the longer match, then fewer in flight, then the
        // least recently chosen. Operation for operation as the reference's TTFT.cost.
        const std::int32_t top = top_match(v, order);
        const std::int64_t least = v.tokens - std::min(std::int64_t{top} * v.block_size, v.tokens);
        std::uint32_t chosen = order[0];
        double best_cost = 0.0;
        std::int64_t best_m = -1, best_f = 0;
        for (std::uint32_t r : order) {
            const std::int64_t m = v.match[r];
            const std::int64_t f = v.inflight[r];
            const double c = cost(v, r, least);
            if (best_m < 0 || c < best_cost || (c == best_cost && (m > best_m || (m == best_m && f < best_f)))) {
                chosen = r;
                best_cost = c;
                best_m = m;
                best_f = f;
            }
        }
        return {chosen, top == 0 ? "miss" : (v.match[chosen] == top ? "affinity" : "load")};
    }

    bool extends_match() const override { return count_ > 0; }

    // A prompt queued behind a request with the same leading blocks on the same FIFO replica
    // finds them cached when its own prefill starts: count them as matched.
    void extend_match(const std::uint64_t* hashes, std::size_t n, const std::vector<std::uint32_t>& eligible,
                      std::vector<std::int32_t>& match) const override {
        if (count_ == 0) return;
        for (std::uint32_t r : eligible) {
            std::size_t m = static_cast<std::size_t>(match[r]);
            for (const Pending& q : pending_[r]) {
                const std::size_t len = std::min(q.hashes.size(), n);
                if (len <= m) continue;
                std::size_t k = 0;
                while (k < len && q.hashes[k] == hashes[k]) ++k;
                m = std::max(m, k);
            }
            match[r] = static_cast<std::int32_t>(m);
        }
    }

    void replica_added(std::uint32_t r, const std::string&) override {
        if (pending_.size() <= r) pending_.resize(r + 1);
    }
    void replica_removed(std::uint32_t r, const std::string&) override {
        count_ -= pending_[r].size();
        std::vector<Pending>().swap(pending_[r]);
    }
    void reserved(std::int64_t handle, std::uint32_t r, const std::uint64_t* hashes, std::size_t n) override {
        pending_[r].push_back(Pending{handle, std::vector<std::uint64_t>(hashes, hashes + n)});
        ++count_;
    }
    void released(std::int64_t handle, std::uint32_t r) override {
        auto& list = pending_[r];
        for (std::size_t i = 0; i < list.size(); ++i) {
            if (list[i].handle == handle) {
                list[i] = std::move(list.back());
                list.pop_back();
                --count_;
                return;
            }
        }
    }

private:
    double cost(const DecisionView& v, std::uint32_t r, std::int64_t least) const {
        const std::int64_t u = v.tokens - v.match_tokens(r);
        const std::int64_t w = v.queued[r] + u;
        const ReplicaLoad& load = v.loads[r];
        const std::int64_t d = v.inflight[r] - load.prefill_requests;
        const std::int64_t cap = std::max<std::int64_t>(batch_ - d, 1);
        const std::int64_t steps = std::max<std::int64_t>(1, (w + cap - 1) / cap);
        const double kv = static_cast<double>(load.decode_blocks * v.block_size);
        return static_cast<double>(w) + static_cast<double>(steps) * (static_cast<double>(d) + step_ + kvw_ * kv) +
               fleet_ * static_cast<double>(u - least);
    }

    struct Pending {
        std::int64_t handle;
        std::vector<std::uint64_t> hashes;
    };
    double step_, kvw_;
    std::int64_t batch_;
    double fleet_;
    std::vector<std::vector<Pending>> pending_;  // per replica id
    std::size_t count_ = 0;                      // entries in pending_: 0 skips the scan
};

}  // namespace

std::uint64_t next_u64(std::uint64_t& state) noexcept {
    state += kGolden;
    return mix64(state);
}

bool RoutingPolicy::saturated(const DecisionView& v, std::uint32_t b) const {
    return static_cast<double>(v.inflight[b]) > std::max(1.0, saturation_ * mean_of(v.inflight, *v.eligible));
}

Policy policy_from_name(std::string_view name) {
    for (const auto& [policy, text] : kPolicyNames)
        if (text == name) return policy;
    throw ValueError("unknown policy '" + std::string(name) + "'");
}

std::unique_ptr<RoutingPolicy> make_policy(const RouterOptions& o) {
    const double s = o.session_saturation;
    switch (o.policy) {
        case Policy::RoundRobin: return std::make_unique<RoundRobin>(s);
        case Policy::Random: return std::make_unique<Random>(s);
        case Policy::LeastLoaded: return std::make_unique<LeastLoaded>(s);
        case Policy::PowerOfTwo: return std::make_unique<PowerOfTwo>(s);
        case Policy::Sticky: return std::make_unique<Sticky>(s, o);
        case Policy::Linear: return std::make_unique<Linear>(s, o);
        case Policy::SGLang: return std::make_unique<SGLang>(s, o);
        case Policy::Dynamo: return std::make_unique<Dynamo>(s, o);
        case Policy::LLMD: return std::make_unique<LLMD>(s, o);
        case Policy::Preble: return std::make_unique<Preble>(s, o);
        case Policy::TTFT: return std::make_unique<TTFT>(s, o);
    }
    throw ValueError("unknown policy value " + std::to_string(static_cast<int>(o.policy)));
}

}  // namespace kvroute
