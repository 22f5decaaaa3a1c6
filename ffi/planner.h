// Quota-driven expert replication planner: the core, with no XLA types.
//
// Header-only so that the same code compiles for the host (CPU handler) and the device (CUDA
// handler): both produce the same plan bit for bit. PLANNER.md beside this file is the normative
// description; tests/reference_planner.py implements it independently in NumPy.
//
// Memory: the caller provides a workspace of `workspace_elems(dims)` int64 values; the planner
// allocates nothing. Work per attempt: O(E + R + replicas * (R + E / R)); a threshold probe makes
// at most 4 plain attempts and 6 repairs of at most 4 attempts each (most probes succeed at the
// first); sorting the ranks once per plan: O(R log R).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "layout.h"

namespace ultraep {

struct PlanOptions {
  int64_t min_tokens_per_replica;  // F: the least tokens a replica may carry (>= 1)
  int64_t master_keep_tokens;      // K: tokens a master always keeps (>= 0)
  double eps;                      // balance tolerance (>= 0, not NaN); 0 is exact mode
  int64_t capacity;                // per-rank receive-buffer rows to stay within; 0: unbounded
  int64_t ranks_per_domain;        // g: consecutive ranks per fast domain (divides R; R: one)
};

enum PlanStatus : int32_t {
  kPlanOk = 0,
  kPlanNegativeLoad = 1,  // some loads[r, e] < 0
  kPlanOverflow = 2,      // an expert's or a rank's total load does not fit in int32
};

// Output views for one plan.
struct PlanOut {
  int32_t* slot_expert;   // [R, S], -1 = empty
  int32_t* slot_quota;    // [R, S]
  int32_t* master_quota;  // [E]
  int32_t* rank_load;     // [R]
};

UEP_HD inline int64_t workspace_elems(const PlanDims& d) {
  return 2 * d.E + 7 * d.R + 3 * d.R * d.S;
}

// Exact mode: eps is +0.0 or -0.0, read from its bits, so that a subnormal eps is a tolerance also
// where the CPU treats subnormals as zero (XLA's CPU threads do), as in PLANNER.md.
UEP_HD inline bool is_exact_mode(double eps) {
  uint64_t bits;
  memcpy(&bits, &eps, sizeof bits);
  return (bits << 1) == 0;
}

namespace detail {

UEP_HD inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
UEP_HD inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

// In-place sort of idx[0..n) so that before(idx[i], idx[j]) holds for i < j (heap sort, no
// allocation and no recursion, so it also runs on the device).
template <class Before>
UEP_HD void sift_down(int64_t* idx, int64_t n, int64_t i, const Before& before) {
  for (;;) {
    int64_t c = 2 * i + 1;
    if (c >= n) return;
    // Max-heap with respect to "comes later".
    if (c + 1 < n && before(idx[c], idx[c + 1])) ++c;
    if (!before(idx[i], idx[c])) return;
    int64_t tmp = idx[i];
    idx[i] = idx[c];
    idx[c] = tmp;
    i = c;
  }
}

template <class Before>
UEP_HD void sort_indices(int64_t* idx, int64_t n, const Before& before) {
  if (n <= 32) {  // insertion sort: fewer steps for the short per-rank expert lists
    for (int64_t i = 1; i < n; ++i) {
      const int64_t v = idx[i];
      int64_t j = i;
      for (; j > 0 && before(v, idx[j - 1]); --j) idx[j] = idx[j - 1];
      idx[j] = v;
    }
    return;
  }
  for (int64_t i = n / 2 - 1; i >= 0; --i) sift_down(idx, n, i, before);
  for (int64_t end = n - 1; end > 0; --end) {
    int64_t tmp = idx[0];
    idx[0] = idx[end];
    idx[end] = tmp;
    sift_down(idx, end, 0, before);
  }
}

// Sorts descending by key, ties by index ascending.
struct DescendingKey {
  const int64_t* key;
  UEP_HD bool operator()(int64_t a, int64_t b) const {
    return key[a] > key[b] || (key[a] == key[b] && a < b);
  }
};

struct Workspace {
  int64_t* load_e;      // [E]
  int64_t* exported;    // [E]
  int64_t* L;           // [R]: master-only rank loads
  int64_t* slack;       // [R]
  int64_t* free_slots;  // [R]
  int64_t* rank_order;  // [R]: ranks by L descending
  int64_t* order;       // [R]: the order the overloaded ranks give in (a repair's)
  int64_t* active;      // [R]: ranks that can take a replica
  int64_t* taken;       // [R]: replicas created on each rank so far (slot cursor)
  int64_t* rep_expert;  // [R * S]
  int64_t* rep_target;  // [R * S]
  int64_t* rep_quota;   // [R * S]

