// XLA FFI handler (CUDA): the planner of PLANNER.md on the device, enqueued on XLA's stream with
// no host synchronisation (so it is safe in a CUDA graph).
//
// One kernel, one block per plan of the batch: all threads of the block sum the expert totals,
// then one thread runs the rest of the core of planner.h (ultraep::plan_from_totals), the
// workspace in global memory. The plan is thus the CPU handler's, bit for bit, by construction
// (the totals are integer sums, so their order does not matter).
//
// Speed: the core is sequential, so one plan takes a single thread's time (measured figures
// and a faster design once tried: README.md, the GPU section).
//
// A device cannot raise: invalid input (a negative load, an int32 overflow) makes the plan's
// outputs -1 everywhere, which no valid plan contains (rank_load >= 0).
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "plan_call.h"
#include "planner.h"
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
// Launching: one block of kThreads threads per plan (c.count >= 1). Returns the launch error.
cudaError_t launch_plans(cudaStream_t stream, const ultraep::PlanCall& c) {
  plan_kernel<<<static_cast<unsigned>(c.count), kThreads, 0, stream>>>(c);
  return cudaGetLastError();
}

// Enqueues a checked call's plans on XLA's stream.
ffi::Error LaunchAll(cudaStream_t stream, const ultraep::PlanCall& c) {
  if (c.count == 0) return ffi::Error::Success();
  if (cudaError_t err = launch_plans(stream, c); err != cudaSuccess)
    return ffi::Error::Internal(std::string("ultraep_plan: kernel launch failed: ") +
                                cudaGetErrorString(err));
  return ffi::Error::Success();
}

// The handler: XLA's stream, then the call's operand, attributes and results (BindPlanCall),
// which go to the shared checks.
constexpr auto kPlanCuda = [](cudaStream_t stream, auto... call) {
  const auto launch = [stream](const ultraep::PlanCall& c) { return LaunchAll(stream, c); };
  return ultraep::HandlePlanCall(launch, call...);
};

}  // namespace

// The library hides everything else; the handler is what the Python side loads by name.
extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* UltraepPlanCuda(
    XLA_FFI_CallFrame*);

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    UltraepPlanCuda, kPlanCuda,
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
cudaError_t time_launches(const ultraep::PlanCall& c, int iters, float* times_ms) {
  cudaStream_t stream = nullptr;
  cudaEvent_t ev0 = nullptr, ev1 = nullptr;
  const auto run = [&]() -> cudaError_t {
    UEP_CUDA_TRY(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    UEP_CUDA_TRY(cudaEventCreate(&ev0));
    UEP_CUDA_TRY(cudaEventCreate(&ev1));
    UEP_CUDA_TRY(launch_plans(stream, c));
    UEP_CUDA_TRY(cudaStreamSynchronize(stream));
    for (int k = 0; k < iters; ++k) {
      UEP_CUDA_TRY(cudaEventRecord(ev0, stream));
      UEP_CUDA_TRY(launch_plans(stream, c));
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
// current device with the handler's kernel and options (capacity 0: unbounded), `iters` timed
// launches of the whole batch after one warm-up, each timed with CUDA events into times_ms[k];
// copies the last launch's plans into the host outputs (poisoned first on the device, so that an
// unwritten entry shows). Returns 0, or a CUDA error code (cudaErrorInvalidValue for dimensions
// or options the handler would reject).
extern "C" __attribute__((visibility("default"))) int ultraep_plan_cuda_bench(
    int64_t R, int64_t E, int64_t S, int64_t min_tokens_per_replica, int64_t master_keep_tokens,
    double balance_eps, int64_t capacity, int64_t count, const int32_t* loads_host, int iters,
    float* times_ms, int32_t* slot_expert, int32_t* slot_quota, int32_t* master_quota,
    int32_t* rank_load) {
  const ultraep::PlanDims d{R, E, S};
  const ultraep::PlanOptions o{min_tokens_per_replica, master_keep_tokens, balance_eps, capacity};
  if (!d.valid() || count < 1 || iters < 0 || ultraep::check_options(o).failure())
    return static_cast<int>(cudaErrorInvalidValue);
  const int64_t ws = ultraep::workspace_elems(d);
  BenchBuffers b;
  cudaError_t err = b.fill(d, count, ws, loads_host);
  const ultraep::PlanCall c{
      d,           o,          count, ws, b.loads, b.slot_expert, b.slot_quota, b.master_quota,
      b.rank_load, b.workspace};
  if (err == cudaSuccess) err = time_launches(c, iters, times_ms);
  if (err == cudaSuccess)
    err = b.copy_out(d, count, slot_expert, slot_quota, master_quota, rank_load);
  return static_cast<int>(err);
}
