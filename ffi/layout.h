// The instance layout of an EP group (ultraep_jax/layout.py is the same rule in Python): R ranks,
// E experts, E_m = E / R masters per rank, S spare slots per rank. Expert e's master is on rank
// e / E_m at local index e % E_m, so rank r masters experts [r * E_m, (r + 1) * E_m); slot s of
// rank r is entry r * S + s of the plan's [R, S] outputs.
#pragma once

#include <cstdint>

#ifdef __CUDACC__
#define UEP_HD __host__ __device__
#else
#define UEP_HD
#endif

namespace ultraep {

struct PlanDims {
  int64_t R;  // ranks on the EP axis
  int64_t E;  // logical experts, E % R == 0
  int64_t S;  // spare slots per rank

  // R >= 1, E a positive multiple of R, S >= 0.
  UEP_HD bool valid() const { return R >= 1 && E >= 1 && E % R == 0 && S >= 0; }
  UEP_HD int64_t experts_per_rank() const { return E / R; }
  // The first of rank r's masters (the others follow it).
  UEP_HD int64_t first_master(int64_t r) const { return r * experts_per_rank(); }
  // Slot s of rank r in the [R, S] outputs.
  UEP_HD int64_t slot(int64_t r, int64_t s) const { return r * S + s; }
};

}  // namespace ultraep
