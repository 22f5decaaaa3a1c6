// XLA FFI handlers (host): run the planner on each [R, E] matrix of the batch, with the
// sequential core (ultraep_plan) or with the parallel form's host emulation (ultraep_plan_parallel,
// planner_parallel.h: the same plans, a check of the logic the CUDA kernel runs).
#include <cstdint>
#include <string>
#include <vector>

#include "plan_call.h"
#include "planner.h"
#include "planner_parallel.h"
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

// Plans each matrix of a checked call in turn with `plan` (ultraep::plan_one's signature).
template <class Plan>
ffi::Error PlanEach(const ultraep::PlanCall& c, const Plan& plan) {
  for (int64_t i = 0; i < c.count; ++i) {
    const int32_t status = plan(c.dims, c.options, c.loads_of(i), c.out_of(i), c.workspace_of(i));
    if (status == ultraep::kPlanNegativeLoad)
      return ffi::Error::InvalidArgument(negative_load_message(c.loads_of(i), c.dims, i));
    if (status == ultraep::kPlanOverflow)
      return ffi::Error::InvalidArgument(
          "ultraep_plan: an expert's or a rank's total load exceeds int32 (plan " +
          std::to_string(i) + ")");
  }
  return ffi::Error::Success();
}

ffi::Error PlanAll(const ultraep::PlanCall& c) { return PlanEach(c, ultraep::plan_one); }
ffi::Error PlanAllParallel(const ultraep::PlanCall& c) {
  const auto plan = [](const ultraep::PlanDims& d, const ultraep::PlanOptions& o,
                       const int32_t* loads, ultraep::PlanOut out, int64_t* workspace) {
    return ultraep::par::plan_one_host(d, o, loads, out, workspace);
  };
  return PlanEach(c, plan);
}

// The handlers: the call's operand, attributes and results (BindPlanCall) go to the shared checks.
constexpr auto kPlanCpu = [](auto... call) {
  return ultraep::HandlePlanCall(PlanAll, ultraep::workspace_elems, call...);
};
constexpr auto kPlanParallelCpu = [](auto... call) {
  return ultraep::HandlePlanCall(PlanAllParallel, ultraep::par::parallel_workspace_elems, call...);
};

}  // namespace

// The library hides everything else; the handlers are what the Python side loads by name.
extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* UltraepPlanCpu(XLA_FFI_CallFrame*);
extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* UltraepPlanParallelCpu(
    XLA_FFI_CallFrame*);

XLA_FFI_DEFINE_HANDLER_SYMBOL(UltraepPlanCpu, kPlanCpu, ultraep::BindPlanCall(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(UltraepPlanParallelCpu, kPlanParallelCpu,
                              ultraep::BindPlanCall(ffi::Ffi::Bind()));

// Workspace size (int64 elements) the caller must provide per plan, for the Python wrapper.
extern "C" __attribute__((visibility("default"))) int64_t ultraep_workspace_elems(int64_t R,
                                                                                  int64_t E,
                                                                                  int64_t S) {
  return ultraep::workspace_elems(ultraep::PlanDims{R, E, S});
}

// The same for the parallel form (ultraep_plan_parallel, on either platform: both handlers of that
// target take this workspace).
extern "C" __attribute__((visibility("default"))) int64_t
ultraep_parallel_workspace_elems(int64_t R, int64_t E, int64_t S) {
  return ultraep::par::parallel_workspace_elems(ultraep::PlanDims{R, E, S});
}

// Warps per plan of the parallel form (0: the sequential core runs instead), for tests that check
// that the probe rounds were exercised.
extern "C" __attribute__((visibility("default"))) int64_t ultraep_parallel_warps(int64_t R,
                                                                                 int64_t E,
                                                                                 int64_t S) {
  return ultraep::par::parallel_warps(ultraep::PlanDims{R, E, S});
}

// Test hook (no XLA): one plan of loads [R, E] with the parallel form's host emulation on `warps`
// warps (1 .. 16, so that tests can put the probe rounds' boundaries anywhere; the device uses
// ultraep_parallel_warps), `ranks_per_domain` as the handler's attribute. Returns a PlanStatus (the
// outputs as the handler's), or -1 for dimensions, options or a warp count the handler would not
// run.
extern "C" __attribute__((visibility("default"))) int32_t ultraep_plan_parallel_host(
    int64_t R, int64_t E, int64_t S, int64_t min_tokens_per_replica, int64_t master_keep_tokens,
    double balance_eps, int64_t capacity, int64_t ranks_per_domain, int64_t warps,
    const int32_t* loads, int32_t* slot_expert, int32_t* slot_quota, int32_t* master_quota,
    int32_t* rank_load) {
  const ultraep::PlanDims d{R, E, S};
  const ultraep::PlanOptions o{min_tokens_per_replica, master_keep_tokens, balance_eps, capacity,
                               ranks_per_domain};
  if (!d.valid() || ultraep::check_options(R, o).failure() || !ultraep::par::indices_fit(d) ||
      warps < 1 || warps > ultraep::par::kMaxWarps)
    return -1;
  const int w = static_cast<int>(warps);
  std::vector<int64_t> workspace(ultraep::par::host_workspace_elems(d, w));
  const ultraep::PlanOut out{slot_expert, slot_quota, master_quota, rank_load};
  return ultraep::par::plan_one_host(d, o, loads, out, workspace.data(), w);
}
