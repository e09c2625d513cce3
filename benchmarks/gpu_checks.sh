#!/usr/bin/env bash
# Every GPU check of the project in one run, one line per check, for the first person with a GPU:
# the preflight (each of its items on a line of its own), `pytest -m gpu`, the in-process test files on
# the GPU machine, and the GPU benchmark lines of docs/performance.md. Sized for one H100 in under 9
# minutes: each check has a timeout and the run a budget (default 530 s); a check that no longer fits
# is reported "not run" with the reason, so the run never overstays.
#
#   bash benchmarks/gpu_checks.sh [--out DIR] [--budget SECONDS] [--only NAME[,NAME...]] [--dry-run] [--cpu]
#
#   --out DIR     where each check's full output goes (DIR/<check>.log, DIR/preflight.json, DIR/summary.txt);
#                 default gpu_checks_<date>/ in the current directory
#   --budget S    seconds for the whole run (default 530; 0: no limit); a check starts only while its
#                 timeout fits in what is left
#   --only LIST   run these checks only (names as listed by --dry-run)
#   --dry-run     print each check's command and timeout, run nothing (exit 0)
#   --cpu         the same checks in their CPU form (preflight --quick, benchmark smoke sizes, one-step
#                 jobs; timeouts x 5, no budget): for trying the script itself on a machine without a GPU;
#                 its figures mean nothing
#
# Environments: a checkout with `pip install -e .` (or the NGC image of the Dockerfile), or a bare image
# with torch + CUDA but no megatron-core and no network (e.g. Python 3.12, torch 2.11+cu130,
# transformers, pytest-xdist): there, wheels made beforehand with
#   bash ../shared/tools/offline-wheels-py312.sh .whl      (or any `pip download` of megatron-core 0.16.1)
# and carried in $GSPO_WHEELS (default ./.whl) are installed with `pip install --no-index --no-deps`,
# and the checkout is put on PYTHONPATH. Exit status: 0 all ran checks passed, 1 one failed or timed out,
# 2 the environment cannot run them (named on the "setup" line).
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"

out="gpu_checks_$(date +%Y%m%d_%H%M%S)"
budget=""
only=""
dry=0
cpu=0
while [ $# -gt 0 ]; do
    case "$1" in
        --out) out="$2"; shift 2 ;;
        --budget) budget="$2"; shift 2 ;;
        --only) only="$2"; shift 2 ;;
        --dry-run) dry=1; shift ;;
        --cpu) cpu=1; shift ;;
        -h|--help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
        *) echo "gpu_checks.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done
# --cpu: the checks' CPU forms on a (possibly loaded) CPU: timeouts x 5 and, unless given, no budget
scale=$([ "$cpu" = 1 ] && echo 5 || echo 1)
budget=${budget:-$([ "$cpu" = 1 ] && echo 0 || echo 530)}
py="${PYTHON:-python3}"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore

# ---- the checks: name | timeout (s) | GPU command | CPU command ("-": none) ------------------------
# Ordered by what the first GPU run most needs: the preflight's items (numerics, decode, FP8, resume,
# MFU on the 2B proxy, memory), then the gpu-marked tests, then the figures of docs/performance.md.
JOB2B="model.preset=qwen3-moe-2b-proxy train.sft_steps=0 train.tensorboard=false reward.name=digit_match eval.interval=0"
JOBCPU="train.sft_steps=0 train.tensorboard=false reward.name=digit_match eval.interval=0 train.num_steps=1"
CHECKS=(
"preflight|240|$py -m megatron_gspo.preflight --json \$OUT/preflight.json|$py -m megatron_gspo.preflight --quick --json \$OUT/preflight.json"
"pytest-gpu|60|$py -m pytest -q -p no:cacheprovider -m gpu tests|$py -m pytest -q -p no:cacheprovider -m gpu tests"
"bench-decode-2b|90|$py benchmarks/run.py --device cuda --shape 2b-proxy --no-hf --expert-impls auto --no-memory --no-scaling --no-lpmem --no-profile --json \$OUT/bench_2b.json|$py benchmarks/run.py --smoke --no-hf --expert-impls auto --json \$OUT/bench_smoke.json"
"bench-decode-2b-graphs|75|$py benchmarks/run.py --device cuda --shape 2b-proxy --no-hf --expert-impls auto --no-memory --no-scaling --no-lpmem --no-profile --cuda-graphs --json \$OUT/bench_2b_graphs.json|-"
"rl-2b-proxy|75|$py -m megatron_gspo.train $JOB2B train.num_steps=3 generation.max_new_tokens=64 train.output_dir=\$OUT/rl_2b|$py -m megatron_gspo.train $JOBCPU train.output_dir=\$OUT/rl_tiny"
"rl-2b-512-tokens|90|$py -m megatron_gspo.train $JOB2B train.num_steps=2 generation.max_new_tokens=512 generation.ignore_eos=true train.output_dir=\$OUT/rl_2b_512|-"
"default-job|75|$py -m megatron_gspo.train train.tensorboard=false train.output_dir=\$OUT/default_job|-"
"pytest-in-process|120|$py -m pytest -q -p no:cacheprovider -m 'not slow' \$XDIST tests/test_decode.py tests/test_generation.py tests/test_experts.py tests/test_logprobs.py tests/test_devices.py tests/test_on_policy.py tests/test_jobs_in_one_process.py tests/test_fp8_alignment.py|-"
)

fmt() { printf '%-40s %-9s %7s  %s\n' "$1" "$2" "$3" "$4"; }

if [ "$dry" = 1 ]; then
    for c in "${CHECKS[@]}"; do
        IFS='|' read -r name tmo gpu_cmd cpu_cmd <<< "$c"
        cmd=$([ "$cpu" = 1 ] && echo "$cpu_cmd" || echo "$gpu_cmd")
        [ -n "$only" ] && [[ ",$only," != *",$name,"* ]] && continue
        fmt "$name" "$(( tmo * scale ))s" "" "$cmd"
    done
    exit 0
