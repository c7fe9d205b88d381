// msl_runtime.cpp -- executes a compiled kernel's grid with GPU semantics.
//
// Every GPU thread of a threadgroup is a fiber with its own stack.  A worker
// (OS thread) runs one threadgroup at a time: it resumes the runnable fibers
// in thread order, each one running until it blocks (at a SIMD collective or
// a threadgroup barrier) or returns.  So between two synchronisation points a
// thread runs as far as it can before the next one starts, which makes a
// missing barrier show up as a wrong result rather than hide.
//
//  * SIMD collectives: a lane deposits its value in its SIMD group's slot and
//    blocks.  When the last lane of the group arrives, all lanes are released
//    and each one reads every lane's value.  All lanes of the group must be
//    at the same call (same function, same place in the text); a lane that
//    already returned, or one waiting somewhere else, is an error.
//  * threadgroup_barrier: all threads of the threadgroup must reach the same
//    barrier; a thread that returned before it is an error.
//  * threadgroup memory is an arena per worker, reset (and filled with 0xff
//    bytes) for every threadgroup.
//  * Errors (divergence, out-of-bounds access in debug builds, a fault in
//    kernel code) abandon the launch and come back to Python as a message.
//
// Built once into a shared library by tests/msl/harness.py.
#if defined(__APPLE__)
#define _XOPEN_SOURCE 700  // ucontext on macOS
#define _DARWIN_C_SOURCE
#endif
#define MSL_SHIM_ABI_ONLY
#include "msl_shim.h"

#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#if defined(__x86_64__) && !defined(MSL_RT_USE_UCONTEXT)
#define MSL_RT_ASM_SWITCH 1
#else
#define MSL_RT_ASM_SWITCH 0
#include <ucontext.h>
#endif

#if defined(__linux__) && defined(__x86_64__)
#include <ucontext.h>
#define MSL_RT_CATCH_FAULTS 1
#else
#define MSL_RT_CATCH_FAULTS 0
#endif

namespace {

constexpr uint32_t kMaxSimd = 32;
constexpr uint32_t kSlotBytes = 64;
constexpr uint32_t kMaxThreads = 1024;
constexpr size_t kMaxThreadgroupBytes = 32768;

enum FiberState : uint8_t { kReady, kWaitSimd, kWaitBarrier, kDone };

struct Fiber {
#if MSL_RT_ASM_SWITCH
  void* sp = nullptr;
#else
  ucontext_t uc;
#endif
  char* stack_lo = nullptr;
  char* stack_hi = nullptr;
  FiberState state = kReady;
  uint32_t tid = 0, lane = 0, sg = 0;
  const char* wait_op = nullptr;
  uint32_t wait_site = 0;
  msl_thread_info info;
  msl_simd_view view;
};

struct SimdGroup {
  uint32_t exist = 0;    // lanes that exist (partial groups at the edge)
  uint32_t done = 0;     // lanes that returned
  uint32_t arrived = 0;  // lanes waiting at the current collective
  const char* op = nullptr;
  uint32_t site = 0;
  uint32_t first_lane = 0;
  uint32_t gen = 0;  // completed collectives; selects the slot buffer
  alignas(16) unsigned char slots[2][kMaxSimd][kSlotBytes];
};

struct TgEntry {
  int id;
  size_t off;
};

struct Worker {
  // fiber stacks
  char* stack_map = nullptr;
  size_t stack_map_bytes = 0;
  size_t stack_bytes = 0;
  uint32_t nstacks = 0;
  std::vector<Fiber> fibers;
  std::vector<SimdGroup> simds;
#if MSL_RT_ASM_SWITCH
  void* sched_sp = nullptr;
#else
  ucontext_t sched_uc;
#endif
  // current threadgroup
  uint32_t n = 0, ndone = 0;
  uint32_t bar_count = 0, bar_site = 0, bar_first = 0;
  const char* bar_op = nullptr;
  std::vector<unsigned char> tg_mem;
  std::vector<TgEntry> tg_entries;
  size_t tg_used = 0;
  // launch
  const msl_launch_desc* d = nullptr;
  msl_thread_fn fn = nullptr;
  bool failed = false;
  std::string err;
  // fault handling
  std::vector<char> altstack;

