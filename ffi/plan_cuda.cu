// XLA FFI handler (CUDA): the planner of PLANNER.md on the device, one block per plan of the
// batch, enqueued on XLA's stream with no host synchronisation (so it is safe in a CUDA graph).
//
// Two kernels compute the same plan, bit for bit:
//
// - plan_kernel_parallel (the default): the whole plan in shared memory. All threads sum the
//   expert totals and sort (rank sort: the orders are strict total orders, so any correct sort
//   gives the same permutation); then the threshold probes, which are independent given the sorted
//   state, run in parallel, one warp per probe with its own workspace, and the first success in
//   probe order wins (PLANNER.md's search is "a fixed sequence of probes; the first success
//   wins", so the winner is the one the sequential search finds). Inside a probe the warp shares
//   the target choice (an arg-min over the ranks); everything else follows detail::try_threshold
//   step by step. The coarse probes run in one round; the refine probes, which depend on which
//   coarse probe won, in a second.
// - plan_kernel_serial: the core (planner.h) run by one thread, the workspace in global memory.
//   Used where the parallel kernel's shared memory does not fit (very large E or R * S), or when
//   ULTRAEP_CUDA_PLANNER=serial is set.
//
// A device cannot raise: invalid input (a negative load, an int32 overflow) makes the plan's
// outputs -1 everywhere, which no valid plan contains (rank_load >= 0).
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "handler_shapes.h"
#include "planner.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kSerialThreads = 256;
constexpr int kMaxWarps = 32;   // probe warps of the parallel kernel (1024 threads)
constexpr int kFastProbes = 4;  // PLANNER.md: tau0 + i * delta, i < 4
constexpr int kCoarse = 31;     // c_j, j = 1 .. 31
constexpr int kRefine = 15;     // r_i, i = 1 .. 15
constexpr int kFirstProbes = kFastProbes + kCoarse;
constexpr int64_t kInt32Max = 2147483647;

