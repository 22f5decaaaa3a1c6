// XLA FFI handler (host): runs the planner core on each [R, E] matrix of the batch.
#include <cstdint>
#include <string>

#include "handler_shapes.h"
#include "planner.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using ultraep::PlanBatch;

namespace {

// Names the first negative entry, for an error message a user can act on.
std::string negative_load_message(const int32_t* loads, const PlanBatch& b, int64_t batch) {
  const auto& d = b.dims;
  for (int64_t i = 0; i < d.R * d.E; ++i) {
    if (loads[i] < 0)
      return "ultraep_plan: loads must be >= 0, but loads[" + std::to_string(batch) + "][" +
             std::to_string(i / d.E) + ", " + std::to_string(i % d.E) +
             "] = " + std::to_string(loads[i]);
  }
  return "ultraep_plan: negative load";
}

ffi::Error PlanCpu(ffi::AnyBuffer loads, int64_t slots_per_rank, int64_t min_tokens_per_replica,
                   int64_t master_keep_tokens, double balance_eps, int64_t capacity,
                   ffi::Result<ffi::AnyBuffer> slot_expert, ffi::Result<ffi::AnyBuffer> slot_quota,
                   ffi::Result<ffi::AnyBuffer> master_quota, ffi::Result<ffi::AnyBuffer> rank_load,
                   ffi::Result<ffi::AnyBuffer> workspace) {
  if (loads.element_type() != ffi::S32)
    return ffi::Error::InvalidArgument("ultraep_plan: loads must be int32");
  ultraep::PlanBatch b;
  ffi::Error shapes = ultraep::plan_batch(loads, slots_per_rank, *slot_expert, *slot_quota,
                                          *master_quota, *rank_load, *workspace, &b);
  if (shapes.failure()) return shapes;
  ffi::Error opt =
      ultraep::check_options(min_tokens_per_replica, master_keep_tokens, balance_eps, capacity);
  if (opt.failure()) return opt;
  const auto& d = b.dims;
  const ultraep::PlanOptions o{min_tokens_per_replica, master_keep_tokens, balance_eps, capacity};
  const int32_t* in = loads.typed_data<int32_t>();
  for (int64_t i = 0; i < b.count; ++i) {
    ultraep::PlanOut out{slot_expert->typed_data<int32_t>() + i * d.R * d.S,
                         slot_quota->typed_data<int32_t>() + i * d.R * d.S,
                         master_quota->typed_data<int32_t>() + i * d.E,
                         rank_load->typed_data<int32_t>() + i * d.R};
    const int32_t* li = in + i * d.R * d.E;
    const int32_t status =
        ultraep::plan_one(d, o, li, out, reinterpret_cast<int64_t*>(workspace->untyped_data()) + i * b.workspace);
    if (status == ultraep::kPlanNegativeLoad)
      return ffi::Error::InvalidArgument(negative_load_message(li, b, i));
    if (status == ultraep::kPlanOverflow)
      return ffi::Error::InvalidArgument(
          "ultraep_plan: an expert's or a rank's total load exceeds int32 (plan " +
          std::to_string(i) + ")");
  }
  return ffi::Error::Success();
}

}  // namespace

// The library hides everything else; the handler is what the Python side loads by name.
extern "C" __attribute__((visibility("default"))) XLA_FFI_Error* UltraepPlanCpu(XLA_FFI_CallFrame*);

XLA_FFI_DEFINE_HANDLER_SYMBOL(UltraepPlanCpu, PlanCpu,
                              ffi::Ffi::Bind()
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
                                  .Ret<ffi::AnyBuffer>());

// Workspace size (int64 elements) the caller must provide per plan, for the Python wrapper.
extern "C" __attribute__((visibility("default"))) int64_t ultraep_workspace_elems(int64_t R,
                                                                                  int64_t E,
                                                                                  int64_t S) {
  return ultraep::workspace_elems(ultraep::PlanDims{R, E, S});
}
