// Router core: replicas, matches, sessions and lifecycle accounting around one policy
// (policies.cpp). Each step mirrors python/kvroute/reference/router.py so that both make the
// same decisions bit for bit: same candidate order, same float expressions, same generator.
#include "kvroute/router.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <list>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "kvroute/errors.hpp"
#include "kvroute/hash.hpp"
#include "policies.hpp"

namespace kvroute {

namespace {

constexpr std::int64_t kInt64Max = std::numeric_limits<std::int64_t>::max();

// Counters saturate instead of overflowing (num_tokens is bounded, their sum over time is not).
void add_saturating(std::int64_t& total, std::int64_t v) {
    total = total > kInt64Max - v ? kInt64Max : total + v;
}

void require(bool ok, const std::string& what) {
    if (!ok) throw ValueError(what);
}

bool finite_positive(double v) { return std::isfinite(v) && v > 0.0; }

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

double RouterOptions::param(std::string_view key) const {
    auto it = params.find(key);
    if (it == params.end()) throw ValueError("params['" + std::string(key) + "'] is missing");
    return it->second;
}

double RouterOptions::param_or(std::string_view key, double fallback) const {
    auto it = params.find(key);
    return it == params.end() ? fallback : it->second;
}

void RouterOptions::check() const {
    // The core's own guard: whatever object filled these, nothing below divides by zero,
    // loops forever or reads out of range (kvroute.config has the user-facing messages).
    require(block_size >= 1 && block_size <= kMaxBlockSize,
            "block_size must be in [1, " + std::to_string(kMaxBlockSize) + "], got " + std::to_string(block_size));
    require(!index_capacity || *index_capacity >= 1, "index_capacity must be >= 1");
    require(!index_ttl || finite_positive(*index_ttl), "index_ttl must be a finite number > 0");
    require(finite_positive(speculative_ttl), "speculative_ttl must be a finite number > 0");
    require(finite_positive(session_ttl), "session_ttl must be a finite number > 0");
    require(finite_positive(request_ttl), "request_ttl must be a finite number > 0");
    require(max_sessions >= 1, "max_sessions must be >= 1");
    require(max_session_bytes >= 1, "max_session_bytes must be >= 1");
    require(finite_positive(prefill_rate), "prefill_rate must be a finite number > 0");
    require(std::isfinite(session_saturation) && session_saturation >= 1.0,
            "session_saturation must be a finite number >= 1");
    for (const auto& [key, value] : params)
        require(std::isfinite(value) && value >= 0.0,
                "params['" + key + "'] must be a finite number >= 0, got " + std::to_string(value));
    if (policy == Policy::Sticky) {
        const double v = param("vnodes");
        require(v >= 1.0 && v <= 4096.0 && v == std::floor(v), "params['vnodes'] must be an int in [1, 4096]");
        require(!params.count("bound") || param("bound") >= 1.0, "params['bound'] must be >= 1");
    }
}

struct Router::Impl {
    struct Request {
        std::int64_t replica;  // -1 once its replica was removed
        std::int64_t uncached;
        std::int64_t blocks;
        std::int64_t uncached_blocks;
        double routed_at;
        bool prefilled;
    };
    struct Session {
        std::string key;
        std::uint32_t replica;
        std::uint64_t gen;
        std::int64_t blocks;
        double last_seen;
    };
    using SessionList = std::list<Session>;
    // Where the session step left a decision.
    struct Picked {
        Choice choice{0, ""};
        const char* binding = "none";
        std::int64_t stranded = 0;
        bool expired_entry = false;
        SessionList::iterator entry;
    };

    explicit Impl(RouterOptions o);

    std::uint32_t add_replica(const std::string& name, std::optional<std::int64_t> engine_block_size);
    void remove_replica(const std::string& name);
    Decision route(const std::uint64_t* hashes, std::size_t pb, std::int64_t num_tokens,
                   const std::optional<std::string>& session, double t);
    void prefill_done(std::int64_t handle);
    void finish(std::int64_t handle);
    void set_external_load(std::uint32_t r, const ExternalLoad& e);
    void bind_session(const std::string& key, std::uint32_t r, double t);
    std::optional<std::string> session_of(const std::string& key, double t) const;
    std::size_t observe_route(std::uint32_t r, const std::uint64_t* hashes, std::size_t n, double t);