  ~Worker() {
    if (stack_map) munmap(stack_map, stack_map_bytes);
  }
};

thread_local Worker* tl_w = nullptr;
thread_local Fiber* tl_f = nullptr;

std::mutex g_launch_mutex;
std::vector<std::unique_ptr<Worker>> g_pool;

// --------------------------------------------------------------------------
// Context switching
// --------------------------------------------------------------------------
#if MSL_RT_ASM_SWITCH
extern "C" void msl_rt_ctx_switch(void** save_sp, void* load_sp);
extern "C" void msl_rt_ctx_trampoline();
// Saves the callee-saved registers plus MXCSR and the x87 control word on
// the current stack, stores the stack pointer, loads the other one and
// restores the same set from it.
asm(R"(
  .text
  .globl msl_rt_ctx_switch
  .hidden msl_rt_ctx_switch
  .type msl_rt_ctx_switch,@function
msl_rt_ctx_switch:
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
  .size msl_rt_ctx_switch,.-msl_rt_ctx_switch

  .globl msl_rt_ctx_trampoline
  .hidden msl_rt_ctx_trampoline
  .type msl_rt_ctx_trampoline,@function
msl_rt_ctx_trampoline:
  movq %r12, %rdi
  callq *%r13
  ud2
  .size msl_rt_ctx_trampoline,.-msl_rt_ctx_trampoline
)");
#endif

extern "C" void msl_rt_fiber_main(Fiber* f);

void fiber_init(Worker& w, Fiber& f) {
#if MSL_RT_ASM_SWITCH
  (void)w;
  uint64_t* top = reinterpret_cast<uint64_t*>(reinterpret_cast<uintptr_t>(f.stack_hi) & ~uintptr_t(15));
  uint32_t mxcsr;
  uint16_t fpcw;
  asm volatile("stmxcsr %0" : "=m"(mxcsr));
  asm volatile("fnstcw %0" : "=m"(fpcw));
  top[-1] = 0;
  top[-2] = 0;
  top[-3] = reinterpret_cast<uint64_t>(&msl_rt_ctx_trampoline);  // ret
  top[-4] = 0;                                                    // rbp
  top[-5] = 0;                                                    // rbx
  top[-6] = reinterpret_cast<uint64_t>(&f);                       // r12
  top[-7] = reinterpret_cast<uint64_t>(&msl_rt_fiber_main);       // r13
  top[-8] = 0;                                                    // r14
  top[-9] = 0;                                                    // r15
  top[-10] = uint64_t(mxcsr) | (uint64_t(fpcw) << 32);
  f.sp = &top[-10];
#else
  getcontext(&f.uc);
  f.uc.uc_stack.ss_sp = f.stack_lo;
  f.uc.uc_stack.ss_size = size_t(f.stack_hi - f.stack_lo);
  f.uc.uc_link = nullptr;
  uintptr_t p = reinterpret_cast<uintptr_t>(&f);
  makecontext(&f.uc, reinterpret_cast<void (*)()>(+[](unsigned hi, unsigned lo) {
                msl_rt_fiber_main(reinterpret_cast<Fiber*>((uintptr_t(hi) << 32) | lo));
              }),
              2, unsigned(p >> 32), unsigned(p & 0xffffffffu));
  (void)w;
#endif
}

inline void switch_to_fiber(Worker& w, Fiber& f) {
#if MSL_RT_ASM_SWITCH
  msl_rt_ctx_switch(&w.sched_sp, f.sp);
#else
  swapcontext(&w.sched_uc, &f.uc);
#endif
}

inline void switch_to_scheduler(Worker& w, Fiber& f) {
#if MSL_RT_ASM_SWITCH
  msl_rt_ctx_switch(&f.sp, w.sched_sp);
#else
  swapcontext(&f.uc, &w.sched_uc);
#endif
}

// --------------------------------------------------------------------------
// Messages
// --------------------------------------------------------------------------
std::string fmt(const char* f, ...) __attribute__((format(printf, 1, 2)));
std::string fmt(const char* f, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, f);
  vsnprintf(buf, sizeof buf, f, ap);
  va_end(ap);
  return buf;
}

