#!/usr/bin/env bash
# Every GPU figure (planner, exchanges, overlap, replay, GPU tests) in one command (docs/gpu.md):
#
#   bash experiments/gpu/run_all.sh                          # every part, on a GPU machine
#   bash experiments/gpu/run_all.sh --parts=setup,tests      # some parts (each <= 10 minutes)
#   bash experiments/gpu/run_all.sh --dry_run                # every part at tiny shapes on CPU
#   bash experiments/gpu/run_all.sh --check [--dry_run]      # every command checked, none run
#
# Parts, in order, with their expected time on one H100 (estimates: tests measured 137 s before):
#   setup           pip install of this checkout (builds ffi/ with the CUDA planner and its bench),
#                   then env.txt: commit, date, nvidia-smi, nvcc, jax / jaxlib    1-2 min, then s
#   tests           JAX_PLATFORMS=cuda,cpu pytest tests/library/test_gpu.py
#                   tests/experiments/test_gpu_planner.py -> tests_gpu.log               ~3 min
#   gpu_check       gpu_check --sections=env,planner,moe -> gpu_check/                  ~3 min
#   exchange        gpu_check --sections=env,exchange (5 XLA flag variants) -> exchange/  ~6 min
#   replay_train    replay, --shape=deepseek_v3, DeepSeek-R1 at EP64, train, Mosaic GPU
#                   kernels, bf16 -> replay_train.json / .log                           ~8 min
#   replay_prefill  the same, prefill -> replay_prefill.json / .log                       ~4 min
#   gmm             gpu_check --sections=env,gmm, a reduced sweep -> gmm/ (no target)       ~5 min
#   tests_cpu       the whole test suite on the host's CPU -> tests_cpu.log (optional)  ~10 min
# summary.md (python -m experiments.gpu.summary) is rewritten at the end of every run.
# Default --parts: setup,tests,gpu_check,exchange,replay_train,replay_prefill,gmm.
# On a machine that allows 10 minutes a command, run
#   --parts=setup,tests,gpu_check   then   --parts=setup,exchange
#   then --parts=setup,replay_train   then --parts=setup,replay_prefill,gmm
# and unpack $OUT/gpu_all.tar.gz into experiments/results/ after each.
#
# Options: --parts=LIST, --out=DIR (default experiments/results/gpu_<UTC date>; dry run:
# runs/gpu_all_dry; check: runs/gpu_all_check), --dry_run, --check (no GPU needed: each part's
# command is checked by experiments.gpu.command_check instead of run: its program imports and its
# flags parse, pytest collects, pip is not run; the setup's queries run as they are; with
# --dry_run the dry run's commands). Exits 1 when any part failed (after running the later
# parts), 2 for a bad argument. Environment: PYTHON (default python3), GPU_ALL_COMMIT (the commit to
# record where the tree has no .git), REPLAY_MATRICES (1), REPLAY_EP (64), PART_TIMEOUT (seconds a
# part may take, default 570), OUT (a folder copied back from a remote machine: DIR is packed into
# $OUT/gpu_all.tar.gz after each part, so that finished parts come back even if a later one is
# cut off).
set -uo pipefail
cd "$(dirname "$0")/../.."

PY=${PYTHON:-python3}
DRY=0
CHECK=0
PARTS=setup,tests,gpu_check,exchange,replay_train,replay_prefill,gmm
DIR=""
for arg in "$@"; do
  case $arg in
    --dry_run) DRY=1 ;;
    --check) CHECK=1 ;;
    --parts=*) PARTS=${arg#--parts=} ;;
    --out=*) DIR=${arg#--out=} ;;
    *) echo "run_all.sh: unknown argument $arg (see the header of $0)" >&2; exit 2 ;;
  esac
done
if [ -z "$DIR" ]; then
  if [ $CHECK = 1 ]; then
    DIR=runs/gpu_all_check
  elif [ $DRY = 1 ]; then
    DIR=runs/gpu_all_dry
  else
    DIR=experiments/results/gpu_$(date -u +%Y%m%d)
  fi
