// Host emulator of the CUDA execution model, header-only C++17: runs the kernels of cuda/*.cu
// unchanged on the CPU inside `cargo test`.
//
// * One OS thread runs one block at a time; every CUDA thread of the block is a fiber
//   (ucontext) with its own stack, so `__syncthreads()` and warp operations suspend it until
//   its peers arrive.
// * Builtins: threadIdx, blockIdx, blockDim, gridDim (per fiber); __syncthreads (a barrier
//   that all live threads of the block must reach: a thread that exits while others wait at
//   a barrier is reported as a divergent barrier), __syncwarp (the same within a warp);
//   __shfl_sync / _xor / _down / _up and __ballot_sync over the live lanes of a warp;
//   dynamic shared memory (RINGATTN_DYNAMIC_SMEM(), poisoned with 0xFF bytes at every block
//   start); atomicAdd on f32, int and unsigned, correct across OS threads; warp_allgather,
//   on which the PTX twins of ptx.cuh rebuild a warp's fragments.
// * Errors are collected per launch and returned to the caller; a kernel never aborts the
//   process.
//
// * Schedules: forward, reverse or seeded-random fiber order per round (Schedule), so that a
//   missing barrier changes results.
//
// * Blocks can be spread over a pool of OS threads (launch's `workers`).
//
// Still to come (issue 4): the fast x86-64 context switch and bounds-checked, race-shadowed
// shared-memory accesses.
#pragma once

#include <algorithm>
#include <array>
#include <atomic>
#include <thread>
#include <cmath>
#include <math.h>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <ucontext.h>
#include <vector>

