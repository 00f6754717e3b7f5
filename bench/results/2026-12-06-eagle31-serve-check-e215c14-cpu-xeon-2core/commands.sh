set -e
cd "$(git rev-parse --show-toplevel)"
P=.venv-vllm/bin/python
rm -rf $OUT && mkdir -p $OUT
$P -m draftling train --target $SERVE_FIXTURE/target --device cpu --data $SERVE_FIXTURE/data --run-dir $OUT/run "aux_layer_ids=[2, 4, 7]" train.max_steps=300 train.batch_size=8 train.ttt_steps=3 train.lr=3e-3 train.warmup_steps=10 draft.fc_norm=true draft.norm_output=true > $OUT/train.log 2>&1
for fmt in sglang speculators; do
  named=""; [ $fmt = speculators ] && named="--verifier-id test/tiny-llama"
  $P -m draftling export --draft $OUT/run/draft --out $OUT/$fmt --format $fmt --target $SERVE_FIXTURE/target $named --dtype float32
  $P -m draftling serve-check $OUT/$fmt --target $SERVE_FIXTURE/target --device cpu --prompts $SERVE_FIXTURE/held_out.jsonl --max-new-tokens 32 --out $OUT/check-$fmt.json > $OUT/check-$fmt.log 2>&1 || echo "check $fmt exit $?"
done