fi
mkdir -p "$DIR"
TIMEOUT=${PART_TIMEOUT:-570}
MATRICES=${REPLAY_MATRICES:-1}
EP=${REPLAY_EP:-64}
if [ $DRY = 1 ]; then
  export JAX_PLATFORMS=cpu
  DRYFLAG=--dry_run
else
  DRYFLAG=""
  # The setup builds the CUDA planner with nvcc from the PATH, or from the environment's
  # nvidia-cuda-nvcc wheel (CMakeLists.txt).
  if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
    export PATH=$PATH:/usr/local/cuda/bin
  fi
fi
export PYTHONUNBUFFERED=1
[ $CHECK = 1 ] && export JAX_PLATFORMS=cpu  # a check needs no GPU

FAILED=()  # the parts that failed; the script exits 1 when there is any

pack() {  # finished parts come back even if a later part is cut off
  if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then
    tar czf "$OUT/gpu_all.tar.gz" -C "$(dirname "$DIR")" "$(basename "$DIR")"
  fi
}

run_part() {  # run_part NAME LOG COMMAND...: runs it under the part timeout, records it
  local name=$1 log=$2
  shift 2
  [ $CHECK = 1 ] && set -- "$PY" -m experiments.gpu.command_check "$@"
  echo "== $name: $*"
  local start=$SECONDS
  timeout "$TIMEOUT" "$@" >"$log" 2>&1
  local rc=$?
  local took=$((SECONDS - start))
  tail -n 25 "$log"
  [ $rc = 124 ] && echo "== $name: TIMED OUT after $TIMEOUT s (partial output in $log)"
  echo "== $name: exit $rc, $took s"
  [ $rc = 0 ] || FAILED+=("$name")
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$took" "$*" >>"$DIR/commands.tsv"
  pack
}

record_env() {
  {
    echo "commit: ${GPU_ALL_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}$(
      git status --porcelain --untracked-files=no 2>/dev/null | grep -q . && echo ' (uncommitted changes)')"
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "dry_run: $DRY"
    echo "host: $(hostname) ($(nproc) cores)"
    echo "python: $($PY --version 2>&1) ($PY)"
    $PY - <<'EOF'
import importlib.metadata as md
import jax
for pkg in ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "flax", "triton"):
    try:
        print(f"{pkg}: {md.version(pkg)}")
    except md.PackageNotFoundError:
        pass
print(f"jax.__version__: {jax.__version__}")
print(f"devices: {jax.devices()}")
try:
    from ultraep_jax import tools
    print(f"cuda_planner_handler: {'built' if tools.has_cuda_handler() else 'MISSING'}")
except ImportError as e:
    print(f"cuda_planner_handler: unknown ({e})")
EOF
    echo "nvcc: $(command -v nvcc >/dev/null && nvcc --version | tail -n 2 | tr '\n' ' ' || echo 'not found')"
    echo "== nvidia-smi"
    nvidia-smi 2>&1 || echo "(no nvidia-smi)"
  } >"$DIR/env.txt" 2>&1
  cat "$DIR/env.txt"
}

part_setup() {
  if [ $DRY = 1 ] && $PY -c "from ultraep_jax import tools; tools.cpu_library()" 2>/dev/null; then
    echo "== setup: installed already (dry run: no reinstall)"
  else
    # No network on the device machine: its image has the build requirements. The CUDA handler
    # and the planner's benchmark library are built only when asked for (pyproject.toml).
    local build_cuda=()
    [ $DRY = 0 ] && build_cuda=(env ULTRAEP_BUILD_CUDA=ON ULTRAEP_BUILD_CUDA_BENCH=ON)
    run_part setup "$DIR/setup.log" \
      "${build_cuda[@]}" $PY -m pip install -q --no-index --no-build-isolation --no-deps -e .
  fi
  record_env
  if [ $DRY = 0 ] && ! grep -q "cuda_planner_handler: built" "$DIR/env.txt"; then
    echo "!! the CUDA planner handler is MISSING (no nvcc when ffi/ was built? setup.log): the planner"
    echo "!! section reports 'skipped'; no CPU planner time is reported as the GPU's."
  fi
  pack
}

