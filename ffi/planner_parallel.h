// The planner of PLANNER.md in a parallel form: the same plan as the sequential core (planner.h),
// bit for bit, written once for a block of warps of 32 lanes. plan_cuda.cu runs it with real
// warps (DeviceBlock, DeviceLanes); HostBlock and HostLanes below run the same code on the host,
// the warps one after the other and each warp's lanes in a loop, so that CPU tests check the logic
// the device runs.
//
// What runs in parallel (PLANNER.md, "The parallel form"):
// - set-up: expert totals, rank totals, the rank order (each rank's position counted), all over
//   the block's threads;
// - the threshold search: the probes of one step of the fixed probe sequence (the fast path, the
//   coarse probes, the refine probes) on separate warps, up to one per warp at a time; the first
//   success in sequence order wins, as in the sequential search;
// - inside a probe: the argmax over a source's masters and over the target ranks are each one
//   max-reduction over the lanes of a packed 64-bit key whose order is the core's tie rule; the
//   replicas themselves stay one after the other (each depends on the slack the previous left);
// - the plan's outputs, over the block's threads.
//
// Memory: the block-shared part (load_e, L, the rank order) is in the caller's int64 workspace
// (parallel_workspace_elems); each warp's state (int32 entries) is in shared memory on the
// device and after the shared part on the host. Every int32 entry provably fits: slacks and
// quotas are at most the threshold (< Lmax <= 2^31 - 1), exports at most load_e, ranks and
// experts below E; parallel_warps() is 0 where the sizes do not allow that, and callers then run
// the sequential core (the same plan).
#pragma once

#include <cstdint>

#include "planner.h"

namespace ultraep {
namespace par {

using detail::kFailed;
using detail::kInfeasible;
using detail::kLoose;
using detail::kMost;
using detail::kStrict;
using detail::kSuccess;
using detail::max64;
using detail::min64;
using detail::Outcome;
using detail::Rule;

constexpr int kLanes = 32;     // lanes per warp
constexpr int kMaxWarps = 16;  // warps per block: 512 threads leave 128 registers per thread
// Bytes of warp state one block may hold: what a CUDA block gets without opting in to more
// shared memory (48 KiB), less room for the block's own scratch.
constexpr int64_t kWarpStateBytes = 46 * 1024;
constexpr int64_t kInt32Max = 2147483647;

// int32 entries of one warp's state: exported [E]; slack, free slots, order [R]; 3 x [R * S].
UEP_HD inline int64_t warp_state_elems(const PlanDims& d) { return d.E + 3 * d.R + 3 * d.R * d.S; }

// The ranks the target key's rank field holds (its 30 bits, see target_key).
constexpr int64_t kMaxKeyRanks = int64_t{1} << 30;

// Whether every rank, expert and slot index fits in int32 (the warp state's entries) and every
// rank in the target key.
UEP_HD inline bool indices_fit(const PlanDims& d) {
  return d.E <= kInt32Max && d.S <= kInt32Max / d.R && d.R <= kMaxKeyRanks;
}

// Warps per block: as many as the warp-state budget holds, at most kMaxWarps; 0 where one does not
// fit or where the indices do not fit (indices_fit; then the sequential core runs).
UEP_HD inline int parallel_warps(const PlanDims& d) {
  if (!indices_fit(d)) return 0;
  const int64_t w = kWarpStateBytes / (4 * warp_state_elems(d));
  return static_cast<int>(w < kMaxWarps ? w : kMaxWarps);
}

// int64 elements of the block-shared part of the workspace: load_e [E], L [R], rank order [R].
UEP_HD inline int64_t shared_elems(const PlanDims& d) { return d.E + 2 * d.R; }

// int64 workspace elements of the host form with `warps` warps: the shared part, then the states.
UEP_HD inline int64_t host_workspace_elems(const PlanDims& d, int warps) {
  return shared_elems(d) + (warps * warp_state_elems(d) + 1) / 2;
}

// int64 workspace elements per plan of the parallel form on either platform: the host form's with
// parallel_warps(d) warps (the device keeps the states in shared memory), and at least the
// sequential core's (its fallback).
UEP_HD inline int64_t parallel_workspace_elems(const PlanDims& d) {
  return max64(workspace_elems(d), host_workspace_elems(d, parallel_warps(d)));
}

// The block-shared values, written by the set-up and only read after it.
struct Shared {
  PlanDims d;
  PlanOptions o;
  int64_t* load_e;      // [E]
  int64_t* L;           // [R]: master-only rank loads
  int64_t* rank_order;  // [R]: ranks by L descending, ties by index
  int64_t lmax = 0;

