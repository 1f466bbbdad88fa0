#!/usr/bin/env bash
# The CPU measurement campaign behind docs/sim.md's validation table and the shipped
# cpu-tiny calibration: six A:F pairs x two workloads x three modes, each mode its own
# launch (with --mode all the later modes would run on warm caches), REPS repeats, into
# DIR, then every report into one run bundle, DIR/runs.json.gz. Run it on an otherwise
# idle machine; about 5 s per launch on 2 cores.
#
#   bash tools/dev/sim_campaign.sh DIR [REPS]
#   afd sim validate DIR/runs.json.gz --json DIR/validation.json
#   afd sim calibrate DIR/runs.json.gz -o cpu-tiny.json
set -euo pipefail
DIR=${1:?usage: sim_campaign.sh DIR [REPS]}
REPS=${2:-3}
AFD=${AFD:-afd}
mkdir -p "$DIR"
total=$((REPS * 2 * 6 * 3)); n=0
for rep in $(seq "$REPS"); do for wl in uneven bimodal; do
  for af in "1 1" "2 1" "1 2" "2 2" "3 1" "1 3"; do set -- $af
    for mode in async sync colocated; do
      n=$((n + 1))
      out="$DIR/a$1f$2-$wl-$mode-r$rep.json"
      echo "[$n/$total] $out"
      # Exit 1 means a verification miss; the report (timings) is written before the check.
      $AFD run --device cpu --attention-ranks "$1" --ffn-ranks "$2" --workload "$wl" \
        --requests 48 --max-prompt-len 512 --max-num-batched-tokens 512 --mode "$mode" \
        --no-progress --json "$out" > "$out.log" 2>&1 || test -s "$out"
done; done; done; done
$AFD sim bundle "$DIR"/a*f*-*-*-r*.json -o "$DIR/runs.json.gz" \
  --notes "bash tools/dev/sim_campaign.sh $DIR $REPS on $(nproc) cores, $(date -u +%F), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
