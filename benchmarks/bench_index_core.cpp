// The PrefixIndex core without Python: p50 of match (512 blocks) and of insert (512 blocks, the
// first 500 present), to tell core time from binding and numpy overhead in bench_index.py.
// Build and run from the repository root:
//   g++ -std=c++17 -O3 -DNDEBUG -Icpp/include benchmarks/bench_index_core.cpp
//       cpp/src/prefix_index.cpp -o /tmp/bench_index_core
//   /tmp/bench_index_core [blocks=1000000] [replicas=64]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "kvroute/prefix_index.hpp"

using kvroute::PrefixIndex;

namespace {

template <class F>
double p50_ns(int rounds, F&& f) {
    std::vector<double> t(static_cast<std::size_t>(rounds));
    for (auto& x : t) {
        const auto a = std::chrono::steady_clock::now();
        f();
        x = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - a).count();
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
    const std::size_t target = argc > 1 ? std::stoul(argv[1]) : 1000000;
    const auto replicas = static_cast<std::uint32_t>(argc > 2 ? std::stoul(argv[2]) : 64);
    std::mt19937_64 rng(1);
    PrefixIndex ix(replicas);
    std::vector<std::uint64_t> probe(512);
    for (auto& h : probe) h = rng();
    ix.insert(3, probe.data(), probe.size(), 0.0);
    // Filler: chains of 64-1024 new blocks, 70% of them branching off a recent chain.
    std::vector<std::vector<std::uint64_t>> recent;
    std::size_t total = probe.size();
    while (total < target) {
        std::vector<std::uint64_t> c;
        if (!recent.empty() && rng() % 10 < 7) {
            const auto& b = recent[rng() % recent.size()];
            c.assign(b.begin(), b.begin() + static_cast<std::ptrdiff_t>(1 + rng() % b.size()));
        }
        const std::size_t add = 64 + rng() % 961;
        for (std::size_t i = 0; i < add; ++i) c.push_back(rng());
        ix.insert(static_cast<std::int64_t>(rng() % replicas), c.data(), c.size(), 0.0);
        total += add;
        recent.push_back(std::move(c));
        if (recent.size() > 2000) recent.erase(recent.begin());
    }
    const std::size_t blocks = ix.num_blocks();
    std::vector<std::int32_t> out;
    const double match = p50_ns(200000, [&] { ix.match(probe.data(), probe.size(), out); });
    std::vector<std::uint64_t> c(probe.begin(), probe.begin() + 500);
    c.resize(512);
    // Each round's 12 new blocks are removed again (untimed), so the index keeps its size.
    std::vector<double> t(100000);
    for (auto& x : t) {
        for (std::size_t j = 500; j < 512; ++j) c[j] = rng();
        const auto a = std::chrono::steady_clock::now();
        ix.insert(3, c.data(), c.size(), 0.0);
        x = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - a).count();
        ix.remove(3, c.data() + 500, 12);
    }
    std::sort(t.begin(), t.end());
    const double insert = t[t.size() / 2];
    std::printf("%zu blocks, %u replicas: match 512 p50 %.0f ns; insert 512 (500 present) p50 %.0f ns\n",
                blocks, replicas, match, insert);
    ix.check_invariants();
    return 0;
}
