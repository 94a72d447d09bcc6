// Router and Decision; the reference twin is python/kvroute/reference/router.py. Argument
// checks here raise exactly the reference's errors, in the reference's order.
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "gil.hpp"
#include "hashes.hpp"
#include "kvroute/errors.hpp"
#include "kvroute/prefix_index.hpp"
#include "kvroute/router.hpp"
#include "pyargs.hpp"
#include "register.hpp"
#include "py_router.hpp"
#include "tokens.hpp"

namespace py = pybind11;

namespace kvroute::bindings {
namespace {

std::string name_arg(py::handle h) {
    if (!PyUnicode_Check(h.ptr())) throw TypeError("replica name must be a str, got " + type_name(h));
    return utf8_arg(h, "replica name");
}

bool flag_arg(const char* what, py::handle h) {
    if (!is_bool(h)) throw TypeError(std::string(what) + " must be a bool, got " + type_name(h));
    return PyObject_IsTrue(h.ptr()) == 1;
}

// operator.index(h) as a Python int, or TypeError "<what> must be an int, got T".
py::object index_arg(const char* what, py::handle h) {
    PyObject* index = is_bool(h) ? nullptr : PyNumber_Index(h.ptr());
    if (index == nullptr) {
        if (PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_TypeError)) throw py::error_already_set();
        PyErr_Clear();
        throw TypeError(std::string(what) + " must be an int, got " + type_name(h));
    }
    return py::reinterpret_steal<py::object>(index);
}

// The reference's _count: an int in [0, 2**63).
std::int64_t count_arg(const char* what, py::handle h) {
    py::object v = index_arg(what, h);
    int overflow = 0;
    const long long raw = PyLong_AsLongLongAndOverflow(v.ptr(), &overflow);
    if (overflow != 0 || raw < 0)
        throw ValueError(std::string(what) + " must be in [0, 2**63), got " + py::str(v).cast<std::string>());
    return raw;
}

// The reference index's _now: None, or a finite int/float/numpy number.
std::optional<double> now_arg(py::handle h) {
    if (h.is_none()) return std::nullopt;
    if (is_bool(h) || !is_number(h)) throw TypeError("now must be a number or None, got " + type_name(h));
    const double v = py::float_(py::reinterpret_borrow<py::object>(h)).cast<double>();
    if (!std::isfinite(v)) throw ValueError("now must be finite, got " + py::repr(h).cast<std::string>());
    return v;
}

// A session id of at most max_session_bytes UTF-8 bytes (the table's byte bound).
std::optional<std::string> session_arg(py::handle h, std::size_t max_bytes) {
    if (h.is_none()) return std::nullopt;
    if (!PyUnicode_Check(h.ptr())) throw TypeError("session must be a str or None, got " + type_name(h));
    std::string s = utf8_arg(h, "session");
    if (s.size() > max_bytes)
        throw ValueError("session must be at most " + std::to_string(max_bytes) +
                         " bytes (max_session_bytes), got " + std::to_string(s.size()));
    return s;
}

// A session id given where one is required (not None).
std::string required_session_arg(py::handle h, std::size_t max_bytes) {
    if (!PyUnicode_Check(h.ptr())) throw TypeError("session must be a str, got " + type_name(h));
    return *session_arg(h, max_bytes);
}

// A set_external_load() term: an int (not a bool) in [0, 2**40].
std::int64_t external_arg(const char* what, py::handle h) {
    py::object v = index_arg(what, h);
    int overflow = 0;
    const long long raw = PyLong_AsLongLongAndOverflow(v.ptr(), &overflow);
    if (overflow != 0 || raw < 0 || raw > kMaxExternalLoad)
        throw ValueError(std::string(what) + " must be in [0, 2**40], got " + py::str(v).cast<std::string>());
    return raw;
}

// A handle; nullopt when it is an int no int64 holds (never issued, so IndexError later).
std::optional<std::int64_t> handle_arg(py::handle h, std::string& text) {
    int overflow = 0;
    if (PyLong_CheckExact(h.ptr())) {  // the common case, without a temporary object
        const long long raw = PyLong_AsLongLongAndOverflow(h.ptr(), &overflow);
        if (overflow == 0) return raw;
    }
    py::object v = index_arg("handle", h);
    const long long raw = PyLong_AsLongLongAndOverflow(v.ptr(), &overflow);
    if (overflow == 0) return raw;
    text = py::str(v).cast<std::string>();
    return std::nullopt;
}

// The config as kvroute.config.validated() returns it: RouterConfig's own checks, whatever
// object (a subclass that skipped them included) was handed in. The core checks again.
RouterOptions options_from(py::handle config) {
    RouterOptions o;
    o.policy = policy_from_name(config.attr("policy").cast<std::string>());
    const std::string mode = config.attr("mode").cast<std::string>();
    if (mode == "approximate") o.mode = IndexMode::Approximate;
    else if (mode == "precise") o.mode = IndexMode::Precise;
    else if (mode == "hybrid") o.mode = IndexMode::Hybrid;
    else throw ValueError("unknown mode '" + mode + "'");
    o.block_size = config.attr("block_size").cast<std::size_t>();
    o.salt = salt_bytes(config.attr("salt"));
    py::object cap = config.attr("index_capacity");
    if (!cap.is_none()) o.index_capacity = cap.cast<std::uint64_t>();
    py::object ttl = config.attr("index_ttl");
    if (!ttl.is_none()) o.index_ttl = ttl.cast<double>();
    o.speculative_ttl = config.attr("speculative_ttl").cast<double>();
    o.session_ttl = config.attr("session_ttl").cast<double>();
    o.max_sessions = config.attr("max_sessions").cast<std::size_t>();
    o.max_session_bytes = config.attr("max_session_bytes").cast<std::size_t>();
    o.request_ttl = config.attr("request_ttl").cast<double>();
    o.seed = config.attr("seed").cast<std::uint64_t>();
    o.prefill_rate = config.attr("prefill_rate").cast<double>();
    o.session_saturation = config.attr("session_saturation").cast<double>();
    for (auto item : py::reinterpret_borrow<py::dict>(config.attr("params")))
        if (!item.second.is_none()) o.params[item.first.cast<std::string>()] = item.second.cast<double>();
    return o;
}

// engine_block_size: None or an int in [1, 2**20] (the core checks it against block_size).
std::optional<std::int64_t> engine_block_arg(py::handle h) {
    if (h.is_none()) return std::nullopt;
    PyObject* index = is_bool(h) ? nullptr : PyNumber_Index(h.ptr());
    if (index == nullptr) {
        if (PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_TypeError)) throw py::error_already_set();
        PyErr_Clear();
        throw TypeError("engine_block_size must be an int or None, got " + type_name(h));
    }
    py::object v = py::reinterpret_steal<py::object>(index);
    int overflow = 0;
    const long long raw = PyLong_AsLongLongAndOverflow(v.ptr(), &overflow);
    if (overflow != 0 || raw < 1 || raw > (1 << 20))
        throw ValueError("engine_block_size must be in [1, 1048576], got " + py::str(v).cast<std::string>());
    return raw;
}