  UEP_HD Shared(int64_t* base, const PlanDims& dims, const PlanOptions& opts)
      : d(dims), o(opts), load_e(base), L(base + dims.E), rank_order(base + dims.E + dims.R) {}
};

// One warp's state while it runs a probe (int32; see the top of this file for why that fits).
struct WarpState {
  int32_t* exported;    // [E]: tokens each master gave away in this attempt
  int32_t* slack;       // [R]
  int32_t* free_slots;  // [R]
  int32_t* order;       // [R]: the order the overloaded ranks give in
  int32_t* rep_expert;  // [R * S]: the attempt's replicas in creation order
  int32_t* rep_target;  // [R * S]
  int32_t* rep_quota;   // [R * S]

  UEP_HD WarpState(int32_t* base, const PlanDims& d)
      : exported(base),
        slack(base + d.E),
        free_slots(base + d.E + d.R),
        order(base + d.E + 2 * d.R),
        rep_expert(base + d.E + 3 * d.R),
        rep_target(base + d.E + 3 * d.R + d.R * d.S),
        rep_quota(base + d.E + 3 * d.R + 2 * d.R * d.S) {}
};

// ---------------------------------------------------------------------------------------------
// The lanes' interface (HostLanes here, DeviceLanes in plan_cuda.cu): for_each, max_key and sum
// over an index range split across the lanes, leader() (the lane that writes a value all lanes
// computed) and sync(). Every lane runs the scalar code with the same values, since each
// reduction ends in every lane. A lane overwrites warp state only after every lane has read what
// it overwrites: a reduction or a sync() lies between (on the device lanes are not in lockstep).
//
// The host's lanes and block. A warp's lanes run in a loop: lane l takes the indices l, l + 32,
// ... of a range, and a reduction combines the lanes' values in the device's butterfly order
// (xor over lane distances 16, 8, 4, 2, 1; max and integer sums give the same in any order).

struct HostLanes {
  UEP_HD bool leader() const { return true; }  // the lane that writes what all lanes computed
  UEP_HD void sync() const {}

  template <class F>
  UEP_HD void for_each(int64_t n, const F& f) const {
    for (int l = 0; l < kLanes; ++l)
      for (int64_t i = l; i < n; i += kLanes) f(i);
  }

  // The lanes' values combined pairwise across lane distances 16 .. 1, as the shuffles do.
  template <class T, class Op>
  UEP_HD static T butterfly(T* v, const Op& op) {
    for (int dist = kLanes / 2; dist > 0; dist /= 2) {
      T next[kLanes];
      for (int l = 0; l < kLanes; ++l) next[l] = op(v[l], v[l ^ dist]);
      for (int l = 0; l < kLanes; ++l) v[l] = next[l];
    }
    return v[0];
  }

  // max over i < n of key(i) (0 when n == 0), the same in every lane.
  template <class F>
  UEP_HD uint64_t max_key(int64_t n, const F& key) const {
    uint64_t v[kLanes];
    for (int l = 0; l < kLanes; ++l) {
      v[l] = 0;
      for (int64_t i = l; i < n; i += kLanes) {
        const uint64_t k = key(i);
        v[l] = v[l] > k ? v[l] : k;
      }
    }
    return butterfly(v, [](uint64_t a, uint64_t b) { return a > b ? a : b; });
  }

