#!/usr/bin/env bash
# Every GPU check of the project in one run, one line per check, in the order of what has never run first
# (issue 39): Transformer Engine's kernels in an RL step (bf16, then FP8 with delayed and with current
# scaling: the rollout-vs-training log-prob gap and the first minibatch's clip fraction), the lean decoder
# over TE weights, MFU on the 2B proxy at 256 rows x 576 tokens with TE beside the local spec, the 30B
# one-layer cut's memory with TE, the in-process suite on CUDA and decode.cuda_graphs, the 512-token job with
# train.max_tokens_per_micro_batch, then the preflight under megatron-core 0.19.2. Sized for one 10-minute
# command on one H100: the run has a budget (default 540 s, the kit's install included); each check gets
# its timeout or what is left of the budget, whichever is less, and one that would get under 20 s is
# reported "not run" with the reason, so the run never overstays. No GPU has run this list yet.
#
#   bash benchmarks/gpu_checks.sh [--kit DIR] [--out DIR] [--budget SECONDS] [--only NAME[,NAME...]] [--dry-run] [--cpu]
#
#   --kit DIR     the GPU kit (python -m tools.gpu_kit build --out DIR; docs/gpu_kit.md): installed first when
#                 Transformer Engine does not import (the torch extension is built from the kit's sdist when
#                 the kit holds no wheel of it for this Python and torch: minutes, then kept in DIR/ext and
#                 copied to $OUT); megatron-core 0.19.2 from it for the last check
#   --out DIR     where each check's full output goes (DIR/<check>.log, DIR/*.json, DIR/summary.txt);
#                 default gpu_checks_<date>/ in the current directory
#   --budget S    seconds for the whole run (default 540; 0: no limit)
#   --only LIST   run these checks only (names as listed by --dry-run)
#   --dry-run     list each check: its budget, what it needs (TE, megatron-core 0.19) and whether the kit
#                 given covers that, and its command; run nothing (exit 0; 2 when the kit given is missing
#                 or damaged: python -m tools.gpu_kit check DIR, which every run does first)
#   --cpu         the checks that have a CPU form, in that form (preflight --quick items, one-step jobs;
#                 timeouts x 5, no budget): for trying the script itself on a machine without a GPU; its
#                 figures mean nothing
#
# Environments: the NGC image of the Dockerfile (TE there), or a bare image with torch + CUDA but no
# megatron-core, no TE and no network (Python 3.12, torch 2.11+cu130): there, --kit DIR, or wheels carried in
# $GSPO_WHEELS (default ./.whl) installed with `pip install --no-index --no-deps`; the checkout is put on
# PYTHONPATH. Exit status: 0 all ran checks passed, 1 one failed or timed out, 2 the environment cannot run
# them (named on the "setup" line).
set -uo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"

out="gpu_checks_$(date +%Y%m%d_%H%M%S)"
budget=""
only=""
kit=""
dry=0
cpu=0
while [ $# -gt 0 ]; do
    case "$1" in
        --kit) kit="$2"; shift 2 ;;
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
budget=${budget:-$([ "$cpu" = 1 ] && echo 0 || echo 540)}
py="${PYTHON:-python3}"
mcore019="${GSPO_MCORE019_SITE:-${TMPDIR:-/tmp}/gpu_kit_mcore019}"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
# The kit is checked (manifest, every file's size and sha256; seconds) before anything else, the dry run
# included: a damaged copy is named here, not found by the install on the GPU machine.
if [ -n "$kit" ] && ! kit_check=$("$py" -m tools.gpu_kit check "$kit" 2>&1); then
    echo "gpu_checks.sh: --kit $kit: ${kit_check#python -m tools.gpu_kit: error: }" >&2
    exit 2
fi