// "site" is file << 28 | line << 10 | column; the harness turns the marker
// back into text naming the line and column in the kernel source.
std::string site_str(uint32_t site) {
  if (site == 0) return "(unknown place)";
  return fmt("@@site:%u@@", site);
}

std::string lanes_str(uint32_t mask) {
  std::string s;
  for (uint32_t i = 0; i < 32;) {
    if (!((mask >> i) & 1u)) {
      ++i;
      continue;
    }
    uint32_t j = i;
    while (j + 1 < 32 && ((mask >> (j + 1)) & 1u)) ++j;
    if (!s.empty()) s += ",";
    s += (i == j) ? fmt("%u", i) : fmt("%u-%u", i, j);
    i = j + 1;
  }
  return s.empty() ? "none" : s;
}

std::string where(const Fiber* f) {
  if (!f) return "";
  const msl_thread_info& t = f->info;
  return fmt(
      " [thread_position_in_grid=(%u,%u,%u) threadgroup_position_in_grid=(%u,%u,%u) "
      "thread_index_in_threadgroup=%u simdgroup=%u lane=%u]",
      t.thread_position_in_grid[0], t.thread_position_in_grid[1], t.thread_position_in_grid[2],
      t.threadgroup_position_in_grid[0], t.threadgroup_position_in_grid[1],
      t.threadgroup_position_in_grid[2], t.thread_index_in_threadgroup, f->sg, f->lane);
}

// Record the error and leave the fiber for good.
[[noreturn]] void fail_here(const std::string& msg) {
  Worker* w = tl_w;
  Fiber* f = tl_f;
  if (!w || !f) {
    fprintf(stderr, "msl runtime: %s (outside a kernel thread)\n", msg.c_str());
    abort();
  }
  if (!w->failed) {
    w->failed = true;
    w->err = msg + where(f);
  }
  f->state = kDone;
  switch_to_scheduler(*w, *f);
  abort();  // never resumed
}

void block(Worker& w, Fiber& f) { switch_to_scheduler(w, f); }

}  // namespace

// --------------------------------------------------------------------------
// Entry points used by kernel code
// --------------------------------------------------------------------------
extern "C" void msl_rt_fail(const char* message) { fail_here(message); }

extern "C" void msl_rt_fail_oob(const char* buffer, const void* addr, size_t size,
                                const char* lo, const char* hi) {
  const char* a = static_cast<const char*>(addr);
  long long off = static_cast<long long>(a - lo);
  long long n = static_cast<long long>(hi - lo);
  std::string idx;
  if (size > 0 && off % static_cast<long long>(size) == 0) {
    long long e = off / static_cast<long long>(size);
    idx = fmt("element %lld of a buffer of %lld element(s) of %zu bytes", e,
              n / static_cast<long long>(size), size);
  } else {
    idx = fmt("bytes [%lld, %lld) of a buffer of %lld bytes", off, off + (long long)size, n);
  }
  fail_here(fmt("out-of-bounds access to buffer '%s': %s", buffer ? buffer : "?", idx.c_str()));
}

