// Host emulator of the CUDA execution model, header-only C++17: runs the kernels of cuda/*.cu
// unchanged on the CPU inside `cargo test`.
//
// * One OS thread runs one block at a time; every CUDA thread of the block is a fiber with
//   its own stack (mmap'ed, with a guard page), so `__syncthreads()` and warp operations
//   suspend it until its peers arrive. On x86-64 fibers switch with a few instructions of
//   assembly (callee-saved registers, MXCSR and the x87 control word); elsewhere, and under
//   AddressSanitizer, with ucontext.
// * Builtins: threadIdx, blockIdx, blockDim, gridDim (per fiber); __syncthreads (a barrier
//   that all live threads of the block must reach: a thread that exits while others wait at
//   a barrier is reported as a divergent barrier), __syncwarp (the same within a warp);
//   __shfl_sync / _xor / _down / _up and __ballot_sync over the live lanes of a warp;
//   dynamic shared memory (RINGATTN_DYNAMIC_SMEM(), poisoned with 0xFF bytes at every block
//   start); atomicAdd on f32, int and unsigned and atomicMax on unsigned, address-checked and
//   correct across OS threads; the bit casts and __float2int_rn of the CUDA math API; warp_allgather,
//   on which the PTX twins of ptx.cuh rebuild a warp's fragments; mbarrier waits (a fiber
//   suspended until the phase it waits for completes; see ptx.cuh's mbarrier twins).
// * Deadlocks (no fiber can run: barriers or mbarrier phases that can never complete) end the
//   block with an error, unless a thread reported one first (its cause is kept).
// * Checks on wrapper-mediated accesses (smem_load/smem_store, gmem_load/gmem_store, and the
//   PTX twins): shared addresses must lie in the block's arena and global ones in a buffer
//   registered with the launch (LaunchConfig::globals); a race shadow over the arena reports
//   two threads touching the same shared word between two barriers when one of them writes
//   (read after write, write after read, write after write).
// * Schedules: forward, reverse or seeded-random fiber order per round (Schedule), so that a
//   missing barrier changes results.
// * Blocks can be spread over a pool of OS threads (LaunchConfig::workers).
// * Errors are collected per launch and returned to the caller; a kernel never aborts the
//   process. Limits: weak-memory effects and bank conflicts are invisible, and raw shared
//   accesses that bypass the helpers are covered only by the schedules and the poison.
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
#include <memory>
#include <string>
#include <sys/mman.h>
#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#define RINGATTN_EMU_ASAN 1
#endif
#include <ucontext.h>
#include <exception>
#include <vector>

