// The planner's CUDA kernels and their launchers, shared by the XLA FFI handlers (plan_cuda.cu)
// and the benchmark library (plan_cuda_bench.cu), which are built as separate libraries. CUDA
// only: include it from one .cu file of each library.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "plan_call.h"
#include "planner.h"
#include "planner_parallel.h"

namespace ultraep::cuda {

constexpr int kThreads = 256;  // threads per block (one block per plan)

// All threads sum the expert totals (coalesced: neighbouring threads read neighbouring experts of
// a row), then thread 0 runs the sequential rest of the core.
__global__ void __launch_bounds__(kThreads) plan_kernel(ultraep::PlanCall c) {
  const int64_t i = blockIdx.x;
  if (i >= c.count) return;
  const ultraep::PlanDims& d = c.dims;
  const int32_t* plan_loads = c.loads_of(i);
  int64_t* ws = c.workspace_of(i);
  int64_t* load_e = ultraep::detail::Workspace(ws, d).load_e;
  int32_t sign = 0;
  for (int64_t e = threadIdx.x; e < d.E; e += blockDim.x) {
    int64_t sum = 0;
    for (int64_t r = 0; r < d.R; ++r) {
      const int32_t v = plan_loads[r * d.E + e];
      sign |= v;
      sum += v;
    }
    load_e[e] = sum;
  }
  const int negative = __syncthreads_or(sign < 0);
  if (threadIdx.x != 0) return;
  ultraep::plan_from_totals(d, c.options, negative != 0, c.out_of(i), ws);
}

// ---------------------------------------------------------------------------------------------
// The parallel form's lanes and block on the device (the host's are in planner_parallel.h).

namespace par = ultraep::par;
constexpr unsigned kFullMask = 0xffffffffu;

// The largest 64-bit key of the warp, in every lane: two 32-bit redux instructions (the high
// halves' maximum, then the low halves' among the lanes that hold it) where the device has them.
__device__ uint64_t warp_max(uint64_t v) {
#if __CUDA_ARCH__ >= 800
  const unsigned hi = __reduce_max_sync(kFullMask, static_cast<unsigned>(v >> 32));
  const unsigned lo = __reduce_max_sync(
      kFullMask, static_cast<unsigned>(v >> 32) == hi ? static_cast<unsigned>(v) : 0u);
  return (static_cast<uint64_t>(hi) << 32) | lo;
#else
  for (int dist = par::kLanes / 2; dist > 0; dist /= 2) {
    const uint64_t o = __shfl_xor_sync(kFullMask, v, dist);
    v = v > o ? v : o;
  }
  return v;
#endif
}

// The warp's sum, in every lane.
__device__ int64_t warp_sum(int64_t v) {
  for (int dist = par::kLanes / 2; dist > 0; dist /= 2) v += __shfl_xor_sync(kFullMask, v, dist);
  return v;
}

__device__ int lane_id() { return static_cast<int>(threadIdx.x) % par::kLanes; }
__device__ int warp_id() { return static_cast<int>(threadIdx.x) / par::kLanes; }

// One warp's lanes: lane l takes indices l, l + 32, ... (the HostLanes interface). Every lane
// runs the scalar code with the same values (each reduction ends in every lane); lane 0 writes.
struct DeviceLanes {
  __device__ bool leader() const { return lane_id() == 0; }
  __device__ void sync() const { __syncwarp(); }

  template <class F>
  __device__ void for_each(int64_t n, const F& f) const {
    for (int64_t i = lane_id(); i < n; i += par::kLanes) f(i);
  }
  template <class F>
  __device__ uint64_t max_key(int64_t n, const F& key) const {
    uint64_t v = 0;
    for (int64_t i = lane_id(); i < n; i += par::kLanes) {
      const uint64_t k = key(i);
      v = v > k ? v : k;
    }
    return warp_max(v);
  }
  template <class F>
  __device__ int64_t sum(int64_t n, const F& f) const {
    int64_t v = 0;
    for (int64_t i = lane_id(); i < n; i += par::kLanes) v += f(i);
    return warp_sum(v);
  }
};

// The block (the HostBlock interface): n_warps warps, each warp's state in dynamic shared memory.
struct DeviceBlock {
  int n_warps;
  int32_t* memory;  // n_warps warp states of warp_state_elems entries each (shared)
  ultraep::PlanDims d;
  int64_t* scratch;  // [kMaxWarps] (shared): the warps' partial values of a block reduction
  int64_t* result;   // [kMaxWarps] (shared): what each warp of a round reports