  // sum over i < n of f(i).
  template <class F>
  UEP_HD int64_t sum(int64_t n, const F& f) const {
    int64_t v[kLanes];
    for (int l = 0; l < kLanes; ++l) {
      v[l] = 0;
      for (int64_t i = l; i < n; i += kLanes) v[l] += f(i);
    }
    return butterfly(v, [](int64_t a, int64_t b) { return a + b; });
  }
};

// The block on the host: its warps run one after the other, each with its own state in `memory`.
struct HostBlock {
  int n_warps;
  int32_t* memory;  // n_warps warp states of warp_state_elems entries each
  PlanDims d;
  int64_t result[kMaxWarps] = {};  // what each warp of a round reports

  UEP_HD int warps() const { return n_warps; }
  UEP_HD void sync() const {}
  UEP_HD WarpState state(int w) const { return WarpState(memory + w * warp_state_elems(d), d); }
  UEP_HD int64_t* results() { return result; }

  template <class F>
  UEP_HD void for_each(int64_t n, const F& f) const {
    for (int64_t i = 0; i < n; ++i) f(i);
  }
  template <class F>
  UEP_HD bool any(int64_t n, const F& pred) const {
    bool v = false;
    for (int64_t i = 0; i < n; ++i) v |= pred(i);  // every index runs (pred may write)
    return v;
  }
  template <class F>
  UEP_HD int64_t sum(int64_t n, const F& f) const {
    int64_t v = 0;
    for (int64_t i = 0; i < n; ++i) v += f(i);
    return v;
  }
  template <class F>
  UEP_HD int64_t max(int64_t n, const F& f) const {
    int64_t v = 0;  // the values reduced here are >= 0
    for (int64_t i = 0; i < n; ++i) {
      const int64_t x = f(i);
      v = v > x ? v : x;
    }
    return v;
  }
  // Warps 0 .. m-1 each run f(w, lanes, their state).
  template <class F>
  UEP_HD void for_warps(int64_t m, const F& f) const {
    for (int w = 0; w < m; ++w) f(w, HostLanes{}, state(w));
  }
};

// ---------------------------------------------------------------------------------------------
// Packed keys: one max-reduction picks what the core's loops pick, ties included.

constexpr uint64_t kLow31 = (uint64_t{1} << 31) - 1;
constexpr uint64_t kLow30 = (uint64_t{1} << 30) - 1;

// The target key of rank t (slack s, f free slots) for a replica that should carry `need` tokens
// of an expert that can give `a`, `near` whether t is near (detail::is_near); 0 when t is no
// candidate. Bits: 63 kept (the strict rule's filter passed; always set for loose and most), 62
// fits (s >= need; never set for most), 61 near (only with fits), 60..30 the slack part (kLow31 -
// s when it fits, so that the least slack is the largest; else s), 29..0 kLow30 - t (ties to the
// smallest rank). The maximum is then pick_target's choice: a kept rank before any other, among
// those a fitting one, a near one first, by least slack, else the most slack, then the smallest
// rank. s <= tau < 2^31 and t < R <= 2^30 (indices_fit), so every field fits.
UEP_HD inline uint64_t target_key(int64_t t, int64_t s, int64_t f, int64_t need, int64_t a,
                                  Rule rule, bool near) {
  if (f <= 0 || s <= 0) return 0;
  const uint64_t kept = rule != kStrict || !(f == 1 && s > a);
  const uint64_t fits = rule != kMost && s >= need;
  const uint64_t nearby = fits && near;
  const uint64_t slack_part = fits ? kLow31 - static_cast<uint64_t>(s) : static_cast<uint64_t>(s);
  return (kept << 63) | (fits << 62) | (nearby << 61) | (slack_part << 30) |
         (kLow30 - static_cast<uint64_t>(t));
}
UEP_HD inline int64_t key_rank(uint64_t key) {
  return static_cast<int64_t>(kLow30 - (key & kLow30));
}
UEP_HD inline int64_t key_slack(uint64_t key) {
  const uint64_t part = (key >> 30) & kLow31;
  return static_cast<int64_t>((key >> 62) & 1 ? kLow31 - part : part);
}

// The master of rank `src` with the most tokens left to give, into *avail (ties -> smallest
// index), as one reduction of the key (avail << 32 | E_m - 1 - j). avail is clamped at 0: below 1
// the attempt fails whichever master is named (every floor is >= 1).
template <class Lanes>
UEP_HD int64_t richest_master(const Lanes& lanes, const Shared& sh, const WarpState& ws,
                              int64_t src, int64_t* avail) {
  const int64_t em = sh.d.experts_per_rank(), first = sh.d.first_master(src);
  const int64_t K = sh.o.master_keep_tokens;
  const uint64_t key = lanes.max_key(em, [&](int64_t j) {
    const int64_t a = sh.load_e[first + j] - K - ws.exported[first + j];
    return (static_cast<uint64_t>(a > 0 ? a : 0) << 32) | static_cast<uint64_t>(em - 1 - j);
  });
  *avail = static_cast<int64_t>(key >> 32);
  return first + em - 1 - static_cast<int64_t>(key & 0xffffffffu);
}

// ---------------------------------------------------------------------------------------------
// One warp: a probe's attempts (PLANNER.md "The oracle").

// What an attempt at tau needs beside the order: the excess all overloaded ranks must shed (X at
// the start) and how many ranks are overloaded (the plain order's length).
struct Probe {
  int64_t tau;
  int64_t excess;
  int64_t n_over;
};

template <class Lanes>
UEP_HD Probe probe_at(const Lanes& lanes, const Shared& sh, int64_t tau) {
  const int64_t excess = lanes.sum(sh.d.R, [&](int64_t t) { return max64(sh.L[t] - tau, 0); });
  const int64_t n_over = lanes.sum(sh.d.R, [&](int64_t t) { return int64_t{sh.L[t] > tau}; });
  return Probe{tau, excess, n_over};
}

// The plain order D into ws.order: the first n_over ranks of the rank order. (The first sync: a
// lane may still be reading the order a repair left, with no reduction in between.)
template <class Lanes>
UEP_HD void plain_order(const Lanes& lanes, const Shared& sh, WarpState& ws, const Probe& p) {
  lanes.sync();
  lanes.for_each(p.n_over,
                 [&](int64_t i) { ws.order[i] = static_cast<int32_t>(sh.rank_order[i]); });
  lanes.sync();
}

// A repair's move: `failed` to the front of ws.order, the others keeping their order (rare, so
// one lane does it, once every lane has read ws.order[0] for the repair's test).
template <class Lanes>
UEP_HD void move_to_front(const Lanes& lanes, WarpState& ws, int64_t failed) {
  lanes.sync();
  if (lanes.leader()) {
    int64_t p = 0;
    while (ws.order[p] != failed) ++p;
    for (; p > 0; --p) ws.order[p] = ws.order[p - 1];
    ws.order[0] = static_cast<int32_t>(failed);
  }
  lanes.sync();
}

// One source's replicas (the inner loop of attempt): while the source still has excess *x, its
// richest master gives a replica to the chosen target. Returns how the loop ended.
template <class Lanes>
UEP_HD Outcome shed(const Lanes& lanes, const Shared& sh, WarpState& ws, int64_t src, int64_t f,
                    Rule rule, int64_t later, int64_t* x, int64_t* nrep) {
  const int64_t first = *nrep, dsz = sh.o.ranks_per_domain;  // src's replicas: [first, *nrep)
  while (*x > 0) {
    const int64_t fl = min64(f, *x);  // adaptive floor
    int64_t avail = 0;
    const int64_t e = richest_master(lanes, sh, ws, src, &avail);
    if (avail < fl) return f == 1 ? kInfeasible : kFailed;
    const int64_t need = min64(*x, avail);
    const uint64_t key = lanes.max_key(sh.d.R, [&](int64_t t) {
      const int64_t s = ws.slack[t];  // only a fit's nearness counts
      const bool near = s >= need && rule != kMost &&
                        detail::is_near(t, src, e, dsz, ws.rep_expert, ws.rep_target, first, *nrep);
      return target_key(t, s, ws.free_slots[t], need, avail, rule, near);
    });
    if (key == 0) return kFailed;
    const int64_t t = key_rank(key);
    // Fill the target as far as the expert allows and the later ranks can use (as planner.h).
    const int64_t q = min64(min64(key_slack(key), avail), *x + later);
    if (q < fl) return kFailed;
    if (lanes.leader()) {
      ws.rep_expert[*nrep] = static_cast<int32_t>(e);
      ws.rep_target[*nrep] = static_cast<int32_t>(t);
      ws.rep_quota[*nrep] = static_cast<int32_t>(q);
      ws.slack[t] -= static_cast<int32_t>(q);
      ws.free_slots[t] -= 1;
      ws.exported[e] += static_cast<int32_t>(q);
    }
    lanes.sync();
    ++*nrep;
    *x -= q;
  }
  return kSuccess;
}

// attempt(tau, f, rule, order) of PLANNER.md with the order in ws.order[0, n_over). A target is
// any rank with slack and a free slot (the core's active list holds exactly those), so no list
// is kept. On success the replicas are ws.rep_* [0, *nrep); on failure *failed is the source.
template <class Lanes>
UEP_HD Outcome attempt(const Lanes& lanes, const Shared& sh, WarpState& ws, const Probe& p,
                       int64_t f, Rule rule, int64_t* nrep, int64_t* failed) {
  *nrep = 0;
  lanes.for_each(sh.d.E, [&](int64_t e) { ws.exported[e] = 0; });
  if (p.tau >= sh.lmax) {
    lanes.sync();
    return kSuccess;
  }
  lanes.for_each(sh.d.R, [&](int64_t t) {
    ws.slack[t] = static_cast<int32_t>(max64(p.tau - sh.L[t], 0));
    ws.free_slots[t] = static_cast<int32_t>(sh.d.S);
  });
  lanes.sync();
  int64_t later = p.excess;  // X: what the ranks after the current one must shed
  for (int64_t ri = 0; ri < p.n_over; ++ri) {
    const int64_t src = ws.order[ri];
    int64_t x = sh.L[src] - p.tau;
    later -= x;
    *failed = src;
    const Outcome out = shed(lanes, sh, ws, src, f, rule, later, &x, nrep);
    if (out != kSuccess) return out;
    if (lanes.leader()) ws.slack[src] = static_cast<int32_t>(-x);  // over-export: a target
    lanes.sync();
  }
  return kSuccess;
}

// The rest of repair(tau, f, rule) after its plain attempt failed at `failed` (ws.order plain).
template <class Lanes>
UEP_HD Outcome repair(const Lanes& lanes, const Shared& sh, WarpState& ws, const Probe& p,
                      int64_t f, Rule rule, int64_t failed, int64_t* nrep) {
  for (int b = 0; b < 3 && failed != ws.order[0]; ++b) {
    move_to_front(lanes, ws, failed);
    const Outcome out = attempt(lanes, sh, ws, p, f, rule, nrep, &failed);
    if (out != kFailed) return out;
  }
  return kFailed;
}

// try(tau) of PLANNER.md on one warp: the plain attempts, then the repairs, until one succeeds
// (its replicas stay in ws, their count in *nrep). `any_floor`: the probe may give up the floor.
template <class Lanes>
UEP_HD bool try_threshold(const Lanes& lanes, const Shared& sh, WarpState& ws, int64_t tau,
                          bool any_floor, int64_t* nrep) {
  const int64_t F = sh.o.min_tokens_per_replica;
  const int floors = (any_floor && F > 1) ? 2 : 1;
  const Probe p = probe_at(lanes, sh, tau);
  int64_t failed_plain[2][2] = {};  // [floor][loose, strict]: where the plain attempts failed
  for (int i = 0; i < floors; ++i) {
    for (int r = 0; r < 2; ++r) {
      plain_order(lanes, sh, ws, p);
      const Outcome out = attempt(lanes, sh, ws, p, i == 0 ? F : 1, r == 0 ? kLoose : kStrict, nrep,
                                  &failed_plain[i][r]);
      if (out != kFailed) return out == kSuccess;
    }
  }
  for (int i = 0; i < floors; ++i) {
    const int64_t f = i == 0 ? F : 1;
    for (int r = 0; r < 3; ++r) {
      const Rule rule = r == 0 ? kLoose : (r == 1 ? kStrict : kMost);
      plain_order(lanes, sh, ws, p);
      int64_t failed = r < 2 ? failed_plain[i][r] : 0;  // the plain attempt failed above
      if (r == 2) {
        const Outcome out = attempt(lanes, sh, ws, p, f, rule, nrep, &failed);
        if (out != kFailed) return out == kSuccess;
      }
      const Outcome out = repair(lanes, sh, ws, p, f, rule, failed, nrep);
      if (out != kFailed) return out == kSuccess;
    }
  }
  return false;
}

// ---------------------------------------------------------------------------------------------
// The block: set-up, the search's rounds of probes, the outputs.

// Expert totals, rank totals, T, Lmax and the rank order into sh (PLANNER.md "Derived
// quantities"). Returns a PlanStatus (a negative load first, as the core).
template <class Block>
UEP_HD int32_t set_up(Block& block, Shared& sh, const int32_t* loads, int64_t* total) {
  const PlanDims& d = sh.d;
  const bool negative = block.any(d.E, [&](int64_t e) {
    int64_t sum = 0;
    int32_t sign = 0;
    for (int64_t r = 0; r < d.R; ++r) {
      sign |= loads[r * d.E + e];
      sum += loads[r * d.E + e];
    }
    sh.load_e[e] = sum;
    return sign < 0;
  });
  if (negative) return kPlanNegativeLoad;
  const bool overflow = block.any(d.R, [&](int64_t r) {
    int64_t l = 0;
    bool over = false;
    for (int64_t e = d.first_master(r); e < d.first_master(r) + d.experts_per_rank(); ++e) {
      over |= sh.load_e[e] > kInt32Max;
      l += sh.load_e[e];
    }
    sh.L[r] = l;
    return over || l > kInt32Max;
  });
  if (overflow) return kPlanOverflow;
  *total = block.sum(d.R, [&](int64_t r) { return sh.L[r]; });
  sh.lmax = block.max(d.R, [&](int64_t r) { return sh.L[r]; });
  // Rank r's place in the order: the ranks before it (more load, or as much and a smaller index).
  block.for_each(d.R, [&](int64_t r) {
    int64_t pos = 0;
    for (int64_t s = 0; s < d.R; ++s) pos += sh.L[s] > sh.L[r] || (sh.L[s] == sh.L[r] && s < r);
    sh.rank_order[pos] = r;
  });
  block.sync();
  return kPlanOk;
}

// PLANNER.md "Output" from a warp's replicas (none when ws is null): master quotas, the replicas
// in their targets' slots in creation order (replica i takes the slot after the earlier replicas
// on its target), and every rank's balanced load.
template <class Block>
UEP_HD void write_plan(Block& block, const Shared& sh, const WarpState* ws, int64_t nrep,
                       PlanOut out) {
  const PlanDims& d = sh.d;
  const auto quota = [&](int64_t e) { return sh.load_e[e] - (ws ? ws->exported[e] : 0); };
  block.for_each(d.E, [&](int64_t e) { out.master_quota[e] = static_cast<int32_t>(quota(e)); });
  block.for_each(d.R * d.S, [&](int64_t i) {
    out.slot_expert[i] = -1;
    out.slot_quota[i] = 0;
  });
  block.sync();
  block.for_each(nrep, [&](int64_t i) {
    const int32_t t = ws->rep_target[i];
    int64_t n = 0;
    for (int64_t j = 0; j < i; ++j) n += ws->rep_target[j] == t;
    out.slot_expert[d.slot(t, n)] = ws->rep_expert[i];
    out.slot_quota[d.slot(t, n)] = ws->rep_quota[i];
  });
  block.for_each(d.R, [&](int64_t r) {
    int64_t l = 0;
    for (int64_t e = d.first_master(r); e < d.first_master(r) + d.experts_per_rank(); ++e)
      l += quota(e);
    for (int64_t j = 0; j < nrep; ++j) l += ws->rep_target[j] == r ? ws->rep_quota[j] : 0;
    out.rank_load[r] = static_cast<int32_t>(l);
  });
  block.sync();
}

// The outputs of a plan that failed: -1 everywhere (as the core's).
template <class Block>
UEP_HD void write_failed_plan(Block& block, const PlanDims& d, PlanOut out) {
  block.for_each(d.R * d.S, [&](int64_t i) { out.slot_expert[i] = out.slot_quota[i] = -1; });
  block.for_each(d.E, [&](int64_t e) { out.master_quota[e] = -1; });
  block.for_each(d.R, [&](int64_t r) { out.rank_load[r] = -1; });
  block.sync();
}

// The threshold search of PLANNER.md as rounds of probes. Each step of the fixed sequence (fast
// probes, coarse probes, refine probes) is a list of thresholds that the warps probe at once,
// `warps` at a time; the first success in list order wins, which is the probe the sequential
// search stops at (probes are pure functions of the threshold). Each success writes its plan to
// `out`: a refine success overwrites its coarse probe's plan, as it wins over it.
template <class Block>
struct Search {
  Block& block;
  const Shared& sh;
  PlanOut out;
  bool any_floor;     // the probes may give up the floor (exact mode; set for the window)
  int64_t last = -1;  // the previous probe: a repeat has the same (failed) outcome, as planner.h

