#!/usr/bin/env bash
# Riptide on a machine with a GPU (or an Ascend NPU), from a fresh checkout, in under 8 minutes:
#
#   scripts/device_check.sh [--dry-run] [--out DIR]
#
#   1. setup      a venv that sees the machine's own torch (--system-site-packages), Riptide installed
#                 into it with the platform's extra: .[dev,cuda] (mooncake-transfer-engine) or
#                 .[dev,npu] (torch-npu, mooncake-transfer-engine-npu). Wheels it installs: those of
#                 pyproject.toml's dependencies, plus pytest, pytest-timeout, openai and the Mooncake
#                 build. Offline, it installs Riptide alone (--no-deps) and runs what the machine has.
#   2. platform   what platforms.detect() finds: device, count, free memory, backend, Mooncake protocol.
#   3. tests      pytest -m "gpu or npu": the server (logprobs against transformers, bf16 batches), a
#                 push of device tensors into a server on the device, a short GRPO run; and the CPU
#                 platform tests.
#   4. serve      bench/serve_throughput.py on the device, bf16, a ~0.5 GB model (hidden 1024, 16
#                 layers, vocab 32000) built from a config: tokens/s against transformers' generate
#                 and a hand-written decode floor.
#   5. sync       bench/weight_sync.py --quick on the device, bf16 (the ~1 GB fp32 model, 0.5 GB):
#                 push GB/s against a raw device -> pinned host -> device copy of the same bytes
#                 (raw_d2h2d_gbps) and a raw Mooncake write. Skipped, with the reason, without Mooncake.
#
# Each step has a time limit; a step that fails or runs out is reported and the next one runs.
# Everything goes under DIR (default device_check_out/): one log per step, and results.jsonl with
# each bench's JSON line. --dry-run prints the steps and their commands and runs nothing.
set -uo pipefail
cd "$(dirname "$0")/.."

DRY=0
OUT=device_check_out
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY=1 ;;
        --out) OUT=$2; shift ;;
        -h|--help) sed -n 2,27p "$0"; exit 0 ;;
        *) echo "device_check.sh: unknown argument $1 (use --dry-run, --out DIR)" >&2; exit 2 ;;
    esac
    shift
done

PY=${PYTHON:-python3}
VENV=${VENV:-.venv-device}
VPY=$VENV/bin/python
if [ $DRY = 1 ]; then
    DEV="<cuda|npu>"
else
    DEV=$($PY -c "import torch; print('cuda' if torch.cuda.is_available() else 'npu' if __import__('importlib.util').util.find_spec('torch_npu') else 'none')" 2>/dev/null || echo none)
    if [ "$DEV" = none ]; then
        echo "device_check.sh: $PY has no torch that sees a CUDA device, nor torch_npu: nothing to check here" >&2
        exit 1
    fi
    mkdir -p "$OUT"
    : > "$OUT/results.jsonl"
fi
EXTRA=$([ "$DEV" = npu ] && echo npu || echo cuda)
FAILED=()

step() {    # step NAME LIMIT_S COMMAND...: run it (or print it), log to $OUT/NAME.log
    local name=$1 limit=$2
    shift 2
    local shown=() a
    for a in "$@"; do [[ $a == *[[:space:]]* ]] && shown+=("'$a'") || shown+=("$a"); done
    echo "== $name (limit ${limit}s): ${shown[*]}"
    [ $DRY = 1 ] && return 0
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "   rc=$rc in $((SECONDS - t0))s; log $OUT/$name.log"
    if [ $rc != 0 ]; then
        FAILED+=("$name (rc $rc)")
        tail -n 15 "$OUT/$name.log" | sed 's/^/   | /'
    fi
    return $rc
}

keep_json() {    # the bench's last line, when it is JSON, into results.jsonl
    [ $DRY = 1 ] && return 0
    tail -n 1 "$OUT/$1.log" | $VPY -c "import json,sys; l=sys.stdin.read(); json.loads(l); print(l.strip())" \
        >> "$OUT/results.jsonl" 2>/dev/null && echo "   $(tail -n 1 "$OUT/results.jsonl" | cut -c1-300)"
}

SETUP="[ -x $VPY ] || $PY -m venv --system-site-packages $VENV || exit 1
if ! $VPY -m pip install -q -e '.[dev,$EXTRA]'; then
    echo 'could not install .[dev,$EXTRA] (offline?): Riptide alone; steps needing what is missing fail or are skipped'
    $VPY -m pip install -q --no-deps --no-build-isolation -e . || exit 1
fi"

step setup 90 bash -c "$SETUP"
step platform 30 "$VPY" -c "
import platforms, torch
p = platforms.detect()
d = platforms.choose_device('auto')
free, total = p.memory(d)
print({'device': str(d), 'count': p.device_count(), 'name': getattr(p.module(), 'get_device_name', str)(d),
       'free_gib': round(free / 2**30, 1), 'total_gib': round(total / 2**30, 1), 'torch': torch.__version__,
       'backend': p.dist_backend, 'ray_resource': p.ray_resource, 'mooncake': p.mooncake('auto')})"
[ $DRY = 1 ] || cat "$OUT/platform.log"

step tests 140 "$VPY" -m pytest -q -rs -m "gpu or npu or not slow" tests/test_device.py tests/test_platforms.py \
    --junitxml="$OUT/tests.xml"

step serve 120 "$VPY" bench/serve_throughput.py --device "$DEV" --dtype bfloat16 --hidden 1024 --layers 16 \
    --vocab 32000 --num-requests 128 --skip hf_cb && keep_json serve

if [ $DRY = 1 ] || "$VPY" -c "import mooncake.engine" 2>/dev/null; then
    step sync 100 "$VPY" bench/weight_sync.py --device "$DEV" --dtype bfloat16 --quick && keep_json sync
else
    echo "== sync: skipped: the Mooncake wheel (mooncake-transfer-engine) is not installed and could not be"
    FAILED+=("sync (skipped: no Mooncake)")
fi

[ $DRY = 1 ] && exit 0
echo "== done in ${SECONDS}s; results in $OUT/results.jsonl"
if [ ${#FAILED[@]} -gt 0 ]; then
    printf '   not passed: %s\n' "${FAILED[@]}"
    exit 1
fi