// num_tokens: an int in [0, 2**32), so that no load sum can overflow.
std::int64_t num_tokens_arg(py::handle h) {
    py::object v = index_arg("num_tokens", h);
    int overflow = 0;
    const long long raw = PyLong_AsLongLongAndOverflow(v.ptr(), &overflow);
    if (overflow != 0 || raw < 0 || raw > kMaxPromptTokens)
        throw ValueError("num_tokens must be in [0, 2**32), got " + py::str(v).cast<std::string>());
    return raw;
}

// Keeps the RouterConfig object alive next to the core, for Router.config.

py::object opt_int(const std::optional<std::int64_t>& v) {
    return v ? py::object(py::int_(*v)) : py::object(py::none());
}


void register_decision(py::module_& m) {
    py::class_<Decision>(m, "Decision", "Where a request goes and why; `handle` is for prefill_done() and finish().")
        .def_readonly("replica", &Decision::replica, "Name of the chosen replica.")
        .def_readonly("replica_id", &Decision::replica_id, "Dense id of the chosen replica.")
        .def_readonly("matched_blocks", &Decision::matched_blocks, "Leading prompt blocks it holds.")
        .def_readonly("cached_tokens", &Decision::cached_tokens, "Tokens expected to be cached there.")
        .def_readonly("prompt_tokens", &Decision::prompt_tokens, "Tokens of the prompt.")
        .def_property_readonly("reason", [](const Decision& d) { return std::string(d.reason); },
                               "Why this replica (see kvroute.config).")
        .def_property_readonly("binding", [](const Decision& d) { return std::string(d.binding); },
                               "Session binding: none, new, kept or rebound.")
        .def_readonly("stranded_blocks", &Decision::stranded_blocks,
                      "Blocks a rebound session left on its previous replica.")
        .def_readonly("handle", &Decision::handle, "Handle for prefill_done() and finish().")
        .def("__eq__",
             [](const Decision& a, py::object other) {
                 if (!py::isinstance<Decision>(other)) return false;
                 const Decision& b = other.cast<const Decision&>();
                 return a.replica == b.replica && a.replica_id == b.replica_id &&
                        a.matched_blocks == b.matched_blocks && a.cached_tokens == b.cached_tokens &&
                        a.prompt_tokens == b.prompt_tokens && std::string(a.reason) == b.reason &&
                        std::string(a.binding) == b.binding && a.stranded_blocks == b.stranded_blocks &&
                        a.handle == b.handle;
             },
             py::arg("other"))
        .def("__repr__", [](const Decision& d) {
            return "Decision(replica='" + d.replica + "', replica_id=" + std::to_string(d.replica_id) +
                   ", matched_blocks=" + std::to_string(d.matched_blocks) +
                   ", cached_tokens=" + std::to_string(d.cached_tokens) +
                   ", prompt_tokens=" + std::to_string(d.prompt_tokens) + ", reason='" + d.reason +
                   "', binding='" + d.binding + "', stranded_blocks=" + std::to_string(d.stranded_blocks) +
                   ", handle=" + std::to_string(d.handle) + ")";
        });

}

