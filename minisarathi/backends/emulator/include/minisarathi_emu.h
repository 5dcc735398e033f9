// minisarathi CUDA emulator: lets a .cu file compile with g++ and run on the CPU.
//
// Each CUDA thread of a block is a fiber (its own stack, switched by a hand-written x86-64 context
// switch). All fibers of a block run on one OS thread, so __shared__ is thread_local storage and
// __syncthreads / __syncwarp / __shfl_*_sync are cooperative barriers: a fiber that reaches one
// switches back to the block's scheduler, which resumes the others in the chosen order (forward,
// reverse or seeded random) and releases a barrier once every fiber it names has arrived.
// Different blocks run on different OS threads. Numerics are IEEE float on the CPU with float32
// denormals flushed to zero as under -ftz=true, not bit-exact with the GPU. cp.async copies are deferred: they land in shared memory when the issuing thread's
// wait releases their group, never earlier (see "asynchronous copies" below). Tensor-core mma.sync and
// ldmatrix are warp-collective operations (minisarathi_emu_mma.h).
// Blocks that wait for each other through a global counter (cuda/common.cuh: blocks_wait) run side by side,
// as on a GPU whose grid fits in its SMs (see "blocks that wait for each other" below).
// Not emulated: other inline PTX, wgmma, TMA, CUB, cooperative groups.
#pragma once
#ifndef MINISARATHI_EMU_H
#define MINISARATHI_EMU_H

#if !defined(__x86_64__) || !defined(__linux__)
#error "the minisarathi CUDA emulator switches fibers with x86-64 Linux assembly"
#endif

#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <link.h>
#include <dlfcn.h>
#include <mutex>
#include <string>
#include <sys/mman.h>
#include <thread>
#include <type_traits>
#include <unistd.h>
#include <vector>

// ---- CUDA keywords ------------------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
// Block-scope thread_local is implicitly static: one instance per OS thread = per running block.
#define __shared__ thread_local
#define __constant__ const

