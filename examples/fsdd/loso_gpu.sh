#!/usr/bin/env bash
# Leave-one-speaker-out before/after on one GPU machine: every fold of every family at once, one
# stage per call (each fits in ~10 minutes on an H200 with 16 cores). From the repository root:
#
#     bash examples/fsdd/loso_gpu.sh data ctc nested aed transducer
#     bash examples/fsdd/loso_gpu.sh synth-data synth synth-aed synth-transducer  # + espeak-ng speakers
#
# data:        the five folds' data (make_data.py --test-speaker, in parallel)
# ctc:         loso.py --family ctc, before (the plain recipe) and after (the chosen options)
# nested:      loso_tune.py: plain against the chosen options on each fold's nested dev speaker
# aed, transducer: loso.py for the family, before and after, from the fold's CTC checkpoints
# synth-data:  the folds again with SYNTH_TRAIN (default 1500) training utterances of the synthetic
#              speakers in SYNTHETIC (default examples/fsdd/data/synthetic-recordings, made by
#              synth_speakers.py) added (SYNTH_DATA, default examples/fsdd/data/loso-synth: give
#              each variant of SYNTHETIC / SYNTH_TRAIN its own SYNTH_DATA and EXP)
# synth:       the chosen options on those folds: CTC test (after-synth) and the nested dev check
# synth-aed, synth-transducer: loso.py for the family with the chosen options on those folds, from
#              the after-synth CTC checkpoints (after-synth)
# ship, ship-synth: the models to ship, trained on the index split (all five speakers) with the
#              chosen options (ship-synth: plus the synthetic speakers' training utterances): CTC,
#              then AED and transducer from its checkpoint, exported into $EXP/<stage>/ (to copy
#              into examples/fsdd-model/ once their figures are checked)
#
# Results: $EXP/{before,after,after-synth}/<family>-loso.{json,md}, $EXP/tune/*/dev.json. Environment:
# RECORDINGS (default ../shared/data/fsdd/recordings), EXP (default examples/fsdd/exp/loso),
# PYTHON (default python3), EXTRA (more training options for every run, e.g. "--max-minutes 8"),
# SPEAKERS (default all five).
set -uo pipefail
cd "$(dirname "$0")/../.."
REC=${RECORDINGS:-../shared/data/fsdd/recordings}
EXP=${EXP:-examples/fsdd/exp/loso}
PY=${PYTHON:-python3}
EXTRA=${EXTRA:-}
SYNTHETIC=${SYNTHETIC:-examples/fsdd/data/synthetic-recordings}
SYNTH_TRAIN=${SYNTH_TRAIN:-1500}
DATA=examples/fsdd/data/loso
SYNTH_DATA=${SYNTH_DATA:-examples/fsdd/data/loso-synth}
SPEAKERS=${SPEAKERS:-george jackson nicolas theo yweweler}
SYNTH_OPTIONS=(--synthetic-recordings "$SYNTHETIC" --num-synthetic-train "$SYNTH_TRAIN")
declare -A NESTED=([george]=jackson [jackson]=george [nicolas]=theo [theo]=yweweler [yweweler]=nicolas)
# the chosen options (LOSO-TUNING.md); the per-utterance mean belongs to the encoder, which the
# transducer and the AED inherit from the CTC checkpoint
CHOSEN="--aug-tempo 0.1 --aug-mel-shift 1 --keep-by dev-wer"
export PYTHONUNBUFFERED=1
mkdir -p "$EXP/logs"
loso() { "$PY" examples/fsdd/loso.py --recordings "$REC" --jobs 5 --reuse --torch-python "$PY" \
  --speakers "${SPEAKERS// /,}" "$@"; }