  // Probes taus[0, n) in order; the index of the first success (its plan written), or -1.
  UEP_HD int64_t first_success(const int64_t* taus, int64_t n) {
    for (int64_t s = 0; s < n; s += block.warps()) {
      const int64_t m = min64(block.warps(), n - s);
      int64_t* result = block.results();
      block.for_warps(m, [&](int w, const auto& lanes, WarpState ws) {
        const int64_t i = s + w, tau = taus[i], prev = i > 0 ? taus[i - 1] : last;
        int64_t nrep = 0;
        const bool repeat = tau < sh.lmax && tau == prev;  // skipped by the sequential search
        const bool ok = !repeat && try_threshold(lanes, sh, ws, tau, any_floor, &nrep);
        if (lanes.leader()) result[w] = ok ? nrep : -1;
      });
      int64_t won = -1, nrep = 0;
      for (int64_t w = m - 1; w >= 0; --w) {
        if (result[w] < 0) continue;
        won = w;
        nrep = result[w];
      }
      block.sync();  // every thread has read the results before the next round writes them
      last = taus[won >= 0 ? s + won : s + m - 1];  // the last probe the sequential search made
      if (won >= 0) {
        const WarpState ws = block.state(static_cast<int>(won));
        write_plan(block, sh, &ws, nrep, out);
        return s + won;
      }
    }
    return -1;
  }