  UEP_HD Workspace(int64_t* base, const PlanDims& d) {
    load_e = base;
    exported = load_e + d.E;
    L = exported + d.E;
    slack = L + d.R;
    free_slots = slack + d.R;
    rank_order = free_slots + d.R;
    order = rank_order + d.R;
    active = order + d.R;
    taken = active + d.R;
    rep_expert = taken + d.R;
    rep_target = rep_expert + d.R * d.S;
    rep_quota = rep_target + d.R * d.S;
  }
};

// Whether rank t is near for a replica of expert e given by source rank src (PLANNER.md,
// pick_target): in src's fast domain (dsz consecutive ranks each), or in a domain that already
// holds a replica of e. Only src's masters give while src is the source, so e's replicas are among
// its replicas rep_*[first, nrep). With one domain (dsz = R) every rank is near.
template <class Index>
UEP_HD bool is_near(int64_t t, int64_t src, int64_t e, int64_t dsz, const Index* rep_expert,
                    const Index* rep_target, int64_t first, int64_t nrep) {
  const int64_t dom = t / dsz;
  if (dom == src / dsz) return true;
  for (int64_t i = first; i < nrep; ++i)
    if (rep_expert[i] == e && rep_target[i] / dsz == dom) return true;
  return false;
}

// The best fit, the best near fit and the most slack among the candidates seen so far (ties ->
// smallest rank).
struct Choice {
  int64_t fit = -1, fit_s = 0, fit_t = 0;     // least slack >= need: position, slack, rank
  int64_t near = -1, near_s = 0, near_t = 0;  // the same among the near ranks
  int64_t most = -1, most_s = 0, most_t = 0;  // most slack