void def_fleet(py::class_<PyRouter>& cls) {
    cls
        .def("replica_id", [](const PyRouter& r, py::handle name) { return r.core->replica_id(name_arg(name)); },
             py::arg("name"), "The dense id of a replica (its id in router.index).")
        .def("add_replica",
             [](PyRouter& r, py::handle name, py::handle engine_block_size) {
                 const std::string n = name_arg(name);
                 return r.core->add_replica(n, engine_block_arg(engine_block_size));
             },
             py::arg("name"), py::kw_only(), py::arg("engine_block_size") = py::none(),
             "Add a replica (healthy, not draining); returns its id (the lowest free one). "
             "engine_block_size: tokens per engine KV block (a multiple of block_size, or at most it; "
             "None: block_size): matches on it are rounded down to whole engine blocks.")
        .def("engine_block", [](const PyRouter& r, py::handle name) { return r.core->engine_block(name_arg(name)); },
             py::arg("name"), "Router blocks per engine block of a replica (1: every router block is whole).")
        .def("remove_replica",
             [](PyRouter& r, py::handle name) {
                 const std::string n = name_arg(name);
                 py::gil_scoped_release release;  // walks the requests in flight and the index
                 r.core->remove_replica(n);
             },
             py::arg("name"), "Remove a replica: its index blocks go, its in-flight requests are released.")
        .def("drain",
             [](PyRouter& r, py::handle name, py::handle draining) {
                 const std::string n = name_arg(name);
                 r.core->replica_id(n);  // KeyError before the flag's TypeError, as the reference
                 r.core->drain(n, flag_arg("draining", draining));
             },
             py::arg("name"), py::arg("draining") = true,
             "Stop (or resume) sending new requests to a replica; its state is kept.")
        .def("set_healthy",
             [](PyRouter& r, py::handle name, py::handle healthy) {
                 const std::string n = name_arg(name);
                 r.core->replica_id(n);
                 r.core->set_healthy(n, flag_arg("healthy", healthy));
             },
             py::arg("name"), py::arg("healthy"), "Mark a replica healthy or not; an unhealthy replica is never chosen.");
}

