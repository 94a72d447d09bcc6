// Router core. Each step mirrors python/kvroute/reference/router.py so that both make the
// same decisions bit for bit: same candidate order, same float expressions, same generator.
#include "kvroute/router.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kvroute/errors.hpp"
#include "kvroute/hash.hpp"

namespace kvroute {

namespace {

constexpr std::uint64_t kGolden = 0x9E3779B97F4A7C15ULL;

std::uint64_t next_u64(std::uint64_t& state) noexcept {
    state += kGolden;
    return mix64(state);
}

double next_unit(std::uint64_t& state) noexcept {
    return static_cast<double>(next_u64(state) >> 11) * (1.0 / 9007199254740992.0);
}

// First candidate with the smallest key; later ones win only when strictly smaller, so ties
// fall to the rotation order.
template <class Key>
std::uint32_t argmin(const std::vector<std::uint32_t>& order, Key key) {
    std::uint32_t best = order[0];
    auto best_key = key(best);
    for (std::size_t i = 1; i < order.size(); ++i) {
        auto k = key(order[i]);
        if (k < best_key) {
            best = order[i];
            best_key = k;
        }
    }
    return best;
}

template <class Key>
std::uint32_t argmax(const std::vector<std::uint32_t>& order, Key key) {
    std::uint32_t best = order[0];
    auto best_key = key(best);
    for (std::size_t i = 1; i < order.size(); ++i) {
        auto k = key(order[i]);
        if (k > best_key) {
            best = order[i];
            best_key = k;
        }
    }
    return best;
}

}  // namespace

std::uint64_t mix64(std::uint64_t z) noexcept {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

std::uint64_t fnv1a64(const void* data, std::size_t len) noexcept {
    const auto* p = static_cast<const unsigned char*>(data);
    std::uint64_t h = 0xCBF29CE484222325ULL;
    for (std::size_t i = 0; i < len; ++i) h = (h ^ p[i]) * 0x100000001B3ULL;
    return h;
}

Router::Router(RouterOptions options)
    : opt_(std::move(options)), bs_(static_cast<std::int64_t>(opt_.block_size)), rng_(opt_.seed) {
    root_ = root_hash(opt_.salt.data(), opt_.salt.size());
    index_ = std::make_shared<PrefixIndex>(0, opt_.index_capacity, opt_.index_ttl, false);
    if (opt_.mode == IndexMode::Hybrid)
        spec_ = std::make_shared<PrefixIndex>(0, opt_.index_capacity, opt_.speculative_ttl, false);
}

std::uint32_t Router::lookup(const std::string& name) const {
    auto it = ids_.find(name);
    if (it == ids_.end()) throw KeyError("unknown replica '" + name + "'");
    return it->second;
}

void Router::reset_slot(std::uint32_t r) {
    loads_[r] = ReplicaLoad{};
    inflight_[r] = 0;
    queued_[r] = 0;
    eligible_dirty_ = true;
}

std::uint32_t Router::add_replica(const std::string& name) {
    std::lock_guard<std::mutex> lock(mu_);
    if (name.empty()) throw ValueError("replica name must not be empty");
    if (ids_.count(name)) throw ValueError("replica '" + name + "' already exists");
    const std::uint32_t r = index_->add_replica();
    if (spec_) spec_->add_replica();
    // Ids added to the index directly (not through the Router) stay dead slots here.
    while (r >= names_.size()) {
        names_.emplace_back();
        live_.push_back(0);
        gen_.push_back(0);
        loads_.emplace_back();
        inflight_.push_back(0);
        queued_.push_back(0);
        pending_.emplace_back();
    }
    reset_slot(r);
    names_[r] = name;
    live_[r] = 1;
    gen_[r] += 1;
    ids_.emplace(name, r);
    rebuild_ring();
    return r;
}

void Router::remove_replica(const std::string& name) {
    std::lock_guard<std::mutex> lock(mu_);
    const std::uint32_t r = lookup(name);
    index_->remove_replica(r);
    if (spec_) spec_->remove_replica(r);
    // Their later prefill_done/finish are accepted as no-ops: a gateway cannot avoid racing
    // a removal with the responses still streaming.
    for (auto& kv : requests_)
        if (kv.second.replica == static_cast<std::int64_t>(r)) {
            release_pending(kv.first, kv.second);
            kv.second.replica = -1;
        }
    reset_slot(r);
    names_[r].clear();
    live_[r] = 0;
    ids_.erase(name);
    rebuild_ring();
}

void Router::drain(const std::string& name, bool draining) {
    std::lock_guard<std::mutex> lock(mu_);
    loads_[lookup(name)].draining = draining;
    eligible_dirty_ = true;
}

void Router::set_healthy(const std::string& name, bool healthy) {
    std::lock_guard<std::mutex> lock(mu_);
    loads_[lookup(name)].healthy = healthy;
    eligible_dirty_ = true;
}

std::vector<std::string> Router::replicas() const {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::string> out;
    for (std::size_t r = 0; r < names_.size(); ++r)
        if (live_[r]) out.push_back(names_[r]);
    return out;
}

std::uint32_t Router::replica_id(const std::string& name) const {
    std::lock_guard<std::mutex> lock(mu_);
    return lookup(name);
}

void Router::report_load(const std::string& name, std::optional<std::int64_t> waiting,
                         std::optional<std::int64_t> running, std::optional<double> kv_usage) {
    std::lock_guard<std::mutex> lock(mu_);
    ReplicaLoad& l = loads_[lookup(name)];
    if (waiting) l.waiting = waiting;
    if (running) l.running = running;
    if (kv_usage) l.kv_usage = kv_usage;
}

ReplicaLoad Router::load(const std::string& name) const {
    std::lock_guard<std::mutex> lock(mu_);
    const std::uint32_t r = lookup(name);
    ReplicaLoad l = loads_[r];
    l.in_flight = inflight_[r];
    l.queued_prefill_tokens = queued_[r];
    return l;
}

RouterStats Router::stats() const {
    std::lock_guard<std::mutex> lock(mu_);
    RouterStats s = stats_;
    s.sessions = static_cast<std::int64_t>(sessions_.size());
    s.in_flight = static_cast<std::int64_t>(requests_.size());
    s.replicas = static_cast<std::int64_t>(ids_.size());
    return s;
}

void Router::rebuild_ring() {
    if (opt_.policy != Policy::Sticky) return;
    ring_.clear();
    for (std::uint32_t r = 0; r < names_.size(); ++r) {
        if (!live_[r]) continue;
        const std::uint64_t base = fnv1a64(names_[r].data(), names_[r].size());
        for (std::uint32_t k = 0; k < opt_.vnodes; ++k)
            ring_.emplace_back(mix64(base + static_cast<std::uint64_t>(k) * kGolden), r);
    }
    std::sort(ring_.begin(), ring_.end());
}

Router::Request& Router::request(std::int64_t h) {
    auto it = requests_.find(h);
    if (it == requests_.end()) {
        if (h >= 1 && h < next_handle_)
            throw StateError("request " + std::to_string(h) + " already finished");
        throw IndexError("unknown handle " + std::to_string(h));
    }
    return it->second;
}

void Router::prefill_done(std::int64_t handle) {
    std::lock_guard<std::mutex> lock(mu_);
    Request& req = request(handle);
    if (req.replica < 0) return;
    if (req.prefilled)
        throw StateError("request " + std::to_string(handle) + " already reported its first token");
    const auto r = static_cast<std::size_t>(req.replica);
    ReplicaLoad& l = loads_[r];
    req.prefilled = true;
    release_pending(handle, req);
    queued_[r] -= req.uncached;
    l.prefill_requests -= 1;
    l.prefill_blocks -= req.uncached_blocks;
    l.decode_blocks += req.blocks;
}

void Router::release_pending(std::int64_t handle, Request& req) {
    if (opt_.policy != Policy::TTFT) return;
    auto& list = pending_[static_cast<std::size_t>(req.replica)];
    for (std::size_t i = 0; i < list.size(); ++i) {
        if (list[i].handle == handle) {
            list[i] = list.back();
            list.pop_back();
            --pending_count_;
            break;
        }
    }
    std::vector<std::uint64_t>().swap(req.hashes);
}

void Router::finish(std::int64_t handle) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = requests_.find(handle);
    if (it == requests_.end()) request(handle);  // throws the right error
    Request req = std::move(it->second);
    requests_.erase(it);
    if (req.replica < 0) return;
    release_pending(handle, req);
    const auto r = static_cast<std::size_t>(req.replica);
    ReplicaLoad& l = loads_[r];
    if (req.prefilled) {
        l.decode_blocks -= req.blocks;
    } else {
        queued_[r] -= req.uncached;
        l.prefill_requests -= 1;
        l.prefill_blocks -= req.uncached_blocks;
    }
    inflight_[r] -= 1;
}

Decision Router::route_tokens(const std::uint32_t* tokens, std::size_t n,
                              const std::optional<std::string>& session,
                              std::optional<double> now) {
    // Hashing needs no router state, so it runs before the lock; the buffer is per thread.
    thread_local std::vector<std::uint64_t> hashes;
    const std::size_t blocks = n / opt_.block_size;
    if (hashes.size() < blocks) hashes.resize(blocks);
    chain_hashes(tokens, n, opt_.block_size, root_, hashes.data());
    return route_hashes(hashes.data(), blocks, static_cast<std::int64_t>(n), session, now);
}

Decision Router::route_hashes(const std::uint64_t* hashes, std::size_t n, std::int64_t num_tokens,
                              const std::optional<std::string>& session,
                              std::optional<double> now) {
    const double t = now ? *now : PrefixIndex::monotonic_now();
    std::lock_guard<std::mutex> lock(mu_);
    return route_locked(hashes, n, num_tokens, session, t);
}

const char* Router::generic_reason(const std::vector<std::uint32_t>& order,
                                   std::uint32_t chosen) const {
    std::int32_t top = 0;
    for (std::uint32_t r : order) top = std::max(top, match_[r]);
    if (top == 0) return "miss";
    return match_[chosen] == top ? "affinity" : "load";
}

std::int64_t Router::capacity(const std::vector<std::uint32_t>& cands) const {
    std::int64_t total = 0;
    for (std::uint32_t r : cands) total += inflight_[r];
    return static_cast<std::int64_t>(std::ceil(*opt_.bound * static_cast<double>(total + 1) /
                                               static_cast<double>(cands.size())));
}

bool Router::saturated(std::uint32_t b, const std::vector<std::uint32_t>& eligible) const {
    const double n = static_cast<double>(eligible.size());
    switch (opt_.policy) {
        case Policy::SGLang: {
            std::int64_t lo = std::numeric_limits<std::int64_t>::max();
            for (std::uint32_t r : eligible) lo = std::min(lo, inflight_[r]);
            const std::int64_t load = inflight_[b];
            return load - lo > opt_.balance_abs_threshold &&
                   static_cast<double>(load) > static_cast<double>(lo) * opt_.balance_rel_threshold;
        }
        case Policy::Linear: {
            std::int64_t sum = 0;
            for (std::uint32_t r : eligible) sum += queued_[r];
            const double mean = static_cast<double>(sum) / n;
            return static_cast<double>(queued_[b]) > opt_.escape_factor * mean;
        }
        case Policy::Sticky:
            if (!opt_.bound) return false;
            return inflight_[b] >= capacity(eligible);
        default: {
            std::int64_t sum = 0;
            for (std::uint32_t r : eligible) sum += inflight_[r];
            const double mean = static_cast<double>(sum) / n;
            return static_cast<double>(inflight_[b]) >
                   std::max(1.0, opt_.session_saturation * mean);
        }
    }
}

std::pair<std::uint32_t, const char*> Router::choose(const std::vector<std::uint32_t>& cands,
                                                     std::uint64_t& rng, std::size_t pb,
                                                     std::int64_t num_tokens,
                                                     const std::optional<std::string>& session,
                                                     const std::uint64_t* hashes) {
    // Rotation: ties go to the earliest candidate after the per-decision offset.
    std::vector<std::uint32_t>& order = order_;
    order.clear();
    const std::size_t k = static_cast<std::size_t>(rot_ % cands.size());
    order.insert(order.end(), cands.begin() + static_cast<std::ptrdiff_t>(k), cands.end());
    order.insert(order.end(), cands.begin(), cands.begin() + static_cast<std::ptrdiff_t>(k));
    const std::size_t n = order.size();
    const auto& L = loads_;
    const std::int64_t* F = inflight_.data();
    const std::int64_t* Q = queued_.data();
    auto inflight = [F](std::uint32_t r) { return F[r]; };
    auto queued = [Q](std::uint32_t r) { return Q[r]; };

    switch (opt_.policy) {
        case Policy::RoundRobin:
            return {order[0], "balance"};
        case Policy::Random:
            return {order[static_cast<std::size_t>(next_u64(rng) % n)], "balance"};
        case Policy::LeastLoaded:
            return {argmin(order, inflight), "balance"};
        case Policy::PowerOfTwo: {
            if (n == 1) return {order[0], "balance"};
            const std::size_t i = static_cast<std::size_t>(next_u64(rng) % n);
            std::size_t j = static_cast<std::size_t>(next_u64(rng) % (n - 1));
            if (j >= i) ++j;
            const std::uint32_t a = order[i], b = order[j];
            return {F[b] < F[a] ? b : a, "balance"};
        }
        case Policy::Sticky: {
            std::uint64_t key;
            if (session) {
                key = mix64(fnv1a64(session->data(), session->size()));
            } else if (pb > 0) {
                key = mix64(hashes[0]);
            } else {
                return {order[0], "balance"};
            }
            allowed_.assign(names_.size(), 0);
            for (std::uint32_t r : order) allowed_[r] = 1;
            const bool bounded = opt_.bound.has_value();
            // Capacity over every eligible replica, also when a saturated bound one is excluded.
            const std::int64_t cap = bounded ? capacity(eligible_) : 0;
            const auto start = static_cast<std::size_t>(
                std::lower_bound(ring_.begin(), ring_.end(),
                                 std::make_pair(key, std::uint32_t{0})) -
                ring_.begin());
            bool first = true;
            for (std::size_t i = 0; i < ring_.size(); ++i) {
                const std::uint32_t r = ring_[(start + i) % ring_.size()].second;
                if (!allowed_[r]) continue;
                if (!bounded || F[r] < cap) return {r, first ? "hash" : "overflow"};
                first = false;
            }
            throw StateError("Router invariant broken: bounded loads found no replica below capacity");
        }
        case Policy::Linear: {
            const double wa = opt_.w_affinity, wl = opt_.w_load;
            auto aff = [&](std::uint32_t r) {
                const std::int64_t m = mtok(r, num_tokens);
                return m >= opt_.min_match_tokens ? m : std::int64_t{0};
            };
            std::int64_t top = 0;
            for (std::uint32_t r : order) top = std::max(top, aff(r));
            auto score = [&](std::uint32_t r) {
                return wa * static_cast<double>(aff(r)) - wl * static_cast<double>(queued(r));
            };
            if (top == 0) return {argmax(order, score), "miss"};
            std::uint32_t best_aff = order[0];
            for (std::uint32_t r : order)
                if (aff(r) == top) {
                    best_aff = r;
                    break;
                }
            std::int64_t sum = 0;
            for (std::uint32_t r : order) sum += queued(r);
            const double mean = static_cast<double>(sum) / static_cast<double>(n);
            if (static_cast<double>(queued(best_aff)) > opt_.escape_factor * mean)
                return {argmin(order, queued), "load"};
            const std::uint32_t chosen = argmax(order, score);
            return {chosen, aff(chosen) == top ? "affinity" : "load"};
        }
        case Policy::SGLang: {
            std::int64_t lo = std::numeric_limits<std::int64_t>::max(), hi = 0;
            for (std::uint32_t r : order) {
                lo = std::min(lo, F[r]);
                hi = std::max(hi, F[r]);
            }
            if (hi - lo > opt_.balance_abs_threshold &&
                static_cast<double>(hi) > static_cast<double>(lo) * opt_.balance_rel_threshold)
                return {argmin(order, inflight), "load"};
            std::int32_t top = 0;
            for (std::uint32_t r : order) top = std::max(top, match_[r]);
            const std::int64_t mt = std::min(
                static_cast<std::int64_t>(top) * static_cast<std::int64_t>(opt_.block_size), num_tokens);
            const double rate =
                num_tokens > 0 ? static_cast<double>(mt) / static_cast<double>(num_tokens) : 0.0;
            if (rate > opt_.cache_threshold) {
                for (std::uint32_t r : order)
                    if (match_[r] == top) return {r, "affinity"};
            }
            return {argmin(order, inflight), "miss"};
        }
        case Policy::Dynamo: {
            const auto pbi = static_cast<std::int64_t>(pb);
            std::vector<double>& costs = scratch_;
            costs.resize(n);
            for (std::size_t i = 0; i < n; ++i) {
                const std::uint32_t r = order[i];
                const std::int64_t adj =
                    std::max<std::int64_t>(L[r].prefill_blocks + pbi - match_[r], 0);
                costs[i] = opt_.prefill_load_scale * static_cast<double>(adj) +
                           static_cast<double>(L[r].decode_blocks + pbi);
            }
            std::uint32_t chosen;
            if (opt_.temperature > 0.0) {
                double lo = costs[0], hi = costs[0];
                for (double c : costs) {
                    lo = std::min(lo, c);
                    hi = std::max(hi, c);
                }
                const double span = hi - lo;
                double total = 0.0;
                for (double& c : costs) {
                    const double norm = span > 0.0 ? (c - lo) / span : 0.0;
                    c = std::exp(-norm / opt_.temperature);
                    total += c;
                }
                const double u = next_unit(rng) * total;
                double acc = 0.0;
                chosen = order[n - 1];
                for (std::size_t i = 0; i < n; ++i) {
                    acc += costs[i];
                    if (u < acc) {
                        chosen = order[i];
                        break;
                    }
                }
            } else {
                std::size_t best = 0;
                for (std::size_t i = 1; i < n; ++i)
                    if (costs[i] < costs[best]) best = i;
                chosen = order[best];
            }
            return {chosen, generic_reason(order, chosen)};
        }
        case Policy::LLMD: {
            auto q = [&](std::uint32_t r) {
                return L[r].waiting ? *L[r].waiting : L[r].prefill_requests;
            };
            std::int64_t qmax = q(order[0]), qmin = qmax;
            for (std::uint32_t r : order) {
                qmax = std::max(qmax, q(r));
                qmin = std::min(qmin, q(r));
            }
            auto score = [&](std::uint32_t r) {
                const double prefix =
                    pb > 0 ? static_cast<double>(match_[r]) / static_cast<double>(pb) : 0.0;
                const double queue = qmax > qmin ? static_cast<double>(qmax - q(r)) /
                                                       static_cast<double>(qmax - qmin)
                                                 : 1.0;
                const double kv = 1.0 - (L[r].kv_usage ? *L[r].kv_usage : 0.0);
                return opt_.w_prefix * prefix + opt_.w_queue * queue + opt_.w_kv * kv;
            };
            const std::uint32_t chosen = argmax(order, score);
            return {chosen, generic_reason(order, chosen)};
        }
        case Policy::Preble: {
            const double dw = opt_.decode_weight;
            auto cost = [&](std::uint32_t r) {
                return static_cast<double>(queued(r) + num_tokens - mtok(r, num_tokens)) +
                       dw * static_cast<double>(F[r]);
            };
            std::int32_t top = 0;
            for (std::uint32_t r : order) top = std::max(top, match_[r]);
            const std::int64_t mt = std::min(
                static_cast<std::int64_t>(top) * static_cast<std::int64_t>(opt_.block_size), num_tokens);
            std::uint32_t chosen;
            if (mt > num_tokens - mt) {
                pool_.clear();
                for (std::uint32_t r : order)
                    if (match_[r] == top) pool_.push_back(r);
                chosen = argmin(pool_, cost);
            } else {
                chosen = argmin(order, cost);
            }
            return {chosen, generic_reason(order, chosen)};
        }
        case Policy::TTFT:
        default: {
            // Queued + uncached tokens over one shared prefill rate: comparing tokens is exact.
            // Ties: the longer match, then fewer in flight, then the rotation order.
            // Plus the prefill this request adds to the fleet beyond the best-cached candidate.
            const std::int32_t* M = match_.data();
            std::int32_t top = 0;
            for (std::size_t i = 0; i < n; ++i) top = std::max(top, M[order[i]]);
            const std::int64_t least_uncached = num_tokens - std::min(std::int64_t{top} * bs_, num_tokens);
            std::uint32_t chosen = order[0];
            std::int64_t best_tok = 0, best_m = -1, best_f = 0;
            for (std::size_t i = 0; i < n; ++i) {
                const std::uint32_t r = order[i];
                const std::int64_t m = M[r];
                const std::int64_t tok =
                    Q[r] + 2 * (num_tokens - std::min(m * bs_, num_tokens)) - least_uncached;
                if (best_m < 0 || tok < best_tok ||
                    (tok == best_tok && (m > best_m || (m == best_m && F[r] < best_f)))) {
                    chosen = r;
                    best_tok = tok;
                    best_m = m;
                    best_f = F[r];
                }
            }
            const char* why = top == 0 ? "miss" : (M[chosen] == top ? "affinity" : "load");
            return {chosen, why};
        }
    }
}

Decision Router::route_locked(const std::uint64_t* hashes, std::size_t pb, std::int64_t num_tokens,
                              const std::optional<std::string>& session, double t) {
    if (eligible_dirty_) {
        eligible_.clear();
        for (std::uint32_t r = 0; r < names_.size(); ++r)
            if (eligible(r)) eligible_.push_back(r);
        eligible_dirty_ = false;
    }
    if (eligible_.empty())
        throw StateError("no eligible replica: every replica is removed, drained or unhealthy");
    if (opt_.index_ttl) index_->expire(t);
    if (spec_) spec_->expire(t);
    index_->match(hashes, pb, match_);
    match_.resize(names_.size(), 0);
    if (spec_) {
        spec_->match(hashes, pb, spec_match_);
        for (std::size_t r = 0; r < match_.size() && r < spec_match_.size(); ++r)
            match_[r] = std::max(match_[r], spec_match_[r]);
    }
    if (opt_.policy == Policy::TTFT && pending_count_ > 0) {
        // A prompt queued behind a request with the same leading blocks on the same FIFO
        // replica finds them cached when its own prefill starts: count them as matched.
        for (std::uint32_t r : eligible_) {
            std::size_t m = static_cast<std::size_t>(match_[r]);
            for (const Pending& q : pending_[r]) {
                const std::size_t len = std::min(q.len, pb);
                if (len <= m) continue;
                std::size_t k = 0;
                while (k < len && q.hashes[k] == hashes[k]) ++k;
                m = std::max(m, k);
            }
            match_[r] = static_cast<std::int32_t>(m);
        }
    }

    std::uint64_t rng = rng_;
    const char* binding = session ? "new" : "none";
    std::int64_t stranded = 0;
    std::uint32_t chosen = 0;
    const char* reason = "";
    Session* entry = nullptr;
    bool expired_entry = false;
    SessionList::iterator entry_it;
    if (session) {
        auto it = sessions_.find(*session);
        if (it != sessions_.end()) {
            entry_it = it->second;
            if (entry_it->last_seen + opt_.session_ttl <= t)
                expired_entry = true;
            else
                entry = &*entry_it;
        }
    }
    if (entry) {
        const std::uint32_t b = entry->replica;
        const bool valid = eligible(b) && gen_[b] == entry->gen;
        if (valid && !saturated(b, eligible_)) {
            chosen = b;
            reason = "session";
        } else {
            if (valid && eligible_.size() > 1) {
                std::vector<std::uint32_t> cands;
                cands.reserve(eligible_.size() - 1);
                for (std::uint32_t r : eligible_)
                    if (r != b) cands.push_back(r);
                std::tie(chosen, reason) = choose(cands, rng, pb, num_tokens, session, hashes);
            } else {
                std::tie(chosen, reason) = choose(eligible_, rng, pb, num_tokens, session, hashes);
            }
        }
        if (valid && chosen == b) {
            binding = "kept";
        } else {
            binding = "rebound";
            stranded = entry->blocks;
        }
    } else {
        std::tie(chosen, reason) = choose(eligible_, rng, pb, num_tokens, session, hashes);
    }

    // The one step that may still fail (a chain that contradicts the index) comes first.
    if (opt_.mode == IndexMode::Approximate)
        index_->insert(chosen, hashes, pb, t);
    else if (spec_)
        spec_->insert(chosen, hashes, pb, t);

    rot_ += 1;
    rng_ = rng;
    const auto p = static_cast<std::int64_t>(pb);
    const std::int64_t matched = match_[chosen];
    const std::int64_t cached =
        std::min(matched * static_cast<std::int64_t>(opt_.block_size), num_tokens);
    const std::int64_t uncached_blocks = p - matched;
    const std::int64_t h = next_handle_++;
    auto slot = requests_.emplace(h, Request{chosen, num_tokens - cached, p, uncached_blocks, false, {}});
    if (opt_.policy == Policy::TTFT) {
        std::vector<std::uint64_t>& kept = slot.first->second.hashes;
        kept.assign(hashes, hashes + pb);
        pending_[chosen].push_back(Pending{h, kept.data(), kept.size()});
        ++pending_count_;
    }
    ReplicaLoad& l = loads_[chosen];
    queued_[chosen] += num_tokens - cached;
    inflight_[chosen] += 1;
    l.prefill_requests += 1;
    l.prefill_blocks += uncached_blocks;
    stats_.routed += 1;
    stats_.prompt_tokens += num_tokens;
    stats_.cached_tokens += cached;
    if (binding[0] == 'r') {
        stats_.rebinds += 1;
        stats_.stranded_blocks += stranded;
    }
    if (session) {
        if (expired_entry) {
            sessions_.erase(*session);
            lru_.erase(entry_it);
            stats_.session_expirations += 1;
        }
        while (!lru_.empty() && !(lru_.front().last_seen + opt_.session_ttl > t)) {
            sessions_.erase(lru_.front().key);
            lru_.pop_front();
            stats_.session_expirations += 1;
        }
        auto it = sessions_.find(*session);
        if (it == sessions_.end()) {
            lru_.push_back(Session{*session, chosen, gen_[chosen], p, t});
            sessions_.emplace(*session, std::prev(lru_.end()));
        } else {
            Session& s = *it->second;
            s.replica = chosen;
            s.gen = gen_[chosen];
            s.blocks = p;
            s.last_seen = t;
            lru_.splice(lru_.end(), lru_, it->second);
        }
        while (sessions_.size() > opt_.max_sessions) {
            sessions_.erase(lru_.front().key);
            lru_.pop_front();
            stats_.session_evictions += 1;
        }
    }

    Decision d;
    d.replica = names_[chosen];
    d.replica_id = chosen;
    d.matched_blocks = matched;
    d.cached_tokens = cached;
    d.prompt_tokens = num_tokens;
    d.reason = reason;
    d.binding = binding;
    d.stranded_blocks = stranded;
    d.handle = h;
    return d;
}

}  // namespace kvroute