struct dim3 {
    unsigned x, y, z;
    constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

namespace emu {

struct Block;

enum class Wait { None, Block, Warp };

// One cp.async copy in flight: performed when its group retires.
struct AsyncCopy {
    void* dst;
    const void* src;
    unsigned bytes;      // bytes read from src
    unsigned zero_fill;  // bytes of dst after them set to 0
};

struct Thread {
    dim3 tid;
    unsigned linear = 0;
    unsigned warp_ops = 0;
    // cp.async: copies not yet committed, and committed groups oldest first.
    std::vector<AsyncCopy> uncommitted;
    std::vector<std::vector<AsyncCopy>> groups;
    Block* block = nullptr;
    ucontext_t ctx{};
    std::vector<char> stack;
    bool done = false;
    Wait wait = Wait::None;
};

// The order in which the scheduler resumes a block's fibers each round. A kernel whose result
// does not depend on atomic order must give bit-identical results under every schedule;
// missing barriers show up as differences.
enum class Schedule { Forward = 0, Reverse = 1, Random = 2 };

struct Block {
    dim3 bid, bdim, gdim;
    Schedule schedule = Schedule::Forward;
    uint64_t seed = 0;
    std::vector<Thread> threads;
    // Dynamic shared memory of the block, 64-byte aligned, poisoned (0xFF bytes: NaN as f32,
    // -1 as integers) at block start so that reads before writes show up.
    std::vector<unsigned char> smem;
    size_t smem_offset = 0;
    // Warp exchange slots for shuffles and ballots, double-buffered by each lane's count of
    // warp operations so that a fast lane's next exchange cannot overwrite a value a slower
    // lane has yet to read: slots[parity][thread].
    std::vector<uint64_t> slots[2];
    ucontext_t scheduler{};
    const std::function<void()>* body = nullptr;
    std::string error;
};

inline thread_local Thread* current = nullptr;

inline void fail(const std::string& msg) {
    if (current && current->block && current->block->error.empty()) {
        current->block->error = msg;
    }
}

// Suspends the calling fiber until the scheduler resumes it.
inline void yield(Wait w) {
    Thread* t = current;
    t->wait = w;
    swapcontext(&t->ctx, &t->block->scheduler);
    current = t;
}

inline void fiber_entry() {
    Thread* t = current;
    (*t->block->body)();
    if (!t->uncommitted.empty() || !t->groups.empty()) {
        fail("thread " + std::to_string(t->linear) + " exited with cp.async copies never waited for");
    }
    t->done = true;
    t->wait = Wait::None;
    swapcontext(&t->ctx, &t->block->scheduler);
}

constexpr size_t kStack = 64 * 1024;

// Runs one block: round-robin over fibers until every thread is done; barriers release
// when every live thread (of the block, or of the warp) waits on them.
inline void run_block(Block& b, size_t smem_bytes) {
    unsigned n = b.bdim.x * b.bdim.y * b.bdim.z;
    b.smem.assign(smem_bytes + 64, 0xFF);
    b.smem_offset = (64 - reinterpret_cast<uintptr_t>(b.smem.data()) % 64) % 64;
    b.threads.assign(n, Thread{});
    b.slots[0].assign(n, 0);
    b.slots[1].assign(n, 0);
    for (unsigned i = 0; i < n; ++i) {
        Thread& t = b.threads[i];
        t.linear = i;
        t.tid = dim3(i % b.bdim.x, (i / b.bdim.x) % b.bdim.y, i / (b.bdim.x * b.bdim.y));
        t.block = &b;
        t.stack.resize(kStack);
        getcontext(&t.ctx);
        t.ctx.uc_stack.ss_sp = t.stack.data();
        t.ctx.uc_stack.ss_size = t.stack.size();
        t.ctx.uc_link = nullptr;
        makecontext(&t.ctx, fiber_entry, 0);
    }
    std::vector<unsigned> order(n);
    uint64_t rng = b.seed ^ (uint64_t(b.bid.x) << 32) ^ (uint64_t(b.bid.y) << 16) ^ b.bid.z;
    auto next_random = [&rng]() {  // splitmix64
        uint64_t z = (rng += 0x9e3779b97f4a7c15ull);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        return z ^ (z >> 31);
    };
    for (;;) {
        bool progressed = false;
        for (unsigned i = 0; i < n; ++i) order[i] = b.schedule == Schedule::Reverse ? n - 1 - i : i;
        if (b.schedule == Schedule::Random) {
            for (unsigned i = n; i > 1; --i) std::swap(order[i - 1], order[next_random() % i]);
        }
        for (unsigned idx : order) {
            Thread& t = b.threads[idx];
            if (t.done || t.wait != Wait::None) continue;
            current = &t;
            swapcontext(&b.scheduler, &t.ctx);
            current = nullptr;
            progressed = true;
        }
        // Release warps whose live lanes all wait at __syncwarp.
        for (unsigned w0 = 0; w0 < n; w0 += 32) {
            unsigned w1 = w0 + 32 < n ? w0 + 32 : n;
            bool any = false, all = true;
            for (unsigned i = w0; i < w1; ++i) {
                const Thread& t = b.threads[i];
                if (t.done) continue;
                any = true;
                all = all && t.wait == Wait::Warp;
            }
            if (any && all) {
                for (unsigned i = w0; i < w1; ++i) b.threads[i].wait = Wait::None;
                progressed = true;
            }
        }
        unsigned live = 0, at_barrier = 0, finished = 0;
        for (const Thread& t : b.threads) {
            if (t.done) { ++finished; continue; }
            ++live;
            if (t.wait == Wait::Block) ++at_barrier;
        }
        if (live == 0) return;
        if (at_barrier == live) {
            if (finished > 0) {
                b.error = "divergent __syncthreads: " + std::to_string(finished) +
                          " thread(s) of the block exited while others wait at a barrier";
                return;
            }
            for (Thread& t : b.threads) t.wait = Wait::None;
            continue;
        }
        if (!progressed) {
            b.error = "deadlock: threads wait at barriers that can never complete";
            return;
        }
    }
}

// Launches `body` (the kernel call) over `grid` × `block` with `smem_bytes` of dynamic
// shared memory per block, blocks spread over `workers` OS threads (0: one per core);
// returns the first error (by block order), or "".
inline std::string launch(dim3 grid, dim3 block, const std::function<void()>& body, size_t smem_bytes = 0,
                          Schedule schedule = Schedule::Forward, uint64_t seed = 0, unsigned workers = 1) {
    const uint64_t nblocks = uint64_t(grid.x) * grid.y * grid.z;
    if (workers == 0) workers = std::max(1u, std::thread::hardware_concurrency());
    workers = unsigned(std::min<uint64_t>(workers, std::max<uint64_t>(nblocks, 1)));
    std::vector<std::string> errors(nblocks);
    std::atomic<uint64_t> next{0};
    auto work = [&] {
        for (uint64_t i = next++; i < nblocks; i = next++) {
            Block b;
            b.bid = dim3(unsigned(i % grid.x), unsigned((i / grid.x) % grid.y), unsigned(i / (uint64_t(grid.x) * grid.y)));
            b.bdim = block;
            b.gdim = grid;
            b.body = &body;
            b.schedule = schedule;
            b.seed = seed;
            run_block(b, smem_bytes);
            if (!b.error.empty()) {
                errors[i] = "block (" + std::to_string(b.bid.x) + "," + std::to_string(b.bid.y) + "," +
                            std::to_string(b.bid.z) + "): " + b.error;
            }
        }
    };
    std::vector<std::thread> pool;
    for (unsigned w = 1; w < workers; ++w) pool.emplace_back(work);
    work();
    for (std::thread& t : pool) t.join();
    for (const std::string& e : errors) {
        if (!e.empty()) return e;
    }
    return "";
}

}  // namespace emu

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define threadIdx (::emu::current->tid)
#define blockIdx (::emu::current->block->bid)
#define blockDim (::emu::current->block->bdim)
#define gridDim (::emu::current->block->gdim)

inline void __syncthreads() { ::emu::yield(::emu::Wait::Block); }
inline void __syncwarp(unsigned = 0xffffffffu) { ::emu::yield(::emu::Wait::Warp); }

namespace emu {
// Publishes this lane's 64-bit word, waits for the warp, returns lane `src`'s word (lanes
// outside the block read their own value, as CUDA leaves them undefined).
inline uint64_t warp_exchange(uint64_t mine, unsigned src_lane) {
    Thread* t = current;
    Block* b = t->block;
    const unsigned parity = t->warp_ops++ & 1u;
    b->slots[parity][t->linear] = mine;
    yield(Wait::Warp);
    const unsigned src = (t->linear & ~31u) + (src_lane & 31u);
    return src < b->threads.size() ? b->slots[parity][src] : mine;
}

template <typename T>
inline uint64_t to_word(T v) {
    static_assert(sizeof(T) <= 8, "shuffle of at most 64 bits");
    uint64_t w = 0;
    std::memcpy(&w, &v, sizeof(T));
    return w;
}

template <typename T>
inline T from_word(uint64_t w) {
    T v;
    std::memcpy(&v, &w, sizeof(T));
    return v;
}

inline unsigned lane_id() { return current->linear & 31u; }

// Publishes this lane's word, waits for the warp, returns every lane's word (0 for lanes
// past the end of the block).
inline std::array<uint64_t, 32> warp_allgather(uint64_t mine) {
    Thread* t = current;
    Block* b = t->block;
    const unsigned parity = t->warp_ops++ & 1u;
    b->slots[parity][t->linear] = mine;
    yield(Wait::Warp);
    std::array<uint64_t, 32> all{};
    const unsigned w0 = t->linear & ~31u;
    for (unsigned i = 0; i < 32 && w0 + i < b->threads.size(); ++i) all[i] = b->slots[parity][w0 + i];
    return all;
}

// The block's dynamic shared memory (what `extern __shared__` names on the device).
inline unsigned char* dynamic_smem() {
    Block* b = current->block;
    return b->smem.data() + b->smem_offset;
}
}  // namespace emu

// Dynamic shared memory, the same spelling in device and host builds (kernels use it instead
// of declaring `extern __shared__` arrays themselves).
#define RINGATTN_DYNAMIC_SMEM() (::emu::dynamic_smem())

// Atomics: correct across OS threads (blocks may run on several), built on the compiler's
// __atomic builtins; float adds by compare-and-swap on the bit pattern.
inline float atomicAdd(float* addr, float v) {
    uint32_t* p = reinterpret_cast<uint32_t*>(addr);
    uint32_t old = __atomic_load_n(p, __ATOMIC_RELAXED);
    for (;;) {
        float f;
        std::memcpy(&f, &old, 4);
        const float sum = f + v;
        uint32_t next;
        std::memcpy(&next, &sum, 4);
        if (__atomic_compare_exchange_n(p, &old, next, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) return f;
    }
}
inline int atomicAdd(int* addr, int v) { return __atomic_fetch_add(addr, v, __ATOMIC_RELAXED); }
inline unsigned atomicAdd(unsigned* addr, unsigned v) { return __atomic_fetch_add(addr, v, __ATOMIC_RELAXED); }

template <typename T>
inline T __shfl_sync(unsigned, T v, int src, int width = 32) {
    const unsigned lane = ::emu::lane_id();
    const unsigned base = lane & ~unsigned(width - 1);
    return ::emu::from_word<T>(::emu::warp_exchange(::emu::to_word(v), base + (unsigned(src) & unsigned(width - 1))));
}

template <typename T>
inline T __shfl_xor_sync(unsigned, T v, int mask, int width = 32) {
    const unsigned lane = ::emu::lane_id();
    unsigned src = lane ^ unsigned(mask);
    if ((src & ~unsigned(width - 1)) != (lane & ~unsigned(width - 1))) src = lane;
    return ::emu::from_word<T>(::emu::warp_exchange(::emu::to_word(v), src));
}

template <typename T>
inline T __shfl_down_sync(unsigned, T v, unsigned delta, int width = 32) {
    const unsigned lane = ::emu::lane_id();
    const unsigned src = lane + delta;
    const bool inside = (src & ~unsigned(width - 1)) == (lane & ~unsigned(width - 1));
    return ::emu::from_word<T>(::emu::warp_exchange(::emu::to_word(v), inside ? src : lane));
}

template <typename T>
inline T __shfl_up_sync(unsigned, T v, unsigned delta, int width = 32) {
    const unsigned lane = ::emu::lane_id();
    const bool inside = (lane & unsigned(width - 1)) >= delta;
    return ::emu::from_word<T>(::emu::warp_exchange(::emu::to_word(v), inside ? lane - delta : lane));
}

// Bit i set when lane i of the warp passes a non-zero predicate. Each lane publishes its
// predicate stamped with the index of this warp operation, so lanes that exited earlier
// (whose slots hold older stamps) do not count.
inline unsigned __ballot_sync(unsigned, int pred) {
    ::emu::Thread* t = ::emu::current;
    const uint64_t op = t->warp_ops;
    const unsigned parity = unsigned(op & 1u);
    ::emu::warp_exchange((op << 1) | (pred ? 1u : 0u), ::emu::lane_id());
    ::emu::Block* b = t->block;
    const unsigned w0 = t->linear & ~31u;
    unsigned bits = 0;
    for (unsigned i = 0; i < 32 && w0 + i < b->threads.size(); ++i) {
        const uint64_t w = b->slots[parity][w0 + i];
        if ((w >> 1) == op && (w & 1u)) bits |= 1u << i;
    }
    return bits;
}