void def_load(py::class_<PyRouter>& cls) {
    cls
        .def("report_load",
             [](PyRouter& r, py::handle name, py::handle waiting, py::handle running, py::handle kv_usage) {
                 const std::string n = name_arg(name);
                 r.core->replica_id(n);
                 std::optional<std::int64_t> w, run;
                 std::optional<double> kv;
                 if (!waiting.is_none()) w = count_arg("waiting", waiting);
                 if (!running.is_none()) run = count_arg("running", running);
                 if (!kv_usage.is_none()) {
                     if (is_bool(kv_usage) || !is_number(kv_usage))
                         throw TypeError("kv_usage must be a float, got " + type_name(kv_usage));
                     py::float_ k(py::reinterpret_borrow<py::object>(kv_usage));
                     const double v = k.cast<double>();
                     if (!(v >= 0.0 && v <= 1.0))
                         throw ValueError("kv_usage must be in [0, 1], got " + py::repr(k).cast<std::string>());
                     kv = v;
                 }
                 r.core->report_load(n, w, run, kv);
             },
             py::arg("name"), py::kw_only(), py::arg("waiting") = py::none(), py::arg("running") = py::none(),
             py::arg("kv_usage") = py::none(),
             "Set engine-reported load figures (those given; None leaves a figure as it is).")
        .def("load",
             [](const PyRouter& r, py::handle name) {
                 const ReplicaLoad l = r.core->load(name_arg(name));
                 py::dict d;
                 d["queued_prefill_tokens"] = l.queued_prefill_tokens;
                 d["in_flight"] = l.in_flight;
                 d["prefill_requests"] = l.prefill_requests;
                 d["active_blocks"] = l.prefill_blocks + l.decode_blocks;
                 d["prefill_blocks"] = l.prefill_blocks;
                 d["decode_blocks"] = l.decode_blocks;
                 d["waiting"] = opt_int(l.waiting);
                 d["running"] = opt_int(l.running);
                 d["kv_usage"] = l.kv_usage ? py::object(py::float_(*l.kv_usage)) : py::object(py::none());
                 d["healthy"] = l.healthy;
                 d["draining"] = l.draining;
                 const ExternalLoad& e = l.external;
                 py::dict own, ext;
                 own["in_flight"] = l.in_flight - e.in_flight;
                 own["queued_prefill_tokens"] = l.queued_prefill_tokens - e.queued_prefill_tokens;
                 own["prefill_requests"] = l.prefill_requests - e.prefill_requests;
                 own["prefill_blocks"] = l.prefill_blocks - e.prefill_blocks;
                 own["decode_blocks"] = l.decode_blocks - e.decode_blocks;
                 ext["in_flight"] = e.in_flight;
                 ext["queued_prefill_tokens"] = e.queued_prefill_tokens;
                 ext["prefill_requests"] = e.prefill_requests;
                 ext["prefill_blocks"] = e.prefill_blocks;
                 ext["decode_blocks"] = e.decode_blocks;
                 d["own"] = own;
                 d["external"] = ext;
                 return d;
             },
             py::arg("name"),
             "A replica's load terms (own + external), reported figures and flags; \"own\": the requests "
             "this router routed there, \"external\": what set_external_load() set.")
        .def("set_external_load",
             [](PyRouter& r, py::handle name, py::handle in_flight, py::handle queued, py::handle prefill_requests,
                py::handle prefill_blocks, py::handle decode_blocks) {
                 const std::string n = name_arg(name);
                 r.core->replica_id(n);  // KeyError before the terms' errors, as the reference
                 ExternalLoad e;
                 e.in_flight = external_arg("in_flight", in_flight);
                 e.queued_prefill_tokens = external_arg("queued_prefill_tokens", queued);
                 e.prefill_requests = external_arg("prefill_requests", prefill_requests);
                 e.prefill_blocks = external_arg("prefill_blocks", prefill_blocks);
                 e.decode_blocks = external_arg("decode_blocks", decode_blocks);
                 r.core->set_external_load(n, e);
             },
             py::arg("name"), py::kw_only(), py::arg("in_flight") = 0, py::arg("queued_prefill_tokens") = 0,
             py::arg("prefill_requests") = 0, py::arg("prefill_blocks") = 0, py::arg("decode_blocks") = 0,
             "Replace the load other routers put on a replica (each term an int in [0, 2**40]); every "
             "policy then sees own + external.")
        .def("stats",
             [](const PyRouter& r) {
                 const RouterStats s = r.core->stats();
                 py::dict d;
                 d["routed"] = s.routed;
                 d["prompt_tokens"] = s.prompt_tokens;
                 d["cached_tokens"] = s.cached_tokens;
                 d["rebinds"] = s.rebinds;
                 d["stranded_blocks"] = s.stranded_blocks;
                 d["session_expirations"] = s.session_expirations;
                 d["session_evictions"] = s.session_evictions;
                 d["request_expirations"] = s.request_expirations;
                 d["sessions"] = s.sessions;
                 d["session_bytes"] = s.session_bytes;
                 d["in_flight"] = s.in_flight;
                 d["replicas"] = s.replicas;
                 return d;
             },
             "Counters: decisions, tokens, rebinds, sessions, requests in flight.");
}