extern "C" const msl_simd_view* msl_rt_simd(const char* op, uint32_t site, const void* value,
                                            uint32_t size) {
  Worker& w = *tl_w;
  Fiber& f = *tl_f;
  SimdGroup& s = w.simds[f.sg];
  uint32_t bit = 1u << f.lane;
  if (s.done) {
    fail_here(fmt("%s at %s reached by lane %u while lane(s) %s of SIMD group %u already "
                  "returned (divergent SIMD collective: all lanes must take part)",
                  op, site_str(site).c_str(), f.lane, lanes_str(s.done).c_str(), f.sg));
  }
  if (s.arrived == 0) {
    s.op = op;
    s.site = site;
    s.first_lane = f.lane;
  } else if (s.site != site || strcmp(s.op, op) != 0) {
    fail_here(fmt("divergent SIMD collective: lane %u calls %s at %s while lane(s) %s of "
                  "SIMD group %u wait in %s at %s",
                  f.lane, op, site_str(site).c_str(), lanes_str(s.arrived).c_str(), f.sg, s.op,
                  site_str(s.site).c_str()));
  }
  uint32_t parity = s.gen & 1u;
  if (size) memcpy(s.slots[parity][f.lane], value, size);
  f.view.slots = &s.slots[parity][0][0];
  f.view.active = s.exist;
  f.view.lane = f.lane;
  f.view.width = w.d->simd_width;
  f.view.slot_bytes = kSlotBytes;
  f.wait_op = op;
  f.wait_site = site;
  f.state = kWaitSimd;
  s.arrived |= bit;
  if (s.arrived == s.exist) {
    uint32_t base = f.sg * w.d->simd_width;
    for (uint32_t l = 0; l < w.d->simd_width; ++l) {
      if ((s.exist >> l) & 1u) w.fibers[base + l].state = kReady;
    }
    s.arrived = 0;
    s.gen++;
  }
  block(w, f);
  return &f.view;
}

extern "C" void msl_rt_barrier(const char* op, uint32_t site) {
  Worker& w = *tl_w;
  Fiber& f = *tl_f;
  if (w.ndone) {
    fail_here(fmt("%s at %s reached while %u thread(s) of the threadgroup already returned "
                  "(every thread of the threadgroup must reach the barrier)",
                  op, site_str(site).c_str(), w.ndone));
  }
  if (w.bar_count == 0) {
    w.bar_op = op;
    w.bar_site = site;
    w.bar_first = f.tid;
  } else if (w.bar_site != site) {
    fail_here(fmt("divergent barriers: thread %u is at %s %s while %u thread(s) (first: "
                  "thread %u) wait at %s %s",
                  f.tid, op, site_str(site).c_str(), w.bar_count, w.bar_first, w.bar_op,
                  site_str(w.bar_site).c_str()));
  }
  f.wait_op = op;
  f.wait_site = site;
  f.state = kWaitBarrier;
  if (++w.bar_count == w.n) {
    for (uint32_t i = 0; i < w.n; ++i) w.fibers[i].state = kReady;
    w.bar_count = 0;
  }
  block(w, f);
}

extern "C" void* msl_rt_tg_alloc(int id, size_t size, size_t align) {
  Worker& w = *tl_w;
  for (const TgEntry& e : w.tg_entries) {
    if (e.id == id) return w.tg_mem.data() + e.off;
  }
  if (align < 16) align = 16;
  size_t off = (w.tg_used + align - 1) / align * align;
  if (off + size > kMaxThreadgroupBytes) {
    fail_here(fmt("threadgroup memory: %zu bytes in use, %zu more requested; Apple GPUs "
                  "allow %zu bytes per threadgroup",
                  w.tg_used, size, kMaxThreadgroupBytes));
  }
  memset(w.tg_mem.data() + off, 0xff, size);
  w.tg_entries.push_back(TgEntry{id, off});
  w.tg_used = off + size;
  return w.tg_mem.data() + off;
}