# ---- the checks: name | timeout (s) | needs (te, mcore019, -) | GPU command | CPU command ("-": none) ------
PF="$py -m megatron_gspo.preflight"
TE="model.transformer_impl=transformer_engine"
TINY="train.sft_steps=0 train.tensorboard=false reward.name=digit_match eval.interval=0"
JOB2B="model.preset=qwen3-moe-2b-proxy train.sft_steps=0 train.tensorboard=false reward.name=digit_match eval.interval=0"
# 256 rows x 576 tokens: 64 prompts x 4 samples, 64 prompt + 512 generated tokens
SHAPE="train.prompts_per_step=64 generation.n_samples_per_prompt=4 data.max_prompt_length=64 generation.max_new_tokens=512 generation.ignore_eos=true"
CHECKS=(
"te-rl-bf16|60|te|$py -m megatron_gspo.train $TINY train.num_steps=2 $TE model.precision=bf16 train.output_dir=\$OUT/te_rl_bf16|-"
"te-rl-fp8-delayed|60|te|$py -m megatron_gspo.train $TINY train.num_steps=2 $TE model.precision=bf16 model.fp8=hybrid model.fp8_recipe=delayed train.output_dir=\$OUT/te_rl_fp8_delayed|-"
"te-rl-fp8-current|60|te|$py -m megatron_gspo.train $TINY train.num_steps=2 $TE model.precision=bf16 model.fp8=hybrid model.fp8_recipe=tensorwise train.output_dir=\$OUT/te_rl_fp8_current|-"
"decode-te-spec|60|te|$PF --only decode.te_spec --json \$OUT/decode_te_spec.json|$PF --quick --only decode.te_spec --json \$OUT/decode_te_spec.json"
"mfu-2b-te|120|te|$PF --only speed.mfu_bf16 $TE $SHAPE --json \$OUT/mfu_2b_te.json|-"
"mfu-2b-local|120|-|$PF --only speed.mfu_bf16 model.transformer_impl=local $SHAPE --json \$OUT/mfu_2b_local.json|-"
"memory-30b-te|60|te|$PF --only memory.30b_cut $TE --json \$OUT/memory_30b_te.json|-"
"pytest-in-process|150|-|$py -m pytest -q -p no:cacheprovider -m 'not slow' \$XDIST tests/test_decode.py tests/test_generation.py tests/test_experts.py tests/test_logprobs.py tests/test_devices.py tests/test_on_policy.py tests/test_jobs_in_one_process.py tests/test_fp8_alignment.py tests/test_compat.py tests/test_routing.py tests/test_trainer.py|-"
"decode-cuda-graphs|60|-|$PF --only decode.cuda_graphs --json \$OUT/decode_cuda_graphs.json|$PF --quick --only decode.cuda_graphs --json \$OUT/decode_cuda_graphs.json"
"rl-2b-512-tokens|90|-|$py -m megatron_gspo.train $JOB2B train.num_steps=2 generation.max_new_tokens=512 generation.ignore_eos=true train.max_tokens_per_micro_batch=16384 train.output_dir=\$OUT/rl_2b_512|$py -m megatron_gspo.train $TINY train.num_steps=1 generation.max_new_tokens=32 train.max_tokens_per_micro_batch=256 train.output_dir=\$OUT/rl_2b_512"
"preflight-mcore019|240|mcore019|PYTHONPATH=\$MCORE019:\$PYTHONPATH $PF --json \$OUT/preflight_mcore019.json|PYTHONPATH=\$MCORE019:\$PYTHONPATH $PF --quick --json \$OUT/preflight_mcore019.json"
)

fmt() { printf '%-24s %-9s %7s  %s\n' "$1" "$2" "$3" "$4"; }

