// XLA FFI handlers (CUDA): the planner of PLANNER.md on the device, enqueued on XLA's stream with
// no host synchronisation (so they are safe in a CUDA graph). Two kernels, one block per plan of
// the batch, both giving the CPU handler's plan bit for bit:
//
// - ultraep_plan (the default): all threads of the block sum the expert totals, then one thread
//   runs the rest of the sequential core of planner.h (ultraep::plan_from_totals), the workspace
//   in global memory. Bit-equal by construction (the totals are integer sums, so their order does
//   not matter). Slow: the core is sequential (docs/gpu.md).
// - ultraep_plan_parallel (opt-in: `uep.plan(..., parallel=True)`): the parallel form of
//   planner_parallel.h with real warps (DeviceBlock, DeviceLanes below): the set-up over the
//   block, a round of threshold probes on separate warps, each probe's argmax over masters and
//   target ranks as warp max-reductions of packed keys, each warp's state in shared memory. The
//   same header code runs on the host in the CPU tests (HostBlock, HostLanes), bit-equal to the
//   core there. Opt-in until a GPU has timed it and checked it bit for bit (tests/test_gpu.py).
//
// A device cannot raise: invalid input (a negative load, an int32 overflow) makes the plan's
// outputs -1 everywhere, which no valid plan contains (rank_load >= 0).
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "plan_call.h"
#include "planner.h"
#include "planner_parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

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
cudaError_t launch_plans(cudaStream_t stream, const ultraep::PlanCall& c) {
  plan_kernel<<<static_cast<unsigned>(c.count), kThreads, 0, stream>>>(c);
  return cudaGetLastError();
}

// The parallel form: parallel_warps(dims) warps per block, their states in dynamic shared memory
// (at most par::kWarpStateBytes, so no opt-in is needed). Where that is 0, the sequential kernel
// (the same plan; c's workspace stride holds its workspace too).
cudaError_t launch_parallel_plans(cudaStream_t stream, const ultraep::PlanCall& c) {
  const int warps = par::parallel_warps(c.dims);
  if (warps == 0) return launch_plans(stream, c);
  const size_t shared = sizeof(int32_t) * warps * par::warp_state_elems(c.dims);
  parallel_plan_kernel<<<static_cast<unsigned>(c.count), warps * par::kLanes, shared, stream>>>(
      c, warps);
  return cudaGetLastError();
}

using Launch = cudaError_t (*)(cudaStream_t, const ultraep::PlanCall&);

// Enqueues a checked call's plans on XLA's stream.
ffi::Error LaunchAll(cudaStream_t stream, const ultraep::PlanCall& c, Launch launch) {
  if (c.count == 0) return ffi::Error::Success();
  if (cudaError_t err = launch(stream, c); err != cudaSuccess)
    return ffi::Error::Internal(std::string("ultraep_plan: kernel launch failed: ") +
                                cudaGetErrorString(err));
  return ffi::Error::Success();
}

// The handlers: XLA's stream, then the call's operand, attributes and results (BindPlanCall),
// which go to the shared checks.
constexpr auto kPlanCuda = [](cudaStream_t stream, auto... call) {
  const auto run = [stream](const ultraep::PlanCall& c) {
    return LaunchAll(stream, c, launch_plans);
  };
  return ultraep::HandlePlanCall(run, ultraep::workspace_elems, call...);
};
constexpr auto kPlanParallelCuda = [](cudaStream_t stream, auto... call) {
  const auto run = [stream](const ultraep::PlanCall& c) {
    return LaunchAll(stream, c, launch_parallel_plans);
  };
  return ultraep::HandlePlanCall(run, par::parallel_workspace_elems, call...);
};

}  // namespace

// The library hides everything else; the handlers are what the Python side loads by name.
extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* UltraepPlanCuda(
    XLA_FFI_CallFrame*);
extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* UltraepPlanParallelCuda(
    XLA_FFI_CallFrame*);

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    UltraepPlanCuda, kPlanCuda,
    ultraep::BindPlanCall(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
    {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(
    UltraepPlanParallelCuda, kPlanParallelCuda,
    ultraep::BindPlanCall(ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>()),
    {ffi::Traits::kCmdBufferCompatible});

namespace {

#define UEP_CUDA_TRY(x)                                           \
  do {                                                            \
    if (cudaError_t err_ = (x); err_ != cudaSuccess) return err_; \
  } while (0)

// The device buffers of the benchmark hook's batch, freed on destruction.
struct BenchBuffers {
  int32_t *loads = nullptr, *slot_expert = nullptr, *slot_quota = nullptr;
  int32_t *master_quota = nullptr, *rank_load = nullptr;
  int64_t* workspace = nullptr;

  BenchBuffers() = default;
  BenchBuffers(const BenchBuffers&) = delete;
  BenchBuffers& operator=(const BenchBuffers&) = delete;
  ~BenchBuffers() {
    cudaFree(loads);
    cudaFree(slot_expert);
    cudaFree(slot_quota);
    cudaFree(master_quota);
    cudaFree(rank_load);
    cudaFree(workspace);
  }

  // Allocates `count` plans' buffers and copies loads_host [count, R, E] in; the outputs are
  // poisoned (with 4 bytes to spare past the slots), so that an unwritten entry shows.
  cudaError_t fill(const ultraep::PlanDims& d, int64_t count, int64_t ws, const int32_t* host) {
    const size_t n_loads = sizeof(int32_t) * count * d.R * d.E;
    const size_t n_slots = sizeof(int32_t) * count * d.R * d.S + 4;
    UEP_CUDA_TRY(cudaMalloc(&loads, n_loads));
    UEP_CUDA_TRY(cudaMalloc(&slot_expert, n_slots));
    UEP_CUDA_TRY(cudaMalloc(&slot_quota, n_slots));
    UEP_CUDA_TRY(cudaMalloc(&master_quota, sizeof(int32_t) * count * d.E));
    UEP_CUDA_TRY(cudaMalloc(&rank_load, sizeof(int32_t) * count * d.R));
    UEP_CUDA_TRY(cudaMalloc(&workspace, sizeof(int64_t) * count * ws));
    UEP_CUDA_TRY(cudaMemcpy(loads, host, n_loads, cudaMemcpyHostToDevice));
    UEP_CUDA_TRY(cudaMemset(slot_expert, 0x5a, n_slots));
    UEP_CUDA_TRY(cudaMemset(slot_quota, 0x5a, n_slots));
    UEP_CUDA_TRY(cudaMemset(master_quota, 0x5a, sizeof(int32_t) * count * d.E));
    UEP_CUDA_TRY(cudaMemset(rank_load, 0x5a, sizeof(int32_t) * count * d.R));
    return cudaSuccess;
  }

  // Copies the plans of `count` matrices to the host outputs.
  cudaError_t copy_out(const ultraep::PlanDims& d, int64_t count, int32_t* se, int32_t* sq,
                       int32_t* mq, int32_t* rl) const {
    const size_t n_slots = sizeof(int32_t) * count * d.R * d.S;
    UEP_CUDA_TRY(cudaMemcpy(se, slot_expert, n_slots, cudaMemcpyDeviceToHost));
    UEP_CUDA_TRY(cudaMemcpy(sq, slot_quota, n_slots, cudaMemcpyDeviceToHost));
    UEP_CUDA_TRY(
        cudaMemcpy(mq, master_quota, sizeof(int32_t) * count * d.E, cudaMemcpyDeviceToHost));
    return cudaMemcpy(rl, rank_load, sizeof(int32_t) * count * d.R, cudaMemcpyDeviceToHost);
  }
};

// One warm-up launch of the batch, then `iters` launches each timed with CUDA events into
// times_ms[k], on a stream of its own.
cudaError_t time_launches(const ultraep::PlanCall& c, Launch launch, int iters, float* times_ms) {
  cudaStream_t stream = nullptr;
  cudaEvent_t ev0 = nullptr, ev1 = nullptr;
  const auto run = [&]() -> cudaError_t {
    UEP_CUDA_TRY(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    UEP_CUDA_TRY(cudaEventCreate(&ev0));
    UEP_CUDA_TRY(cudaEventCreate(&ev1));
    UEP_CUDA_TRY(launch(stream, c));
    UEP_CUDA_TRY(cudaStreamSynchronize(stream));
    for (int k = 0; k < iters; ++k) {
      UEP_CUDA_TRY(cudaEventRecord(ev0, stream));
      UEP_CUDA_TRY(launch(stream, c));
      UEP_CUDA_TRY(cudaEventRecord(ev1, stream));
      UEP_CUDA_TRY(cudaEventSynchronize(ev1));
      UEP_CUDA_TRY(cudaEventElapsedTime(&times_ms[k], ev0, ev1));
    }
    return cudaSuccess;
  };
  const cudaError_t err = run();
  if (ev0) cudaEventDestroy(ev0);
  if (ev1) cudaEventDestroy(ev1);
  if (stream) cudaStreamDestroy(stream);
  return err;
}

#undef UEP_CUDA_TRY

}  // namespace

// Benchmark and test hook (no XLA): plans `count` >= 1 matrices loads_host [count, R, E] on the
// current device with a handler's kernel (`parallel` 0: ultraep_plan's, else
// ultraep_plan_parallel's) and options (capacity 0: unbounded), `iters` timed launches of the
// whole batch after one warm-up, each timed with CUDA events into times_ms[k]; copies the last
// launch's plans into the host outputs (poisoned first on the device, so that an unwritten entry
// shows). Returns 0, or a CUDA error code (cudaErrorInvalidValue for dimensions or options the
// handler would reject).
extern "C" __attribute__((visibility("default"))) int ultraep_plan_cuda_bench(
    int parallel, int64_t R, int64_t E, int64_t S, int64_t min_tokens_per_replica,
    int64_t master_keep_tokens, double balance_eps, int64_t capacity, int64_t count,
    const int32_t* loads_host, int iters, float* times_ms, int32_t* slot_expert,
    int32_t* slot_quota, int32_t* master_quota, int32_t* rank_load) {
  const ultraep::PlanDims d{R, E, S};
  const ultraep::PlanOptions o{min_tokens_per_replica, master_keep_tokens, balance_eps, capacity};
  if (!d.valid() || count < 1 || iters < 0 || ultraep::check_options(o).failure())
    return static_cast<int>(cudaErrorInvalidValue);
  const int64_t ws = parallel ? par::parallel_workspace_elems(d) : ultraep::workspace_elems(d);
  BenchBuffers b;
  cudaError_t err = b.fill(d, count, ws, loads_host);
  const ultraep::PlanCall c{
      d,           o,          count, ws, b.loads, b.slot_expert, b.slot_quota, b.master_quota,
      b.rank_load, b.workspace};
  if (err == cudaSuccess)
    err = time_launches(c, parallel ? launch_parallel_plans : launch_plans, iters, times_ms);
  if (err == cudaSuccess)
    err = b.copy_out(d, count, slot_expert, slot_quota, master_quota, rank_load);
  return static_cast<int>(err);
}