// -fsanitize=bounds (debug builds) reports out-of-range indexing of arrays
// whose size the compiler knows (thread-local and threadgroup arrays) here.
namespace {
struct UbsanLoc {
  const char* file;
  uint32_t line, column;
};
struct UbsanType {
  uint16_t kind, info;
  char name[1];
};
struct UbsanOob {
  UbsanLoc loc;
  const UbsanType* array_type;
  const UbsanType* index_type;
};
long long ubsan_index(const UbsanType* t, void* handle) {
  unsigned bits = 1u << (t->info >> 1);
  bool is_signed = t->info & 1;
  uint64_t raw = bits <= 64 ? reinterpret_cast<uint64_t>(handle) : 0;
  if (bits > 64) return -1;
  if (bits < 64 && is_signed) {
    uint64_t sign = 1ull << (bits - 1);
    raw &= (sign << 1) - 1;
    return static_cast<long long>((raw ^ sign) - sign);
  }
  return static_cast<long long>(raw);
}
}  // namespace

extern "C" MSL_RT_API void __ubsan_handle_out_of_bounds(void* data, void* index) {
  auto* d = static_cast<UbsanOob*>(data);
  std::string msg = fmt("out-of-bounds index %lld into array of type %s at %s:%u:%u",
                        ubsan_index(d->index_type, index), d->array_type->name, d->loc.file,
                        d->loc.line, d->loc.column);
  if (tl_f) fail_here(msg);
  fprintf(stderr, "msl runtime: %s\n", msg.c_str());
}
extern "C" MSL_RT_API void __ubsan_handle_out_of_bounds_abort(void* data, void* index) {
  __ubsan_handle_out_of_bounds(data, index);
  abort();
}

// --------------------------------------------------------------------------
// Fibers and threadgroups
// --------------------------------------------------------------------------
extern "C" void msl_rt_fiber_main(Fiber* f) {
  Worker& w = *tl_w;
  w.fn(w.d, &f->info);
  // The thread returned.
  SimdGroup& s = w.simds[f->sg];
  f->state = kDone;
  w.ndone++;
  s.done |= 1u << f->lane;
  if (s.arrived) {
    fail_here(fmt("lane %u returned while lane(s) %s of SIMD group %u wait in %s at %s "
                  "(divergent SIMD collective: all lanes must take part)",
                  f->lane, lanes_str(s.arrived).c_str(), f->sg, s.op, site_str(s.site).c_str()));
  }
  if (w.bar_count) {
    fail_here(fmt("thread %u returned while %u thread(s) wait at %s %s (every thread of "
                  "the threadgroup must reach the barrier)",
                  f->tid, w.bar_count, w.bar_op, site_str(w.bar_site).c_str()));
  }
  switch_to_scheduler(w, *f);
  abort();
}

namespace {

bool ensure_stacks(Worker& w, uint32_t n, size_t stack_bytes) {
  size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  stack_bytes = (stack_bytes + page - 1) / page * page;
  if (w.stack_map && w.nstacks >= n && w.stack_bytes == stack_bytes) return true;
  if (w.stack_map) munmap(w.stack_map, w.stack_map_bytes);
  w.stack_map = nullptr;
  size_t per = stack_bytes + page;  // one guard page below each stack
  size_t total = per * n;
  void* m = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                 -1, 0);
  if (m == MAP_FAILED) return false;
  w.stack_map = static_cast<char*>(m);
  w.stack_map_bytes = total;
  w.stack_bytes = stack_bytes;
  w.nstacks = n;
  for (uint32_t i = 0; i < n; ++i) mprotect(w.stack_map + i * per, page, PROT_NONE);
  w.fibers.resize(n);
  for (uint32_t i = 0; i < n; ++i) {
    w.fibers[i].stack_lo = w.stack_map + i * per + page;
    w.fibers[i].stack_hi = w.fibers[i].stack_lo + stack_bytes;
  }
  return true;
}

std::string deadlock_report(Worker& w) {
  std::string s = "deadlock: no thread of the threadgroup can make progress;";
  if (w.bar_count) {
    s += fmt(" %u thread(s) wait at %s %s;", w.bar_count, w.bar_op, site_str(w.bar_site).c_str());
  }
  for (size_t g = 0; g < w.simds.size(); ++g) {
    const SimdGroup& sg = w.simds[g];
    if (sg.arrived) {
      s += fmt(" lane(s) %s of SIMD group %zu wait in %s at %s;", lanes_str(sg.arrived).c_str(), g,
               sg.op, site_str(sg.site).c_str());
    }
  }
  s += " (a barrier or SIMD collective reached by only part of its threads)";
  return s;
}

