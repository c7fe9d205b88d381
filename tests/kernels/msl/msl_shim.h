// msl_shim.h -- a C++17 stand-in for the subset of the Metal Shading Language
// that MLX custom kernels (mx.fast.metal_kernel) use.
//
// Kernel bodies are compiled as ordinary C++ against this header and run by
// msl_runtime.cpp, which executes every GPU thread as a fiber so that SIMD
// collectives and threadgroup barriers behave like they do on the GPU.  See
// tests/msl/README.md for the supported subset and its limits.
//
// The file has two parts:
//   * the ABI shared with the runtime (plain C structs and functions), always;
//   * the MSL vocabulary (types, math, simd_*, atomics, address spaces),
//     unless MSL_SHIM_ABI_ONLY is defined (the runtime defines it), split
//     by concept into msl_shim_types.h, msl_shim_vec.h, msl_shim_math.h,
//     msl_shim_dptr.h and msl_shim_sync.h (included below, in that order).
#ifndef MLX_SPEC_MSL_SHIM_H
#define MLX_SPEC_MSL_SHIM_H

#include <stddef.h>
#include <stdint.h>

#include <type_traits>

// ---------------------------------------------------------------------------
// ABI between generated kernels, the runtime and the Python harness.
// ---------------------------------------------------------------------------
extern "C" {

typedef struct msl_launch_desc {
  uint32_t grid[3];       // threads, like dispatchThreads
  uint32_t tg[3];         // threadgroup size (already clipped to the grid)
  uint32_t nargs;         // entries in args / lo / hi
  uint32_t workers;       // OS threads running threadgroups
  uint32_t schedule;      // 0: threads in index order, 1: reverse order
  uint32_t simd_width;    // lanes per SIMD group (32 on Apple GPUs)
  uint64_t stack_bytes;   // stack size of each GPU thread
  void* const* args;      // one pointer per kernel parameter
  const char* const* lo;  // first valid byte of each buffer (debug checks)
  const char* const* hi;  // one past the last valid byte
} msl_launch_desc;

typedef struct msl_thread_info {
  uint32_t thread_position_in_grid[3];
  uint32_t thread_position_in_threadgroup[3];
  uint32_t threadgroup_position_in_grid[3];
  uint32_t threads_per_threadgroup[3];
  uint32_t dispatch_threads_per_threadgroup[3];
  uint32_t threads_per_grid[3];
  uint32_t threadgroups_per_grid[3];
  uint32_t grid_origin[3];
  uint32_t thread_index_in_threadgroup;
  uint32_t thread_index_in_simdgroup;
  uint32_t simdgroup_index_in_threadgroup;
  uint32_t simdgroups_per_threadgroup;
  uint32_t threads_per_simdgroup;
  uint32_t thread_execution_width;
  uint32_t thread_index_in_quadgroup;
  uint32_t quadgroup_index_in_threadgroup;
  uint32_t quadgroups_per_threadgroup;
  uint32_t dispatch_simdgroups_per_threadgroup;
  uint32_t dispatch_quadgroups_per_threadgroup;
} msl_thread_info;

// What a lane sees after a SIMD collective: every lane's contribution.
typedef struct msl_simd_view {
  const unsigned char* slots;  // width slots of slot_bytes bytes each
  uint32_t active;             // bit i set: lane i took part
  uint32_t lane;               // the caller's lane
  uint32_t width;              // SIMD width
  uint32_t slot_bytes;
} msl_simd_view;

typedef void (*msl_thread_fn)(const msl_launch_desc*, const msl_thread_info*);

#define MSL_RT_API __attribute__((visibility("default")))

// Runtime entry points (msl_runtime.cpp).  `site` packs where the call is in
// the kernel text: file (0 source, 1 header) << 28 | line << 10 | column.
MSL_RT_API const msl_simd_view* msl_rt_simd(const char* op, uint32_t site,
                                 const void* value, uint32_t size);
MSL_RT_API void msl_rt_barrier(const char* op, uint32_t site);
MSL_RT_API void* msl_rt_tg_alloc(int id, size_t size, size_t align);
MSL_RT_API void msl_rt_fail(const char* message) __attribute__((noreturn));
MSL_RT_API void msl_rt_fail_oob(const char* buffer, const void* addr, size_t size,
                     const char* lo, const char* hi)
    __attribute__((noreturn));
MSL_RT_API int msl_rt_launch(const msl_launch_desc* d, msl_thread_fn fn, char* err,
                  size_t err_cap);
}  // extern "C"

#ifndef MSL_SHIM_ABI_ONLY

#include "msl_shim_types.h"
#include "msl_shim_vec.h"
#include "msl_shim_math.h"
#include "msl_shim_dptr.h"
#include "msl_shim_sync.h"


// Constants from metal_stdlib.
#define MAXFLOAT __FLT_MAX__
#define FLT_MAX __FLT_MAX__
#define FLT_MIN __FLT_MIN__
#define FLT_EPSILON __FLT_EPSILON__
#define HALF_MAX 65504.0f
#define HALF_MIN 6.103515625e-05f
#define INFINITY __builtin_inff()
#define HUGE_VALF __builtin_inff()
#define NAN __builtin_nanf("")
#define M_E_F 2.71828182845904523536f
#define M_LOG2E_F 1.44269504088896340736f
#define M_LOG10E_F 0.434294481903251827651f
#define M_LN2_F 0.693147180559945309417f
#define M_LN10_F 2.30258509299404568402f
#define M_PI_F 3.14159265358979323846f
#define M_PI_2_F 1.57079632679489661923f
#define M_PI_4_F 0.785398163397448309616f
#define M_1_PI_F 0.318309886183790671538f
#define M_2_PI_F 0.636619772367581343076f
#define M_2_SQRTPI_F 1.12837916709551257390f
#define M_SQRT2_F 1.41421356237309504880f
#define M_SQRT1_2_F 0.707106781186547524401f

// Address spaces and kernel-language keywords: no meaning on the CPU.  These
// come last so that no system header sees them.
#define device
#define constant
#define thread
#define threadgroup
#define threadgroup_imageblock
#define ray_data
#define object_data
#define METAL_FUNC inline
#define METAL_PRAGMA_UNROLL

#endif  // MSL_SHIM_ABI_ONLY
#endif  // MLX_SPEC_MSL_SHIM_H