  __device__ int warps() const { return n_warps; }
  __device__ void sync() const { __syncthreads(); }
  __device__ par::WarpState state(int w) const {
    return par::WarpState(memory + w * par::warp_state_elems(d), d);
  }
  __device__ int64_t* results() const { return result; }

  template <class F>
  __device__ void for_each(int64_t n, const F& f) const {
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) f(i);
  }
  template <class F>
  __device__ bool any(int64_t n, const F& pred) const {
    bool v = false;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) v |= pred(i);
    return __syncthreads_or(v) != 0;
  }
  // The block's sum (max) of the warps' values; `max` reduces values >= 0.
  __device__ int64_t combine(int64_t v, bool max) const {
    if (lane_id() == 0) scratch[warp_id()] = v;
    __syncthreads();
    int64_t all = 0;
    for (int w = 0; w < n_warps; ++w)
      all = max ? (all > scratch[w] ? all : scratch[w]) : all + scratch[w];
    __syncthreads();  // read before a later reduction writes scratch again
    return all;
  }
  template <class F>
  __device__ int64_t sum(int64_t n, const F& f) const {
    int64_t v = 0;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) v += f(i);
    return combine(warp_sum(v), false);
  }
  template <class F>
  __device__ int64_t max(int64_t n, const F& f) const {
    uint64_t v = 0;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
      const uint64_t x = static_cast<uint64_t>(f(i));
      v = v > x ? v : x;
    }
    return combine(static_cast<int64_t>(warp_max(v)), true);
  }
  template <class F>
  __device__ void for_warps(int64_t m, const F& f) const {
    if (warp_id() < m) f(warp_id(), DeviceLanes{}, state(warp_id()));
    __syncthreads();
  }
};

// One block of parallel_warps(dims) warps per plan, running the parallel form.
__global__ void __launch_bounds__(par::kMaxWarps* par::kLanes)
    parallel_plan_kernel(ultraep::PlanCall c, int warps) {
  extern __shared__ int32_t warp_memory[];
  __shared__ int64_t scratch[par::kMaxWarps], result[par::kMaxWarps];
  const int64_t i = blockIdx.x;
  if (i >= c.count) return;
  DeviceBlock block{warps, warp_memory, c.dims, scratch, result};
  par::plan_one(block, c.dims, c.options, c.loads_of(i), c.out_of(i), c.workspace_of(i));
}

// ---------------------------------------------------------------------------------------------
// Launching: one block per plan (c.count >= 1). Returns the launch error.
inline cudaError_t launch_plans(cudaStream_t stream, const ultraep::PlanCall& c) {
  plan_kernel<<<static_cast<unsigned>(c.count), kThreads, 0, stream>>>(c);
  return cudaGetLastError();
}

// The parallel form: parallel_warps(dims) warps per block, their states in dynamic shared memory
// (at most par::kWarpStateBytes, so no opt-in is needed). Where that is 0, the sequential kernel
// (the same plan; c's workspace stride holds its workspace too).
inline cudaError_t launch_parallel_plans(cudaStream_t stream, const ultraep::PlanCall& c) {
  const int warps = par::parallel_warps(c.dims);
  if (warps == 0) return launch_plans(stream, c);
  const size_t shared = sizeof(int32_t) * warps * par::warp_state_elems(c.dims);
  parallel_plan_kernel<<<static_cast<unsigned>(c.count), warps * par::kLanes, shared, stream>>>(
      c, warps);
  return cudaGetLastError();
}

using Launch = cudaError_t (*)(cudaStream_t, const ultraep::PlanCall&);

}  // namespace ultraep::cuda