fi
if [ -n "$only" ]; then
    for n in ${only//,/ }; do
        printf '%s\n' "${CHECKS[@]}" | cut -d'|' -f1 | grep -qx "$n" ||
            { echo "gpu_checks.sh: no check named $n; checks: $(printf '%s\n' "${CHECKS[@]}" | cut -d'|' -f1 | tr '\n' ' ')" >&2; exit 2; }
    done
fi

mkdir -p "$out" || exit 2
out="$(cd "$out" && pwd)"
summary="$out/summary.txt"
: > "$summary"
say() { fmt "$@" | tee -a "$summary"; }
start=$(date +%s)

# ---- setup: torch (with CUDA unless --cpu), megatron-core (from carried wheels if absent), the rest ---
wheels="${GSPO_WHEELS:-$root/.whl}"
if ! "$py" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("megatron") is None)' > /dev/null 2>&1; then
    if ls "$wheels"/*.whl > /dev/null 2>&1; then
        "$py" -m pip install -q --no-index --no-deps "$wheels"/*.whl > "$out/setup.log" 2>&1
    fi
fi
setup=$("$py" - "$cpu" 2>&1 <<'EOF'
import importlib, sys
cpu = sys.argv[1] == "1"
try:
    import torch
except Exception as e:
    print(f"FAIL no torch ({e})"); sys.exit()
if not cpu and not torch.cuda.is_available():
    print(f"FAIL torch {torch.__version__} sees no CUDA device (use --cpu to try the script without a GPU)"); sys.exit()
try:
    import megatron.core
except Exception as e:
    print(f"FAIL no megatron-core ({type(e).__name__}: {e}); carry its wheel in $GSPO_WHEELS (default ./.whl): "
          "bash offline-wheels-py312.sh .whl, or pip download megatron-core==0.16.1"); sys.exit()
missing = [m for m in ("yaml", "psutil", "tensorboard", "safetensors", "tokenizers", "jinja2", "pytest")
           if importlib.util.find_spec(m) is None]
te = importlib.util.find_spec("transformer_engine") is not None
dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
xdist = importlib.util.find_spec("xdist") is not None
print(f"OK {dev}; python {sys.version.split()[0]}, torch {torch.__version__}, megatron-core {megatron.core.__version__}, "
      f"transformer_engine {'yes' if te else 'no'}, pytest-xdist {'yes' if xdist else 'no'}"
      + (f"; missing: {', '.join(missing)}" if missing else "") + ("|XDIST" if xdist else "|"))
EOF
)
status=${setup%% *}
info=${setup#* }
xdist_flag=""
[[ "$info" == *"|XDIST" ]] && xdist_flag="-n 8"
info=${info%|*}
if [ "$status" != OK ]; then
    say "setup" "failed" "" "$info"
    exit 2
fi
say "setup" "ok" "" "$info$([ "$cpu" = 1 ] && echo ' [--cpu: figures mean nothing]')"

# ---- run -------------------------------------------------------------------------------------------
detail() {  # the line of a check's log worth showing
    local name=$1 log=$2
    case "$name" in
        pytest-*) grep -E '[0-9]+ (passed|failed|skipped|error)' "$log" | tail -n 1 ;;
        bench-*) grep -E '^decode step' "$log" | tail -n 1 | cut -c1-160 ;;
        rl-*|default-job) grep -E 'step [0-9]+/[0-9]+ \|' "$log" | tail -n 1 | sed 's/^[0-9:]* //' | cut -c1-160 ;;
        *) tail -n 1 "$log" | cut -c1-160 ;;
    esac
}
preflight_items() {  # one line per preflight item
    "$py" - "$1" <<'EOF' | while IFS=$'\t' read -r n s v; do say "  preflight/$n" "$s" "" "$v"; done
import json, sys
doc = json.load(open(sys.argv[1]))
for name, r in doc["checks"].items():
    print(f"{name}\t{r['status']}\t{' '.join(str(r.get('value', '')).split())[:150]}")
EOF
}
failed=0
for c in "${CHECKS[@]}"; do
    IFS='|' read -r name tmo gpu_cmd cpu_cmd <<< "$c"
    [ -n "$only" ] && [[ ",$only," != *",$name,"* ]] && continue
    cmd=$([ "$cpu" = 1 ] && echo "$cpu_cmd" || echo "$gpu_cmd")
    if [ "$cmd" = "-" ]; then
        say "$name" "skipped" "" "GPU only (no CPU form)"
        continue
    fi
    tmo=$(( tmo * scale ))
    used=$(( $(date +%s) - start ))
    if [ "$budget" -gt 0 ] && [ $(( used + tmo )) -gt "$budget" ]; then
        say "$name" "not run" "" "time budget: ${used}s of ${budget}s used, this check may take ${tmo}s (--budget 0 runs everything)"
        continue
    fi
    log="$out/$name.log"
    t0=$(date +%s)
    OUT="$out" XDIST="$xdist_flag" timeout --kill-after=10 "$tmo" bash -c "OUT='$out'; XDIST='$xdist_flag'; $cmd" > "$log" 2>&1
    rc=$?
    secs="$(( $(date +%s) - t0 ))s"
    if [ $rc -eq 0 ]; then st=ok; elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then st=timeout; failed=1; else st=failed; failed=1; fi
    d=$(detail "$name" "$log")
    [ $rc -ne 0 ] && [ -z "$d" ] && d=$(tail -n 1 "$log" | cut -c1-160)
    say "$name" "$st" "$secs" "${d:-see $log}"
    if [ "$name" = preflight ] && [ -f "$out/preflight.json" ]; then
        preflight_items "$out/preflight.json"
    fi
done
say "total" "$([ $failed = 0 ] && echo ok || echo failed)" "$(( $(date +%s) - start ))s" "logs in $out"
exit $failed