  // The refine probes between a failed `a` and a successful `b`: the first success, else b.
  UEP_HD int64_t refine(int64_t a, int64_t b) {
    int64_t taus[15];
    int64_t n = 0;
    for (int64_t i = 1; i < 16; ++i) {
      const int64_t r = a + (b - a) * i / 16;
      if (r > a && r < b) taus[n++] = r;
    }
    const int64_t k = first_success(taus, n);
    return k >= 0 ? taus[k] : b;
  }

  // window(a, b) of PLANNER.md: the winner, or -1 if the window fails.
  UEP_HD int64_t window(int64_t a, int64_t b, int64_t delta) {
    int64_t taus[32];
    int64_t n = 0;
    taus[n++] = a;
    for (int64_t k = 1; k < 4 && a + k * delta <= b; ++k) taus[n++] = a + k * delta;
    int64_t i = first_success(taus, n);
    if (i >= 0) return taus[i];
    const int64_t p = taus[n - 1];
    if (p >= b) return -1;
    for (int64_t j = 1; j <= 32; ++j) taus[j - 1] = p + (b - p) * j / 32;
    i = first_success(taus, 32);
    return i < 0 ? -1 : refine(i > 0 ? taus[i - 1] : p, taus[i]);
  }

  // The capacity step: window(min(tau0, C), C), then window(M, min(tau0, C) - 1), every probe
  // allowed to give up the floor. Returns the winner, or -1.
  UEP_HD int64_t capacity(const detail::SearchStart& st) {
    const bool floors = any_floor;
    any_floor = true;
    const int64_t a = min64(st.tau0, sh.o.capacity);
    int64_t w = window(a, sh.o.capacity, st.delta);
    if (w < 0 && a > st.mean_ceil) w = window(st.mean_ceil, a - 1, st.delta);
    any_floor = floors;
    return w;
  }