// Runs threadgroup (gx, gy, gz).  Returns false on error (w.err is set).
bool run_group(Worker& w, uint32_t gx, uint32_t gy, uint32_t gz) {
  const msl_launch_desc& d = *w.d;
  const uint32_t W = d.simd_width;
  uint32_t g[3] = {gx, gy, gz};
  uint32_t dims[3], ngroups[3];
  for (int i = 0; i < 3; ++i) {
    ngroups[i] = (d.grid[i] + d.tg[i] - 1) / d.tg[i];
    uint32_t start = g[i] * d.tg[i];
    dims[i] = d.grid[i] - start < d.tg[i] ? d.grid[i] - start : d.tg[i];
  }
  uint32_t n = dims[0] * dims[1] * dims[2];
  uint32_t full = d.tg[0] * d.tg[1] * d.tg[2];
  uint32_t nsg = (n + W - 1) / W;
  w.n = n;
  w.ndone = 0;
  w.bar_count = 0;
  w.tg_entries.clear();
  w.tg_used = 0;
  w.simds.resize(nsg);
  for (uint32_t s = 0; s < nsg; ++s) {
    SimdGroup& sg = w.simds[s];
    uint32_t lanes = n - s * W < W ? n - s * W : W;
    sg.exist = lanes >= 32 ? 0xffffffffu : ((1u << lanes) - 1u);
    sg.done = sg.arrived = 0;
    sg.gen = 0;
    sg.op = nullptr;
  }
  for (uint32_t t = 0; t < n; ++t) {
    Fiber& f = w.fibers[t];
    msl_thread_info& ti = f.info;
    uint32_t lx = t % dims[0], ly = (t / dims[0]) % dims[1], lz = t / (dims[0] * dims[1]);
    uint32_t l[3] = {lx, ly, lz};
    for (int i = 0; i < 3; ++i) {
      ti.thread_position_in_threadgroup[i] = l[i];
      ti.threadgroup_position_in_grid[i] = g[i];
      ti.thread_position_in_grid[i] = g[i] * d.tg[i] + l[i];
      ti.threads_per_threadgroup[i] = dims[i];
      ti.dispatch_threads_per_threadgroup[i] = d.tg[i];
      ti.threads_per_grid[i] = d.grid[i];
      ti.threadgroups_per_grid[i] = ngroups[i];
      ti.grid_origin[i] = 0;
    }
    ti.thread_index_in_threadgroup = t;
    ti.thread_index_in_simdgroup = t % W;
    ti.simdgroup_index_in_threadgroup = t / W;
    ti.simdgroups_per_threadgroup = nsg;
    ti.threads_per_simdgroup = W;
    ti.thread_execution_width = W;
    ti.thread_index_in_quadgroup = t % 4;
    ti.quadgroup_index_in_threadgroup = t / 4;
    ti.quadgroups_per_threadgroup = (n + 3) / 4;
    ti.dispatch_simdgroups_per_threadgroup = (full + W - 1) / W;
    ti.dispatch_quadgroups_per_threadgroup = (full + 3) / 4;
    f.tid = t;
    f.lane = t % W;
    f.sg = t / W;
    f.state = kReady;
    f.wait_op = nullptr;
    fiber_init(w, f);
  }
  const bool reverse = d.schedule == 1;
  while (w.ndone < n) {
    bool ran = false;
    for (uint32_t k = 0; k < n; ++k) {
      Fiber& f = w.fibers[reverse ? n - 1 - k : k];
      if (f.state != kReady) continue;
      ran = true;
      tl_f = &f;
      switch_to_fiber(w, f);
      tl_f = nullptr;
      if (w.failed) return false;
    }
    if (!ran && w.ndone < n) {
      w.failed = true;
      w.err = deadlock_report(w);
      return false;
    }
  }
  return true;
}