replay_args() {  # replay_args MODE
  local mode=$1
  if [ $DRY = 1 ]; then
    echo "--workloads=deepseek-r1 --ep_sizes=4 --mode=$mode --matrices=1 --d_model=16 --d_ff=8" \
      "--pairs_per_rank=512 --prefill_pairs_per_rank=512 --repeats=1 --refine=0" \
      "--refine_rounds=1 --bookkeeping_ranks=1 --cpu_core=-1"
  else
    # Wall clock on the GPU: little noise, so fewer refinement rounds than on a shared CPU.
    echo "--shape=deepseek_v3 --kernel=mgpu --workloads=deepseek-r1 --ep_sizes=$EP --mode=$mode" \
      "--matrices=$MATRICES --repeats=3 --refine_rounds=9 --cpu_core=-1"
  fi
}

IFS=, read -ra WANT <<<"$PARTS"
for part in "${WANT[@]}"; do
  case $part in
    setup) part_setup ;;
    tests)
      run_part tests "$DIR/tests_gpu.log" env JAX_PLATFORMS="$([ $DRY = 1 ] && echo cpu || echo cuda,cpu)" \
        $PY -m pytest -q -p no:cacheprovider tests/library/test_gpu.py \
        tests/experiments/test_gpu_planner.py ;;
    tests_cpu)
      run_part tests_cpu "$DIR/tests_cpu.log" env JAX_PLATFORMS=cpu \
        $PY -m pytest -q -p no:cacheprovider tests/ ;;
    gpu_check)
      run_part gpu_check "$DIR/gpu_check.log" $PY -m experiments.gpu.check $DRYFLAG \
        --out="$DIR/gpu_check" --sections=env,planner,moe ;;
    exchange)
      # The dry run's variants: XLA's defaults, and a flag no jaxlib knows (the reporting path).
      variants=$([ $DRY = 1 ] && echo "default,--xla_ultraep_no_such_flag=true" ||
        echo "default,decomposer,one_shot_off,device_kernel,latency_hiding")
      run_part exchange "$DIR/exchange.log" $PY -m experiments.gpu.check $DRYFLAG \
        --out="$DIR/exchange" --sections=env,exchange --exchange_variants="$variants" \
        --exchange_timeout=150 ;;
    replay_train | replay_prefill)
      mode=${part#replay_}
      # shellcheck disable=SC2046
      run_part "$part" "$DIR/$part.log" $PY -m experiments.replay $(replay_args "$mode") \
        --json_out="$DIR/$part.json" ;;
    gmm)
      run_part gmm "$DIR/gmm.log" $PY -m experiments.gpu.check $DRYFLAG --out="$DIR/gmm" \
        --sections=env,gmm --gmm_groups=8 --gmm_sizes=16384,65536 \
        --mgpu_configs=128x128x64c4g4,128x128x64c5g4 ;;
    summary) ;;
    *) echo "run_all.sh: unknown part $part" >&2; exit 2 ;;
  esac
done

if [ $CHECK = 1 ]; then
  run_part summary "$DIR/summary.log" $PY -m experiments.gpu.summary --dir="$DIR"
elif $PY -m experiments.gpu.summary --dir="$DIR" >/dev/null; then
  echo "== summary: $DIR/summary.md"
  cat "$DIR/summary.md"
else
  FAILED+=(summary)
fi
pack
if [ ${#FAILED[@]} -gt 0 ]; then
  echo "== failed: ${FAILED[*]}"
  exit 1
fi
