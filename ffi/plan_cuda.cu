// XLA FFI handler (CUDA): the same planner core, run on the device, one block per plan of the
// batch, enqueued on XLA's stream with no host synchronisation (so it is safe in a CUDA graph).
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

// One block per plan: all threads sum the expert totals (coalesced: neighbouring threads read
// neighbouring experts of a row), then thread 0 runs the sequential rest of the planner.
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
  plan_kernel<<<static_cast<unsigned>(b.count), kThreads, 0, stream>>>(
      b.dims, o, b.count, b.workspace, loads.typed_data<int32_t>(),
      slot_expert->typed_data<int32_t>(), slot_quota->typed_data<int32_t>(),
      master_quota->typed_data<int32_t>(), rank_load->typed_data<int32_t>(),
      reinterpret_cast<int64_t*>(workspace->untyped_data()));
  cudaError_t err = cudaGetLastError();
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