    std::uint32_t lookup(const std::string& name) const {
        auto it = ids.find(name);
        if (it == ids.end()) throw KeyError("unknown replica '" + name + "'");
        return it->second;
    }
    bool eligible(std::uint32_t r) const { return live[r] && loads[r].healthy && !loads[r].draining; }

    std::int64_t engine_k(std::optional<std::int64_t> engine_block_size) const;
    void align_spec(std::uint32_t r);
    void grow_slots(std::uint32_t r);
    void reset_slot(std::uint32_t r);
    void refresh_eligible();
    void expire(double t);
    void expire_indexes(double t);
    void compute_match(const std::uint64_t* hashes, std::size_t pb, std::int64_t num_tokens);
    const std::vector<std::uint32_t>& build_order(std::int64_t excluded);
    Picked pick(const DecisionView& v, const std::optional<std::string>& session, double t, std::uint64_t& rng);
    void touch_recency(std::uint32_t chosen);
    std::int64_t reserve(std::uint32_t chosen, std::int64_t matched, std::size_t pb,
                         std::int64_t num_tokens, const std::uint64_t* hashes, double t);
    void release(std::int64_t handle, const Request& req);
    void update_session(const std::string& key, const Picked& p, std::uint32_t chosen, std::int64_t blocks, double t);
    void drop_session_front(std::int64_t& counter);
    Request& request(std::int64_t handle);

    const RouterOptions opt;
    const std::int64_t bs;
    const std::int64_t min_match;  // tokens; shorter matches score as none (0: no threshold)
    std::uint64_t root = 0;
    std::shared_ptr<PrefixIndex> index;
    std::shared_ptr<PrefixIndex> spec;
    std::unique_ptr<RoutingPolicy> policy;

    mutable std::mutex mu;
    std::vector<std::string> names;
    std::vector<char> live;
    std::unordered_map<std::string, std::uint32_t> ids;
    std::vector<std::uint64_t> gen;
    std::vector<ReplicaLoad> loads;  // in_flight and queued_prefill_tokens live in the two below
    std::vector<std::int64_t> inflight;  // hot in every decision: kept contiguous
    std::vector<std::int64_t> queued;
    std::vector<std::int32_t> base;     // scratch: the index's (already rounded) match
    std::vector<std::uint32_t> recency; // live replicas, least recently chosen first
    std::vector<char> chosen_once;      // chosen since it was added
    bool eligible_dirty = true;         // eligible_ids is rebuilt only after a membership/flag change
    std::vector<std::uint32_t> eligible_ids;
    std::vector<char> eligible_flag;    // by id, rebuilt with eligible_ids
    std::map<std::int64_t, Request> requests;  // by handle = routing order: the oldest first
    std::int64_t next_handle = 1;
    std::uint64_t rng;
    SessionList lru;  // front: least recently used
    std::unordered_map<std::string, SessionList::iterator> sessions;
    std::int64_t session_bytes = 0;
    RouterStats stats;