  // (*k, *ks, *kt) becomes (k, t, s) if that has less slack (or as much and a smaller rank).
  UEP_HD static void least(int64_t* k, int64_t* ks, int64_t* kt, int64_t pos, int64_t t,
                           int64_t s) {
    if (*k >= 0 && (s > *ks || (s == *ks && t >= *kt))) return;
    *k = pos;
    *ks = s;
    *kt = t;
  }
  UEP_HD void see(int64_t k, int64_t t, int64_t s, int64_t need, bool nearby) {
    if (s >= need) least(&fit, &fit_s, &fit_t, k, t, s);
    if (s >= need && nearby) least(&near, &near_s, &near_t, k, t, s);
    if (most < 0 || s > most_s || (s == most_s && t < most_t)) {
      most = k;
      most_s = s;
      most_t = t;
    }
  }
  UEP_HD int64_t pick() const { return near >= 0 ? near : (fit >= 0 ? fit : most); }
};

// The target rules of pick_target (PLANNER.md).
enum Rule { kLoose, kStrict, kMost };

// The target for a replica that should carry `need` tokens of an expert that can give `a`: among
// ranks with a free slot and slack (ws.active[0, n_active)), with kMost the one with the most
// slack; else the one with the least slack that still takes all of `need` (best fit keeps large
// slacks for large excesses), a near one (near(t), see is_near) before any other, else the one
// with the most slack; ties -> smallest rank. With kStrict, a rank whose last free slot would
// strand slack (free == 1, slack > a) is left out unless no other candidate exists. Returns the
// position in ws.active, -1 if there is no candidate.
template <class Near>
UEP_HD int64_t pick_target(const Workspace& ws, int64_t n_active, int64_t need, int64_t a,
                           Rule rule, const Near& near) {
  const bool strict = rule == kStrict;
  Choice all, kept;  // every candidate; the strict rule's candidates
  for (int64_t k = 0; k < n_active; ++k) {
    const int64_t t = ws.active[k], s = ws.slack[t];
    const bool nearby = rule != kMost && s >= need && near(t);  // only a fit's nearness counts
    all.see(k, t, s, need, nearby);
    if (strict && !(ws.free_slots[t] == 1 && s > a)) kept.see(k, t, s, need, nearby);
  }
  if (rule == kMost) return all.most;
  return (strict && kept.most >= 0) ? kept.pick() : all.pick();
}

// The master of rank `src` with the most tokens left to give, avail[e] of PLANNER.md, into *avail
// (ties -> smallest index): a large piece now keeps the source's replica count low.
UEP_HD inline int64_t richest_master(const PlanDims& d, const Workspace& ws, int64_t src, int64_t K,
                                     int64_t* avail) {
  const int64_t first = d.first_master(src);
  int64_t best = first;
  *avail = ws.load_e[first] - K - ws.exported[first];
  for (int64_t j = first + 1; j < first + d.experts_per_rank(); ++j) {
    const int64_t a = ws.load_e[j] - K - ws.exported[j];
    if (a > *avail) {
      best = j;
      *avail = a;
    }
  }
  return best;
}

// How an attempt ended.
enum Outcome { kSuccess, kFailed, kInfeasible };  // kInfeasible: no plan reaches the threshold

// attempt(tau, f, rule, order) of PLANNER.md with the order in ws.order[0, n_order) (the
// overloaded ranks). On success the replicas are in ws.rep_* [0, *num_replicas) and ws.exported
// holds what each master gave away; on failure *failed is the source that failed. kInfeasible: a
// floor-1 attempt found a source whose masters have nothing left, which no plan can relieve.
UEP_HD inline Outcome attempt(const PlanDims& d, const PlanOptions& o, Workspace& ws, int64_t tau,
                              int64_t lmax, int64_t f, Rule rule, int64_t n_order,
                              int64_t* num_replicas, int64_t* failed) {
  *num_replicas = 0;
  for (int64_t e = 0; e < d.E; ++e) ws.exported[e] = 0;
  if (tau >= lmax) return kSuccess;
  int64_t n_active = 0;  // ranks that can still take a replica, in any order
  for (int64_t t = 0; t < d.R; ++t) {
    ws.slack[t] = max64(tau - ws.L[t], 0);
    ws.free_slots[t] = d.S;
    if (ws.slack[t] > 0 && d.S > 0) ws.active[n_active++] = t;
  }
  int64_t later = 0;  // X of PLANNER.md: the excess that the ranks after the current one must shed
  for (int64_t t = 0; t < d.R; ++t) later += max64(ws.L[t] - tau, 0);
  int64_t nrep = 0;
  for (int64_t ri = 0; ri < n_order; ++ri) {
    const int64_t src = ws.order[ri];
    int64_t x = ws.L[src] - tau;
    later -= x;
    *failed = src;
    const int64_t first = nrep;  // src's replicas: rep_*[first, nrep)
    while (x > 0) {
      const int64_t fl = min64(f, x);
      int64_t avail = 0;
      const int64_t e = richest_master(d, ws, src, o.master_keep_tokens, &avail);
      if (avail < fl) return f == 1 ? kInfeasible : kFailed;
      const auto near = [&](int64_t t) {
        return is_near(t, src, e, o.ranks_per_domain, ws.rep_expert, ws.rep_target, first, nrep);
      };
      const int64_t k = pick_target(ws, n_active, min64(x, avail), avail, rule, near);
      if (k < 0) return kFailed;
      const int64_t t = ws.active[k];
      // Fill the target as far as the expert allows, even past the source's need (but not past
      // what the later ranks could use): the source then takes later ranks' replicas in its
      // own, otherwise idle, slots.
      const int64_t q = min64(min64(ws.slack[t], avail), x + later);
      if (q < fl) return kFailed;
      ws.rep_expert[nrep] = e;
      ws.rep_target[nrep] = t;
      ws.rep_quota[nrep] = q;
      ++nrep;
      ws.slack[t] -= q;
      ws.free_slots[t] -= 1;
      x -= q;
      ws.exported[e] += q;
      if (ws.slack[t] == 0 || ws.free_slots[t] == 0) ws.active[k] = ws.active[--n_active];
    }
    ws.slack[src] = -x;  // over-exported: the source becomes a target
    if (x < 0 && d.S > 0) ws.active[n_active++] = src;
  }
  *num_replicas = nrep;
  return kSuccess;
}

// try(tau) of PLANNER.md: the plain attempts, then the repairs, until one succeeds (its replicas
// stay in ws). `any_floor`: the probe may give up the floor F (exact mode, the capacity window).
UEP_HD inline bool try_threshold(const PlanDims& d, const PlanOptions& o, Workspace& ws,
                                 int64_t tau, int64_t lmax, bool any_floor, int64_t* num_replicas) {
  const int64_t F = o.min_tokens_per_replica;
  const int floors = (any_floor && F > 1) ? 2 : 1;
  int64_t n_over = 0;  // the plain order D: the overloaded ranks in rank order
  while (n_over < d.R && ws.L[ws.rank_order[n_over]] > tau) ++n_over;
  const auto plain = [&]() {
    for (int64_t i = 0; i < n_over; ++i) ws.order[i] = ws.rank_order[i];
  };
  int64_t failed_plain[2][2];  // [floor][loose, strict]: where the plain attempts failed
  for (int i = 0; i < floors; ++i) {
    for (int r = 0; r < 2; ++r) {
      plain();
      const Outcome out = attempt(d, o, ws, tau, lmax, i == 0 ? F : 1, r == 0 ? kLoose : kStrict,
                                  n_over, num_replicas, &failed_plain[i][r]);
      if (out == kSuccess) return true;
      if (out == kInfeasible) return false;
    }
  }
  // repair(tau, f, rule): the source that failed moves to the front, at most 3 times.
  for (int i = 0; i < floors; ++i) {
    const int64_t f = i == 0 ? F : 1;
    for (int r = 0; r < 3; ++r) {
      const Rule rule = r == 0 ? kLoose : (r == 1 ? kStrict : kMost);
      plain();
      int64_t failed = 0;
      if (r < 2) {  // the plain attempt with this rule failed above
        failed = failed_plain[i][r];
      } else {
        const Outcome out = attempt(d, o, ws, tau, lmax, f, rule, n_over, num_replicas, &failed);
        if (out == kSuccess) return true;
        if (out == kInfeasible) return false;
      }
      for (int b = 0; b < 3 && failed != ws.order[0]; ++b) {
        int64_t p = 0;
        while (ws.order[p] != failed) ++p;
        for (; p > 0; --p) ws.order[p] = ws.order[p - 1];
        ws.order[0] = failed;
        const Outcome out = attempt(d, o, ws, tau, lmax, f, rule, n_over, num_replicas, &failed);
        if (out == kSuccess) return true;
        if (out == kInfeasible) return false;
      }
    }
  }
  return false;
}

// The threshold search of PLANNER.md: probes thresholds in a fixed order, the first success wins.
// On return *tau is the winner and ws holds its replicas (*have) or must be recomputed (!*have).
struct Search {
  const PlanDims& d;
  const PlanOptions& o;
  Workspace& ws;
  int64_t lmax;
  int64_t* nrep;
  bool any_floor;     // the probes may give up the floor (exact mode; set for the window)
  int64_t last = -1;  // the previous probe: a repeat has the same (failed) outcome