covers() {  # whether the kit given covers what a check needs (the dry run's column)
    local needs=$1
    [ -z "$kit" ] && { echo "no kit"; return; }
    case "$needs" in
        te) if ls "$kit"/ext/*/transformer_engine_torch-*.whl > /dev/null 2>&1; then echo "kit: TE"
            elif ls "$kit"/sdist/transformer_engine_torch-*.tar.gz > /dev/null 2>&1; then echo "kit: TE+build"
            else echo "kit: NO TE"; fi ;;
        mcore019) if ls "$kit"/mcore019/megatron_core-0.19*.whl > /dev/null 2>&1; then echo "kit: mc0.19"; else echo "kit: NO 0.19"; fi ;;
        *) echo "kit: base" ;;
    esac
}

if [ "$dry" = 1 ]; then
    for c in "${CHECKS[@]}"; do
        IFS='|' read -r name tmo needs gpu_cmd cpu_cmd <<< "$c"
        cmd=$([ "$cpu" = 1 ] && echo "$cpu_cmd" || echo "$gpu_cmd")
        [ -n "$only" ] && [[ ",$only," != *",$name,"* ]] && continue
        printf '%-24s %6s  needs %-9s %-13s %s\n' "$name" "$(( tmo * scale ))s" "${needs/-/base}" "$(covers "$needs")" "$cmd"
    done
    echo "budget ${budget}s for the run (0: none), the kit's install included; a check gets min(its timeout, what is left)"
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

# ---- setup: the kit when TE does not import, carried wheels when megatron-core is missing, then the check ---
if [ -n "$kit" ] && ! "$py" -c 'import torch, transformer_engine.pytorch' > /dev/null 2>&1; then
    t0=$(date +%s)
    if OUT="$out" "$py" -m tools.gpu_kit install "$kit" --mcore019-target "$mcore019" > "$out/kit_install.log" 2>&1; then
        say "kit" "ok" "$(( $(date +%s) - t0 ))s" "$(tail -n 1 "$out/kit_install.log" | cut -c1-160)"
    else
        say "kit" "failed" "$(( $(date +%s) - t0 ))s" "$(tail -n 1 "$out/kit_install.log" | cut -c1-160) (log: $out/kit_install.log)"
    fi
elif [ -n "$kit" ] && [ ! -d "$mcore019/megatron" ]; then  # TE is there: megatron-core 0.19 for the last check
    "$py" -m pip install -q --no-index --no-deps --target "$mcore019" "$kit"/mcore019/*.whl > "$out/kit_install.log" 2>&1
fi
wheels="${GSPO_WHEELS:-$root/.whl}"
if ! "$py" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("megatron") is None)' > /dev/null 2>&1; then
    if ls "$wheels"/*.whl > /dev/null 2>&1; then
        "$py" -m pip install -q --no-index --no-deps "$wheels"/*.whl > "$out/setup.log" 2>&1
    fi
fi
# The verdict goes to a file of its own: what the interpreter prints on its streams (a CUDA build of torch
# without a GPU warns "No CUDA runtime is found" at import) must not be read as the verdict.
verdict="$out/setup.status"
"$py" - "$cpu" "$verdict" > "$out/setup.log" 2>&1 <<'EOF'
import importlib, sys
cpu, path = sys.argv[1] == "1", sys.argv[2]
def say(line):
    open(path, "w").write(line + "\n"); sys.exit()
try:
    import torch
except Exception as e:
    say(f"FAIL no torch ({e})")
if not cpu and not torch.cuda.is_available():
    say(f"FAIL torch {torch.__version__} sees no CUDA device (use --cpu to try the script without a GPU)")
try:
    import megatron.core
except Exception as e:
    say(f"FAIL no megatron-core ({type(e).__name__}: {e}); give --kit DIR, or carry its wheel in $GSPO_WHEELS "
        "(default ./.whl): pip download megatron-core==0.16.1")
missing = [m for m in ("yaml", "psutil", "tensorboard", "safetensors", "tokenizers", "jinja2", "pytest")
           if importlib.util.find_spec(m) is None]
try:
    import transformer_engine.pytorch
    te = f"transformer_engine {transformer_engine.__version__}"
except Exception as e:
    te = f"transformer_engine no ({type(e).__name__})"
dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
xdist = importlib.util.find_spec("xdist") is not None
say(f"OK {dev}; python {sys.version.split()[0]}, torch {torch.__version__}, megatron-core {megatron.core.__version__}, "
    f"{te}, pytest-xdist {'yes' if xdist else 'no'}" + (f"; missing: {', '.join(missing)}" if missing else "")
    + ("|XDIST" if xdist else "|"))
EOF
setup=$(cat "$verdict" 2> /dev/null || echo "FAIL the setup check printed no verdict: $(tail -n 1 "$out/setup.log")")
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
have_te=$([[ "$info" == *"transformer_engine no"* ]] && echo 0 || echo 1)

# ---- run -------------------------------------------------------------------------------------------
metrics() {  # the last step's figures worth a line: loss, reward, log-prob gap, clip fractions
    "$py" - "$1" <<'EOF' 2> /dev/null
import json, sys
rows = [json.loads(ln) for ln in open(sys.argv[1]) if ln.strip()]
last = rows[-1]
# onpolicy/clip_frac: the first minibatch's (the one on the rollout's own policy); logprob_diff: rollout vs training
names = {"step": "step", "loss/loss": "loss", "rollout/reward_mean": "reward", "rollout/logprob_diff_mean": "lp gap mean",
         "rollout/logprob_diff_max": "lp gap max", "loss/onpolicy/clip_frac": "clip 1st mb",
         "loss/clip_frac": "clip", "perf/step_time_s": "s/step"}
print(", ".join(f"{v} {last[k]:.4g}" if isinstance(last[k], float) else f"{v} {last[k]}"
                for k, v in names.items() if k in last))
EOF
}
detail() {  # the line of a check's log worth showing
    local name=$1 log=$2 json
    json=$(grep -oE '\$OUT/[a-z0-9_]+\.json' <<< "$3" | head -n 1)
    case "$name" in
        pytest-*) grep -E '[0-9]+ (passed|failed|skipped|error)' "$log" | tail -n 1 ;;
        te-rl-*|rl-*) m=$(ls "$out"/*/metrics.jsonl 2> /dev/null | grep "/${4}/" | head -n 1)
                      [ -n "$m" ] && metrics "$m" | cut -c1-200 ;;
        *) if [ -n "$json" ] && [ -f "$out/${json#\$OUT/}" ]; then
               "$py" - "$out/${json#\$OUT/}" <<'EOF' | cut -c1-200