void def_routing(py::class_<PyRouter>& cls) {
    cls
        .def("route",
             [](PyRouter& r, py::handle tokens, py::handle session, py::handle now, py::handle lora,
                py::handle cache_salt, py::handle mm) {
                 TokenView view = tokens_as_uint32(tokens);
                 const RequestKeys keys = request_keys(lora, cache_salt, mm);
                 const std::optional<std::string> s = session_arg(session, r.core->options().max_session_bytes);
                 const std::optional<double> t = now_arg(now);
                 const CacheKeys k{keys.lora, keys.cache_salt, keys.mm.data(), keys.mm.size()};
                 // Hashing and the index walk loop over the prompt: long only for huge prompts (gil.hpp).
                 return without_gil_if(view.size() >= kGilTokens,
                                       [&] { return r.core->route_tokens(view.data(), view.size(), k, s, t); });
             },
             py::arg("tokens"), py::kw_only(), py::arg("session") = py::none(), py::arg("now") = py::none(),
             py::arg("lora") = py::none(), py::arg("cache_salt") = py::none(), py::arg("mm") = py::none(),
             "Route a prompt of token ids, hashed with config.block_size and config.salt and the request's "
             "cache keys (lora, cache_salt, mm: as block_hashes takes them).")
        .def("route_hashes",
             [](PyRouter& r, py::handle hashes, py::handle num_tokens, py::handle session, py::handle now) {
                 HashView view = as_hashes(hashes, "hashes");
                 const std::int64_t n = num_tokens_arg(num_tokens);
                 const std::optional<std::string> s = session_arg(session, r.core->options().max_session_bytes);
                 const std::optional<double> t = now_arg(now);
                 return without_gil_if(view.size() >= kGilHashes,
                                       [&] { return r.core->route_hashes(view.data(), view.size(), n, s, t); });
             },
             py::arg("hashes"), py::arg("num_tokens"), py::kw_only(), py::arg("session") = py::none(),
             py::arg("now") = py::none(), "Route a prompt given as precomputed block hashes covering num_tokens tokens.")
        .def("prefill_done",
             [](PyRouter& r, py::handle handle, py::handle now) {
                 std::string text;
                 const std::optional<std::int64_t> h = handle_arg(handle, text);
                 now_arg(now);
                 if (!h) throw IndexError("unknown handle " + text);
                 r.core->prefill_done(*h);  // short (O(1), plus the replica's queued ttft requests): keeps the GIL
             },
             py::arg("handle"), py::arg("now") = py::none(),
             "The request produced its first token: its prompt moves from prefill to decode.")
        .def("finish",
             [](PyRouter& r, py::handle handle, py::handle now) {
                 std::string text;
                 const std::optional<std::int64_t> h = handle_arg(handle, text);
                 now_arg(now);
                 if (!h) throw IndexError("unknown handle " + text);
                 r.core->finish(*h);  // short (O(1), plus the replica's queued ttft requests): keeps the GIL
             },
             py::arg("handle"), py::arg("now") = py::none(),
             "The request ended (completed, failed or cancelled): release its load.");
}

