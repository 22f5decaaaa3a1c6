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
  if (R < 1 || E < 1 || E % R != 0 || S < 0 || count < 1 || iters < 0 ||
      ultraep::check_options(o).failure())
    return static_cast<int>(cudaErrorInvalidValue);
  const int64_t ws = ultraep::workspace_elems(d);
  int32_t *dl = nullptr, *dse = nullptr, *dsq = nullptr, *dmq = nullptr, *drl = nullptr;
  int64_t* dws = nullptr;
  cudaEvent_t ev0 = nullptr, ev1 = nullptr;
  cudaStream_t stream = nullptr;
  cudaError_t err = cudaSuccess;
  ultraep::PlanCall c{};
#define UEP_TRY(x)                     \
  do {                                 \
    err = (x);                         \
    if (err != cudaSuccess) goto done; \
  } while (0)
  UEP_TRY(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  UEP_TRY(cudaMalloc(&dl, sizeof(int32_t) * count * R * E));
  UEP_TRY(cudaMalloc(&dse, sizeof(int32_t) * count * R * S + 4));
  UEP_TRY(cudaMalloc(&dsq, sizeof(int32_t) * count * R * S + 4));
  UEP_TRY(cudaMalloc(&dmq, sizeof(int32_t) * count * E));
  UEP_TRY(cudaMalloc(&drl, sizeof(int32_t) * count * R));
  UEP_TRY(cudaMalloc(&dws, sizeof(int64_t) * count * ws));
  UEP_TRY(cudaMemcpy(dl, loads_host, sizeof(int32_t) * count * R * E, cudaMemcpyHostToDevice));
  // Poison the outputs, so that an unwritten entry shows.
  UEP_TRY(cudaMemset(dse, 0x5a, sizeof(int32_t) * count * R * S + 4));
  UEP_TRY(cudaMemset(dsq, 0x5a, sizeof(int32_t) * count * R * S + 4));
  UEP_TRY(cudaMemset(dmq, 0x5a, sizeof(int32_t) * count * E));
  UEP_TRY(cudaMemset(drl, 0x5a, sizeof(int32_t) * count * R));
  UEP_TRY(cudaEventCreate(&ev0));
  UEP_TRY(cudaEventCreate(&ev1));
  c = ultraep::PlanCall{d, o, count, ws, dl, dse, dsq, dmq, drl, dws};
  UEP_TRY(launch_plans(stream, c));
  UEP_TRY(cudaStreamSynchronize(stream));
  for (int k = 0; k < iters; ++k) {
    UEP_TRY(cudaEventRecord(ev0, stream));
    UEP_TRY(launch_plans(stream, c));
    UEP_TRY(cudaEventRecord(ev1, stream));
    UEP_TRY(cudaEventSynchronize(ev1));
    UEP_TRY(cudaEventElapsedTime(&times_ms[k], ev0, ev1));
  }
  UEP_TRY(cudaMemcpy(slot_expert, dse, sizeof(int32_t) * count * R * S, cudaMemcpyDeviceToHost));
  UEP_TRY(cudaMemcpy(slot_quota, dsq, sizeof(int32_t) * count * R * S, cudaMemcpyDeviceToHost));
  UEP_TRY(cudaMemcpy(master_quota, dmq, sizeof(int32_t) * count * E, cudaMemcpyDeviceToHost));
  UEP_TRY(cudaMemcpy(rank_load, drl, sizeof(int32_t) * count * R, cudaMemcpyDeviceToHost));
#undef UEP_TRY
done:
  if (ev0) cudaEventDestroy(ev0);
  if (ev1) cudaEventDestroy(ev1);
  cudaFree(dl);
  cudaFree(dse);
  cudaFree(dsq);
  cudaFree(dmq);
  cudaFree(drl);
  cudaFree(dws);
  if (stream) cudaStreamDestroy(stream);
  return static_cast<int>(err);
}
