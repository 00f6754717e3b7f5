#!/usr/bin/env bash
# Issue 48 item 3: EAGLE-3, EAGLE-3.1 and the block drafter (dflash) side by side on one GPU,
# same target (SmolLM2-135M-Instruct bf16), same regenerated data, same step budget and the
# recipe's schedule (lab/configs/gpu_smollm2.yaml scaled to STEPS), then the release bench of
# each on prompt set v1 and lab/gpu/methods.py's methods.json. With SWEEP=1, issue 46's
# sweep (one_engine_sweep.py, --skip-regen) follows with this run's SWEEP_HEAD (eagle3). With
# EXPORT_HEAD=<method>, that head's speculators export (bf16) comes back with the first poll after it is written, in
# parts of 15 MB (head-part-*; `cat` them, then `tar xf`), for the serving check in vLLM here.
# Device calls straight after each other (the machine goes back 30 s idle):
#   1. carries .dev/a .whl:          mkdir -p /tmp/m && cp .dev/a/* /tmp/m/
#   2. carries .dev/b .dev/p .whl:   bash lab/gpu/methods.sh start [SECONDS]
#   3.. carries .whl:                bash lab/gpu/methods.sh poll SECONDS   (until "methods: done")
# `start` runs everything in a session of its own (it outlives the call) and polls. Each poll
# copies the logs and whatever results exist to $OUT. Knobs: PER_FILE (prompts per corpus
# file, 1000), STEPS (1200), METHODS ("eagle3 dflash eagle31"), DFLASH_LAYERS (2), SWEEP (1),
# SWEEP_HEAD (eagle3), SWEEP_ARGS (added to one_engine_sweep.py), SWEEP2_ARGS (a second sweep with these
# arguments, e.g. '--repeats 1 --batch1-prompts 8 --per-slot 8' to see the drain's share), EXPORT_HEAD (none), BLOCK_TESTS (0: 1 runs the CUDA-only block-round,
# bf16-identity, compiled-graph, exact-attention and graphed-prefill tests at the end), RUN_S (1500: caps the whole job);
# for a dry run on the CPU: DEV ("--device cuda --dtype bfloat16"), DATA_EXTRA, TRAIN_EXTRA,
# BENCH_EXTRA (KEY=VALUE or flags added to those commands); AB=1 adds lab/gpu/exact_attention_ab.py
# (AB_ARGS replaces its rows, repeats and variants; --profile adds each pass's kernels; AB_S caps it, 330 s).
# DECODE_AB=1 adds lab/gpu/decode_ab.py (issue 47: the 8B-shape plain step by variant; random weights;
# DECODE_AB_ARGS adds to it, e.g. '--steps 50 --variants matmul,matmul_fused').
# ADMIT_AB=1 adds lab/gpu/admissions_ab.py after the sweep (deferred admissions on and off with the
# SWEEP_HEAD; ADMIT_AB_ARGS adds to it, e.g. '--levels 16,64 --repeats 1'; ADMIT_AB_S caps it, 400 s).
# PREFILL_AB=1 adds lab/gpu/prefill_ab.py before the sweep (admissions' prefill eager, compiled and graphed; PREFILL_AB_ARGS
# adds to it, e.g. '--levels 16,64 --repeats 1'; PREFILL_AB_S caps it, 400 s).
# ROUND_PROFILE=1 profiles the SWEEP_HEAD's rounds by phase and kernel (lab/gpu/round_profile.py;
# ROUND_PROFILE_ARGS adds to it) before the sweep.
# BENCH=0 skips the release benches. Order: A/B, CUDA tests, data, training, export, round profile, prefill A/B, sweep,
# admissions A/B, benches
# (what needs no head first). E.g.
#   DEV="--device cpu --dtype float32" PER_FILE=1 STEPS=4 SWEEP=0 DATA_EXTRA=data.regen.max_new_tokens=16 \
#   TRAIN_EXTRA="train.batch_size=4 train.smoke_every=2" BENCH_EXTRA="--max-new-tokens 8" bash lab/gpu/methods.sh start
W=/tmp/work/methods
case "${1:-}" in
  start)
    source lab/gpu/common.sh
    mkdir -p $W/results && date -u +%FT%TZ > $W/started
    setsid bash -c "timeout ${RUN_S:-1500} bash $0 job > $W/log.txt 2>&1; echo \"exit \$?\" > $W/done" \
      < /dev/null > /dev/null 2>&1 &
    exec bash $0 poll ${2:-500} ;;
  job)
    source lab/gpu/common.sh
    C=lab/configs/gpu_smollm2.yaml D=$W/data DEV=${DEV:---device cuda --dtype bfloat16}
    t0=$(date +%s)
    if [ "${AB:-0}" = 1 ]; then
      timeout ${AB_S:-330} python3 lab/gpu/exact_attention_ab.py --target $T --out $W/results/exact_attention_ab.json \
        ${AB_ARGS:---rows 1,64 --repeats 1 --variants exact_fused,exact_matmul} > $W/results/exact_attention_ab_log.txt 2>&1 || echo "exact attention A/B failed"
      echo "exact attention A/B done"
    fi
    if [ "${DECODE_AB:-0}" = 1 ]; then
      timeout 420 python3 lab/gpu/decode_ab.py --out $W/results/decode_ab/decode_ab.json ${DECODE_AB_ARGS:-} \
        > $W/results/decode_ab_log.txt 2>&1 || echo "decode A/B failed"
      echo "decode A/B done"
    fi
    if [ "${BLOCK_TESTS:-0}" = 1 ]; then
      timeout 300 python3 -m pytest -q -rs -p no:cacheprovider tests/engine/test_engine.py tests/engine/test_batch_engine.py -k "block or bf16 or compile_and_cuda_graphs_match or exact_attention or graphed_prefill" \
        > $W/results/block_cuda_tests.txt 2>&1 || echo "block tests failed"
      echo "block tests: $(tail -1 $W/results/block_cuda_tests.txt)"
    fi
    python3 -m draftling data --config $C --target $T $DEV --out $D data.max_prompts_per_file=${PER_FILE:-1000} ${DATA_EXTRA:-} 2>&1 \
      | grep --line-buffered -v "^regenerate: "
    python3 -m draftling vocab --data $D --config $C --target $T
    cp $D/summary.json $W/results/data_summary.json
    echo "data: $(( $(date +%s) - t0 )) s"
    common="train.max_steps=${STEPS:-1200} train.stop_on_convergence=false train.ckpt_every_epoch=false train.max_minutes=8"
    declare -A extra=([eagle3]="" [eagle31]="draft.fc_norm=true draft.norm_output=true"
                      [dflash]="draft.method=dflash draft.layers=${DFLASH_LAYERS:-2}")
    methods=${METHODS:-eagle3 dflash eagle31}
    for m in $methods; do
      s=$(date +%s)
      python3 -m draftling train --config $C --target $T $DEV --data $D --run-dir $W/run-$m $common ${extra[$m]} ${TRAIN_EXTRA:-} \
        > $W/results/train-$m.txt 2>&1 || echo "train $m failed"
      echo "{\"method\": \"$m\", \"wall_s\": $(( $(date +%s) - s ))}" > $W/results/train-$m-wall.json
      cp $W/run-$m/train_result.json $W/results/train-$m-result.json 2>/dev/null || true
      cp $W/run-$m/metrics.jsonl $W/results/train-$m-metrics.jsonl 2>/dev/null || true
      echo "trained $m: $(( $(date +%s) - s )) s"
    done
    if [ -n "${EXPORT_HEAD:-}" ] && [ -f $W/run-$EXPORT_HEAD/draft/draft.safetensors ]; then
      python3 -m draftling export --draft $W/run-$EXPORT_HEAD/draft --out $W/export-$EXPORT_HEAD --format speculators \
        --target $T --verifier-id HuggingFaceTB/SmolLM2-135M-Instruct --dtype bfloat16 > $W/results/export.txt 2>&1 \
        && tar cf - -C $W export-$EXPORT_HEAD | split -b 15000000 - $W/head-part- || echo "export failed"
      echo "exported $EXPORT_HEAD"
    fi
    sweep_head=${SWEEP_HEAD:-eagle3}
    if [ "${ROUND_PROFILE:-0}" = 1 ] && [ -f $W/run-$sweep_head/draft/draft.safetensors ]; then
      timeout 400 python3 lab/gpu/round_profile.py --target $T --draft $W/run-$sweep_head/draft \
        --out $W/results/round_profile.json ${ROUND_PROFILE_ARGS:-} > $W/results/round_profile_log.txt 2>&1 || echo "round profile failed"
      echo "round profile done"
    fi
    if [ "${PREFILL_AB:-0}" = 1 ] && [ -f $W/run-$sweep_head/draft/draft.safetensors ]; then
      timeout ${PREFILL_AB_S:-400} python3 lab/gpu/prefill_ab.py --target $T --draft $W/run-$sweep_head/draft \
        --out $W/results/prefill_ab.json ${PREFILL_AB_ARGS:-} > $W/results/prefill_ab_log.txt 2>&1 || echo "prefill A/B failed"
      echo "prefill A/B done"
    fi
    if [ "${SWEEP:-1}" = 1 ] && [ -f $W/run-$sweep_head/draft/draft.safetensors ]; then
      python3 lab/gpu/one_engine_sweep.py --target $T --draft $W/run-$sweep_head/draft --out $W/sweep --repeats 2 ${SWEEP_ARGS:-} \
        --skip-regen > $W/results/sweep_log.txt 2>&1 || echo "sweep failed"
      rm -rf $W/results/sweep && cp -r $W/sweep/results $W/results/sweep 2>/dev/null || true
      echo "swept with $sweep_head"
    fi
    if [ -n "${SWEEP2_ARGS:-}" ] && [ -f $W/run-$sweep_head/draft/draft.safetensors ]; then
      python3 lab/gpu/one_engine_sweep.py --target $T --draft $W/run-$sweep_head/draft --out $W/sweep2 ${SWEEP2_ARGS} \
        --skip-regen > $W/results/sweep2_log.txt 2>&1 || echo "second sweep failed"
      rm -rf $W/results/sweep2 && cp -r $W/sweep2/results $W/results/sweep2 2>/dev/null || true
      echo "swept again ($SWEEP2_ARGS)"
    fi
    if [ "${ADMIT_AB:-0}" = 1 ] && [ -f $W/run-$sweep_head/draft/draft.safetensors ]; then
      timeout ${ADMIT_AB_S:-400} python3 lab/gpu/admissions_ab.py --target $T --draft $W/run-$sweep_head/draft \
        --out $W/results/admissions_ab.json ${ADMIT_AB_ARGS:-} > $W/results/admissions_ab_log.txt 2>&1 || echo "admissions A/B failed"
      echo "admissions A/B done"
    fi
    for m in $([ "${BENCH:-1}" = 1 ] && echo $methods); do
      [ -f $W/run-$m/draft/draft.safetensors ] || { echo "no head for $m"; continue; }
      python3 -m draftling bench --release --target $T $DEV --draft $W/run-$m/draft ${BENCH_EXTRA:-} \
        --prompt-set v1 --baselines engine_plain --results-dir $W/bench-$m --tag $m 'bench.sampled_temperatures=[]' \
        > $W/results/bench-$m.txt 2>&1 || echo "bench $m failed"
      cp -r $W/bench-$m $W/results/ 2>/dev/null || true
      python3 lab/gpu/methods.py $W/results > $W/results/methods_log.txt 2>&1 || true
      echo "benched $m"
    done
    echo "all: $(( $(date +%s) - t0 )) s" ;;
  poll)
    for _ in $(seq ${2:-500}); do [ -f $W/done ] && break; sleep 1; done
    # A call brings back at most 8 files: the results travel as one archive.
    cp $W/log.txt $W/started $W/results/ 2>/dev/null || true
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > $W/results/gpu.txt || true
    python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)" > $W/results/versions.txt 2>&1 || true
    tar czf $OUT/methods.tgz -C $W results
    [ -f $W/head-sent ] || { cp $W/head-part-* $OUT/ 2>/dev/null && touch $W/head-sent; } || true  # the export, once
    tail -5 $W/log.txt
    if [ -f $W/done ]; then echo "methods: done ($(cat $W/done))"; else echo "methods: running"; fi ;;
  *) echo "usage: $0 start [SECONDS] | poll [SECONDS]"; exit 2 ;;
esac
