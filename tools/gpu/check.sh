#!/usr/bin/env bash
# The prepared GPU check: on a machine with a GPU and only this checkout, set up, then run each
# step bounded in time, writing a Markdown report. A step that fails does not stop the others;
# the exit code is 1 when any failed. Without a GPU (or with --cpu) every step runs in its CPU
# mode (the Triton interpreter, tiny sizes): what CI runs so that the script does not rot.
#
#   tools/gpu/check.sh [--out DIR] [--wheels DIR] [--cpu] [--only STEP,...] [--models M...]
#
# --out DIR      report.md, check.log and the figures as JSON (default: $OUT, else tools/gpu/out)
# --wheels DIR   a machine that cannot reach a package index: pip install DIR/*.whl (kern's
#                wheel from scripts/build-wheel and what the machine's Python lacks, from
#                constraints.txt's pins) into a fresh folder, and run with the machine's python3
# --cpu          the CPU mode even where a GPU is present
# --only STEPS   some of: env, kernels, gemm, sync, graphs, decode, e2e (default: all, in that
#                order)
# --models M...  decode: some of qwen3-0.6b, qwen3-4b, qwen3-8b (default qwen3-0.6b qwen3-8b:
#                the figures the decode targets name; making the ~8B takes a minute or two)
# --targets A,B  e2e: some of tools/e2e/gpu.toml's targets (default all)
# --e2e-limit S  e2e: its time limit in seconds (default 300)
# Without --wheels it uses .venv (scripts/setup makes it when missing).
set -uo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
out=${OUT:-$root/tools/gpu/out}
wheels="" cpu=0 only="env,kernels,gemm,sync,graphs,decode,e2e" models="qwen3-0.6b qwen3-8b"
targets="" e2e_limit=300
while [ $# -gt 0 ]; do
  case $1 in
    --out) out=$2; shift 2 ;;
    --wheels) wheels=$2; shift 2 ;;
    --cpu) cpu=1; shift ;;
    --only) only=$2; shift 2 ;;
    --models) models=$2; shift 2 ;;
    --targets) targets="--targets $2"; shift 2 ;;
    --e2e-limit) e2e_limit=$2; shift 2 ;;
    *) echo "tools/gpu/check.sh: unknown argument $1 (see the header of this file)" >&2; exit 2 ;;
  esac
done
mkdir -p "$out"
report=$out/report.md log=$out/check.log
work=$(mktemp -d)  # models and the gate's logs: only the report and the figures go to --out
: >"$log"
started=$(date +%s)

if [ -n "$wheels" ]; then
  py=$(command -v python3)
  site=$(mktemp -d)
  if ! "$py" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$wheels"/*.whl >>"$log" 2>&1; then
    echo "tools/gpu/check.sh: installing $wheels/*.whl failed (see $log)" >&2
    exit 2
  fi
  export PYTHONPATH=$site PATH=$site/bin:$PATH
else
  [ -x .venv/bin/python ] || scripts/setup >>"$log" 2>&1 || { echo "scripts/setup failed (see $log)" >&2; exit 2; }
  py=$root/.venv/bin/python
fi
gpu=0
if [ $cpu = 0 ] && "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>>"$log"; then
  gpu=1
fi
mode=$([ $gpu = 1 ] && echo "GPU" || echo "CPU (interpreter, tiny sizes: no figure means anything)")
{
  echo "# kern GPU check"
  echo
  echo "$(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'), mode: $mode"
  echo
} >"$report"

failed=()
# step NAME LIMIT_S CMD...: run CMD with a time limit, its output into the report and the log.
step() {
  local name=$1 limit=$2
  shift 2
  case ",$only," in *",$name,"*) ;; *) return 0 ;; esac
  local t0 rc part
  t0=$(date +%s)
  part=$(mktemp)
  echo "== $name" | tee -a "$log"
  timeout --kill-after=10 "$limit" "$@" >"$part" 2>&1
  rc=$?
  cat "$part" >>"$log"
  {
    echo "## $name"
    echo
    case $rc in
      0) echo "passed in $(($(date +%s) - t0)) s" ;;
      124 | 137) echo "**TIMED OUT** after $limit s" ;;
      *) echo "**FAILED** (exit $rc) after $(($(date +%s) - t0)) s" ;;
    esac
    echo
    # the step's own Markdown lines (tables, lists), then the tail of anything else
    grep -E '^(\||- |[A-Za-z].*:$|[a-z].*: )' "$part" | grep -v '^<!--' | head -120
    if [ $rc != 0 ]; then
      echo
      echo '```'
      tail -40 "$part"
      echo '```'
    fi
    echo
  } >>"$report"
  rm -f "$part"
  [ $rc = 0 ] || failed+=("$name")
  echo "   $name: exit $rc" | tee -a "$log"
}

step env 30 "$py" tools/gpu/bench.py env
if [ $gpu = 1 ]; then
  step kernels 90 env KERN_KERNEL_DEVICE=cuda "$py" -m pytest -q -p no:cacheprovider tests/kernels
  step gemm 110 "$py" tools/gpu/bench.py gemm --json "$out/gemm.json"
  # one eager step first, its forward under set_sync_debug_mode("error")
  step sync 90 "$py" tools/gpu/bench.py sync --work "$work/models" --json "$out/sync.json"
  # graph replay bits == eager bits padded to every size, capture time, ms/step both ways
  step graphs 120 "$py" tools/gpu/bench.py graphs --work "$work/models" --json "$out/graphs.json"
  # shellcheck disable=SC2086
  step decode 240 "$py" tools/gpu/bench.py decode --models $models --work "$work/models" --json "$out/decode.json"
  # shellcheck disable=SC2086
  step e2e "$e2e_limit" "$py" tools/e2e/e2e.py --config tools/e2e/gpu.toml $targets --out "$work/e2e" --timeout 300
else
  # the kernel tests themselves run in pytest on the CPU; here only that the step works
  step kernels 300 env KERN_KERNEL_DEVICE=cpu "$py" -m pytest -q -p no:cacheprovider tests/kernels/test_matmul.py -k "tile or mistakes"
  step gemm 300 env TRITON_INTERPRET=1 "$py" tools/gpu/bench.py gemm --small
  step sync 120 "$py" tools/gpu/bench.py sync --small --work "$work/models"
  # the padding logic through the CPU's eager stand-in (no graph is captured on a CPU)
  step graphs 120 "$py" tools/gpu/bench.py graphs --small --work "$work/models"
  step decode 300 "$py" tools/gpu/bench.py decode --small --work "$work/models"
  # shellcheck disable=SC2086
  step e2e 120 "$py" tools/e2e/e2e.py --config tools/e2e/gpu.toml $targets --out "$work/e2e"
fi
[ -f "$work/e2e/summary.md" ] && cp "$work/e2e/summary.md" "$out/e2e-summary.md"

{
  echo "---"
  echo "whole check: $(($(date +%s) - started)) s; failed: ${failed[*]:-none}"
} >>"$report"
cat "$report"
[ ${#failed[@]} = 0 ]
