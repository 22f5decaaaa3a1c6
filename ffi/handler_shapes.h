// Shape checks shared by the CPU and CUDA FFI handlers: thin glue between XLA buffers and the
// planner core, which knows nothing of XLA.
#pragma once

#include <cstdint>
#include <string>

#include "planner.h"
#include "xla/ffi/api/ffi.h"

namespace ultraep {

namespace ffi = xla::ffi;

// A batch of plans: `count` matrices [R, E] laid out contiguously.
struct PlanBatch {
  PlanDims dims;
  int64_t count;
  int64_t workspace;  // int64 elements per plan (passed as twice as many int32)
};

inline std::string dims_str(ffi::Span<const int64_t> dims) {
  std::string s = "[";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + "]";
}

// Checks that loads is [..., R, E] and every output is [..., R, S], [..., E], [..., R],
// [..., workspace] with the same leading dimensions; fills *b.
inline ffi::Error plan_batch(const ffi::AnyBuffer& loads, int64_t slots_per_rank,
                                          const ffi::AnyBuffer& slot_expert,
                                          const ffi::AnyBuffer& slot_quota,
                                          const ffi::AnyBuffer& master_quota,
                                          const ffi::AnyBuffer& rank_load,
                                          const ffi::AnyBuffer& workspace, PlanBatch* b) {
  auto ld = loads.dimensions();
  if (ld.size() < 2)
    return ffi::Error::InvalidArgument("ultraep_plan: loads must be [..., R, E], got " +
                                       dims_str(ld));
  const int64_t R = ld[ld.size() - 2], E = ld[ld.size() - 1], S = slots_per_rank;
  if (R < 1 || E < 1 || E % R != 0)
    return ffi::Error::InvalidArgument("ultraep_plan: loads [..., R, E] needs R >= 1 and E % R == 0, got " +
                                       dims_str(ld));
  if (S < 0) return ffi::Error::InvalidArgument("ultraep_plan: slots_per_rank must be >= 0");
  int64_t count = 1;
  for (size_t i = 0; i + 2 < ld.size(); ++i) count *= ld[i];
  *b = PlanBatch{PlanDims{R, E, S}, count, workspace_elems(PlanDims{R, E, S})};
  struct Want {
    const char* name;
    const ffi::AnyBuffer* buf;
    int64_t elems;
  } wants[] = {{"slot_expert", &slot_expert, R * S},
               {"slot_quota", &slot_quota, R * S},
               {"master_quota", &master_quota, E},
               {"rank_load", &rank_load, R},
               {"workspace", &workspace, 2 * b->workspace}};
  for (const Want& w : wants) {
    if (static_cast<int64_t>(w.buf->element_count()) != count * w.elems)
      return ffi::Error::InvalidArgument(std::string("ultraep_plan: output ") + w.name +
                                         " has " + std::to_string(w.buf->element_count()) +
                                         " elements, expected " +
                                         std::to_string(count * w.elems));
  }
  return ffi::Error::Success();
}

inline ffi::Error check_options(int64_t min_tokens_per_replica, int64_t master_keep_tokens,
                                double eps, int64_t capacity) {
  if (min_tokens_per_replica < 1)
    return ffi::Error::InvalidArgument("ultraep_plan: min_tokens_per_replica must be >= 1");
  if (master_keep_tokens < 0)
    return ffi::Error::InvalidArgument("ultraep_plan: master_keep_tokens must be >= 0");
  if (!(eps >= 0.0)) return ffi::Error::InvalidArgument("ultraep_plan: balance_eps must be >= 0");
  if (capacity < 0)
    return ffi::Error::InvalidArgument("ultraep_plan: capacity must be >= 0 (0: unbounded)");
  return ffi::Error::Success();
}

}  // namespace ultraep
