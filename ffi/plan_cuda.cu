// XLA FFI handlers (CUDA; the kernels are in plan_cuda_kernels.h): the planner of PLANNER.md on the
// device, enqueued on XLA's stream with no host synchronisation (so they are safe in a CUDA graph).
// Two kernels, one block per plan of the batch, both giving the CPU handler's plan bit for bit:
//
// - ultraep_plan (the default): all threads of the block sum the expert totals, then one thread
//   runs the rest of the sequential core of planner.h (ultraep::plan_from_totals), the workspace
//   in global memory. Bit-equal by construction (the totals are integer sums, so their order does
//   not matter). Slow: the core is sequential (docs/gpu.md).
// - ultraep_plan_parallel (opt-in: `uep.plan(..., parallel=True)`): the parallel form of
//   planner_parallel.h with real warps (DeviceBlock, DeviceLanes in plan_cuda_kernels.h): the
//   set-up over the block, a round of threshold probes on separate warps, each probe's argmax over
//   masters and target ranks as warp max-reductions of packed keys, each warp's state in shared
//   memory. The same header code runs on the host in the CPU tests (HostBlock, HostLanes),
//   bit-equal to the core there. Opt-in until a GPU has timed it and checked it bit for bit
//   (tests/test_gpu.py).
//
// A device cannot raise: invalid input (a negative load, an int32 overflow) makes the plan's
// outputs -1 everywhere, which no valid plan contains (rank_load >= 0).
#include <cuda_runtime.h>

#include <string>

#include "plan_call.h"
#include "plan_cuda_kernels.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using ultraep::cuda::Launch;
using ultraep::cuda::launch_parallel_plans;
using ultraep::cuda::launch_plans;
namespace par = ultraep::par;

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