void def_sharing(py::class_<PyRouter>& cls) {
    cls
        .def("bind_session",
             [](PyRouter& r, py::handle session, py::handle name, py::handle now) {
                 const std::string s = required_session_arg(session, r.core->options().max_session_bytes);
                 const std::string n = name_arg(name);
                 r.core->replica_id(n);  // KeyError before now's errors, as the reference
                 r.core->bind_session(s, n, now_arg(now));
             },
             py::arg("session"), py::arg("name"), py::kw_only(), py::arg("now") = py::none(),
             "Bind (or rebind) a session to a replica as if this router had routed it there: sliding TTL "
             "from now, within the session table's bounds.")
        .def("session",
             [](const PyRouter& r, py::handle session, py::handle now) -> py::object {
                 const std::string s = required_session_arg(session, r.core->options().max_session_bytes);
                 const std::optional<std::string> name = r.core->session(s, now_arg(now));
                 return name ? py::object(py::str(*name)) : py::object(py::none());
             },
             py::arg("session"), py::kw_only(), py::arg("now") = py::none(),
             "The replica a session is bound to, or None (unbound, expired, replica removed); the TTL is "
             "not refreshed.")
        .def("observe_route",
             [](PyRouter& r, py::handle name, py::handle hashes, py::handle now) {
                 const std::string n = name_arg(name);
                 r.core->replica_id(n);
                 HashView view = as_hashes(hashes, "hashes");
                 const std::optional<double> t = now_arg(now);
                 return without_gil_if(view.size() >= kGilHashes,
                                       [&] { return r.core->observe_route(n, view.data(), view.size(), t); });
             },
             py::arg("name"), py::arg("hashes"), py::kw_only(), py::arg("now") = py::none(),
             "Another router routed a prompt with these block hashes to `name`: insert them as this "
             "router's own route would (approximate: index, hybrid: speculative index; precise: nothing, 0). "
             "Returns blocks newly held; no load, session or tie change.");
}

}  // namespace

void register_router(py::module_& m) {
    register_decision(m);
    py::class_<PyRouter> cls(m, "Router",
                         "Chooses a replica per request by KV-cache affinity versus load (see "
                         "kvroute.reference.router for the contract).");
    cls.def(py::init([](py::object config, py::object replicas) {
                 config = py::module_::import("kvroute.config").attr("validated")(config);
                 auto r = std::make_unique<PyRouter>();
                 r->core = std::make_shared<Router>(options_from(config));
                 r->config = config;
                 if (PyUnicode_Check(replicas.ptr()) || PyBytes_Check(replicas.ptr()))
                     throw TypeError("replicas must be an iterable of names, got a single str");
                 for (py::handle name : py::iter(replicas)) r->core->add_replica(name_arg(name));
                 return r;
             }),
             py::arg("config") = py::none(), py::arg("replicas") = py::tuple())
        .def_property_readonly("config", [](const PyRouter& r) { return r.config; },
                               "The RouterConfig this router runs with (kvroute.config.validated of the one given).")
        .def_property_readonly("index", [](const PyRouter& r) { return r.core->index(); },
                               "The prefix index routing reads; events feed it.")
        .def_property_readonly("speculative_index",
                               [](const PyRouter& r) { return r.core->speculative_index(); },
                               "Hybrid mode's short-TTL index of route-time insertions, else None.")
        .def_property_readonly("replicas", [](const PyRouter& r) { return r.core->replicas(); },
                               "Names of the replicas, in id order (removed ones left out).");
    def_fleet(cls);
    def_load(cls);
    def_routing(cls);
    def_sharing(cls);
    def_snapshot(cls);  // register_snapshot.cpp
}

}  // namespace kvroute::bindings
