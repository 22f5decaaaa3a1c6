// XLA FFI handler (host): runs the planner core on each [R, E] matrix of the batch.
#include <cstdint>
#include <string>

#include "plan_call.h"
#include "planner.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Names the first negative entry of plan `batch`, for an error message a user can act on.
std::string negative_load_message(const int32_t* loads, const ultraep::PlanDims& d, int64_t batch) {
  for (int64_t i = 0; i < d.R * d.E; ++i) {
    if (loads[i] < 0)
      return "ultraep_plan: loads must be >= 0, but loads[" + std::to_string(batch) + "][" +
             std::to_string(i / d.E) + ", " + std::to_string(i % d.E) +
             "] = " + std::to_string(loads[i]);
  }
  return "ultraep_plan: negative load";
}

// Plans each matrix of a checked call in turn.
ffi::Error PlanAll(const ultraep::PlanCall& c) {
  for (int64_t i = 0; i < c.count; ++i) {
    const int32_t status =
        ultraep::plan_one(c.dims, c.options, c.loads_of(i), c.out_of(i), c.workspace_of(i));
    if (status == ultraep::kPlanNegativeLoad)
      return ffi::Error::InvalidArgument(negative_load_message(c.loads_of(i), c.dims, i));
    if (status == ultraep::kPlanOverflow)
      return ffi::Error::InvalidArgument(
          "ultraep_plan: an expert's or a rank's total load exceeds int32 (plan " +
          std::to_string(i) + ")");
  }
  return ffi::Error::Success();
}

// The handler: the call's operand, attributes and results (BindPlanCall) go to the shared checks.
constexpr auto kPlanCpu = [](auto... call) { return ultraep::HandlePlanCall(PlanAll, call...); };

}  // namespace

// The library hides everything else; the handler is what the Python side loads by name.
extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* UltraepPlanCpu(XLA_FFI_CallFrame*);

XLA_FFI_DEFINE_HANDLER_SYMBOL(UltraepPlanCpu, kPlanCpu, ultraep::BindPlanCall(ffi::Ffi::Bind()));

// Workspace size (int64 elements) the caller must provide per plan, for the Python wrapper.
extern "C" __attribute__((visibility("default"))) int64_t ultraep_workspace_elems(int64_t R,
                                                                                  int64_t E,
                                                                                  int64_t S) {
  return ultraep::workspace_elems(ultraep::PlanDims{R, E, S});
}