# fold_data OUT LOG MAKE_DATA_OPTIONS...: every speaker's fold data into OUT/<speaker>, in parallel
fold_data() {
  local out=$1 log=$2; shift 2
  for s in $SPEAKERS; do
    "$PY" examples/fsdd/make_data.py --recordings "$REC" --test-speaker "$s" --out "$out/$s" \
      --num-lm-sentences 0 --wav-splits '' "$@" > "$EXP/logs/$log-$s.log" 2>&1 &
  done; wait
}
# nested DATA CONFIG_PREFIX TRAIN_OPTIONS...: each fold's nested dev check of one configuration
nested() {
  local data=$1 name=$2; shift 2
  for s in $SPEAKERS; do
    local h=${NESTED[$s]}
    "$PY" examples/fsdd/loso_tune.py train --speakers "$s" --out "$data" --exp "$EXP/tune" --torch-python "$PY" \
      --config "$name-hold-$h" -- --hold-out-speaker "$h" "$@" $EXTRA > "$EXP/logs/$name-$s.log" 2>&1 &
  done
}
for stage in "$@"; do
  started=$(date +%s)
  case $stage in
    data) fold_data "$DATA" data;;
    ctc)
      loso --family ctc --exp "$EXP/before" -- $EXTRA > "$EXP/logs/ctc-before.log" 2>&1 &
      loso --family ctc --exp "$EXP/after" -- $CHOSEN --utterance-mean $EXTRA > "$EXP/logs/ctc-after.log" 2>&1 &
      wait;;
    nested)
      nested "$DATA" nested-plain --keep-by dev-wer
      nested "$DATA" nested-after $CHOSEN --utterance-mean
      wait;;
    synth-data) fold_data "$SYNTH_DATA" synth-data "${SYNTH_OPTIONS[@]}";;
    synth)
      loso --family ctc --out "$SYNTH_DATA" --exp "$EXP/after-synth" -- $CHOSEN --utterance-mean $EXTRA \
        > "$EXP/logs/ctc-after-synth.log" 2>&1 &
      nested "$SYNTH_DATA" nested-after-synth $CHOSEN --utterance-mean
      wait;;
    ship|ship-synth)
      dir=$EXP/$stage data=examples/fsdd/data/$stage synth=()
      [ "$stage" = ship-synth ] && synth=("${SYNTH_OPTIONS[@]}")
      "$PY" examples/fsdd/make_data.py --recordings "$REC" --out "$data" --num-lm-sentences 0 --wav-splits '' \
        "${synth[@]}" > "$EXP/logs/$stage-data.log" 2>&1 || { echo "$stage: data failed" >&2; continue; }
      train() { local family=$1; shift; "$PY" "examples/fsdd/train_$family.py" --data "$data" --exp "$dir/$family" \
        --threads 1 "$@" $EXTRA > "$EXP/logs/$stage-$family.log" 2>&1; }
      train ctc $CHOSEN --utterance-mean || { echo "$stage: CTC training failed" >&2; continue; }
      train aed --init-encoder "$dir/ctc/checkpoint.pt" $CHOSEN & aed=$!
      train transducer --init-encoder "$dir/ctc/checkpoint.pt" $CHOSEN & transducer=$!
      wait $aed || echo "$stage: AED training failed ($EXP/logs/$stage-aed.log)" >&2
      wait $transducer || echo "$stage: transducer training failed ($EXP/logs/$stage-transducer.log)" >&2
      "$PY" examples/fsdd/export_ctc.py --checkpoint "$dir/ctc/checkpoint.pt" --output "$dir/ctc-encoder.onnx" \
        --data "$data" > "$EXP/logs/$stage-export.log" 2>&1 || echo "$stage: CTC export failed" >&2
      for family in aed transducer; do
        "$PY" "examples/fsdd/export_$family.py" --checkpoint "$dir/$family/checkpoint.pt" --output-dir "$dir" \
          --data "$data" >> "$EXP/logs/$stage-export.log" 2>&1 || echo "$stage: $family export failed" >&2
      done;;
    synth-aed|synth-transducer)
      loso --family "${stage#synth-}" --out "$SYNTH_DATA" --exp "$EXP/after-synth" -- $CHOSEN $EXTRA \
        > "$EXP/logs/$stage-after.log" 2>&1;;
    aed|transducer)
      loso --family "$stage" --exp "$EXP/before" -- $EXTRA > "$EXP/logs/$stage-before.log" 2>&1 &
      loso --family "$stage" --exp "$EXP/after" -- $CHOSEN $EXTRA > "$EXP/logs/$stage-after.log" 2>&1 &
      wait;;
    *) echo "loso_gpu.sh: unknown stage $stage (data ctc nested aed transducer synth-data synth synth-aed synth-transducer ship ship-synth)" >&2; exit 2;;
  esac
  echo "$stage: $(( $(date +%s) - started )) s"
  tail -n 3 "$EXP"/logs/*.log 2>/dev/null | grep -E "Error|exit status|failed" || true
done