// ---- built-in variables ---------------------------------------------------------------------------
struct uint3 { unsigned int x, y, z; };
struct dim3 {
    unsigned int x, y, z;
    constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct __align__(16) float4 { float x, y, z, w; };
struct __align__(8) float2 { float x, y; };
struct __align__(16) uint4 { unsigned int x, y, z, w; };

namespace emu {

constexpr int kWarpSize = 32;
constexpr size_t kMaxDynamicSmem = 227 * 1024;   // H100/H200 opt-in maximum per block
constexpr size_t kFiberStack = 256 * 1024;       // mmap'd lazily; only touched pages cost memory
// CuPy compiles kernels with -ftz=true: float32 denormal results become zero (FTZ, MXCSR bit 15) and
// denormal operands read as zero (DAZ, bit 6). Every fiber starts with both set, and the context switch
// keeps them per fiber, so kernels see the GPU's float32 rules while the host code around them does not.
constexpr uint32_t kMxcsrFlushToZero = 0x8040;

enum class FiberState : int { Runnable, AtBlockBarrier, AtWarpBarrier, Done };

// One cp.async in flight: `bytes` land at dst, the first src_bytes read from src, the rest zeros.
struct AsyncCopy {
    unsigned char* dst;
    const unsigned char* src;
    int bytes, src_bytes;
};

struct Fiber {
    void* sp = nullptr;           // saved stack pointer while switched out
    uint3 thread_idx{};
    int linear = 0, lane = 0, warp = 0;
    FiberState state = FiberState::Runnable;
    unsigned wait_mask = 0;       // lanes named by the __syncwarp / __shfl this fiber waits in
    const char* wait_what = "";
    std::vector<AsyncCopy> uncommitted;                 // cp.async issued since the last commit_group
    std::deque<std::vector<AsyncCopy>> async_groups;    // committed groups not yet waited for, oldest first
};

struct Launch {                   // shared by all OS threads of one launch
    dim3 grid, block;
    size_t dynamic_smem = 0;
    int order = 0;                // 0 forward, 1 reverse, 2 seeded random
    bool cooperative = false;     // launched as cuLaunchCooperativeKernel: every block resident (checked by launcher.py)
    uint64_t seed = 0;
    void (*entry)(void*) = nullptr;
    void* entry_ctx = nullptr;
    std::atomic<long long> next_block{0};
    std::atomic<bool> failed{false};
    std::mutex error_lock;
    std::string error;
    // Blocks that wait for each other (blocks_wait): an arrival wakes the waiters of its counter's bucket
    // only (counters of different groups are different words); extra OS threads run the blocks a waiting
    // one needs.
    struct WaitBucket {
        std::mutex lock;
        std::condition_variable arrived;
    } wait_buckets[64];
    std::mutex workers_lock;
    std::vector<std::thread> extra_workers;
    void fail(const std::string& message) {
        std::lock_guard<std::mutex> guard(error_lock);
        if (!failed.exchange(true)) error = message;
    }
};

struct Block {                    // one running block, owned by one OS thread
    Launch* launch = nullptr;
    uint3 block_idx{};
    std::vector<Fiber>* fibers = nullptr;
    void* scheduler_sp = nullptr;
    Fiber* current = nullptr;
    bool aborted = false;
    const unsigned char* shared_begin = nullptr;   // this OS thread's __shared__ variables and smem[]
    const unsigned char* shared_end = nullptr;
    uint64_t exchange[32][kWarpSize];   // per-warp buffer that carries shuffle values between lanes
};

// The only thread_local state of the runtime; written after each block's shared memory is poisoned.
inline thread_local Block* tls_block = nullptr;

}  // namespace emu

#define threadIdx (emu::tls_block->current->thread_idx)
#define blockIdx (emu::tls_block->block_idx)
#define blockDim (emu::tls_block->launch->block)
#define gridDim (emu::tls_block->launch->grid)
#define warpSize 32

// Dynamic shared memory: every kernel names it `extern __shared__ __align__(16) unsigned char smem[];`
thread_local __attribute__((aligned(16))) unsigned char smem[emu::kMaxDynamicSmem];

// ---- context switch (System V x86-64): save callee-saved registers + MXCSR/x87 control word ----
extern "C" void minisarathi_emu_switch(void** save_sp, void* load_sp);
extern "C" void minisarathi_emu_fiber_entry();
asm(R"(
    .text
    .hidden minisarathi_emu_switch
    .globl minisarathi_emu_switch
    .type minisarathi_emu_switch, @function
minisarathi_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size minisarathi_emu_switch, .-minisarathi_emu_switch

    .hidden minisarathi_emu_fiber_entry
    .globl minisarathi_emu_fiber_entry
    .type minisarathi_emu_fiber_entry, @function
minisarathi_emu_fiber_entry:
    movq %r12, %rdi
    callq *%r13
    ud2
    .size minisarathi_emu_fiber_entry, .-minisarathi_emu_fiber_entry
)");

namespace emu {

// A fiber yields to its block's scheduler; it resumes when the scheduler switches back.
inline void yield_to_scheduler() {
    Block* b = tls_block;
    asm volatile("" ::: "memory");
    minisarathi_emu_switch(&b->current->sp, b->scheduler_sp);
    asm volatile("" ::: "memory");
}

// Errors found inside a fiber stop the whole launch; the fiber never runs again.
[[noreturn]] inline void fiber_fail(const std::string& message) {
    Block* b = tls_block;
    const uint3 t = b->current->thread_idx, blk = b->block_idx;
    char where[160];
    std::snprintf(where, sizeof where, "block (%u,%u,%u) thread (%u,%u,%u): ", blk.x, blk.y, blk.z, t.x, t.y, t.z);
    b->launch->fail(where + message);
    b->aborted = true;
    b->current->state = FiberState::Done;
    yield_to_scheduler();
    std::abort();   // unreachable: an aborted block never resumes its fibers
}

inline void block_barrier() {
    tls_block->current->state = FiberState::AtBlockBarrier;
    yield_to_scheduler();
}

inline void warp_barrier(unsigned mask, const char* what) {
    Fiber* f = tls_block->current;
    if (!(mask & (1u << f->lane)))
        fiber_fail(std::string(what) + ": the mask does not include the calling lane");
    f->state = FiberState::AtWarpBarrier;
    f->wait_mask = mask;
    f->wait_what = what;
    yield_to_scheduler();
}

// A shuffle: every lane publishes its value, all lanes of the mask meet, each reads its source lane,
// and they meet again so no lane overwrites the buffer before the others have read it.
template <typename T>
inline T shuffle(unsigned mask, T value, int src_lane, const char* what) {
    static_assert(sizeof(T) <= 8, "shuffles of types over 8 bytes are not emulated");
    Block* b = tls_block;
    Fiber* f = b->current;
    std::memcpy(&b->exchange[f->warp][f->lane], &value, sizeof(T));
    warp_barrier(mask, what);
    if (src_lane < 0 || src_lane >= kWarpSize || !(mask & (1u << src_lane)))
        src_lane = f->lane;   // CUDA: reading an inactive or out-of-range lane is undefined; keep own value
    T result;
    std::memcpy(&result, &b->exchange[f->warp][src_lane], sizeof(T));
    warp_barrier(mask, what);
    return result;
}

inline std::string fiber_name(const Fiber& f) {
    char s[64];
    std::snprintf(s, sizeof s, "(%u,%u,%u)", f.thread_idx.x, f.thread_idx.y, f.thread_idx.z);
    return s;
}

// Called on the fiber's own stack (via minisarathi_emu_fiber_entry) the first time it runs.
inline void fiber_main(Fiber* f) {
    Block* b = tls_block;
    b->launch->entry(b->launch->entry_ctx);
    bool copies_in_flight = !f->uncommitted.empty();
    for (const std::vector<AsyncCopy>& group : f->async_groups) copies_in_flight |= !group.empty();
    if (copies_in_flight)
        fiber_fail("exited with cp.async copies it never waited for (cp_async_wait); on a GPU they may land "
                   "after the block's shared memory is reused");
    f->state = FiberState::Done;
    yield_to_scheduler();
    std::abort();
}

// Releases one barrier if possible; returns false when nothing can move (deadlock).
inline bool release_barriers(Block& b, std::string& error) {
    std::vector<Fiber>& fibers = *b.fibers;
    const int n = (int)fibers.size();
    bool released = false;
    for (int w = 0; w * kWarpSize < n; ++w) {
        for (int l = 0; l < kWarpSize && w * kWarpSize + l < n; ++l) {
            Fiber& f = fibers[w * kWarpSize + l];
            if (f.state != FiberState::AtWarpBarrier) continue;
            bool all_here = true;
            for (int m = 0; m < kWarpSize; ++m) {
                if (!(f.wait_mask & (1u << m))) continue;
                const int idx = w * kWarpSize + m;
                if (idx >= n) {
                    error = std::string(f.wait_what) + " in warp " + std::to_string(w) + ": mask names lane " +
                            std::to_string(m) + " which does not exist (block size not a multiple of 32?)";
                    return false;
                }
                Fiber& g = fibers[idx];
                if (g.state == FiberState::Done) {
                    error = "thread " + fiber_name(g) + " exited while lanes of its warp wait in " + f.wait_what;
                    return false;
                }
                if (g.state == FiberState::AtWarpBarrier && g.wait_mask != f.wait_mask) {
                    error = "lanes of warp " + std::to_string(w) + " wait in " + f.wait_what + " with different masks";
                    return false;
                }
                if (g.state != FiberState::AtWarpBarrier) all_here = false;
            }
            if (all_here) {
                for (int m = 0; m < kWarpSize; ++m)
                    if (f.wait_mask & (1u << m)) fibers[w * kWarpSize + m].state = FiberState::Runnable;
                released = true;
            }
            break;   // the first waiting lane speaks for its warp
        }
    }
    if (released) return true;
    int at_block = 0, done = 0, at_warp = 0;
    const Fiber* exited = nullptr;
    const Fiber* warp_waiter = nullptr;
    for (const Fiber& f : fibers) {
        if (f.state == FiberState::AtBlockBarrier) ++at_block;
        if (f.state == FiberState::Done) { ++done; exited = &f; }
        if (f.state == FiberState::AtWarpBarrier) { ++at_warp; warp_waiter = &f; }
    }
    if (at_block > 0 && at_warp == 0 && done == 0) {
        for (Fiber& f : fibers) f.state = FiberState::Runnable;
        return true;
    }
    if (at_block > 0 && done > 0)
        error = "deadlock: thread " + fiber_name(*exited) + " exited while " + std::to_string(at_block) +
                " threads wait at __syncthreads()";
    else if (warp_waiter)
        error = std::string("deadlock: thread ") + fiber_name(*warp_waiter) + " waits in " + warp_waiter->wait_what +
                " while other threads wait at __syncthreads()";
    else
        error = "deadlock";
    return false;
}

// Poisons this OS thread's copy of the module's thread_local storage (all __shared__ variables and
// the dynamic smem array) with 0xFF bytes: NaN for float/half/bf16, -1 for integers.
struct TlsRange { void* start = nullptr; size_t size = 0; };
inline int find_tls(struct dl_phdr_info* info, size_t, void* data) {
    Dl_info self;
    if (!dladdr((void*)&find_tls, &self) || (void*)info->dlpi_addr != self.dli_fbase) return 0;
    for (int i = 0; i < info->dlpi_phnum; ++i)
        if (info->dlpi_phdr[i].p_type == PT_TLS) {
            auto* range = static_cast<TlsRange*>(data);
            range->start = info->dlpi_tls_data;
            range->size = info->dlpi_phdr[i].p_memsz;
        }
    return 1;
}
inline TlsRange module_tls() {
    tls_block = nullptr;   // touching a thread_local makes the loader allocate this thread's block
    TlsRange range;
    dl_iterate_phdr(find_tls, &range);
    return range;
}

inline uint64_t next_random(uint64_t& s) {   // xorshift64*
    s ^= s >> 12; s ^= s << 25; s ^= s >> 27;
    return s * 2685821657736338717ull;
}

// One OS thread: runs blocks taken from the launch's counter until none are left.
inline void worker(Launch* launch) {
    const int n = (int)(launch->block.x * launch->block.y * launch->block.z);
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    const size_t slot = kFiberStack + page;   // each stack has a guard page below it
    char* stacks = (char*)mmap(nullptr, slot * n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (stacks == MAP_FAILED) { launch->fail("cannot map fiber stacks"); return; }
    for (int i = 0; i < n; ++i) mprotect(stacks + i * slot, page, PROT_NONE);
    const TlsRange tls = module_tls();
    std::vector<Fiber> fibers(n);
    std::vector<int> order(n);
    const long long num_blocks = (long long)launch->grid.x * launch->grid.y * launch->grid.z;
    uint32_t mxcsr;
    asm volatile("stmxcsr %0" : "=m"(mxcsr));
    for (;;) {
        const long long id = launch->next_block.fetch_add(1);
        if (id >= num_blocks || launch->failed.load()) break;
        if (tls.start) std::memset(tls.start, 0xFF, tls.size);
        Block block;
        block.launch = launch;
        block.block_idx = {(unsigned)(id % launch->grid.x), (unsigned)(id / launch->grid.x % launch->grid.y),
                           (unsigned)(id / ((long long)launch->grid.x * launch->grid.y))};
        block.fibers = &fibers;
        block.shared_begin = (const unsigned char*)tls.start;
        block.shared_end = (const unsigned char*)tls.start + tls.size;
        tls_block = &block;
        for (int i = 0; i < n; ++i) {
            Fiber& f = fibers[i];
            f = Fiber{};
            f.linear = i;
            f.lane = i % kWarpSize;
            f.warp = i / kWarpSize;
            f.thread_idx = {(unsigned)(i % launch->block.x), (unsigned)(i / launch->block.x % launch->block.y),
                            (unsigned)(i / (launch->block.x * launch->block.y))};
            // Initial frame, read by minisarathi_emu_switch's epilogue: control words, r15..rbp, return
            // address = the entry stub, which calls r13(r12) = fiber_main(&f) with a 16-byte aligned stack.
            uint64_t* top = (uint64_t*)(stacks + (i + 1) * slot);
            uint64_t* sp = top - 10;
            sp[0] = (uint64_t)(mxcsr | kMxcsrFlushToZero) | ((uint64_t)0x037F << 32);
            sp[1] = 0; sp[2] = 0;                         // r15 r14
            sp[3] = (uint64_t)(void*)&fiber_main;         // r13
            sp[4] = (uint64_t)(void*)&f;                  // r12
            sp[5] = 0; sp[6] = 0;                         // rbx rbp
            sp[7] = (uint64_t)(void*)&minisarathi_emu_fiber_entry;
            f.sp = sp;
        }
        uint64_t rng = launch->seed * 0x9E3779B97F4A7C15ull + (uint64_t)id + 1;
        int live = n;
        std::string error;
        while (live > 0 && !block.aborted) {
            for (int i = 0; i < n; ++i) order[i] = launch->order == 1 ? n - 1 - i : i;
            if (launch->order == 2)
                for (int i = n - 1; i > 0; --i) std::swap(order[i], order[next_random(rng) % (uint64_t)(i + 1)]);
            bool ran = false;
            for (int i : order) {
                Fiber& f = fibers[i];
                if (f.state != FiberState::Runnable) continue;
                block.current = &f;
                minisarathi_emu_switch(&block.scheduler_sp, f.sp);
                ran = true;
                if (block.aborted) break;
                if (f.state == FiberState::Done) --live;
            }
            if (block.aborted || live == 0 || ran) continue;
            if (!release_barriers(block, error)) {
                char where[96];
                std::snprintf(where, sizeof where, "block (%u,%u,%u): ", block.block_idx.x, block.block_idx.y, block.block_idx.z);
                launch->fail(where + error);
                block.aborted = true;
            }
        }
        tls_block = nullptr;
        if (block.aborted) break;
    }
    munmap(stacks, slot * n);
}

// ---- blocks that wait for each other (cuda/common.cuh: blocks_arrive, blocks_wait) ------------------------
// On a GPU a CTA spinning on a global counter waits for CTAs resident on other SMs. Here blocks run to
// completion on a few OS threads, so a block that has to wait while blocks of its launch have not started
// starts one more OS thread to run them, as a GPU runs a cooperative launch's blocks all at once. Only a
// cooperative launch guarantees that (launcher.py refuses one whose grid the device cannot hold): a block
// that waits in any other launch is refused. Arrivals wake the waiters (no spinning on the CPU).
constexpr int kBlocksWaitSeconds = 300;      // then the launch fails as a deadlock

inline Launch::WaitBucket& wait_bucket(Launch* launch, const unsigned long long* counter) {
    return launch->wait_buckets[((uintptr_t)counter / sizeof(*counter)) % 64];
}

inline void blocks_arrive(unsigned long long* counter) {
    Launch::WaitBucket& bucket = wait_bucket(tls_block->launch, counter);
    {
        std::lock_guard<std::mutex> guard(bucket.lock);
        __atomic_fetch_add(counter, 1ull, __ATOMIC_SEQ_CST);
    }
    bucket.arrived.notify_all();
}

inline void blocks_wait(const unsigned long long* counter, unsigned long long target) {
    Launch* launch = tls_block->launch;
    const long long num_blocks = (long long)launch->grid.x * launch->grid.y * launch->grid.z;
    if (!launch->cooperative)
        fiber_fail("waits for other blocks, but the launch is not cooperative: on a GPU they may not all be resident, "
                   "and it may deadlock (load the module with enable_cooperative_groups)");
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(kBlocksWaitSeconds);
    Launch::WaitBucket& bucket = wait_bucket(launch, counter);
    std::unique_lock<std::mutex> lock(bucket.lock);
    while (__atomic_load_n(counter, __ATOMIC_SEQ_CST) < target) {
        const char* problem = launch->failed.load() ? "another block of the launch failed while this one waited for it"
                              : std::chrono::steady_clock::now() > deadline ? "deadlock: waited for other blocks too long"
                                                                             : nullptr;
        if (problem) {
            lock.unlock();
            fiber_fail(problem);
        }
        if (launch->next_block.load() < num_blocks) {
            std::lock_guard<std::mutex> guard(launch->workers_lock);
            launch->extra_workers.emplace_back(worker, launch);
        }
        bucket.arrived.wait_for(lock, std::chrono::milliseconds(20));
    }
}

struct LaunchArgs {               // filled by the Python launcher (ctypes mirror in launcher.py)
    unsigned grid[3], block[3];
    unsigned long long dynamic_smem;
    int order;
    int num_threads;
    unsigned long long seed;
    int cooperative;
};

inline int run(const LaunchArgs* args, void (*entry)(void*), void* ctx, char* error, int error_len) {
    Launch launch;
    launch.grid = dim3(args->grid[0], args->grid[1], args->grid[2]);
    launch.block = dim3(args->block[0], args->block[1], args->block[2]);
    launch.dynamic_smem = args->dynamic_smem;
    launch.order = args->order;
    launch.seed = args->seed;
    launch.cooperative = args->cooperative != 0;
    launch.entry = entry;
    launch.entry_ctx = ctx;
    const long long num_blocks = (long long)args->grid[0] * args->grid[1] * args->grid[2];
    const int threads = (int)std::max(1LL, std::min<long long>(args->num_threads, num_blocks));
    if (num_blocks > 0) {
        std::vector<std::thread> pool;
        for (int i = 1; i < threads; ++i) pool.emplace_back(worker, &launch);
        worker(&launch);
        for (std::thread& t : pool) t.join();
        for (;;) {   // the threads blocks_wait started, which may have started more
            std::vector<std::thread> extra;
            {
                std::lock_guard<std::mutex> guard(launch.workers_lock);
                extra.swap(launch.extra_workers);
            }
            if (extra.empty()) break;
            for (std::thread& t : extra) t.join();
        }
    }
    if (!launch.failed.load()) return 0;
    std::snprintf(error, (size_t)error_len, "%s", launch.error.c_str());
    return 1;
}

// ---- kernel entry: unpack the argument buffers into the kernel's exact parameter types ----------
template <typename... Args, size_t... I>
inline void call_kernel(void (*kernel)(Args...), void** args, std::index_sequence<I...>) {
    kernel(*static_cast<std::remove_cv_t<Args>*>(args[I])...);
}
template <typename... Args>
struct Invocation {
    void (*kernel)(Args...);
    void** args;
    static void run(void* self) {
        auto* inv = static_cast<Invocation*>(self);
        call_kernel(inv->kernel, inv->args, std::index_sequence_for<Args...>{});
    }
};
template <typename... Args>
inline int launch(void (*kernel)(Args...), const LaunchArgs* cfg, void** args, char* error, int error_len) {
    Invocation<Args...> inv{kernel, args};
    return run(cfg, &Invocation<Args...>::run, &inv, error, error_len);
}

// ---- parameter type names, checked by the Python launcher before every call --------------------
template <typename T> struct TypeName { static std::string get() { return "?"; } };
#define MINISARATHI_EMU_TYPE_NAME(T) template <> struct TypeName<T> { static std::string get() { return #T; } };
MINISARATHI_EMU_TYPE_NAME(float)
MINISARATHI_EMU_TYPE_NAME(double)
MINISARATHI_EMU_TYPE_NAME(bool)
MINISARATHI_EMU_TYPE_NAME(char)
MINISARATHI_EMU_TYPE_NAME(signed char)
MINISARATHI_EMU_TYPE_NAME(unsigned char)
MINISARATHI_EMU_TYPE_NAME(short)
MINISARATHI_EMU_TYPE_NAME(unsigned short)
MINISARATHI_EMU_TYPE_NAME(int)
MINISARATHI_EMU_TYPE_NAME(unsigned int)
MINISARATHI_EMU_TYPE_NAME(long)
MINISARATHI_EMU_TYPE_NAME(unsigned long)
MINISARATHI_EMU_TYPE_NAME(long long)
MINISARATHI_EMU_TYPE_NAME(unsigned long long)
template <typename T> struct TypeName<T*> {
    static std::string get() { return (std::is_const_v<T> ? "const " : "") + TypeName<std::remove_cv_t<T>>::get() + "*"; }
};
template <typename T> struct TypeName<const T> { static std::string get() { return TypeName<T>::get(); } };

template <typename... Args>
inline const char* signature(void (*)(Args...)) {
    static const std::string s = [] {
        std::string joined;
        ((joined += TypeName<Args>::get() + ";"), ...);
        return joined;
    }();
    return s.c_str();
}

}  // namespace emu

// ---- intrinsics ------------------------------------------------------------------------------------
inline void __syncthreads() { emu::block_barrier(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) { emu::warp_barrier(mask, "__syncwarp"); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_block() { std::atomic_thread_fence(std::memory_order_seq_cst); }

template <typename T>
inline T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
    const int lane = emu::tls_block->current->lane;
    return emu::shuffle(mask, v, (lane & ~(width - 1)) + (src & (width - 1)), "__shfl_sync");
}
template <typename T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
    const int lane = emu::tls_block->current->lane;
    int src = lane ^ lane_mask;
    if ((src & ~(width - 1)) != (lane & ~(width - 1))) src = lane;
    return emu::shuffle(mask, v, src, "__shfl_xor_sync");
}
template <typename T>
inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    const int lane = emu::tls_block->current->lane;
    int src = lane + (int)delta;
    if ((src & ~(width - 1)) != (lane & ~(width - 1))) src = lane;
    return emu::shuffle(mask, v, src, "__shfl_down_sync");
}
template <typename T>
inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    const int lane = emu::tls_block->current->lane;
    int src = lane - (int)delta;
    if (src < (lane & ~(width - 1))) src = lane;
    return emu::shuffle(mask, v, src, "__shfl_up_sync");
}
inline unsigned __ballot_sync(unsigned mask, int predicate) {
    emu::Block* b = emu::tls_block;
    emu::Fiber* f = b->current;
    b->exchange[f->warp][f->lane] = predicate ? 1 : 0;
    emu::warp_barrier(mask, "__ballot_sync");
    unsigned bits = 0;
    for (int lane = 0; lane < 32; ++lane)
        if ((mask & (1u << lane)) && b->exchange[f->warp][lane]) bits |= 1u << lane;
    emu::warp_barrier(mask, "__ballot_sync");
    return bits;
}
inline int __any_sync(unsigned mask, int predicate) { return __ballot_sync(mask, predicate) != 0; }
inline int __all_sync(unsigned mask, int predicate) { return __ballot_sync(mask, predicate) == mask; }