// --------------------------------------------------------------------------
// Faults in kernel code (x86-64 Linux): turn SIGSEGV/SIGBUS/SIGFPE raised by
// a kernel thread into an error for that launch instead of a dead process.
// --------------------------------------------------------------------------
#if MSL_RT_CATCH_FAULTS
struct sigaction g_old_segv, g_old_bus, g_old_fpe;
thread_local const void* tl_fault_addr = nullptr;
thread_local int tl_fault_sig = 0;
thread_local bool tl_fault_guard = false;

extern "C" void msl_rt_fault_continue() {
  const char* what = tl_fault_sig == SIGFPE ? "arithmetic fault (integer division by zero?)"
                     : tl_fault_sig == SIGBUS ? "bus error"
                                              : "segmentation fault";
  std::string msg = fmt("%s in kernel code at address %p", what, tl_fault_addr);
  if (tl_fault_guard) {
    msg += " (stack overflow: the GPU thread's stack is too small; set MLX_SPEC_MSL_STACK_KB)";
  } else if (tl_fault_sig != SIGFPE) {
    msg += " (run with debug=True / MLX_SPEC_MSL_DEBUG=1 to bounds-check buffers)";
  }
  fail_here(msg);
}

void chain(int sig, siginfo_t* si, void* uc) {
  struct sigaction* old = sig == SIGSEGV ? &g_old_segv : sig == SIGBUS ? &g_old_bus : &g_old_fpe;
  if (old->sa_flags & SA_SIGINFO) {
    if (old->sa_sigaction) {
      old->sa_sigaction(sig, si, uc);
      return;
    }
  } else if (old->sa_handler != SIG_DFL && old->sa_handler != SIG_IGN) {
    old->sa_handler(sig);
    return;
  }
  signal(sig, SIG_DFL);  // the fault repeats and takes the default action
}

void fault_handler(int sig, siginfo_t* si, void* ucv) {
  Fiber* f = tl_f;
  if (!f || !tl_w) {
    chain(sig, si, ucv);
    return;
  }
  tl_fault_sig = sig;
  tl_fault_addr = si->si_addr;
  ucontext_t* uc = static_cast<ucontext_t*>(ucv);
  const char* a = static_cast<const char*>(si->si_addr);
  const char* sp = reinterpret_cast<const char*>(uc->uc_mcontext.gregs[REG_RSP]);
  size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  tl_fault_guard = (a < f->stack_lo && a >= f->stack_lo - page) ||
                   (sp < f->stack_lo + 256 && sp > f->stack_lo - (64u << 20));
  // Resume the fiber in msl_rt_fault_continue at the top of its own stack;
  // its frames are abandoned.
  uintptr_t top = (reinterpret_cast<uintptr_t>(f->stack_hi) & ~uintptr_t(15)) - 256;
  uc->uc_mcontext.gregs[REG_RSP] = static_cast<greg_t>(top - 8);
  uc->uc_mcontext.gregs[REG_RIP] = reinterpret_cast<greg_t>(&msl_rt_fault_continue);
}

void install_fault_handlers() {
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = fault_handler;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGSEGV, &sa, &g_old_segv);
  sigaction(SIGBUS, &sa, &g_old_bus);
  sigaction(SIGFPE, &sa, &g_old_fpe);
}
void restore_fault_handlers() {
  sigaction(SIGSEGV, &g_old_segv, nullptr);
  sigaction(SIGBUS, &g_old_bus, nullptr);
  sigaction(SIGFPE, &g_old_fpe, nullptr);
}
#endif