struct dim3 {
    unsigned x, y, z;
    constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

#if defined(__x86_64__) && !defined(__SANITIZE_ADDRESS__) && !defined(RINGATTN_EMU_UCONTEXT)
#define RINGATTN_EMU_ASM_SWITCH 1
// void ringattn_emu_switch(void** save_sp, void* load_sp): saves the callee-saved registers,
// MXCSR and the x87 control word on the current stack, stores its pointer in *save_sp, then
// restores the same from load_sp and returns on that stack. Weak, so that every translation
// unit including this header may define it.
extern "C" void ringattn_emu_switch(void** save_sp, void* load_sp);
__asm__(
    ".text\n"
    ".weak ringattn_emu_switch\n"
    ".type ringattn_emu_switch,@function\n"
    "ringattn_emu_switch:\n"
    "  pushq %rbp\n"
    "  pushq %rbx\n"
    "  pushq %r12\n"
    "  pushq %r13\n"
    "  pushq %r14\n"
    "  pushq %r15\n"
    "  subq $8, %rsp\n"
    "  stmxcsr (%rsp)\n"
    "  fnstcw 4(%rsp)\n"
    "  movq %rsp, (%rdi)\n"
    "  movq %rsi, %rsp\n"
    "  ldmxcsr (%rsp)\n"
    "  fldcw 4(%rsp)\n"
    "  addq $8, %rsp\n"
    "  popq %r15\n"
    "  popq %r14\n"
    "  popq %r13\n"
    "  popq %r12\n"
    "  popq %rbx\n"
    "  popq %rbp\n"
    "  ret\n"
    ".size ringattn_emu_switch,.-ringattn_emu_switch\n");
#endif

namespace emu {

struct Block;

// What a suspended fiber waits for: a block barrier, a warp barrier, or the completion of an
// mbarrier phase (Thread::mbar, Thread::mbar_parity).
// mbarrier phase (Thread::mbar, Thread::mbar_parity), the rest of a warpgroup at a
// warpgroup-wide instruction (wgmma, setmaxnreg), or a named barrier (Thread::named_id,
// completing when its generation moves past Thread::named_gen).
enum class Wait { None, Block, Warp, Mbarrier, Warpgroup, Named };

// One cp.async copy in flight: performed when its group retires.
struct AsyncCopy {
    void* dst;
    const void* src;
    unsigned bytes;      // bytes read from src
    unsigned zero_fill;  // bytes of dst after them set to 0
};

// One wgmma.mma_async of a warpgroup (D = A·B + D, 64 x n x 16), shared by its 128 threads:
// the operands as read at issue (values exact in double), and the shared memory they came
// from, to report a write to it before the wgmma completes.
struct WgmmaOp {
    uint32_t n = 0;
    bool scale_d = true;             // false: D = A·B, the old D not read
    std::vector<double> a, b;        // A[64][16], B[16][n], row-major
    std::vector<uint32_t> smem_at;   // shared offsets of the 16-bit elements read
    std::vector<uint16_t> smem_was;  // and their values at issue
    unsigned retired = 0;            // threads of the warpgroup that have retired it; the last one
                                     // runs the shared-memory check (until then it may still read)
};

// A thread's share of an in-flight wgmma: the op and the thread's accumulator fragment (the
// hidden state of a WgmmaAcc, see ptx.cuh): its visible values (poisoned while in flight),
// the values the chain of in-flight wgmmas builds, and how many are in flight on it.
struct WgmmaPending {
    std::shared_ptr<const WgmmaOp> op;
    float* visible;
    float* value;
    uint32_t* in_flight;
};

// A bulk tensor copy (TMA load) in flight: `land` performs it (as thread `issuer`: the copy,
// then complete-tx on its mbarrier) when the scheduler lets it land, a round or more later.
struct BulkLoad {
    unsigned issuer;
    std::function<void()> land;
};

// The shared bytes a bulk tensor store read, kept until cp.async.bulk.wait_group.read
// retires it, to report a write to them before that.
struct BulkStoreSource {
    uint32_t offset;
    std::vector<unsigned char> bytes;
};

// One thread's record at a warpgroup rendezvous (see warpgroup_gather).
struct WarpgroupSlot {
    uint64_t words[8];
};

// A fiber's stack: mmap'ed with a PROT_NONE guard page below it, reused across blocks.
struct Stack {
    void* base = nullptr;  // the mapping, guard page first
    size_t bytes = 0;      // mapping size
    char* lo() const { return static_cast<char*>(base) + 4096; }
    char* hi() const { return static_cast<char*>(base) + bytes; }
};

constexpr size_t kStack = 256 * 1024;

// The stacks of one OS thread, unmapped when it exits.
struct StackPool {
    std::vector<Stack> stacks;
    ~StackPool() {
        for (Stack& s : stacks) munmap(s.base, s.bytes);
    }
    // At least `n` stacks (empty when the kernel cannot get them).
    bool reserve(size_t n) {
        while (stacks.size() < n) {
            const size_t bytes = kStack + 4096;
            void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
            if (p == MAP_FAILED) return false;
            mprotect(p, 4096, PROT_NONE);
            stacks.push_back(Stack{p, bytes});
        }
        return true;
    }
};

inline StackPool& stack_pool() {
    static thread_local StackPool pool;
    return pool;
}

struct Thread {
    dim3 tid;
    unsigned linear = 0;
    unsigned warp_ops = 0;
    // cp.async: copies not yet committed, and committed groups oldest first.
    std::vector<AsyncCopy> uncommitted;
    std::vector<std::vector<AsyncCopy>> groups;
    Block* block = nullptr;
#ifdef RINGATTN_EMU_ASM_SWITCH
    void* sp = nullptr;
#else
    ucontext_t ctx{};
#endif
    bool done = false;
    Wait wait = Wait::None;
    // With Wait::Mbarrier: the barrier (in shared memory) and the parity of the phase awaited.
    const uint64_t* mbar = nullptr;
    uint32_t mbar_parity = 0;
    // With Wait::Named: the barrier and the generation this thread arrived in.
    uint32_t named_id = 0, named_gen = 0;
    // Warpgroup rendezvous performed (double-buffers Block::wg_slots, as warp_ops does slots).
    uint64_t wg_ops = 0;
    // wgmma: ops not yet committed, and committed groups oldest first.
    std::vector<WgmmaPending> wgmma_uncommitted;
    std::vector<std::vector<WgmmaPending>> wgmma_groups;
    // wgmma.fence: accesses to accumulator fragments are numbered (acc_seq); fence_mark is the
    // number at this thread's last wgmma.fence (0: none yet).
    uint64_t acc_seq = 1, fence_mark = 0;
    // fence.proxy.async executed so far: shared words this thread stored since its last one
    // (Block::proxy) are unfenced generic writes.
    uint32_t proxy_gen = 0;
    // Bulk tensor stores: not yet committed, and committed groups oldest first.
    std::vector<BulkStoreSource> bulk_uncommitted;
    std::vector<std::vector<BulkStoreSource>> bulk_groups;
#ifdef RINGATTN_EMU_ASAN
    const void* stack_bottom = nullptr;
    size_t stack_size = 0;
#endif
};

// The order in which the scheduler resumes a block's fibers each round. A kernel whose result
// does not depend on atomic order must give bit-identical results under every schedule;
// missing barriers show up as differences.
enum class Schedule { Forward = 0, Reverse = 1, Random = 2 };

// What a launch did to one global buffer (when asked: Range::access): the lowest and one past
// the highest byte offset read and written through the checked wrappers (lo > hi: none).
// The stand-in driver's cross-stream race detector reads it (src/emu/named.rs).
struct Access {
    std::atomic<uint64_t> read_lo{~uint64_t(0)}, read_hi{0}, write_lo{~uint64_t(0)}, write_hi{0};
};

// A global buffer a kernel may access through the checked wrappers.
struct Range {
    const void* base;
    size_t bytes;
    const char* name;
    Access* access = nullptr;
};

inline void widen(std::atomic<uint64_t>& lo, std::atomic<uint64_t>& hi, uint64_t a, uint64_t b) {
    uint64_t cur = lo.load(std::memory_order_relaxed);
    while (a < cur && !lo.compare_exchange_weak(cur, a, std::memory_order_relaxed)) {
    }
    cur = hi.load(std::memory_order_relaxed);
    while (b > cur && !hi.compare_exchange_weak(cur, b, std::memory_order_relaxed)) {
    }
}

// Everything about one launch.
struct LaunchConfig {
    dim3 grid, block;
    size_t smem_bytes = 0;
    Schedule schedule = Schedule::Forward;
    uint64_t seed = 0;
    // OS threads the blocks are spread over (0: one per core).
    unsigned workers = 1;
    // The global buffers of the launch; when empty, global accesses are not checked.
    std::vector<Range> globals;
    // When set, [grid.x * grid.y * grid.z][2] (block x + grid.x (y + grid.y z)): each
    // block's cp.async copies issued and mma multiply-adds (the tests of the kernels' loop
    // bounds and of their FLOP accounting).
    uint64_t* block_counts = nullptr;
};

// Race shadow of one 4-byte word of shared memory: its last writer and the readers of the
// current barrier interval (epoch).
struct Shadow {
    uint32_t w_epoch = 0, r_epoch = 0;
    uint16_t w_thread = 0, r_thread = 0;
    bool r_many = false;
};

struct Block {
    dim3 bid, bdim, gdim;
    Schedule schedule = Schedule::Forward;
    uint64_t seed = 0;
    const LaunchConfig* config = nullptr;
    std::vector<Thread> threads;
    // Dynamic shared memory of the block, 64-byte aligned, poisoned (0xFF bytes: NaN as f32,
    // -1 as integers) at block start so that reads before writes show up.
    std::vector<unsigned char> smem;
    size_t smem_offset = 0;
    size_t smem_bytes = 0;
    std::vector<Shadow> shadow;
    // Barrier intervals completed so far (+1): the race shadow's clock.
    uint32_t epoch = 1;
    // Warp exchange slots for shuffles and ballots, double-buffered by each lane's count of
    // warp operations so that a fast lane's next exchange cannot overwrite a value a slower
    // lane has yet to read: slots[parity][thread].
    std::vector<uint64_t> slots[2];
#ifdef RINGATTN_EMU_ASM_SWITCH
    void* scheduler_sp = nullptr;
#else
    ucontext_t scheduler{};
#endif
#ifdef RINGATTN_EMU_ASAN
    // The scheduler's stack, for AddressSanitizer's fiber-switch annotations.
    const void* sched_bottom = nullptr;
    size_t sched_size = 0;
#endif
    const std::function<void()>* body = nullptr;
    std::string error;
    // cp.async copies its threads issued and mma multiply-adds of its warps
    // (LaunchConfig::block_counts).
    uint64_t async_copies = 0, mma_macs = 0;
    // Warpgroup rendezvous slots, double-buffered by each thread's wg_ops: wg_slots[parity][thread].
    std::vector<WarpgroupSlot> wg_slots[2];
    // Per warpgroup: the wgmma op built from its latest rendezvous, and that rendezvous' number.
    std::vector<std::pair<uint64_t, std::shared_ptr<const WgmmaOp>>> wg_current;
    // Per shared word: the last thread (+1; 0: none) that stored to it through the generic
    // proxy, and that thread's proxy_gen then. The store is unfenced while they are equal.
    // Also the bulk tensor copies in flight that will write the word.
    struct ProxyWord {
        uint32_t gen = 0;
        uint16_t writer = 0;
        uint16_t bulk_pending = 0;
    };
    std::vector<ProxyWord> proxy;
    // Bulk tensor copies in flight, in issue order.
    std::vector<BulkLoad> bulk_loads;
    // Named barriers 1-15 (bar.sync / bar.arrive id, count): the thread count of the current
    // generation (0: idle), arrivals so far, and the generation (completions so far).
    struct NamedBarrier {
        uint32_t count = 0, arrived = 0, generation = 0;
    };
    NamedBarrier named[16];
};

inline thread_local Thread* current = nullptr;

inline void fail(const std::string& msg) {
    if (current && current->block && current->block->error.empty()) {
        current->block->error = "thread " + std::to_string(current->linear) + ": " + msg;
    }
}

// Suspends the calling fiber until the scheduler resumes it.
inline void yield(Wait w) {
    Thread* t = current;
    t->wait = w;
#ifdef RINGATTN_EMU_ASM_SWITCH
    ringattn_emu_switch(&t->sp, t->block->scheduler_sp);
#else
#ifdef RINGATTN_EMU_ASAN
    void* fake = nullptr;
    __sanitizer_start_switch_fiber(&fake, t->block->sched_bottom, t->block->sched_size);
#endif
    swapcontext(&t->ctx, &t->block->scheduler);
#ifdef RINGATTN_EMU_ASAN
    __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
#endif
    current = t;
}

inline void resume(Block& b, Thread& t) {
    current = &t;
#ifdef RINGATTN_EMU_ASM_SWITCH
    ringattn_emu_switch(&b.scheduler_sp, t.sp);
#else
#ifdef RINGATTN_EMU_ASAN
    void* fake = nullptr;
    __sanitizer_start_switch_fiber(&fake, t.stack_bottom, t.stack_size);
#endif
    swapcontext(&b.scheduler, &t.ctx);
#ifdef RINGATTN_EMU_ASAN
    __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
#endif
    current = nullptr;
}

[[noreturn]] inline void fiber_entry() {
    Thread* t = current;
#ifdef RINGATTN_EMU_ASAN
    // First entry: learn the scheduler's stack from the switch that got here.
    __sanitizer_finish_switch_fiber(nullptr, &t->block->sched_bottom, &t->block->sched_size);
#endif
    try {
        (*t->block->body)();
    } catch (const std::exception& e) {
        fail(std::string("exception in kernel: ") + e.what());
    }
    if (!t->uncommitted.empty() || !t->groups.empty()) {
        fail("exited with cp.async copies never waited for");
    }
    if (!t->wgmma_uncommitted.empty() || !t->wgmma_groups.empty()) {
        fail("exited with wgmma operations never waited for (wgmma.wait_group)");
    }
    if (!t->bulk_uncommitted.empty() || !t->bulk_groups.empty()) {
        fail("exited with bulk tensor stores never waited for (cp.async.bulk.wait_group)");
    }
    t->done = true;
    t->wait = Wait::None;
#ifdef RINGATTN_EMU_ASM_SWITCH
    ringattn_emu_switch(&t->sp, t->block->scheduler_sp);
#else
#ifdef RINGATTN_EMU_ASAN
    __sanitizer_start_switch_fiber(nullptr, t->block->sched_bottom, t->block->sched_size);  // this fiber ends
#endif
    swapcontext(&t->ctx, &t->block->scheduler);
#endif
    __builtin_unreachable();
}

// Prepares thread t's fiber to start in fiber_entry on `stack`.
inline void make_fiber(Thread& t, const Stack& stack) {
#ifdef RINGATTN_EMU_ASM_SWITCH
    // The frame ringattn_emu_switch pops: control words, r15..rbp, then fiber_entry as the
    // return address, 16-byte aligned so that fiber_entry starts as if called.
    uintptr_t top = reinterpret_cast<uintptr_t>(stack.hi()) & ~uintptr_t(15);
    uint64_t* a = reinterpret_cast<uint64_t*>(top - 16);
    a[1] = 0;
    a[0] = reinterpret_cast<uint64_t>(&fiber_entry);
    for (int i = 1; i <= 6; ++i) a[-i] = 0;  // rbp, rbx, r12..r15
    const uint32_t mxcsr = 0x1F80;           // default: round to nearest, exceptions masked
    const uint16_t fpcw = 0x037F;
    unsigned char* ctl = reinterpret_cast<unsigned char*>(a - 7);
    std::memcpy(ctl, &mxcsr, 4);
    std::memcpy(ctl + 4, &fpcw, 2);
    t.sp = a - 7;
#else
#ifdef RINGATTN_EMU_ASAN
    t.stack_bottom = stack.lo();
    t.stack_size = size_t(stack.hi() - stack.lo());
#endif
    getcontext(&t.ctx);
    t.ctx.uc_stack.ss_sp = stack.lo();
    t.ctx.uc_stack.ss_size = size_t(stack.hi() - stack.lo());
    t.ctx.uc_link = nullptr;
    makecontext(&t.ctx, reinterpret_cast<void (*)()>(&fiber_entry), 0);
#endif
}

// Runs one block: round-robin over fibers until every thread is done; barriers release
// when every live thread (of the block, or of the warp) waits on them.
inline void run_block(Block& b, size_t smem_bytes) {
    unsigned n = b.bdim.x * b.bdim.y * b.bdim.z;
    b.smem.assign(smem_bytes + 64, 0xFF);
    b.smem_offset = (64 - reinterpret_cast<uintptr_t>(b.smem.data()) % 64) % 64;
    b.smem_bytes = smem_bytes;
    b.shadow.assign((smem_bytes + 3) / 4, Shadow{});
    b.epoch = 1;
    b.threads.assign(n, Thread{});
    b.slots[0].assign(n, 0);
    b.slots[1].assign(n, 0);
    b.wg_slots[0].assign(n, WarpgroupSlot{});
    b.wg_slots[1].assign(n, WarpgroupSlot{});
    b.wg_current.assign((n + 127) / 128, {0, nullptr});
    b.proxy.assign((smem_bytes + 3) / 4, Block::ProxyWord{});
    b.bulk_loads.clear();
    for (Block::NamedBarrier& nb : b.named) nb = Block::NamedBarrier{};
    StackPool& pool = stack_pool();
    if (!pool.reserve(n)) {
        b.error = "cannot map " + std::to_string(n) + " fiber stacks";
        return;
    }
    for (unsigned i = 0; i < n; ++i) {
        Thread& t = b.threads[i];
        t.linear = i;
        t.tid = dim3(i % b.bdim.x, (i / b.bdim.x) % b.bdim.y, i / (b.bdim.x * b.bdim.y));
        t.block = &b;
        make_fiber(t, pool.stacks[i]);
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
            resume(b, t);
            progressed = true;
        }
        // Land the bulk tensor copies issued so far (under the random schedule each may wait
        // further rounds while fibers still progress), as their issuing thread.
        if (!b.bulk_loads.empty()) {
            std::vector<BulkLoad> pending = std::move(b.bulk_loads);
            b.bulk_loads.clear();
            for (BulkLoad& c : pending) {
                if (b.schedule == Schedule::Random && progressed && (next_random() & 1u)) {
                    b.bulk_loads.push_back(std::move(c));
                    continue;
                }
                current = &b.threads[c.issuer];
                c.land();
                current = nullptr;
                progressed = true;
            }
        }
        // Release threads whose mbarrier phase has completed (the phase's parity bit is the
        // mbarrier state's bit 61, see ptx.cuh's twins).
        for (Thread& t : b.threads) {
            if (t.done || t.wait != Wait::Mbarrier) continue;
            uint64_t state;
            std::memcpy(&state, t.mbar, 8);
            if (((uint32_t(state >> 61) & 1u) ^ t.mbar_parity) != 0) {
                t.wait = Wait::None;
                progressed = true;
            }
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
        // Release threads whose named barrier has completed since they arrived.
        for (Thread& t : b.threads) {
            if (!t.done && t.wait == Wait::Named && b.named[t.named_id].generation != t.named_gen) {
                t.wait = Wait::None;
                progressed = true;
            }
        }
        // Release warpgroups (128 threads from a multiple of 128) whose threads all wait at a
        // warpgroup rendezvous.
        for (unsigned w0 = 0; w0 + 128 <= n; w0 += 128) {
            bool all = true;
            for (unsigned i = w0; i < w0 + 128 && all; ++i) {
                all = !b.threads[i].done && b.threads[i].wait == Wait::Warpgroup;
            }
            if (all) {
                for (unsigned i = w0; i < w0 + 128; ++i) b.threads[i].wait = Wait::None;
                progressed = true;
            }
        }
        unsigned live = 0, at_barrier = 0, finished = 0, at_mbarrier = 0, at_warpgroup = 0, at_named = 0;
        for (const Thread& t : b.threads) {
            if (t.done) { ++finished; continue; }
            ++live;
            if (t.wait == Wait::Block) ++at_barrier;
            if (t.wait == Wait::Mbarrier) ++at_mbarrier;
            if (t.wait == Wait::Warpgroup) ++at_warpgroup;
            if (t.wait == Wait::Named) ++at_named;
        }
        if (live == 0) {
            if (!b.bulk_loads.empty() && b.error.empty()) {
                b.error = "the block exited with " + std::to_string(b.bulk_loads.size()) +
                          " bulk tensor copies in flight (never waited for on their mbarriers)";
            }
            return;
        }
        if (at_barrier == live) {
            if (finished > 0) {
                b.error = "divergent __syncthreads: " + std::to_string(finished) +
                          " thread(s) of the block exited while others wait at a barrier";
                return;
            }
            for (Thread& t : b.threads) t.wait = Wait::None;
            ++b.epoch;
            continue;
        }
        if (!progressed) {
            // (An error a thread reported first, e.g. a misused barrier, is the cause: kept.)
            if (b.error.empty()) {
                if (at_warpgroup > 0) {
                    unsigned first = 0;
                    while (b.threads[first].done || b.threads[first].wait != Wait::Warpgroup) ++first;
                    b.error = "deadlock: " + std::to_string(at_warpgroup) +
                              " thread(s) wait at a warpgroup-wide instruction (wgmma, setmaxnreg) that the rest "
                              "of their warpgroup never reaches; the first is thread " + std::to_string(first) +
                              " of warpgroup " + std::to_string(first / 128) + " (warps " +
                              std::to_string(first / 128 * 4) + "-" + std::to_string(first / 128 * 4 + 3) +
                              "): a warpgroup is 4 consecutive warps from a warp rank that is a multiple of 4, "
                              "and all 128 threads must issue the instruction";
                } else if (at_named > 0) {
                    unsigned first = 0;
                    while (b.threads[first].done || b.threads[first].wait != Wait::Named) ++first;
                    const Block::NamedBarrier& nb = b.named[b.threads[first].named_id];
                    b.error = "deadlock: " + std::to_string(at_named) + " thread(s) wait at named barrier " +
                              std::to_string(b.threads[first].named_id) + " (" + std::to_string(nb.arrived) + " of " +
                              std::to_string(nb.count) + " threads arrived) and no thread can arrive";
                } else if (at_mbarrier > 0) {
                    b.error = "deadlock: " + std::to_string(at_mbarrier) +
                              " thread(s) wait on mbarrier phases that can never complete";
                } else {
                    b.error = "deadlock: threads wait at barriers that can never complete";
                }
            }
            return;
        }
    }
}

// Runs `body` (the kernel call) over the grid of `config`; returns the first error (by block
// order), or "".
inline std::string launch(const LaunchConfig& config, const std::function<void()>& body) {
    const dim3 grid = config.grid;
    const uint64_t nblocks = uint64_t(grid.x) * grid.y * grid.z;
    unsigned workers = config.workers;
    if (workers == 0) workers = std::max(1u, std::thread::hardware_concurrency());
    workers = unsigned(std::min<uint64_t>(workers, std::max<uint64_t>(nblocks, 1)));
    std::vector<std::string> errors(nblocks);
    std::atomic<uint64_t> next{0};
    std::atomic<bool> failed{false};
    auto work = [&] {
        for (uint64_t i = next++; i < nblocks && !failed; i = next++) {
            Block b;
            b.bid = dim3(unsigned(i % grid.x), unsigned((i / grid.x) % grid.y), unsigned(i / (uint64_t(grid.x) * grid.y)));
            b.bdim = config.block;
            b.gdim = grid;
            b.body = &body;
            b.schedule = config.schedule;
            b.seed = config.seed;
            b.config = &config;
            run_block(b, config.smem_bytes);
            if (config.block_counts != nullptr) {
                config.block_counts[2 * i] = b.async_copies;
                config.block_counts[2 * i + 1] = b.mma_macs;
            }
            if (!b.error.empty()) {
                errors[i] = "block (" + std::to_string(b.bid.x) + "," + std::to_string(b.bid.y) + "," +
                            std::to_string(b.bid.z) + "): " + b.error;
                failed = true;
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

// The same with positional arguments and no registered global buffers.
inline std::string launch(dim3 grid, dim3 block, const std::function<void()>& body, size_t smem_bytes = 0,
                          Schedule schedule = Schedule::Forward, uint64_t seed = 0, unsigned workers = 1) {
    LaunchConfig c;
    c.grid = grid;
    c.block = block;
    c.smem_bytes = smem_bytes;
    c.schedule = schedule;
    c.seed = seed;
    c.workers = workers;
    return launch(c, body);
}

}  // namespace emu

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __grid_constant__
#define threadIdx (::emu::current->tid)
#define blockIdx (::emu::current->block->bid)
#define blockDim (::emu::current->block->bdim)
#define gridDim (::emu::current->block->gdim)

inline void __syncthreads() { ::emu::yield(::emu::Wait::Block); }

namespace emu {
// bar.sync / bar.arrive id, count twin: the barrier completes when `count` threads (a
// multiple of 32) have arrived, counting every sync and arrive; sync waits for that
// completion. Reported: id 0 (__syncthreads' barrier) or above 15, a count that is not a
// positive multiple of 32 or exceeds the block, threads naming different counts in one
// generation.
inline void named_barrier(uint32_t id, uint32_t count, bool wait, const char* what) {
    Thread* t = current;
    Block* b = t->block;
    if (id == 0 || id > 15) {
        fail(std::string(what) + ": barrier id " + std::to_string(id) + " outside 1 ... 15 (0 is __syncthreads')");
        return;
    }
    if (count == 0 || count % 32 != 0 || count > b->threads.size()) {
        fail(std::string(what) + ": thread count " + std::to_string(count) +
             " is not a positive multiple of 32 within the block");
        return;
    }
    Block::NamedBarrier& nb = b->named[id];
    if (nb.arrived == 0) {
        nb.count = count;
    } else if (nb.count != count) {
        fail(std::string(what) + ": barrier " + std::to_string(id) + " expects " + std::to_string(nb.count) +
             " threads in this generation, this thread names " + std::to_string(count));
        return;
    }
    const uint32_t gen = nb.generation;
    if (++nb.arrived == nb.count) {
        nb.arrived = 0;
        ++nb.generation;
        return;
    }
    if (!wait) return;
    t->named_id = id;
    t->named_gen = gen;
    yield(Wait::Named);
}
}  // namespace emu
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

namespace emu {
// Reports an access of `bytes` at `p` outside the block's shared arena; returns whether it
// is inside.
inline bool check_shared(const void* p, size_t bytes, const char* what) {
    Block* b = current->block;
    const unsigned char* base = b->smem.data() + b->smem_offset;
    const unsigned char* q = static_cast<const unsigned char*>(p);
    if (q >= base && q + bytes <= base + b->smem_bytes) return true;
    fail(std::string(what) + ": " + std::to_string(bytes) + " bytes at shared offset " +
         std::to_string(q - base) + " outside the block's " + std::to_string(b->smem_bytes) +
         " bytes of dynamic shared memory");
    return false;
}

// Reports an access of `bytes` at `p` that is not inside one of the launch's global
// buffers (when the launch registered them); returns whether it is inside. `write`: the
// access writes (stores, atomics), recorded in the buffer's Access when it has one.
inline bool check_global(const void* p, size_t bytes, const char* what, bool write = false) {
    const LaunchConfig* c = current->block->config;
    if (c == nullptr || c->globals.empty()) return true;
    const unsigned char* q = static_cast<const unsigned char*>(p);
    const Range* nearest = nullptr;
    long long best = 0;
    for (const Range& r : c->globals) {
        const unsigned char* lo = static_cast<const unsigned char*>(r.base);
        if (q >= lo && q + bytes <= lo + r.bytes) {
            if (r.access != nullptr) {
                const uint64_t off = uint64_t(q - lo);
                if (write) {
                    widen(r.access->write_lo, r.access->write_hi, off, off + bytes);
                } else {
                    widen(r.access->read_lo, r.access->read_hi, off, off + bytes);
                }
            }
            return true;
        }
        const long long off = static_cast<long long>(q - lo);
        const long long dist = off < 0 ? -off : off - static_cast<long long>(r.bytes);
        if (nearest == nullptr || dist < best) {
            nearest = &r;
            best = dist;
        }
    }
    std::string msg = std::string(what) + ": " + std::to_string(bytes) + " bytes at a global address outside every buffer";
    if (nearest) {
        msg += " (nearest: `" + std::string(nearest->name) + "` of " + std::to_string(nearest->bytes) +
               " bytes, at offset " +
               std::to_string(static_cast<long long>(q - static_cast<const unsigned char*>(nearest->base))) + ")";
    }
    fail(msg);
    return false;
}

// Race shadow: records that the current thread reads (write = false) or writes the shared
// bytes [p, p + bytes) and reports a conflict with another thread in the same barrier
// interval.
inline void shadow_access(const void* p, size_t bytes, bool write, const char* what) {
    Block* b = current->block;
    const size_t off = size_t(static_cast<const unsigned char*>(p) - (b->smem.data() + b->smem_offset));
    const uint16_t me = uint16_t(current->linear);
    const uint32_t e = b->epoch;
    for (size_t w = off / 4; w < (off + bytes + 3) / 4 && w < b->shadow.size(); ++w) {
        Shadow& s = b->shadow[w];
        const char* kind = nullptr;
        unsigned other = 0;
        if (s.w_epoch == e && s.w_thread != me) {
            kind = write ? "write after write" : "read after write";
            other = s.w_thread;
        } else if (write && s.r_epoch == e && (s.r_many || s.r_thread != me)) {
            kind = "write after read";
            other = s.r_thread != me ? s.r_thread : 0xffffu;
        }
        if (kind) {
            fail(std::string("shared-memory race (") + kind + ") in " + what + " at shared offset " +
                 std::to_string(4 * w) + ": thread " + (other == 0xffffu ? std::string("(several)") : std::to_string(other)) +
                 " and this thread touch it between the same two barriers");
            return;
        }
        if (write) {
            s.w_epoch = e;
            s.w_thread = me;
        } else if (s.r_epoch != e) {
            s.r_epoch = e;
            s.r_thread = me;
            s.r_many = false;
        } else if (s.r_thread != me) {
            s.r_many = true;
        }
    }
}

// Reports an access of a T at `p` that is not aligned to alignof(T) (the device faults on a
// misaligned vector access); returns whether it is aligned.
template <typename T>
inline bool check_aligned(const void* p, const char* what) {
    if (reinterpret_cast<uintptr_t>(p) % alignof(T) == 0) return true;
    fail(std::string(what) + ": " + std::to_string(sizeof(T)) + " bytes at an address not aligned to " +
         std::to_string(alignof(T)) + " bytes");
    return false;
}

// Async proxy (fence.proxy.async): records a store of `bytes` at shared `p` by the current
// thread through the generic proxy (ordinary stores, stmatrix); wgmma and bulk-copy reads of
// those words are reported until the thread executes fence.proxy.async.
inline void proxy_generic_write(const void* p, size_t bytes) {
    Block* b = current->block;
    const size_t off = size_t(static_cast<const unsigned char*>(p) - (b->smem.data() + b->smem_offset));
    for (size_t w = off / 4; w < (off + bytes + 3) / 4 && w < b->proxy.size(); ++w) {
        b->proxy[w] = Block::ProxyWord{current->proxy_gen, uint16_t(current->linear + 1)};
    }
}

// Whether the shared word holding byte offset `off` was stored through the generic proxy by
// a thread that has not executed fence.proxy.async since; reports it for `what` (an
// async-proxy reader) and returns false then.
inline bool proxy_fenced(size_t off, const char* what, const char* verb = "reads") {
    Block* b = current->block;
    if (off / 4 >= b->proxy.size()) return true;
    const Block::ProxyWord& pw = b->proxy[off / 4];
    if (pw.bulk_pending != 0) {
        fail(std::string(what) + " " + verb + " shared memory at offset " + std::to_string(off) +
             " while a bulk tensor copy to it is in flight (wait on its mbarrier first)");
        return false;
    }
    if (pw.writer == 0 || b->threads[pw.writer - 1u].proxy_gen != pw.gen) return true;
    fail(std::string(what) + " " + verb + " shared memory at offset " + std::to_string(off) + " that thread " +
         std::to_string(pw.writer - 1u) +
         " stored with an ordinary (generic-proxy) store and has not fenced since: the writer must execute "
         "fence.proxy.async before the barrier that publishes it");
    return false;
}

// Reports an ordinary access to shared words a bulk tensor copy in flight will write.
inline bool bulk_settled(const void* p, size_t bytes, const char* what) {
    Block* b = current->block;
    const size_t off = size_t(static_cast<const unsigned char*>(p) - (b->smem.data() + b->smem_offset));
    for (size_t w = off / 4; w < (off + bytes + 3) / 4 && w < b->proxy.size(); ++w) {
        if (b->proxy[w].bulk_pending != 0) {
            fail(std::string(what) + " at shared offset " + std::to_string(4 * w) +
                 " while a bulk tensor copy to it is in flight (wait on its mbarrier first)");
            return false;
        }
    }
    return true;
}

// Warpgroup rendezvous: publishes this thread's record, waits until the 128 threads of its
// warpgroup (threads 128k ... 128k + 127: warps 4k ... 4k + 3) have published theirs, and
// returns their records (valid until this thread's next rendezvous). nullptr (reported) when
// the block's threads do not complete the warpgroup.
inline const WarpgroupSlot* warpgroup_gather(const WarpgroupSlot& mine, const char* what) {
    Thread* t = current;
    Block* b = t->block;
    const unsigned n = unsigned(b->threads.size()), w0 = t->linear & ~127u;
    if (w0 + 128 > n) {
        fail(std::string(what) + ": warpgroup " + std::to_string(w0 / 128) + " (threads " + std::to_string(w0) +
             "-" + std::to_string(w0 + 127) + ") is incomplete in a block of " + std::to_string(n) +
             " threads: warpgroup instructions need all 4 warps of an aligned warpgroup");
        return nullptr;
    }
    const unsigned parity = unsigned(t->wg_ops++ & 1u);
    b->wg_slots[parity][t->linear] = mine;
    yield(Wait::Warpgroup);
    return &b->wg_slots[parity][w0];
}

// Checked accesses: kernels read and write shared and global memory through these (plain
// loads and stores on the device, see common.cuh): bounds, alignment, and races in shared
// memory.
template <typename T>
inline T smem_load(const T* p) {
    if (!check_aligned<T>(p, "shared load")) return T{};
    if (!check_shared(p, sizeof(T), "shared load")) return T{};
    if (!bulk_settled(p, sizeof(T), "shared load")) return T{};
    shadow_access(p, sizeof(T), false, "shared load");
    return *p;
}
template <typename T>
inline void smem_store(T* p, T v) {
    if (!check_aligned<T>(p, "shared store")) return;
    if (!check_shared(p, sizeof(T), "shared store")) return;
    if (!bulk_settled(p, sizeof(T), "shared store")) return;
    shadow_access(p, sizeof(T), true, "shared store");
    proxy_generic_write(p, sizeof(T));
    *p = v;
}
template <typename T>
inline T gmem_load(const T* p) {
    if (!check_aligned<T>(p, "global load")) return T{};
    if (!check_global(p, sizeof(T), "global load")) return T{};
    return *p;
}
template <typename T>
inline void gmem_store(T* p, T v) {
    if (!check_aligned<T>(p, "global store")) return;
    if (!check_global(p, sizeof(T), "global store", true)) return;
    *p = v;
}
}  // namespace emu

using emu::gmem_load;
using emu::gmem_store;
using emu::smem_load;
using emu::smem_store;

// Dynamic shared memory, the same spelling in device and host builds (kernels use it instead
// of declaring `extern __shared__` arrays themselves).
#define RINGATTN_DYNAMIC_SMEM() (::emu::dynamic_smem())

// Atomics: correct across OS threads (blocks may run on several), built on the compiler's
// __atomic builtins; float adds by compare-and-swap on the bit pattern.
// Each checks its address as a global access.
inline float atomicAdd(float* addr, float v) {
    if (!::emu::check_global(addr, sizeof(float), "atomic add", true)) return 0.0f;
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
inline int atomicAdd(int* addr, int v) {
    if (!::emu::check_global(addr, sizeof(int), "atomic add", true)) return 0;
    return __atomic_fetch_add(addr, v, __ATOMIC_RELAXED);
}
inline unsigned atomicAdd(unsigned* addr, unsigned v) {
    if (!::emu::check_global(addr, sizeof(unsigned), "atomic add", true)) return 0;
    return __atomic_fetch_add(addr, v, __ATOMIC_RELAXED);
}
inline unsigned atomicMax(unsigned* addr, unsigned v) {
    if (!::emu::check_global(addr, sizeof(unsigned), "atomic max", true)) return 0;
    unsigned old = __atomic_load_n(addr, __ATOMIC_RELAXED);
    while (old < v && !__atomic_compare_exchange_n(addr, &old, v, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
    return old;
}

// Bit casts and conversions of the CUDA math API.
inline unsigned __float_as_uint(float x) {
    unsigned u;
    std::memcpy(&u, &x, 4);
    return u;
}
inline float __uint_as_float(unsigned u) {
    float x;
    std::memcpy(&x, &u, 4);
    return x;
}
// cvt.rni.s32.f32: to nearest, ties to even; NaN gives 0, out-of-range values saturate.
inline int __float2int_rn(float x) {
    if (std::isnan(x)) return 0;
    if (x >= 2147483648.0f) return INT32_MAX;
    if (x <= -2147483648.0f) return INT32_MIN;
    return int(std::nearbyint(x));
}

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
