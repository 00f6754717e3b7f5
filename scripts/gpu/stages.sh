# Sourced (after common.sh) by the device scripts that do what is left of a run in each call:
# the call's clock, a quiet logged `draftling`, and a run's stop reason.
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
# The ten non-agent files of the development corpus, as one data.prompts value.
CORPUS='["shared:sharegpt.jsonl","shared:instruct.jsonl","shared:code_mbpp.jsonl","shared:math_gsm8k_train.jsonl",'\
'"shared:summarize.jsonl","shared:tool_use.jsonl","shared:code_gpteacher.jsonl","shared:roleplay_gpteacher.jsonl",'\
'"shared:tool_toolformer.jsonl","shared:t0_tasks.jsonl"]'