  // The ladder: tau0 + i * delta for i < 4, then 31 points spread up to Lmax, the first success
  // refined down from the previous point. Returns the winner, or -1.
  UEP_HD int64_t ladder(const detail::SearchStart& st) {
    int64_t taus[31];
    for (int64_t i = 0; i < 4; ++i) taus[i] = st.tau0 + i * st.delta;
    int64_t k = first_success(taus, 4);
    if (k >= 0) return taus[k];
    const int64_t lo = st.tau0 + 3 * st.delta, span = sh.lmax - lo;
    for (int64_t j = 1; j < 32; ++j) taus[j - 1] = lo + span * j / 32;
    k = first_success(taus, 31);
    return k < 0 ? -1 : refine(k > 0 ? taus[k - 1] : lo, taus[k]);
  }
};

// The search and the outputs: the winner's plan, or the plan without replicas (tau = Lmax).
template <class Block>
UEP_HD void search_and_write(Block& block, const Shared& sh, int64_t total, PlanOut out) {
  const PlanDims& d = sh.d;
  const detail::SearchStart st = detail::search_start(d, sh.o, total, sh.lmax);
  int64_t tau = -1;
  if (total > 0 && d.S > 0 && d.R > 1) {
    Search<Block> search{block, sh, out, is_exact_mode(sh.o.eps)};
    if (detail::capacity_applies(sh.o, sh.lmax, st.mean_ceil)) tau = search.capacity(st);
    if (tau < 0 && st.tau0 < sh.lmax) tau = search.ladder(st);
  }
  if (tau < 0) write_plan(block, sh, nullptr, 0, out);
}

// Plans one load matrix `loads` [R, E] with a block (parallel_warps(d) >= 1 warps); the
// workspace holds parallel_workspace_elems(d) int64 values. Returns a PlanStatus; on an error
// the outputs hold -1 everywhere, as plan_one's.
template <class Block>
UEP_HD int32_t plan_one(Block& block, const PlanDims& d, const PlanOptions& o, const int32_t* loads,
                        PlanOut out, int64_t* workspace) {
  Shared sh(workspace, d, o);
  int64_t total = 0;
  const int32_t status = set_up(block, sh, loads, &total);
  if (status != kPlanOk) {
    write_failed_plan(block, d, out);
    return status;
  }
  search_and_write(block, sh, total, out);
  return kPlanOk;
}

// The host form with `warps` warps (1 .. kMaxWarps; needs indices_fit(d)): plan_one with
// HostBlock, the warps' states after the shared part of the workspace (host_workspace_elems).
inline int32_t plan_one_host(const PlanDims& d, const PlanOptions& o, const int32_t* loads,
                             PlanOut out, int64_t* workspace, int warps) {
  HostBlock block{warps, reinterpret_cast<int32_t*>(workspace + shared_elems(d)), d};
  return plan_one(block, d, o, loads, out, workspace);
}

// The host form as the device runs it: parallel_warps(d) warps, or the sequential core (the same
// plan) where that is 0. The workspace holds parallel_workspace_elems(d) int64 values.
inline int32_t plan_one_host(const PlanDims& d, const PlanOptions& o, const int32_t* loads,
                             PlanOut out, int64_t* workspace) {
  const int warps = parallel_warps(d);
  if (warps == 0) return ultraep::plan_one(d, o, loads, out, workspace);
  return plan_one_host(d, o, loads, out, workspace, warps);
}

}  // namespace par
}  // namespace ultraep