// ---------------------------------------------------------------------------------------------
// The serial kernel: all threads sum the expert totals (coalesced: neighbouring threads read
// neighbouring experts of a row), then thread 0 runs the sequential rest of the core.
__global__ void plan_kernel_serial(ultraep::PlanDims d, ultraep::PlanOptions o, int64_t count,
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

// ---------------------------------------------------------------------------------------------
// The parallel kernel.

// Shared memory of one plan: the block-wide state (read-only while probes run), then one
// workspace per probe warp. 64-bit values first, so every array stays aligned.
struct ParLayout {
  int64_t E, R, RS;
  int64_t per_warp;  // int32 elements of one warp's workspace

  __host__ __device__ ParLayout(const ultraep::PlanDims& d)
      : E(d.E), R(d.R), RS(d.R * d.S), per_warp(d.E + 2 * d.R + 3 * d.R * d.S) {}
  __host__ __device__ int64_t fixed_bytes() const { return 8 * (E + R) + 4 * (R + E); }
  __host__ __device__ int64_t bytes(int warps) const {
    return fixed_bytes() + 4 * per_warp * static_cast<int64_t>(warps);
  }
};

// One probe warp's workspace: what detail::try_threshold keeps in ws.exported, ws.slack,
// ws.free_slots and ws.rep_* (int32: every value is bounded by a load that passed the int32
// overflow check). The active list is not kept: pick_target's choice depends only on the set of
// ranks with slack and a free slot, and their slacks, not on the list's order.
struct WarpWs {
  int32_t* exported;  // [E]
  int32_t* slack;     // [R]
  int32_t* free_slots;  // [R]
  int32_t* rep_expert;  // [R * S]
  int32_t* rep_target;  // [R * S]
  int32_t* rep_quota;   // [R * S]
};

__device__ __forceinline__ unsigned warp_min(unsigned v) {
#if __CUDA_ARCH__ >= 800
  return __reduce_min_sync(0xffffffffu, v);
#else
  for (int off = 16; off > 0; off >>= 1) v = min(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
#endif
}

// detail::pick_target, shared by the warp: among ranks with a free slot and slack, the least
// slack >= need (ties: smallest rank), else the most slack (ties: smallest rank); -1 if none.
// Every lane returns the same rank.
__device__ __forceinline__ int pick_target_warp(const WarpWs& w, int R, int64_t need, int lane) {
  constexpr unsigned kNone = 0xffffffffu;
  unsigned fit_s = kNone, fit_t = kNone, most_k = kNone, most_t = kNone;
  for (int t = lane; t < R; t += 32) {  // ascending t: strict comparisons keep the smallest rank
    const int32_t s = w.slack[t];
    if (s > 0 && w.free_slots[t] > 0) {
      if (s >= need && static_cast<unsigned>(s) < fit_s) {
        fit_s = static_cast<unsigned>(s);
        fit_t = static_cast<unsigned>(t);
      }
      const unsigned k = static_cast<unsigned>(kInt32Max - s);  // most slack = least key
      if (k < most_k) {
        most_k = k;
        most_t = static_cast<unsigned>(t);
      }
    }
  }
  const unsigned best_fit = warp_min(fit_s);
  if (best_fit != kNone) return static_cast<int>(warp_min(fit_s == best_fit ? fit_t : kNone));
  const unsigned best_most = warp_min(most_k);
  if (best_most != kNone) return static_cast<int>(warp_min(most_k == best_most ? most_t : kNone));
  return -1;
}

// detail::try_threshold for one warp (the comments name the core's steps). Returns 1 on success
// (the replicas in w.rep_*, their count in *num_replicas, w.exported set), 0 on failure, and -1
// when it stopped early because a probe earlier in the order (index < `probe`) succeeded, whose
// result wins anyway. Every lane returns the same value.
__device__ int try_threshold_warp(const ultraep::PlanDims& d, const ultraep::PlanOptions& o,
                                  const int64_t* load_e, const int64_t* L,
                                  const int32_t* rank_order, const int32_t* expert_order,
                                  const WarpWs& w, int64_t tau, int64_t lmax, int probe,
                                  const volatile int* best, int* num_replicas) {
  const int lane = threadIdx.x & 31;
  const int R = static_cast<int>(d.R);
  *num_replicas = 0;
  for (int64_t e = lane; e < d.E; e += 32) w.exported[e] = 0;
  if (tau >= lmax) {
    __syncwarp();
    return 1;
  }
  const int64_t em = d.E / d.R;
  for (int t = lane; t < R; t += 32) {
    w.slack[t] = static_cast<int32_t>(ultraep::detail::max64(tau - L[t], 0));
    w.free_slots[t] = static_cast<int32_t>(d.S);
  }
  __syncwarp();
  int nrep = 0;
  for (int ri = 0; ri < R; ++ri) {
    // Stop if an earlier probe already won (lane 0 reads, so that the warp agrees).
    int stop = 0;
    if (lane == 0) stop = *best < probe;
    if (__shfl_sync(0xffffffffu, stop, 0)) return -1;
    const int src = rank_order[ri];
    int64_t x = L[src] - tau;
    if (x <= 0) break;
    for (int64_t j = 0; j < em && x > 0; ++j) {
      const int e = expert_order[src * em + j];
      int64_t exported_e = 0;  // ws.exported[e], which is 0 when e's turn comes
      while (x > 0) {
        const int64_t fl = ultraep::detail::min64(o.min_tokens_per_replica, x);
        const int64_t avail = load_e[e] - o.master_keep_tokens - exported_e;
        if (avail < fl) break;
        const int t = pick_target_warp(w, R, ultraep::detail::min64(x, avail), lane);
        if (t < 0) return 0;
        const int64_t s = w.slack[t];
        const int64_t q = ultraep::detail::min64(ultraep::detail::min64(x, s), avail);
        if (q < fl) return 0;
        __syncwarp();  // every lane has read slack[t] before lane 0 changes it
        if (lane == 0) {
          w.rep_expert[nrep] = e;
          w.rep_target[nrep] = t;
          w.rep_quota[nrep] = static_cast<int32_t>(q);
          w.slack[t] = static_cast<int32_t>(s - q);
          w.free_slots[t] -= 1;
          w.exported[e] = static_cast<int32_t>(exported_e + q);
        }
        __syncwarp();
        ++nrep;
        x -= q;
        exported_e += q;
      }
    }
    if (x > 0) return 0;
  }
  *num_replicas = nrep;
  return 1;
}

__device__ __forceinline__ WarpWs warp_ws(int32_t* base, const ParLayout& lay, int warp) {
  int32_t* p = base + lay.per_warp * warp;
  WarpWs w;
  w.exported = p;
  w.slack = w.exported + lay.E;
  w.free_slots = w.slack + lay.R;
  w.rep_expert = w.free_slots + lay.R;
  w.rep_target = w.rep_expert + lay.RS;
  w.rep_quota = w.rep_target + lay.RS;
  return w;
}

// Ascending order "a before b" of the core's DescendingKey: key descending, ties index ascending.
__device__ __forceinline__ bool before(const int64_t* key, int64_t a, int64_t b) {
  return key[a] > key[b] || (key[a] == key[b] && a < b);
}

// One block of `warps` * 32 threads per plan; `warps` >= 2 (the refine round keeps the winning
// coarse probe's warp untouched and needs at least one other).
__global__ void __launch_bounds__(kMaxWarps * 32, 1)
    plan_kernel_parallel(ultraep::PlanDims d, ultraep::PlanOptions o, int64_t count, int warps,
                         const int32_t* loads, int32_t* slot_expert, int32_t* slot_quota,
                         int32_t* master_quota, int32_t* rank_load) {
  extern __shared__ int64_t smem[];
  __shared__ unsigned long long s_total;
  __shared__ long long s_lmax;
  __shared__ int s_bad;
  __shared__ int s_best;   // round 1: the first successful probe so far (kFirstProbes: none)
  __shared__ int s_best2;  // round 2: the first successful refine probe so far (kRefine: none)
  __shared__ int s_nrep[kMaxWarps];
  __shared__ long long s_tau[kFirstProbes];
  __shared__ long long s_refine[kRefine];

  const int64_t i = blockIdx.x;
  if (i >= count) return;
  const ParLayout lay(d);
  const int tid = threadIdx.x, nthreads = blockDim.x;
  const int warp = tid >> 5, lane = tid & 31;
  const int R = static_cast<int>(d.R);
  const int64_t E = d.E, em = d.E / d.R, RS = d.R * d.S;
  int64_t* load_e = smem;
  int64_t* L = load_e + E;
  int32_t* rank_order = reinterpret_cast<int32_t*>(L + R);
  int32_t* expert_order = rank_order + R;
  int32_t* warp_base = expert_order + E;

  const int32_t* plan_loads = loads + i * d.R * d.E;
  int32_t* p_slot_expert = slot_expert + i * RS;
  int32_t* p_slot_quota = slot_quota + i * RS;
  int32_t* p_master_quota = master_quota + i * E;
  int32_t* p_rank_load = rank_load + i * d.R;

  // Phase 1: expert totals. Thread w sums the rows r = g, g + ng, ... of expert e = w % E.
  for (int64_t e = tid; e < E; e += nthreads) load_e[e] = 0;
  if (tid == 0) {
    s_total = 0;
    s_lmax = 0;
    s_bad = 0;
    s_best = kFirstProbes;
    s_best2 = kRefine;
  }
  __syncthreads();
  const int64_t ng = E >= nthreads ? 1 : nthreads / E;
  int32_t sign = 0;
  for (int64_t wi = tid; wi < E * ng; wi += nthreads) {
    const int64_t e = wi % E, g = wi / E;
    int64_t sum = 0;
    for (int64_t r = g; r < d.R; r += ng) {
      const int32_t v = plan_loads[r * E + e];
      sign |= v;
      sum += v;
    }
    atomicAdd(reinterpret_cast<unsigned long long*>(&load_e[e]),
              static_cast<unsigned long long>(sum));
  }
  const int negative = __syncthreads_or(sign < 0);

  // Master loads, the int32 checks, the total and the largest master load.
  for (int r = tid; r < R; r += nthreads) {
    int64_t l = 0;
    int bad = 0;
    for (int64_t j = 0; j < em; ++j) {
      const int64_t v = load_e[r * em + j];
      bad |= v > kInt32Max;
      l += v;
    }
    bad |= l > kInt32Max;
    L[r] = l;
    if (bad) atomicOr(&s_bad, 1);
    atomicAdd(&s_total, static_cast<unsigned long long>(l));
    atomicMax(&s_lmax, static_cast<long long>(l));
  }
  __syncthreads();
  if (negative || s_bad) {
    for (int64_t k = tid; k < RS; k += nthreads) p_slot_expert[k] = p_slot_quota[k] = -1;
    for (int64_t e = tid; e < E; e += nthreads) p_master_quota[e] = -1;
    for (int r = tid; r < R; r += nthreads) p_rank_load[r] = -1;
    return;
  }
  const int64_t total = static_cast<int64_t>(s_total), lmax = s_lmax;

  // Sorting (rank sort: the position of each element is the number of elements before it).
  for (int r = tid; r < R; r += nthreads) {
    int pos = 0;
    for (int k = 0; k < R; ++k) pos += before(L, k, r);
    rank_order[pos] = r;
  }
  for (int64_t e = tid; e < E; e += nthreads) {
    const int64_t first = (e / em) * em;
    int64_t pos = 0;
    for (int64_t k = first; k < first + em; ++k) pos += before(load_e, k, e);
    expert_order[first + pos] = static_cast<int32_t>(e);
  }

  // The probe sequence (PLANNER.md), exactly as planner.h computes it.
  const int64_t tau0 = ultraep::detail::max64(
      (total + d.R - 1) / d.R,
      static_cast<int64_t>(floor(static_cast<double>(total) * (1.0 + o.eps) /
                                 static_cast<double>(d.R))));
  const bool search = total > 0 && d.S > 0 && d.R > 1 && tau0 < lmax;
  const int64_t delta = ultraep::detail::max64(
      1, static_cast<int64_t>(
             ceil(static_cast<double>(total) * o.eps / static_cast<double>(d.R) / 2.0)));
  const int64_t lo = tau0 + 3 * delta, span = lmax - lo;
  if (tid < kFirstProbes)
    s_tau[tid] = tid < kFastProbes ? tau0 + tid * delta : lo + span * (tid - kFastProbes + 1) / 32;
  __syncthreads();

  // Round 1: the fast and coarse probes, probe p on warp p % warps; a warp keeps the state of
  // its last success, and stops at its first (later probes of that warp cannot win).
  const WarpWs my = warp_ws(warp_base, lay, warp);
  if (search) {
    for (int p = warp; p < kFirstProbes; p += warps) {
      int nrep = 0;
      const int ok = try_threshold_warp(d, o, load_e, L, rank_order, expert_order, my, s_tau[p],
                                        lmax, p, &s_best, &nrep);
      if (ok < 0) break;
      if (ok == 1) {
        if (lane == 0) {
          s_nrep[warp] = nrep;
          atomicMin(&s_best, p);
        }
        break;
      }
    }
  }
  __syncthreads();

  // The winning threshold is the first success in probe order (none: Lmax, no replicas); the
  // plan is the winner's workspace.
  int state_warp = -1;  // the warp whose workspace holds the winner's plan; -1: no replicas
  const int best = s_best;
  if (search && best < kFirstProbes) {
    state_warp = best % warps;
    if (best >= kFastProbes) {
      // Round 2: the refine probes between the previous coarse probe and the winner, on the
      // other warps (the winner's warp keeps its state in case no refine probe succeeds).
      const int j = best - kFastProbes + 1;
      const int64_t hit = s_tau[best], prev = j == 1 ? lo : s_tau[best - 1];
      if (tid < kRefine) s_refine[tid] = prev + (hit - prev) * (tid + 1) / 16;
      __syncthreads();
      if (warp != state_warp) {
        const int slot = (warp - state_warp - 1 + warps) % warps;  // 0 .. warps - 2
        for (int q = slot; q < kRefine; q += warps - 1) {
          const int64_t r = s_refine[q];
          if (r <= prev || r >= hit) continue;  // skipped probes
          int nrep = 0;
          const int ok = try_threshold_warp(d, o, load_e, L, rank_order, expert_order, my, r,
                                            lmax, q, &s_best2, &nrep);
          if (ok < 0) break;
          if (ok == 1) {
            if (lane == 0) {
              s_nrep[warp] = nrep;
              atomicMin(&s_best2, q);
            }
            break;
          }
        }
      }
      __syncthreads();
      const int best2 = s_best2;
      if (best2 < kRefine) {
        state_warp = (state_warp + 1 + best2 % (warps - 1)) % warps;
      }
    }
  }

  // Write the plan from the winning workspace: replicas take their target's slots in creation
  // order; master quotas and balanced rank loads.
  const int nrep = state_warp >= 0 ? s_nrep[state_warp] : 0;
  const WarpWs w = warp_ws(warp_base, lay, state_warp >= 0 ? state_warp : 0);
  for (int64_t e = tid; e < E; e += nthreads)
    p_master_quota[e] = static_cast<int32_t>(load_e[e] - (state_warp >= 0 ? w.exported[e] : 0));
  for (int r = tid; r < R; r += nthreads) {
    int64_t l = 0;
    for (int64_t j = 0; j < em; ++j)
      l += load_e[r * em + j] - (state_warp >= 0 ? w.exported[r * em + j] : 0);
    for (int k = 0; k < nrep; ++k) l += w.rep_target[k] == r ? w.rep_quota[k] : 0;
    p_rank_load[r] = static_cast<int32_t>(l);
  }
  for (int64_t k = tid; k < RS; k += nthreads) {
    const int t = static_cast<int>(k / d.S);
    int64_t n = k % d.S;  // this slot holds the n-th replica created on rank t
    int32_t ex = -1, qu = 0;
    for (int m = 0; m < nrep; ++m) {
      if (w.rep_target[m] != t) continue;
      if (n-- == 0) {
        ex = w.rep_expert[m];
        qu = w.rep_quota[m];
        break;
      }
    }
    p_slot_expert[k] = ex;
    p_slot_quota[k] = qu;
  }
}

// ---------------------------------------------------------------------------------------------
// Launching.

enum Mode : int { kModeAuto = 0, kModeSerial = 1 };

// Dynamic shared memory the parallel kernel may use on the current device (the opt-in maximum
// less the kernel's static shared memory), with the kernel's limit raised to it once per device;
// 0 when that fails (the serial kernel then runs). Leaves no error behind for the launch check.
int64_t parallel_smem_limit() {
  static std::atomic<int64_t> limits[64];
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) {
    cudaGetLastError();
    return 0;
  }
  const int64_t have = limits[dev].load();
  if (have != 0) return have > 0 ? have : 0;
  int optin = 0;
  cudaFuncAttributes attr;
  int64_t limit = -1;
  if (cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) ==
          cudaSuccess &&
      cudaFuncGetAttributes(&attr, plan_kernel_parallel) == cudaSuccess) {
    const int dynamic = optin - static_cast<int>(attr.sharedSizeBytes);
    if (dynamic > 0 && cudaFuncSetAttribute(plan_kernel_parallel,
                                            cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            dynamic) == cudaSuccess)
      limit = dynamic;
  }
  cudaGetLastError();  // a failure above only means: no parallel kernel
  limits[dev].store(limit);
  return limit > 0 ? limit : 0;
}