import json, sys
doc = json.load(open(sys.argv[1]))
print("; ".join(f"{n} {r['status']}: {' '.join(str(r.get('value', '')).split())}" for n, r in doc["checks"].items()
                if len(doc["checks"]) < 4 or r["status"] != "ok"))
EOF
           else tail -n 1 "$log" | cut -c1-160; fi ;;
    esac
}
failed=0
for c in "${CHECKS[@]}"; do
    IFS='|' read -r name tmo needs gpu_cmd cpu_cmd <<< "$c"
    [ -n "$only" ] && [[ ",$only," != *",$name,"* ]] && continue
    cmd=$([ "$cpu" = 1 ] && echo "$cpu_cmd" || echo "$gpu_cmd")
    if [ "$cmd" = "-" ]; then
        say "$name" "skipped" "" "GPU only (no CPU form)"
        continue
    fi
    if [ "$needs" = te ] && [ "$have_te" = 0 ]; then
        say "$name" "skipped" "" "needs Transformer Engine, which does not import here (give --kit DIR)"
        continue
    fi
    if [ "$needs" = mcore019 ] && [ ! -d "$mcore019/megatron" ]; then
        say "$name" "skipped" "" "needs megatron-core 0.19 in $mcore019 (give --kit DIR)"
        continue
    fi
    tmo=$(( tmo * scale ))
    used=$(( $(date +%s) - start ))
    if [ "$budget" -gt 0 ]; then
        left=$(( budget - used ))
        if [ "$left" -lt 20 ]; then
            say "$name" "not run" "" "time budget: ${used}s of ${budget}s used (--budget 0 runs everything)"
            continue
        fi
        [ "$left" -lt "$tmo" ] && tmo=$left
    fi
    log="$out/$name.log"
    t0=$(date +%s)
    OUT="$out" XDIST="$xdist_flag" MCORE019="$mcore019" timeout --kill-after=10 "$tmo" \
        bash -c "OUT='$out'; XDIST='$xdist_flag'; MCORE019='$mcore019'; $cmd" > "$log" 2>&1
    rc=$?
    secs="$(( $(date +%s) - t0 ))s"
    if [ $rc -eq 0 ]; then st=ok; elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then st=timeout; failed=1; else st=failed; failed=1; fi
    outdir=$(grep -oE 'train.output_dir=\$OUT/[a-z0-9_]+' <<< "$cmd" | sed 's|.*\$OUT/||')
    d=$(detail "$name" "$log" "$cmd" "$outdir")
    [ $rc -ne 0 ] && d="$(tail -n 1 "$log" | cut -c1-160)${d:+; $d}"
    say "$name" "$st" "$secs" "${d:-see $log}"
done
say "total" "$([ $failed = 0 ] && echo ok || echo failed)" "$(( $(date +%s) - start ))s" "logs in $out"
exit $failed