// Bit casts and fast-math intrinsics (glibc declares __expf & co. itself, hence macros after <cmath>).
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline long long __double_as_longlong(double d) { long long i; std::memcpy(&i, &d, 8); return i; }
inline double __longlong_as_double(long long i) { double d; std::memcpy(&d, &i, 8); return d; }
// Loads that bypass L1 (data other blocks wrote): every load reads memory here.
template <typename T> inline T __ldcg(const T* p) { return *(const volatile T*)p; }
inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
inline float __uint_as_float(unsigned i) { float f; std::memcpy(&f, &i, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned i; std::memcpy(&i, &f, 4); return i; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __saturatef(float x) { return x < 0.f ? 0.f : (x > 1.f ? 1.f : x); }
#define __expf(x) expf(x)
#define __logf(x) logf(x)
#define __sinf(x) sinf(x)
#define __cosf(x) cosf(x)
#define __powf(x, y) powf(x, y)
#define __sincosf(x, s, c) sincosf(x, s, c)
#define __fmaf_rn(a, b, c) fmaf(a, b, c)
#define __frcp_rn(x) (1.0f / (x))
using std::max;
using std::min;
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }

// Atomics: fibers of one block never run at once, but blocks run on different OS threads.
template <typename T> inline T atomicAdd(T* p, T v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline float atomicAdd(float* p, float v) {
    float old;
    __atomic_load(p, &old, __ATOMIC_SEQ_CST);
    for (;;) {
        float sum = old + v;
        if (__atomic_compare_exchange(p, &old, &sum, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) return old;
    }
}
template <typename T> inline T atomicMax(T* p, T v) {
    T old = __atomic_load_n(p, __ATOMIC_SEQ_CST);
    while (old < v && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {}
    return old;
}
template <typename T> inline T atomicCAS(T* p, T expected, T desired) {
    __atomic_compare_exchange_n(p, &expected, desired, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return expected;
}
template <typename T> inline T atomicExch(T* p, T v) { return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST); }

// ---- asynchronous copies (cp.async) -----------------------------------------------------------------
// PTX semantics, modelled strictly: a copy is issued into the thread's open group; cp.async.commit_group
// closes that group; cp.async.wait_group N returns once all but the newest N committed groups are
// complete. Only then is the data guaranteed in shared memory, and only for the issuing thread (other
// threads see it after a barrier). The emulator therefore poisons the destination with 0xFF (NaN) at
// issue and copies at the wait: a kernel that reads a stage before waiting for it, or waits for the wrong
// group, reads NaN here, as it may read stale data on a GPU.
namespace emu {

inline void cp_async(void* smem_dst, const void* global_src, int bytes, int src_bytes, const char* what) {
    Block* b = tls_block;
    auto* dst = static_cast<unsigned char*>(smem_dst);
    auto* src = static_cast<const unsigned char*>(global_src);
    if (dst < b->shared_begin || dst + bytes > b->shared_end)
        fiber_fail(std::string(what) + ": the destination is not shared memory");
    if ((uintptr_t)dst % bytes || (src_bytes > 0 && (uintptr_t)src % bytes))
        fiber_fail(std::string(what) + ": addresses must be aligned to the copy size (" + std::to_string(bytes) +
                   " bytes)");
    std::memset(dst, 0xFF, (size_t)bytes);
    b->current->uncommitted.push_back({dst, src, bytes, src_bytes});
}

inline void cp_async_commit() {
    Fiber* f = tls_block->current;
    f->async_groups.push_back(std::move(f->uncommitted));   // an empty group is legal, as in PTX
    f->uncommitted.clear();
}

inline void cp_async_wait(int newest_pending) {
    Fiber* f = tls_block->current;
    while ((int)f->async_groups.size() > newest_pending) {
        for (const AsyncCopy& c : f->async_groups.front()) {
            std::memcpy(c.dst, c.src, (size_t)c.src_bytes);
            std::memset(c.dst + c.src_bytes, 0, (size_t)(c.bytes - c.src_bytes));
        }
        f->async_groups.pop_front();
    }
}

}  // namespace emu

// ---- 16-bit floating point types, round-to-nearest-even conversions -------------------------------
struct __half {
    unsigned short bits;
    __half() = default;
    __half(float f);
    operator float() const;
};
struct __nv_bfloat16 {
    unsigned short bits;
    __nv_bfloat16() = default;
    __nv_bfloat16(float f);
    operator float() const;
};
typedef __nv_bfloat16 nv_bfloat16;
typedef __half half;

inline unsigned short emu_float_to_half_bits(float f) {
    const unsigned x = __float_as_uint(f);
    const unsigned sign = (x >> 16) & 0x8000u;
    const unsigned abs = x & 0x7fffffffu;
    if (abs >= 0x7f800000u) return (unsigned short)(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0u));
    if (abs >= 0x477ff000u) return (unsigned short)(sign | 0x7c00u);            // rounds to infinity
    if (abs < 0x38800000u) {                                                    // subnormal half or zero
        // Value in units of 2^-24, rounded to nearest even via float arithmetic (exact for these ranges).
        const float scaled = __uint_as_float(abs) * 16777216.0f;
        return (unsigned short)(sign | (unsigned)std::nearbyint(scaled));
    }
    const unsigned mant = abs + 0xfffu + ((abs >> 13) & 1u);                    // round mantissa to 10 bits
    return (unsigned short)(sign | ((mant - 0x38000000u) >> 13));
}
inline float emu_half_bits_to_float(unsigned short h) {
    const unsigned sign = (unsigned)(h & 0x8000u) << 16;
    const unsigned exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    if (exp == 0) return (sign ? -1.f : 1.f) * (float)mant * (1.0f / 16777216.0f);
    if (exp == 31) return __uint_as_float(sign | 0x7f800000u | (mant << 13));
    return __uint_as_float(sign | ((exp + 112) << 23) | (mant << 13));
}
inline unsigned short emu_float_to_bf16_bits(float f) {
    const unsigned x = __float_as_uint(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((x >> 16) | 0x40u);   // quiet NaN
    return (unsigned short)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}
inline float emu_bf16_bits_to_float(unsigned short b) { return __uint_as_float((unsigned)b << 16); }

inline __half::__half(float f) : bits(emu_float_to_half_bits(f)) {}
inline __half::operator float() const { return emu_half_bits_to_float(bits); }
inline __nv_bfloat16::__nv_bfloat16(float f) : bits(emu_float_to_bf16_bits(f)) {}
inline __nv_bfloat16::operator float() const { return emu_bf16_bits_to_float(bits); }

inline __half __float2half(float f) { return __half(f); }
inline __half __float2half_rn(float f) { return __half(f); }
inline float __half2float(__half h) { return (float)h; }
inline __nv_bfloat16 __float2bfloat16(float f) { return __nv_bfloat16(f); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16(f); }
inline float __bfloat162float(__nv_bfloat16 b) { return (float)b; }
inline __half __ushort_as_half(unsigned short bits) { __half h; h.bits = bits; return h; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short bits) { __nv_bfloat16 b; b.bits = bits; return b; }

namespace emu {
MINISARATHI_EMU_TYPE_NAME(__half)
MINISARATHI_EMU_TYPE_NAME(__nv_bfloat16)
}

#include "minisarathi_emu_mma.h"   // mma.sync and ldmatrix as warp-collective operations

#endif  // MINISARATHI_EMU_H
