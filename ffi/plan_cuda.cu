// XLA FFI handler (CUDA): the planner of PLANNER.md on the device, one block per plan of the
// batch, enqueued on XLA's stream with no host synchronisation (so it is safe in a CUDA graph).
//
// The kernel runs the core of planner.h: all threads of a block sum one plan's expert totals,
// then one thread plans, with its workspace in global memory. So the CUDA plan is the CPU plan bit
// for bit by construction. (A warp-per-probe kernel that ran the threshold probes in parallel
// measured 48-52 us per EP64/E256 plan on an H100 against 244-264 us for this one, but it
// re-implemented the previous target rule; porting it to the current planner.h is left to do.)
//
// A device cannot raise: invalid input (a negative load, an int32 overflow) makes the plan's
// outputs -1 everywhere, which no valid plan contains (rank_load >= 0).
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "handler_shapes.h"
#include "planner.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kThreads = 256;

// The kernel: all threads sum the expert totals (coalesced: neighbouring threads read
// neighbouring experts of a row), then thread 0 runs the sequential rest of the core.
__global__ void plan_kernel(ultraep::PlanDims d, ultraep::PlanOptions o, int64_t count,
                            int64_t ws_elems, const int32_t* loads, int32_t* slot_expert,
                            int32_t* slot_quota, int32_t* master_quota, int32_t* rank_load,
                            int64_t* workspace) {
  const int64_t i = blockIdx.x;
  if (i >= count) return;
  const int32_t* plan_loads = loads + i * d.R * d.E;
  int64_t* ws = workspace + i * ws_elems;
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
  ultraep::PlanOut out{slot_expert + i * d.R * d.S, slot_quota + i * d.R * d.S,
                       master_quota + i * d.E, rank_load + i * d.R};
  ultraep::plan_from_totals(d, o, negative != 0, out, ws);
}

// Launches the batch, one block per plan. Returns the launch error.
cudaError_t launch_plans(cudaStream_t stream, const ultraep::PlanDims& d,
                         const ultraep::PlanOptions& o, int64_t count, int64_t ws_elems,
                         const int32_t* loads, int32_t* slot_expert, int32_t* slot_quota,
                         int32_t* master_quota, int32_t* rank_load, int64_t* workspace) {
  plan_kernel<<<static_cast<unsigned>(count), kThreads, 0, stream>>>(
      d, o, count, ws_elems, loads, slot_expert, slot_quota, master_quota, rank_load, workspace);
  return cudaGetLastError();
}

ffi::Error PlanCuda(cudaStream_t stream, ffi::AnyBuffer loads, int64_t slots_per_rank,
                    int64_t min_tokens_per_replica, int64_t master_keep_tokens,
                    double balance_eps, int64_t capacity,
                    ffi::Result<ffi::AnyBuffer> slot_expert,
                    ffi::Result<ffi::AnyBuffer> slot_quota,
                    ffi::Result<ffi::AnyBuffer> master_quota,
                    ffi::Result<ffi::AnyBuffer> rank_load, ffi::Result<ffi::AnyBuffer> workspace) {
  if (loads.element_type() != ffi::S32)
    return ffi::Error::InvalidArgument("ultraep_plan: loads must be int32");
  ultraep::PlanBatch b;
  ffi::Error shapes = ultraep::plan_batch(loads, slots_per_rank, *slot_expert, *slot_quota,
                                          *master_quota, *rank_load, *workspace, &b);
  if (shapes.failure()) return shapes;
  ffi::Error opt =
      ultraep::check_options(min_tokens_per_replica, master_keep_tokens, balance_eps, capacity);
  if (opt.failure()) return opt;
  if (b.count == 0) return ffi::Error::Success();
  const ultraep::PlanOptions o{min_tokens_per_replica, master_keep_tokens, balance_eps, capacity};
  cudaError_t err = launch_plans(
      stream, b.dims, o, b.count, b.workspace, loads.typed_data<int32_t>(),
      slot_expert->typed_data<int32_t>(), slot_quota->typed_data<int32_t>(),
      master_quota->typed_data<int32_t>(), rank_load->typed_data<int32_t>(),
      reinterpret_cast<int64_t*>(workspace->untyped_data()));
  if (err != cudaSuccess)
    return ffi::Error::Internal(std::string("ultraep_plan: kernel launch failed: ") +
                                cudaGetErrorString(err));
  return ffi::Error::Success();
}

}  // namespace

// The library hides everything else; the handler is what the Python side loads by name.
extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* UltraepPlanCuda(XLA_FFI_CallFrame*);

XLA_FFI_DEFINE_HANDLER_SYMBOL(UltraepPlanCuda, PlanCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Attr<int64_t>("slots_per_rank")
                                  .Attr<int64_t>("min_tokens_per_replica")
                                  .Attr<int64_t>("master_keep_tokens")
                                  .Attr<double>("balance_eps")
                                  .Attr<int64_t>("capacity")
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>(),
                              {ffi::Traits::kCmdBufferCompatible});

// Benchmark and test hook (no XLA): plans `count` matrices loads_host [count, R, E] on the current
// device, `iters` timed launches of the whole batch after one warm-up, each timed with CUDA events
// into times_ms[k]; copies the last launch's plans into the host outputs. Returns 0, or a CUDA
// error code.
extern "C" __attribute__((visibility("default"))) int ultraep_plan_cuda_bench(
    int64_t R, int64_t E, int64_t S, int64_t min_tokens_per_replica, int64_t master_keep_tokens,
    double balance_eps, int64_t count, const int32_t* loads_host, int iters, float* times_ms,
    int32_t* slot_expert, int32_t* slot_quota, int32_t* master_quota, int32_t* rank_load) {
  const ultraep::PlanDims d{R, E, S};
  const ultraep::PlanOptions o{min_tokens_per_replica, master_keep_tokens, balance_eps};
  const int64_t ws = ultraep::workspace_elems(d);
  int32_t *dl = nullptr, *dse = nullptr, *dsq = nullptr, *dmq = nullptr, *drl = nullptr;
  int64_t* dws = nullptr;
  cudaEvent_t ev0 = nullptr, ev1 = nullptr;
  cudaStream_t stream = nullptr;
  cudaError_t err = cudaSuccess;
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
  UEP_TRY(launch_plans(stream, d, o, count, ws, dl, dse, dsq, dmq, drl, dws));
  UEP_TRY(cudaStreamSynchronize(stream));
  for (int k = 0; k < iters; ++k) {
    UEP_TRY(cudaEventRecord(ev0, stream));
    UEP_TRY(launch_plans(stream, d, o, count, ws, dl, dse, dsq, dmq, drl, dws));
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
