# Sourced (after common.sh) by the device scripts that do what is left of a run in each call:
# the call's clock, a quiet logged `draftling`, a run's stop reason, and the recipe before 2026-12-03.
t0=$(date +%s)
left() { echo $(( ${CALL_S:-575} - ($(date +%s) - t0) )); }  # seconds left in this call
# The per-batch regeneration lines, unless QUIET=0 (never fails the pipe).
quiet() { if [ "${QUIET:-1}" = 0 ]; then cat; else grep --line-buffered -v "^regenerate: " || true; fi; }
# `d ARGS`: draftling ARGS, logged to $log with the time left.
d() { echo "+ draftling $* ($(left) s left)" | tee -a $log; python3 -m draftling "$@" 2>&1 | quiet | tee -a $log; }
# The stop reason of the training run in $1 ("" before it has one).
stop_reason() { python3 -c "import json;print(json.load(open('$1/train_result.json'))['stop_reason'])" 2>/dev/null || true; }
# Whether the run in $1 stopped for good: its steps done, or converged (--stop-on-convergence).
finished() { case "$(stop_reason $1)" in completed|converged) return 0 ;; *) return 1 ;; esac; }
# Minutes of training that fit in this call, keeping $1 seconds for the rest.
train_minutes() { python3 -c "print(round(($(left) - $1) / 60, 2))"; }
# gpu_smollm2's recipe and data before 2026-12-03 (six epochs of 32, lr 5e-4, no smoke bench;
# six files capped at 13.1k prompts). The data-scaling curve and the Gemma 3 run trained with
# OLD_RECIPE, the airline adaptation with both, so those scripts pin them over the profile's
# defaults, which now hold the converging recipe on ten files (configs/gpu_smollm2.yaml).
OLD_RECIPE="train.epochs=6 train.max_steps=0 train.batch_size=32 train.lr=5e-4 train.warmup_steps=30 \
train.stop_on_convergence=false train.smoke_every=0 train.max_minutes=8.5 train.ckpt_every=1000"
OLD_DATA='data.prompts=["shared:sharegpt.jsonl","shared:instruct.jsonl","shared:code_mbpp.jsonl",'\
'"shared:math_gsm8k_train.jsonl","shared:summarize.jsonl","shared:tool_use.jsonl"] data.max_prompts_per_file=5000 '\
'data.max_prompts_by_file={"shared:math_gsm8k_train.jsonl":2200}'
