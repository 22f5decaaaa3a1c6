// The plan custom call as both handlers see it (plan_cpu.cc on the host, plan_cuda.cu on the
// device): its typed signature, the checks of its shapes and attributes, and the views of one plan
// of a batch. Thin glue between XLA's FFI and the planner core (planner.h), which knows nothing of
// XLA.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "planner.h"
#include "xla/ffi/api/ffi.h"

namespace ultraep {

namespace ffi = xla::ffi;

// Every buffer of the call is int32, which XLA checks when it binds the call: loads [..., R, E]
// in; slot_expert [..., R, S], slot_quota [..., R, S], master_quota [..., E], rank_load [..., R]
// and the workspace [..., 2 * workspace_elems] (int64 values as int32 pairs, so that the call
// works without jax_enable_x64) out.
using Int32In = ffi::Buffer<ffi::S32>;
using Int32Out = ffi::ResultBuffer<ffi::S32>;

// Appends the call's operand, attributes and results, in the handlers' parameter order, to a
// binding (after the handler's context, if it has one).
template <class Binding>
auto BindPlanCall(Binding&& binding) {
  return std::forward<Binding>(binding)
      .template Arg<Int32In>()
      .template Attr<int64_t>("slots_per_rank")
      .template Attr<int64_t>("min_tokens_per_replica")
      .template Attr<int64_t>("master_keep_tokens")
      .template Attr<double>("balance_eps")
      .template Attr<int64_t>("capacity")
      .template Attr<int64_t>("ranks_per_domain")
      .template Ret<ffi::Buffer<ffi::S32>>()   // slot_expert
      .template Ret<ffi::Buffer<ffi::S32>>()   // slot_quota
      .template Ret<ffi::Buffer<ffi::S32>>()   // master_quota
      .template Ret<ffi::Buffer<ffi::S32>>()   // rank_load
      .template Ret<ffi::Buffer<ffi::S32>>();  // workspace
}

// A checked call: `count` plans, each loads [R, E] and its outputs laid out contiguously. Plain
// pointers (device pointers for the CUDA handler), so the CUDA kernel takes it by value.
struct PlanCall {
  PlanDims dims;
  PlanOptions options;
  int64_t count;     // plans: the product of the leading dimensions of loads
  int64_t ws_elems;  // int64 workspace elements per plan
  const int32_t* loads;
  int32_t* slot_expert;
  int32_t* slot_quota;
  int32_t* master_quota;
  int32_t* rank_load;
  int64_t* workspace;

  // Plan i of the batch.
  UEP_HD const int32_t* loads_of(int64_t i) const { return loads + i * dims.R * dims.E; }
  UEP_HD PlanOut out_of(int64_t i) const {
    return PlanOut{slot_expert + i * dims.R * dims.S, slot_quota + i * dims.R * dims.S,
                   master_quota + i * dims.E, rank_load + i * dims.R};
  }
  UEP_HD int64_t* workspace_of(int64_t i) const { return workspace + i * ws_elems; }
};

inline std::string dims_str(ffi::Span<const int64_t> dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

// The options' checks, for R ranks (the fast domains must split them evenly).
inline ffi::Error check_options(int64_t R, const PlanOptions& o) {
  if (o.min_tokens_per_replica < 1)
    return ffi::Error::InvalidArgument("ultraep_plan: min_tokens_per_replica must be >= 1");
  if (o.master_keep_tokens < 0)
    return ffi::Error::InvalidArgument("ultraep_plan: master_keep_tokens must be >= 0");
  if (!(o.eps >= 0.0)) return ffi::Error::InvalidArgument("ultraep_plan: balance_eps must be >= 0");
  if (o.capacity < 0)
    return ffi::Error::InvalidArgument("ultraep_plan: capacity must be >= 0 (0: unbounded)");
  if (o.ranks_per_domain < 1 || R % o.ranks_per_domain != 0)
    return ffi::Error::InvalidArgument("ultraep_plan: ranks_per_domain must be >= 1 and divide R");
  return ffi::Error::Success();
}

// int64 workspace elements per plan of one form of the planner (workspace_elems for the
// sequential core, par::parallel_workspace_elems for the parallel form).
using WorkspaceElems = int64_t (*)(const PlanDims&);

// The body of every handler, whose parameters after `workspace_of` are those of BindPlanCall
// (after the context): checks that loads is [..., R, E], that every output has the elements of
// [..., R, S], [..., E], [..., R], [..., 2 * workspace_of(dims)] for the same leading dimensions,
// and the attributes, then returns run(call) for the checked call (Run: ffi::Error(const
// PlanCall&)). A failed check is one line that says what is wrong.
template <class Run>
ffi::Error HandlePlanCall(const Run& run, WorkspaceElems workspace_of, Int32In loads,
                          int64_t slots_per_rank, int64_t min_tokens_per_replica,
                          int64_t master_keep_tokens, double balance_eps, int64_t capacity,
                          int64_t ranks_per_domain, Int32Out slot_expert, Int32Out slot_quota,
                          Int32Out master_quota, Int32Out rank_load, Int32Out workspace) {
  auto ld = loads.dimensions();
  if (ld.size() < 2)
    return ffi::Error::InvalidArgument("ultraep_plan: loads must be [..., R, E], got " +
                                       dims_str(ld));
  const int64_t R = ld[ld.size() - 2], E = ld[ld.size() - 1], S = slots_per_rank;
  if (!PlanDims{R, E, 0}.valid())
    return ffi::Error::InvalidArgument(
        "ultraep_plan: loads [..., R, E] needs R >= 1 and E % R == 0, got " + dims_str(ld));
  if (S < 0) return ffi::Error::InvalidArgument("ultraep_plan: slots_per_rank must be >= 0");
  const PlanOptions o{min_tokens_per_replica, master_keep_tokens, balance_eps, capacity,
                      ranks_per_domain};
  if (ffi::Error e = check_options(R, o); e.failure()) return e;
  int64_t count = 1;
  for (size_t i = 0; i + 2 < ld.size(); ++i) count *= ld[i];
  const PlanDims d{R, E, S};
  const int64_t ws_elems = workspace_of(d);
  struct Want {
    const char* name;
    size_t got;
    int64_t elems;
  } wants[] = {{"slot_expert", slot_expert->element_count(), R * S},
               {"slot_quota", slot_quota->element_count(), R * S},
               {"master_quota", master_quota->element_count(), E},
               {"rank_load", rank_load->element_count(), R},
               {"workspace", workspace->element_count(), 2 * ws_elems}};
  for (const Want& w : wants) {
    const int64_t got = static_cast<int64_t>(w.got);
    if (got != count * w.elems)
      return ffi::Error::InvalidArgument(std::string("ultraep_plan: output ") + w.name + " has " +
                                         std::to_string(got) + " elements, expected " +
                                         std::to_string(count * w.elems));
  }
  const PlanCall call{d,
                      o,
                      count,
                      ws_elems,
                      loads.typed_data(),
                      slot_expert->typed_data(),
                      slot_quota->typed_data(),
                      master_quota->typed_data(),
                      rank_load->typed_data(),
                      reinterpret_cast<int64_t*>(workspace->typed_data())};
  return run(call);
}

}  // namespace ultraep