  UEP_HD bool probe(int64_t tau) {
    // Only failures are ever probed again (a success ends the search), and a repeat fails again
    // (the window's probes come first and try a superset of the later probes' attempts).
    if (tau < lmax && tau == last) return false;
    last = tau;
    return try_threshold(d, o, ws, tau, lmax, any_floor, nrep);  // tau >= lmax: no replicas
  }

  // The refine probes between a failed `a` and a successful `b`: the first success, else `b`
  // (*have says whether ws holds the winner's replicas).
  UEP_HD int64_t refine(int64_t a, int64_t b, bool* have) {
    *have = true;  // ws holds b's replicas unless a refine probe runs
    for (int64_t i = 1; i < 16; ++i) {
      const int64_t r = a + (b - a) * i / 16;
      if (r <= a || r >= b) continue;
      *have = false;
      if (probe(r)) {
        *have = true;
        return r;
      }
    }
    return b;
  }

  // window(a, b): the winner, or -1 if the window fails.
  UEP_HD int64_t window(int64_t a, int64_t b, int64_t delta, bool* have) {
    *have = true;
    if (probe(a)) return a;
    int64_t p = a;
    for (int64_t k = 1; k < 4 && a + k * delta <= b; ++k) {
      p = a + k * delta;
      if (probe(p)) return p;
    }
    if (p >= b) return -1;
    int64_t prev = p;
    for (int64_t j = 1; j <= 32; ++j) {
      const int64_t c = p + (b - p) * j / 32;
      if (probe(c)) return refine(prev, c, have);
      prev = c;
    }
    return -1;
  }
};

// clampfloor / clampceil of PLANNER.md: the double's floor (ceil) as int64 when it is below
// `lmax`, else `lmax` (so that a huge, infinite or NaN value never reaches the int64 conversion).
UEP_HD inline int64_t clamp_floor(double v, int64_t lmax) {
  return v < static_cast<double>(lmax) ? static_cast<int64_t>(floor(v)) : lmax;
}
UEP_HD inline int64_t clamp_ceil(double v, int64_t lmax) {
  return v < static_cast<double>(lmax) ? static_cast<int64_t>(ceil(v)) : lmax;
}

}  // namespace detail

// Phase 1: load_e[e] = sum_r loads[r, e] into the workspace's first E entries (row by row, so
// that it vectorises on the host). Returns the OR of all loads: negative iff some load is.
UEP_HD inline int32_t expert_totals(const PlanDims& d, const int32_t* loads, int64_t* workspace) {
  int64_t* load_e = detail::Workspace(workspace, d).load_e;
  for (int64_t e = 0; e < d.E; ++e) load_e[e] = 0;
  int32_t sign = 0;  // branch-free, so the loop vectorises
  for (int64_t r = 0; r < d.R; ++r) {
    for (int64_t e = 0; e < d.E; ++e) {
      const int32_t v = loads[r * d.E + e];
      sign |= v;
      load_e[e] += v;
    }
  }
  return sign;
}

namespace detail {

// PLANNER.md "Derived quantities": each rank's master load L[r] (into ws.L), the total T and Lmax,
// and ws.rank_order (ranks by descending L). Returns a PlanStatus: loads or a rank's sum that do
// not fit int32 overflow.
UEP_HD inline int32_t rank_totals(const PlanDims& d, Workspace& ws, int64_t* total, int64_t* lmax) {
  const int64_t kInt32Max = 2147483647;
  *total = *lmax = 0;
  for (int64_t r = 0; r < d.R; ++r) {
    int64_t l = 0;
    const int64_t first = d.first_master(r);
    for (int64_t e = first; e < first + d.experts_per_rank(); ++e) {
      if (ws.load_e[e] > kInt32Max) return kPlanOverflow;
      l += ws.load_e[e];
    }
    if (l > kInt32Max) return kPlanOverflow;
    ws.L[r] = l;
    *total += l;
    *lmax = max64(*lmax, l);
  }
  for (int64_t r = 0; r < d.R; ++r) ws.rank_order[r] = r;
  sort_indices(ws.rank_order, d.R, DescendingKey{ws.L});
  return kPlanOk;
}

// The outputs of a plan that failed: -1 everywhere, so that a caller that cannot raise (the
// device) still yields no valid plan.
UEP_HD inline void write_failed_plan(const PlanDims& d, PlanOut out) {
  for (int64_t i = 0; i < d.R * d.S; ++i) out.slot_expert[i] = out.slot_quota[i] = -1;
  for (int64_t e = 0; e < d.E; ++e) out.master_quota[e] = -1;
  for (int64_t r = 0; r < d.R; ++r) out.rank_load[r] = -1;
}

// The search's capacity step: thresholds from min(tau0, C) up to C, then from the mean's ceiling
// up to below min(tau0, C), every probe allowed to give up the floor. Returns the winner, or -1.
UEP_HD inline int64_t capacity_probes(Search& search, int64_t tau0, int64_t mean_ceil,
                                      int64_t delta, int64_t cap, bool* have) {
  const bool any_floor = search.any_floor;
  search.any_floor = true;  // a plan that fits the buffer is worth a replica below F
  const int64_t a = min64(tau0, cap);
  int64_t w = search.window(a, cap, delta, have);
  if (w < 0 && a > mean_ceil) w = search.window(mean_ceil, a - 1, delta, have);  // below a
  search.any_floor = any_floor;
  return w;
}

// The search's ladder: tau0 + i * delta for i < 4, then 31 points spread up to Lmax, the first
// success refined down from the previous point. Returns the winner, or -1.
UEP_HD inline int64_t ladder_probes(Search& search, int64_t tau0, int64_t delta, int64_t lmax,
                                    bool* have) {
  for (int64_t i = 0; i < 4; ++i) {
    if (search.probe(tau0 + i * delta)) {
      *have = true;
      return tau0 + i * delta;
    }
  }
  const int64_t lo = tau0 + 3 * delta;
  const int64_t span = lmax - lo;
  int64_t prev = lo;
  for (int64_t j = 1; j < 32; ++j) {
    const int64_t c = lo + span * j / 32;
    if (search.probe(c)) return search.refine(prev, c, have);
    prev = c;
  }
  return -1;
}

// The search's starting points (PLANNER.md "Derived quantities"): M, tau0 and delta.
struct SearchStart {
  int64_t mean_ceil;  // M = ceil(T / R)
  int64_t tau0;       // the first threshold of the ladder
  int64_t delta;      // the ladder's step
};

UEP_HD inline SearchStart search_start(const PlanDims& d, const PlanOptions& o, int64_t total,
                                       int64_t lmax) {
  // The largest integer threshold within (1 + eps) of the mean, but never below the mean's ceiling.
  const int64_t mean_ceil = (total + d.R - 1) / d.R;
  const int64_t tau0 = max64(
      mean_ceil,
      clamp_floor(static_cast<double>(total) * (1.0 + o.eps) / static_cast<double>(d.R), lmax));
  const int64_t delta = max64(
      1, clamp_ceil(static_cast<double>(total) * o.eps / static_cast<double>(d.R) / 2.0, lmax));
  return SearchStart{mean_ceil, tau0, delta};
}

// Whether the search runs its capacity step (PLANNER.md: 0 < C < Lmax and C >= M).
UEP_HD inline bool capacity_applies(const PlanOptions& o, int64_t lmax, int64_t mean_ceil) {
  return o.capacity > 0 && o.capacity < lmax && o.capacity >= mean_ceil;
}

// PLANNER.md "The threshold search": the winning threshold (Lmax when no probe succeeds), with the
// winner's replicas left in ws (ws.rep_*, ws.exported) and their count in *nrep.
UEP_HD inline int64_t search_threshold(const PlanDims& d, const PlanOptions& o, Workspace& ws,
                                       int64_t total, int64_t lmax, int64_t* nrep) {
  const SearchStart st = search_start(d, o, total, lmax);
  const bool exact = is_exact_mode(o.eps);
  *nrep = 0;
  int64_t tau = -1;
  bool have = false;           // ws holds the winner's replicas
  bool won_any_floor = exact;  // the winning probe's floors
  if (total > 0 && d.S > 0 && d.R > 1) {
    Search search{d, o, ws, lmax, nrep, exact};
    if (capacity_applies(o, lmax, st.mean_ceil)) {
      tau = capacity_probes(search, st.tau0, st.mean_ceil, st.delta, o.capacity, &have);
      if (tau >= 0) won_any_floor = true;
    }
    if (tau < 0 && st.tau0 < lmax) tau = ladder_probes(search, st.tau0, st.delta, lmax, &have);
  }
  if (tau < 0) {
    tau = lmax;
    have = false;
  }
  // The winner's replicas again, with its probe's floors, if a later failed probe overwrote them.
  if (!have) try_threshold(d, o, ws, tau, lmax, won_any_floor, nrep);
  return tau;
}

// PLANNER.md "Output": master quotas, then the nrep replicas in their targets' slots in creation
// order, and every rank's balanced load.
UEP_HD inline void write_plan(const PlanDims& d, Workspace& ws, int64_t nrep, PlanOut out) {
  for (int64_t i = 0; i < d.R * d.S; ++i) {
    out.slot_expert[i] = -1;
    out.slot_quota[i] = 0;
  }
  for (int64_t r = 0; r < d.R; ++r) ws.taken[r] = 0;
  for (int64_t e = 0; e < d.E; ++e)
    out.master_quota[e] = static_cast<int32_t>(ws.load_e[e] - ws.exported[e]);
  for (int64_t r = 0; r < d.R; ++r) {
    int64_t l = 0;
    const int64_t first = d.first_master(r);
    for (int64_t e = first; e < first + d.experts_per_rank(); ++e)
      l += ws.load_e[e] - ws.exported[e];
    ws.L[r] = l;  // reused as the balanced load
  }
  for (int64_t i = 0; i < nrep; ++i) {
    const int64_t t = ws.rep_target[i];
    const int64_t slot = d.slot(t, ws.taken[t]++);
    out.slot_expert[slot] = static_cast<int32_t>(ws.rep_expert[i]);
    out.slot_quota[slot] = static_cast<int32_t>(ws.rep_quota[i]);
    ws.L[t] += ws.rep_quota[i];
  }
  for (int64_t r = 0; r < d.R; ++r) out.rank_load[r] = static_cast<int32_t>(ws.L[r]);
}

}  // namespace detail

// Phase 2: the plan from the expert totals that phase 1 left in the workspace (a device may
// compute those in parallel; the sums are integers, so any order gives the same plan).
UEP_HD inline int32_t plan_from_totals(const PlanDims& d, const PlanOptions& o, bool negative,
                                       PlanOut out, int64_t* workspace) {
  detail::Workspace ws(workspace, d);
  int64_t total = 0, lmax = 0;
  int32_t status = negative ? kPlanNegativeLoad : detail::rank_totals(d, ws, &total, &lmax);
  if (status != kPlanOk) {
    detail::write_failed_plan(d, out);
    return status;
  }
  int64_t nrep = 0;
  detail::search_threshold(d, o, ws, total, lmax, &nrep);
  detail::write_plan(d, ws, nrep, out);
  return kPlanOk;
}

// Plans one load matrix `loads` [R, E] (row-major). Returns a PlanStatus; on an error the outputs
// hold -1 everywhere so that a caller that cannot raise (the device) still yields no valid plan.
UEP_HD inline int32_t plan_one(const PlanDims& d, const PlanOptions& o, const int32_t* loads,
                               PlanOut out, int64_t* workspace) {
  const int32_t sign = expert_totals(d, loads, workspace);
  return plan_from_totals(d, o, sign < 0, out, workspace);
}

}  // namespace ultraep