struct AltStack {
#if MSL_RT_CATCH_FAULTS
  stack_t old;
  bool set = false;
  explicit AltStack(Worker& w) {
    if (w.altstack.empty()) w.altstack.resize(64 * 1024);
    stack_t ss;
    ss.ss_sp = w.altstack.data();
    ss.ss_size = w.altstack.size();
    ss.ss_flags = 0;
    set = sigaltstack(&ss, &old) == 0;
  }
  ~AltStack() {
    if (set) sigaltstack(&old, nullptr);
  }
#else
  explicit AltStack(Worker&) {}
#endif
};

}  // namespace

extern "C" int msl_rt_launch(const msl_launch_desc* d, msl_thread_fn fn, char* err,
                             size_t err_cap) {
  auto set_err = [&](const std::string& m) {
    if (err && err_cap) {
      size_t k = m.size() < err_cap - 1 ? m.size() : err_cap - 1;
      memcpy(err, m.data(), k);
      err[k] = 0;
    }
  };
  std::lock_guard<std::mutex> lock(g_launch_mutex);
  if (d->simd_width == 0 || d->simd_width > kMaxSimd) {
    set_err(fmt("unsupported SIMD width %u", d->simd_width));
    return 1;
  }
  uint64_t tg_threads = uint64_t(d->tg[0]) * d->tg[1] * d->tg[2];
  if (tg_threads == 0 || tg_threads > kMaxThreads) {
    set_err(fmt("threadgroup (%u,%u,%u) has %llu threads; it must have 1 to %u", d->tg[0],
                d->tg[1], d->tg[2], (unsigned long long)tg_threads, kMaxThreads));
    return 1;
  }
  uint64_t ng[3], total = 1;
  for (int i = 0; i < 3; ++i) {
    ng[i] = (uint64_t(d->grid[i]) + d->tg[i] - 1) / d->tg[i];
    total *= ng[i];
  }
  if (total == 0) return 0;
  uint32_t nworkers = d->workers ? d->workers : 1;
  if (nworkers > 64) nworkers = 64;
  if (nworkers > total) nworkers = static_cast<uint32_t>(total);
  while (g_pool.size() < nworkers) g_pool.emplace_back(new Worker());

  std::atomic<uint64_t> next{0};
  std::atomic<bool> stop{false};
  std::mutex err_mutex;
  std::string first_err;

  auto work = [&](Worker& w) {
    tl_w = &w;
    w.d = d;
    w.fn = fn;
    w.failed = false;
    w.err.clear();
    if (w.tg_mem.size() < kMaxThreadgroupBytes) w.tg_mem.resize(kMaxThreadgroupBytes);
    if (!ensure_stacks(w, static_cast<uint32_t>(tg_threads), d->stack_bytes)) {
      std::lock_guard<std::mutex> g(err_mutex);
      if (first_err.empty()) first_err = "could not allocate fiber stacks";
      stop = true;
      tl_w = nullptr;
      return;
    }
    AltStack alt(w);
    while (!stop.load(std::memory_order_relaxed)) {
      uint64_t i = next.fetch_add(1);
      if (i >= total) break;
      uint32_t gx = static_cast<uint32_t>(i % ng[0]);
      uint32_t gy = static_cast<uint32_t>((i / ng[0]) % ng[1]);
      uint32_t gz = static_cast<uint32_t>(i / (ng[0] * ng[1]));
      if (!run_group(w, gx, gy, gz)) {
        std::lock_guard<std::mutex> g(err_mutex);
        if (first_err.empty()) first_err = w.err;
        stop = true;
        break;
      }
    }
    tl_w = nullptr;
  };

#if MSL_RT_CATCH_FAULTS
  install_fault_handlers();
#endif
  std::vector<std::thread> threads;
  for (uint32_t k = 1; k < nworkers; ++k) threads.emplace_back(work, std::ref(*g_pool[k]));
  work(*g_pool[0]);
  for (auto& t : threads) t.join();
#if MSL_RT_CATCH_FAULTS
  restore_fault_handlers();
#endif
  if (!first_err.empty()) {
    set_err(first_err);
    return 1;
  }
  return 0;
}