    // Scratch reused across decisions (guarded by mu).
    std::vector<std::int32_t> match;     // real matches: Decision and accounting
    std::vector<std::int32_t> spec_match;
    std::vector<std::int32_t> scored;    // min_match > 0: eligible matches below it zeroed, what policies read
    std::vector<std::uint32_t> order;
};

Router::Impl::Impl(RouterOptions o)
    : opt((o.check(), std::move(o))),
      bs(static_cast<std::int64_t>(opt.block_size)),
      min_match(static_cast<std::int64_t>(opt.param_or("min_match_tokens", 0.0))),
      rng(opt.seed) {
    root = root_hash(opt.salt.data(), opt.salt.size());
    policy = make_policy(opt);
    index = std::make_shared<PrefixIndex>(0, opt.index_capacity, opt.index_ttl, false);
    if (opt.mode == IndexMode::Hybrid)
        spec = std::make_shared<PrefixIndex>(0, opt.index_capacity, opt.speculative_ttl, false);
}

std::int64_t Router::Impl::engine_k(std::optional<std::int64_t> size) const {
    if (!size) return 1;
    if (*size < 1) throw ValueError("engine_block_size must be >= 1, got " + std::to_string(*size));
    if (*size <= bs) return 1;  // a router block is whole engine blocks (or contract C2's k = 1)
    if (*size % bs != 0)
        throw ValueError("engine_block_size must be a multiple of block_size (" + std::to_string(bs) +
                         ") or at most it, got " + std::to_string(*size));
    if (*size / bs > static_cast<std::int64_t>(PrefixIndex::kMaxEngineBlock))
        throw ValueError("engine_block_size must be at most " + std::to_string(PrefixIndex::kMaxEngineBlock) +
                         " router blocks, got " + std::to_string(*size / bs));
    return *size / bs;
}

// The speculative index must use the main index's id for the same replica, also when ids
// were taken in router.index directly: claim exactly r there, handing back the rest.
void Router::Impl::align_spec(std::uint32_t r) {
    if (!spec) return;
    if (spec->is_live(r)) spec->remove_replica(r);
    std::vector<std::uint32_t> others;
    for (std::uint32_t s = spec->add_replica(); s != r; s = spec->add_replica()) others.push_back(s);
    for (std::uint32_t s : others) spec->remove_replica(s);
}

void Router::Impl::grow_slots(std::uint32_t r) {
    // Ids added to the index directly (not through the Router) stay dead slots here.
    while (r >= names.size()) {
        names.emplace_back();
        live.push_back(0);
        gen.push_back(0);
        loads.emplace_back();
        inflight.push_back(0);
        queued.push_back(0);
        chosen_once.push_back(0);
    }
}

void Router::Impl::reset_slot(std::uint32_t r) {
    loads[r] = ReplicaLoad{};
    inflight[r] = 0;
    queued[r] = 0;
    chosen_once[r] = 0;
    eligible_dirty = true;
}

std::uint32_t Router::Impl::add_replica(const std::string& name, std::optional<std::int64_t> size) {
    if (name.empty()) throw ValueError("replica name must not be empty");
    if (ids.count(name)) throw ValueError("replica '" + name + "' already exists");
    const std::int64_t k = engine_k(size);
    const std::uint32_t r = index->add_replica();
    align_spec(r);
    grow_slots(r);
    reset_slot(r);
    names[r] = name;
    live[r] = 1;
    gen[r] += 1;
    if (k > 1) index->set_engine_block(r, static_cast<std::uint64_t>(k));
    ids.emplace(name, r);
    // Never chosen: ahead of every replica that was, after never-chosen ones with lower ids.
    auto pos = std::find_if(recency.begin(), recency.end(),
                            [&](std::uint32_t q) { return chosen_once[q] || q > r; });
    recency.insert(pos, r);
    policy->replica_added(r, name);
    return r;
}

void Router::Impl::remove_replica(const std::string& name) {
    const std::uint32_t r = lookup(name);
    index->remove_replica(r);
    if (spec) spec->remove_replica(r);
    // Their later prefill_done/finish are accepted as no-ops: a gateway cannot avoid racing
    // a removal with the responses still streaming.
    for (auto& kv : requests)
        if (kv.second.replica == static_cast<std::int64_t>(r)) kv.second.replica = -1;
    policy->replica_removed(r, name);
    reset_slot(r);
    names[r].clear();
    live[r] = 0;
    ids.erase(name);
    recency.erase(std::find(recency.begin(), recency.end(), r));
}

void Router::Impl::refresh_eligible() {
    if (!eligible_dirty) return;
    eligible_ids.clear();
    eligible_flag.assign(names.size(), 0);
    for (std::uint32_t r = 0; r < names.size(); ++r)
        if (eligible(r)) {
            eligible_ids.push_back(r);
            eligible_flag[r] = 1;
        }
    eligible_dirty = false;
}

void Router::Impl::expire_indexes(double t) {
    if (opt.index_ttl) index->expire(t);
    if (spec) spec->expire(t);
}

// Time-driven housekeeping before a decision: index TTLs and requests never finished.
void Router::Impl::expire(double t) {
    expire_indexes(t);
    while (!requests.empty()) {
        auto it = requests.begin();
        if (!(it->second.routed_at + opt.request_ttl <= t)) break;
        release(it->first, it->second);
        requests.erase(it);
        stats.request_expirations += 1;
    }
}

void Router::Impl::compute_match(const std::uint64_t* hashes, std::size_t pb, std::int64_t num_tokens) {
    index->match(hashes, pb, match);
    match.resize(names.size(), 0);
    if (spec || policy->extends_match()) {
        // The index rounds its own answer to whole engine blocks (C2); what the speculative
        // index and the policy add is rounded here, with the index's k for the replica.
        base.assign(match.begin(), match.end());
        if (spec) {
            spec->match(hashes, pb, spec_match);
            for (std::size_t r = 0; r < match.size() && r < spec_match.size(); ++r)
                match[r] = std::max(match[r], spec_match[r]);
        }
        policy->extend_match(hashes, pb, eligible_ids, match);
        for (std::uint32_t r : eligible_ids)
            if (match[r] != base[r])
                match[r] -= static_cast<std::int32_t>(match[r] % static_cast<std::int64_t>(index->engine_block(r)));
    }
    if (min_match == 0) return;  // policies read match itself
    // min(m * bs, num_tokens) < min_match  <=>  num_tokens < min_match or m < ceil(min_match / bs)
    const std::int64_t least = num_tokens < min_match ? std::numeric_limits<std::int32_t>::max()
                                                      : (min_match + bs - 1) / bs;
    scored.resize(match.size());
    for (std::uint32_t r : eligible_ids) scored[r] = match[r] < least ? 0 : match[r];
}

// Candidates least recently chosen first, so that every tie goes to the one idle longest.
const std::vector<std::uint32_t>& Router::Impl::build_order(std::int64_t excluded) {
    if (excluded < 0 && eligible_ids.size() == recency.size()) return recency;  // all live are eligible
    order.clear();
    const char* ok = eligible_flag.data();
    for (std::uint32_t r : recency)
        if (ok[r] && static_cast<std::int64_t>(r) != excluded) order.push_back(r);
    return order;
}

// Session step: keep a bound replica that is still eligible and not saturated, else ask the
// policy (without the saturated bound replica when another is eligible).
Router::Impl::Picked Router::Impl::pick(const DecisionView& v, const std::optional<std::string>& session,
                                        double t, std::uint64_t& r) {
    Picked p;
    Session* entry = nullptr;
    if (session) {
        p.binding = "new";
        auto it = sessions.find(*session);
        if (it != sessions.end()) {
            p.entry = it->second;
            if (p.entry->last_seen + opt.session_ttl <= t)
                p.expired_entry = true;
            else
                entry = &*p.entry;
        }
    }
    if (!entry) {
        p.choice = policy->choose(v, build_order(-1), r);
        return p;
    }
    const std::uint32_t b = entry->replica;
    const bool valid = eligible(b) && gen[b] == entry->gen;
    if (valid && !policy->saturated(v, b)) {
        p.choice = {b, "session"};
    } else {
        p.choice = policy->choose(v, build_order(valid && eligible_ids.size() > 1 ? static_cast<std::int64_t>(b) : -1), r);
    }
    if (valid && p.choice.replica == b) {
        p.binding = "kept";
    } else {
        p.binding = "rebound";
        p.stranded = entry->blocks;
    }
    return p;
}

void Router::Impl::touch_recency(std::uint32_t chosen) {
    chosen_once[chosen] = 1;
    if (recency.back() == chosen) return;  // chosen again (affinity): already the most recent
    recency.erase(std::find(recency.begin(), recency.end(), chosen));
    recency.push_back(chosen);
}

std::int64_t Router::Impl::reserve(std::uint32_t chosen, std::int64_t matched, std::size_t pb,
                                   std::int64_t num_tokens, const std::uint64_t* hashes, double t) {
    const auto p = static_cast<std::int64_t>(pb);
    const std::int64_t cached = std::min(matched * bs, num_tokens);
    const std::int64_t h = next_handle++;
    requests.emplace_hint(requests.end(), h, Request{chosen, num_tokens - cached, p, p - matched, t, false});
    policy->reserved(h, chosen, hashes, pb);
    ReplicaLoad& l = loads[chosen];
    queued[chosen] += num_tokens - cached;
    inflight[chosen] += 1;
    l.prefill_requests += 1;
    l.prefill_blocks += p - matched;
    stats.routed += 1;
    add_saturating(stats.prompt_tokens, num_tokens);
    add_saturating(stats.cached_tokens, cached);
    return h;
}

void Router::Impl::drop_session_front(std::int64_t& counter) {
    session_bytes -= static_cast<std::int64_t>(lru.front().key.size());
    sessions.erase(lru.front().key);
    lru.pop_front();
    counter += 1;
}

void Router::Impl::update_session(const std::string& key, const Picked& p, std::uint32_t chosen,
                                  std::int64_t blocks, double t) {
    if (p.expired_entry) {
        session_bytes -= static_cast<std::int64_t>(key.size());
        sessions.erase(key);
        lru.erase(p.entry);
        stats.session_expirations += 1;
    }
    while (!lru.empty() && !(lru.front().last_seen + opt.session_ttl > t)) drop_session_front(stats.session_expirations);
    auto it = sessions.find(key);
    if (it == sessions.end()) {
        lru.push_back(Session{key, chosen, gen[chosen], blocks, t});
        sessions.emplace(key, std::prev(lru.end()));
        session_bytes += static_cast<std::int64_t>(key.size());
    } else {
        Session& s = *it->second;
        s.replica = chosen;
        s.gen = gen[chosen];
        s.blocks = blocks;
        s.last_seen = t;
        lru.splice(lru.end(), lru, it->second);
    }
    // A key is at most max_session_bytes (checked on entry), so this never drops the new one.
    while (sessions.size() > opt.max_sessions ||
           session_bytes > static_cast<std::int64_t>(opt.max_session_bytes))
        drop_session_front(stats.session_evictions);
}

Decision Router::Impl::route(const std::uint64_t* hashes, std::size_t pb, std::int64_t num_tokens,
                             const std::optional<std::string>& session, double t) {
    refresh_eligible();
    if (eligible_ids.empty())
        throw StateError("no eligible replica: every replica is removed, drained or unhealthy");
    expire(t);
    compute_match(hashes, pb, num_tokens);
    const DecisionView v{hashes, pb, num_tokens, bs, &session, min_match > 0 ? scored.data() : match.data(),
                         inflight.data(), queued.data(), loads.data(), &eligible_ids};
    std::uint64_t r = rng;
    const Picked p = pick(v, session, t, r);
    const std::uint32_t chosen = p.choice.replica;
    // The one step that may still fail (a chain that contradicts the index) comes first.
    if (opt.mode == IndexMode::Approximate)
        index->insert(chosen, hashes, pb, t);
    else if (spec)
        spec->insert(chosen, hashes, pb, t);
    rng = r;
    touch_recency(chosen);
    const std::int64_t matched = match[chosen];
    Decision d;
    d.handle = reserve(chosen, matched, pb, num_tokens, hashes, t);
    if (p.binding[0] == 'r') {
        stats.rebinds += 1;
        stats.stranded_blocks += p.stranded;
    }
    if (session) update_session(*session, p, chosen, static_cast<std::int64_t>(pb), t);
    d.replica = names[chosen];
    d.replica_id = chosen;
    d.matched_blocks = matched;
    d.cached_tokens = std::min(matched * bs, num_tokens);
    d.prompt_tokens = num_tokens;
    d.reason = p.choice.reason;
    d.binding = p.binding;
    d.stranded_blocks = p.stranded;
    return d;
}

Router::Impl::Request& Router::Impl::request(std::int64_t h) {
    auto it = requests.find(h);
    if (it == requests.end()) {
        if (h >= 1 && h < next_handle)
            throw StateError("request " + std::to_string(h) + " already finished or expired");
        throw IndexError("unknown handle " + std::to_string(h));
    }
    return it->second;
}

void Router::Impl::release(std::int64_t handle, const Request& req) {
    if (req.replica < 0) return;
    const auto r = static_cast<std::uint32_t>(req.replica);
    ReplicaLoad& l = loads[r];
    if (req.prefilled) {
        l.decode_blocks -= req.blocks;
    } else {
        policy->released(handle, r);
        queued[r] -= req.uncached;
        l.prefill_requests -= 1;
        l.prefill_blocks -= req.uncached_blocks;
    }
    inflight[r] -= 1;
}

void Router::Impl::prefill_done(std::int64_t handle) {
    Request& req = request(handle);
    if (req.replica < 0) return;
    if (req.prefilled)
        throw StateError("request " + std::to_string(handle) + " already reported its first token");
    const auto r = static_cast<std::uint32_t>(req.replica);
    ReplicaLoad& l = loads[r];
    req.prefilled = true;
    policy->released(handle, r);
    queued[r] -= req.uncached;
    l.prefill_requests -= 1;
    l.prefill_blocks -= req.uncached_blocks;
    l.decode_blocks += req.blocks;
}

void Router::Impl::finish(std::int64_t handle) {
    auto it = requests.find(handle);
    if (it == requests.end()) request(handle);  // throws the right error
    release(handle, it->second);
    requests.erase(it);
}

// The counts policies read are own + external: replacing the external part moves them by
// the difference, so a decision costs nothing more with external load set.
void Router::Impl::set_external_load(std::uint32_t r, const ExternalLoad& e) {
    ReplicaLoad& l = loads[r];
    const ExternalLoad o = l.external;
    inflight[r] += e.in_flight - o.in_flight;
    queued[r] += e.queued_prefill_tokens - o.queued_prefill_tokens;
    l.prefill_requests += e.prefill_requests - o.prefill_requests;
    l.prefill_blocks += e.prefill_blocks - o.prefill_blocks;
    l.decode_blocks += e.decode_blocks - o.decode_blocks;
    l.external = e;
}

// Another router routed this session to r: the same table update as our own route's, with
// the block count kept only while it stays on the same replica (unknown otherwise: 0).
void Router::Impl::bind_session(const std::string& key, std::uint32_t r, double t) {
    Picked p;
    std::int64_t blocks = 0;
    auto it = sessions.find(key);
    if (it != sessions.end()) {
        p.entry = it->second;
        if (p.entry->last_seen + opt.session_ttl <= t)
            p.expired_entry = true;
        else if (p.entry->replica == r && p.entry->gen == gen[r])
            blocks = p.entry->blocks;
    }
    update_session(key, p, r, blocks, t);
}

std::optional<std::string> Router::Impl::session_of(const std::string& key, double t) const {
    auto it = sessions.find(key);
    if (it == sessions.end()) return std::nullopt;
    const Session& s = *it->second;
    if (s.last_seen + opt.session_ttl <= t) return std::nullopt;
    if (!live[s.replica] || gen[s.replica] != s.gen) return std::nullopt;  // removed since
    return names[s.replica];
}

// Precise mode's index follows the engines' events, which every router subscribes to: no
// route-time insert to share.
std::size_t Router::Impl::observe_route(std::uint32_t r, const std::uint64_t* hashes, std::size_t n, double t) {
    if (opt.mode == IndexMode::Precise) return 0;
    expire_indexes(t);
    if (spec) return spec->insert(r, hashes, n, t);
    return index->insert(r, hashes, n, t);
}

// -- Router: the lock, then the implementation ----------------------------------------------

Router::Router(RouterOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {}
Router::~Router() = default;

std::shared_ptr<PrefixIndex> Router::index() const noexcept { return impl_->index; }
std::shared_ptr<PrefixIndex> Router::speculative_index() const noexcept { return impl_->spec; }
const RouterOptions& Router::options() const noexcept { return impl_->opt; }

std::uint32_t Router::add_replica(const std::string& name, std::optional<std::int64_t> engine_block_size) {
    std::lock_guard<std::mutex> lock(impl_->mu);
    return impl_->add_replica(name, engine_block_size);
}

void Router::remove_replica(const std::string& name) {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->remove_replica(name);
}

void Router::drain(const std::string& name, bool draining) {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->loads[impl_->lookup(name)].draining = draining;
    impl_->eligible_dirty = true;
}

void Router::set_healthy(const std::string& name, bool healthy) {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->loads[impl_->lookup(name)].healthy = healthy;
    impl_->eligible_dirty = true;
}

std::vector<std::string> Router::replicas() const {
    std::lock_guard<std::mutex> lock(impl_->mu);
    std::vector<std::string> out;
    for (std::size_t r = 0; r < impl_->names.size(); ++r)
        if (impl_->live[r]) out.push_back(impl_->names[r]);
    return out;
}

std::uint32_t Router::replica_id(const std::string& name) const {
    std::lock_guard<std::mutex> lock(impl_->mu);
    return impl_->lookup(name);
}

std::int64_t Router::engine_block(const std::string& name) const {
    std::lock_guard<std::mutex> lock(impl_->mu);
    return static_cast<std::int64_t>(impl_->index->engine_block(impl_->lookup(name)));
}

void Router::report_load(const std::string& name, std::optional<std::int64_t> waiting,
                         std::optional<std::int64_t> running, std::optional<double> kv_usage) {
    std::lock_guard<std::mutex> lock(impl_->mu);
    ReplicaLoad& l = impl_->loads[impl_->lookup(name)];
    if (waiting) l.waiting = waiting;
    if (running) l.running = running;
    if (kv_usage) l.kv_usage = kv_usage;
}

ReplicaLoad Router::load(const std::string& name) const {
    std::lock_guard<std::mutex> lock(impl_->mu);
    const std::uint32_t r = impl_->lookup(name);
    ReplicaLoad l = impl_->loads[r];
    l.in_flight = impl_->inflight[r];
    l.queued_prefill_tokens = impl_->queued[r];
    return l;
}

void Router::set_external_load(const std::string& name, const ExternalLoad& e) {
    const std::pair<const char*, std::int64_t> terms[] = {
        {"in_flight", e.in_flight},           {"queued_prefill_tokens", e.queued_prefill_tokens},
        {"prefill_requests", e.prefill_requests}, {"prefill_blocks", e.prefill_blocks},
        {"decode_blocks", e.decode_blocks}};
    std::lock_guard<std::mutex> lock(impl_->mu);
    const std::uint32_t r = impl_->lookup(name);
    for (const auto& [what, v] : terms)
        require(v >= 0 && v <= kMaxExternalLoad,
                std::string(what) + " must be in [0, 2**40], got " + std::to_string(v));
    impl_->set_external_load(r, e);
}

namespace {
void check_session_size(const std::string& session, std::size_t limit) {
    require(session.size() <= limit, "session must be at most " + std::to_string(limit) +
                                         " bytes (max_session_bytes), got " + std::to_string(session.size()));
}
}  // namespace

void Router::bind_session(const std::string& session, const std::string& name, std::optional<double> now) {
    check_session_size(session, impl_->opt.max_session_bytes);
    const double t = now ? *now : PrefixIndex::monotonic_now();
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->bind_session(session, impl_->lookup(name), t);
}

std::optional<std::string> Router::session(const std::string& session, std::optional<double> now) const {
    check_session_size(session, impl_->opt.max_session_bytes);
    const double t = now ? *now : PrefixIndex::monotonic_now();
    std::lock_guard<std::mutex> lock(impl_->mu);
    return impl_->session_of(session, t);
}

std::size_t Router::observe_route(const std::string& name, const std::uint64_t* hashes, std::size_t n,
                                  std::optional<double> now) {
    const double t = now ? *now : PrefixIndex::monotonic_now();
    std::lock_guard<std::mutex> lock(impl_->mu);
    return impl_->observe_route(impl_->lookup(name), hashes, n, t);
}

RouterStats Router::stats() const {
    std::lock_guard<std::mutex> lock(impl_->mu);
    RouterStats s = impl_->stats;
    s.sessions = static_cast<std::int64_t>(impl_->sessions.size());
    s.session_bytes = impl_->session_bytes;
    s.in_flight = static_cast<std::int64_t>(impl_->requests.size());
    s.replicas = static_cast<std::int64_t>(impl_->ids.size());
    return s;
}

Decision Router::route_tokens(const std::uint32_t* tokens, std::size_t n, const CacheKeys& keys,
                              const std::optional<std::string>& session, std::optional<double> now) {
    // Hashing needs no router state, so it runs before the lock; the buffer is per thread.
    thread_local std::vector<std::uint64_t> hashes;
    const std::size_t bs = impl_->opt.block_size;
    const std::size_t blocks = n / bs;
    if (hashes.size() < blocks) hashes.resize(blocks);
    // The same chain the event applier computes from an engine's keys (contract C1).
    const std::uint64_t root = keyed_root(impl_->root, keys.lora, keys.cache_salt);
    if (keys.mm_count == 0)
        chain_hashes(tokens, n, bs, root, hashes.data());
    else
        chain_hashes_keyed(tokens, n, bs, root, 0, keys.mm, keys.mm_count, hashes.data());
    return route_hashes(hashes.data(), blocks, static_cast<std::int64_t>(n), session, now);
}

Decision Router::route_hashes(const std::uint64_t* hashes, std::size_t n, std::int64_t num_tokens,
                              const std::optional<std::string>& session, std::optional<double> now) {
    if (num_tokens < 0 || num_tokens > kMaxPromptTokens)
        throw ValueError("num_tokens must be in [0, 2**32), got " + std::to_string(num_tokens));
    if (session && session->size() > impl_->opt.max_session_bytes)
        throw ValueError("session must be at most " + std::to_string(impl_->opt.max_session_bytes) +
                         " bytes (max_session_bytes), got " + std::to_string(session->size()));
    const double t = now ? *now : PrefixIndex::monotonic_now();
    std::lock_guard<std::mutex> lock(impl_->mu);
    return impl_->route(hashes, n, num_tokens, session, t);
}

void Router::prefill_done(std::int64_t handle) {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->prefill_done(handle);
}

void Router::finish(std::int64_t handle) {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->finish(handle);
}

// -- snapshots (snapshot.cpp writes and reads the file) ---------------------------------------

std::vector<SessionRecord> Router::export_sessions(double now) const {
    const Impl& d = *impl_;
    std::lock_guard<std::mutex> lock(d.mu);
    std::vector<SessionRecord> out;
    for (const Impl::Session& s : d.lru) {
        if (!d.live[s.replica] || d.gen[s.replica] != s.gen || !(s.last_seen + d.opt.session_ttl > now)) continue;
        out.push_back(SessionRecord{s.key, s.replica, s.blocks, std::max(0.0, now - s.last_seen)});
    }
    return out;
}

std::size_t Router::import_sessions(const std::vector<std::uint32_t>& replicas,
                                    const std::vector<SessionRecord>& sessions, double now) {
    Impl& d = *impl_;
    std::lock_guard<std::mutex> lock(d.mu);
    std::vector<char> gone(d.names.size(), 0);
    for (const std::uint32_t r : replicas) gone[r] = 1;
    for (auto it = d.lru.begin(); it != d.lru.end();) {
        if (!gone[it->replica]) {
            ++it;
            continue;
        }
        d.session_bytes -= static_cast<std::int64_t>(it->key.size());
        d.sessions.erase(it->key);
        it = d.lru.erase(it);
    }
    std::size_t n = 0;
    for (const SessionRecord& rec : sessions) {
        const double last = now - rec.age;
        // An id longer than this table takes in all would only push every other one out.
        if (!(last + d.opt.session_ttl > now) || rec.key.size() > d.opt.max_session_bytes) continue;
        auto it = d.sessions.find(rec.key);
        if (it != d.sessions.end()) {
            d.session_bytes -= static_cast<std::int64_t>(rec.key.size());
            d.lru.erase(it->second);
            d.sessions.erase(it);
        }
        d.lru.push_back(Impl::Session{rec.key, rec.replica, d.gen[rec.replica], rec.blocks, last});
        d.sessions.emplace(rec.key, std::prev(d.lru.end()));
        d.session_bytes += static_cast<std::int64_t>(rec.key.size());
        ++n;
    }
    while (d.sessions.size() > d.opt.max_sessions ||
           d.session_bytes > static_cast<std::int64_t>(d.opt.max_session_bytes))
        d.drop_session_front(d.stats.session_evictions);
    return n;
}

}  // namespace kvroute