// TEMPORARY: the parallel kernel mirrors the previous oracle; until it follows planner.h's
// current one it runs only with ULTRAEP_CUDA_PLANNER=parallel.
bool parallel_enabled() {
  static const bool on = [] {
    const char* v = std::getenv("ULTRAEP_CUDA_PLANNER");
    return v != nullptr && std::strcmp(v, "parallel") == 0;
  }();
  return on;
}

// Launches the batch; `max_warps` caps the parallel kernel's probe warps (0: the serial kernel).
// `workspace` is needed by the serial kernel only. Returns the launch error.
cudaError_t launch_plans(cudaStream_t stream, const ultraep::PlanDims& d,
                         const ultraep::PlanOptions& o, int64_t count, int64_t ws_elems,
                         const int32_t* loads, int32_t* slot_expert, int32_t* slot_quota,
                         int32_t* master_quota, int32_t* rank_load, int64_t* workspace,
                         int max_warps, int* used_warps) {
  int warps = 0;
  if (max_warps >= 2 && d.R <= (int64_t{1} << 20)) {
    const int64_t limit = parallel_smem_limit();
    const ParLayout lay(d);
    warps = max_warps < kMaxWarps ? max_warps : kMaxWarps;
    while (warps >= 2 && lay.bytes(warps) > limit) --warps;
    if (warps < 2) warps = 0;
  }
  if (used_warps != nullptr) *used_warps = warps;
  if (warps > 0) {
    const ParLayout lay(d);
    plan_kernel_parallel<<<static_cast<unsigned>(count), warps * 32,
                           static_cast<size_t>(lay.bytes(warps)), stream>>>(
        d, o, count, warps, loads, slot_expert, slot_quota, master_quota, rank_load);
  } else {
    plan_kernel_serial<<<static_cast<unsigned>(count), kSerialThreads, 0, stream>>>(
        d, o, count, ws_elems, loads, slot_expert, slot_quota, master_quota, rank_load,
        workspace);
  }
  return cudaGetLastError();
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
  cudaError_t err = launch_plans(
      stream, b.dims, o, b.count, b.workspace, loads.typed_data<int32_t>(),
      slot_expert->typed_data<int32_t>(), slot_quota->typed_data<int32_t>(),
      master_quota->typed_data<int32_t>(), rank_load->typed_data<int32_t>(),
      reinterpret_cast<int64_t*>(workspace->untyped_data()), parallel_enabled() ? kMaxWarps : 0,
      nullptr);
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

// Benchmark and test hook (no XLA): plans `count` matrices loads_host [count, R, E] on the current
// device with the given kernel (max_warps 0: the serial kernel; >= 2: the parallel kernel with at
// most that many probe warps), `iters` timed launches of the whole batch after one warm-up,
// each timed with CUDA events into times_ms[k]; copies the last launch's plans into the host
// outputs. Returns 0, or a CUDA error code; *used_warps is the parallel kernel's warp count (0:
// the serial kernel ran).
extern "C" __attribute__((visibility("default"))) int ultraep_plan_cuda_bench(
    int64_t R, int64_t E, int64_t S, int64_t min_tokens_per_replica, int64_t master_keep_tokens,
    double balance_eps, int64_t count, const int32_t* loads_host, int max_warps, int iters,
    float* times_ms, int32_t* slot_expert, int32_t* slot_quota, int32_t* master_quota,
    int32_t* rank_load, int* used_warps) {
  const ultraep::PlanDims d{R, E, S};
  const ultraep::PlanOptions o{min_tokens_per_replica, master_keep_tokens, balance_eps};
  const int64_t ws = ultraep::workspace_elems(d);
  int32_t *dl = nullptr, *dse = nullptr, *dsq = nullptr, *dmq = nullptr, *drl = nullptr;
  int64_t* dws = nullptr;
  cudaEvent_t ev0 = nullptr, ev1 = nullptr;
  cudaStream_t stream = nullptr;
  cudaError_t err = cudaSuccess;
#define UEP_TRY(x)                     \
  do {                                 \
    err = (x);                         \
    if (err != cudaSuccess) goto done; \
  } while (0)
  UEP_TRY(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  UEP_TRY(cudaMalloc(&dl, sizeof(int32_t) * count * R * E));
  UEP_TRY(cudaMalloc(&dse, sizeof(int32_t) * count * R * S + 4));
  UEP_TRY(cudaMalloc(&dsq, sizeof(int32_t) * count * R * S + 4));
  UEP_TRY(cudaMalloc(&dmq, sizeof(int32_t) * count * E));
  UEP_TRY(cudaMalloc(&drl, sizeof(int32_t) * count * R));
  UEP_TRY(cudaMalloc(&dws, sizeof(int64_t) * count * ws));
  UEP_TRY(cudaMemcpy(dl, loads_host, sizeof(int32_t) * count * R * E, cudaMemcpyHostToDevice));
  // Poison the outputs, so that an unwritten entry shows.
  UEP_TRY(cudaMemset(dse, 0x5a, sizeof(int32_t) * count * R * S + 4));
  UEP_TRY(cudaMemset(dsq, 0x5a, sizeof(int32_t) * count * R * S + 4));
  UEP_TRY(cudaMemset(dmq, 0x5a, sizeof(int32_t) * count * E));
  UEP_TRY(cudaMemset(drl, 0x5a, sizeof(int32_t) * count * R));
  UEP_TRY(cudaEventCreate(&ev0));
  UEP_TRY(cudaEventCreate(&ev1));
  UEP_TRY(launch_plans(stream, d, o, count, ws, dl, dse, dsq, dmq, drl, dws, max_warps,
                       used_warps));
  UEP_TRY(cudaStreamSynchronize(stream));
  for (int k = 0; k < iters; ++k) {
    UEP_TRY(cudaEventRecord(ev0, stream));
    UEP_TRY(launch_plans(stream, d, o, count, ws, dl, dse, dsq, dmq, drl, dws, max_warps,
                         nullptr));
    UEP_TRY(cudaEventRecord(ev1, stream));
    UEP_TRY(cudaEventSynchronize(ev1));
    UEP_TRY(cudaEventElapsedTime(&times_ms[k], ev0, ev1));
  }
  UEP_TRY(cudaMemcpy(slot_expert, dse, sizeof(int32_t) * count * R * S, cudaMemcpyDeviceToHost));
  UEP_TRY(cudaMemcpy(slot_quota, dsq, sizeof(int32_t) * count * R * S, cudaMemcpyDeviceToHost));
  UEP_TRY(cudaMemcpy(master_quota, dmq, sizeof(int32_t) * count * E, cudaMemcpyDeviceToHost));
  UEP_TRY(cudaMemcpy(rank_load, drl, sizeof(int32_t) * count * R, cudaMemcpyDeviceToHost));
#undef UEP_TRY
done:
  if (ev0) cudaEventDestroy(ev0);
  if (ev1) cudaEventDestroy(ev1);
  cudaFree(dl);
  cudaFree(dse);
  cudaFree(dsq);
  cudaFree(dmq);
  cudaFree(drl);
  cudaFree(dws);
  if (stream) cudaStreamDestroy(stream);
  return static_cast<int>(err);
}
