// Benchmark and test hook of the CUDA planner (no XLA), built as its own library
// (libultraep_plan_cuda_bench.so, next to the handlers' library) so that the handlers' library
// carries only the handlers: plans a batch of load matrices with either kernel of
// plan_cuda_kernels.h, timed with CUDA events, and copies the plans back to the host.
// experiments/gpu/planner.py loads it with ctypes; tests/test_gpu.py compares its plans with the
// CPU planner's.
#include <cuda_runtime.h>

#include <cstdint>

#include "plan_call.h"
#include "plan_cuda_kernels.h"
#include "planner.h"
#include "planner_parallel.h"

namespace {

using ultraep::cuda::Launch;
namespace par = ultraep::par;

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
// ultraep_plan_parallel's) and options (capacity 0: unbounded; ranks_per_domain R: one domain),
// `iters` timed launches of the whole batch after one warm-up, each timed with CUDA events into
// times_ms[k]; copies the last launch's plans into the host outputs (poisoned first on the device,
// so that an unwritten entry shows). Returns 0, or a CUDA error code (cudaErrorInvalidValue for
// dimensions or options the handler would reject).
extern "C" __attribute__((visibility("default"))) int ultraep_plan_cuda_bench(
    int parallel, int64_t R, int64_t E, int64_t S, int64_t min_tokens_per_replica,
    int64_t master_keep_tokens, double balance_eps, int64_t capacity, int64_t ranks_per_domain,
    int64_t count, const int32_t* loads_host, int iters, float* times_ms, int32_t* slot_expert,
    int32_t* slot_quota, int32_t* master_quota, int32_t* rank_load) {
  const ultraep::PlanDims d{R, E, S};
  const ultraep::PlanOptions o{min_tokens_per_replica, master_keep_tokens, balance_eps, capacity,
                               ranks_per_domain};
  if (!d.valid() || count < 1 || iters < 0 || ultraep::check_options(R, o).failure())
    return static_cast<int>(cudaErrorInvalidValue);
  const int64_t ws = parallel ? par::parallel_workspace_elems(d) : ultraep::workspace_elems(d);
  BenchBuffers b;
  cudaError_t err = b.fill(d, count, ws, loads_host);
  const ultraep::PlanCall c{
      d,           o,          count, ws, b.loads, b.slot_expert, b.slot_quota, b.master_quota,
      b.rank_load, b.workspace};
  if (err == cudaSuccess)
    err = time_launches(
        c, parallel ? ultraep::cuda::launch_parallel_plans : ultraep::cuda::launch_plans, iters,
        times_ms);
  if (err == cudaSuccess)
    err = b.copy_out(d, count, slot_expert, slot_quota, master_quota, rank_load);
  return static_cast<int>(err);
}
