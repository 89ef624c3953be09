#!/usr/bin/env bash
# Quick-start throughput of two commits, run alternately in one job on this machine:
#
#   bash scripts/bench_commits.sh OLD_REV NEW_REV [ROUNDS=3] [STEPS=40]
#
# Each round trains recipes/quickstart/tiny_llm.yaml for STEPS steps at both commits (which goes
# first alternates per round, so drift in the machine's speed hits both alike), from that
# commit's own checkout of the code but this repo's venv and data cache. A run's figure is the
# median tokens/s of its steps after the first 5; the script prints every run, each commit's
# median over rounds and NEW / OLD. No eval, no checkpoint, no sample: only training steps count.
# Take the figures on a quiet machine (nothing else running on its cores).
set -euo pipefail
if [ $# -lt 2 ]; then sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 2; fi
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
OLD="$(git -C "$REPO_ROOT" rev-parse --short "$1")"
NEW="$(git -C "$REPO_ROOT" rev-parse --short "$2")"
ROUNDS="${3:-3}"
STEPS="${4:-40}"
WORK="$(mktemp -d /tmp/bench_commits.XXXXXX)"
trap 'for r in "$OLD" "$NEW"; do git -C "$REPO_ROOT" worktree remove --force "$WORK/$r" 2>/dev/null || true; done' EXIT

# The data the quick start reads, built once by this checkout's launcher (a no-op when cached).
python -m veomni.launch "$REPO_ROOT/recipes/quickstart/tiny_llm.yaml" >/dev/null
for rev in "$OLD" "$NEW"; do git -C "$REPO_ROOT" worktree add --detach --quiet "$WORK/$rev" "$rev"; done

run() {  # run REV ROUND -> prints the run's median tokens/s
    local rev="$1" out="$WORK/out_$1_$2"
    (cd "$WORK/$rev" && PYTHONPATH="$WORK/$rev" OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 \
        -m veomni.train.run recipes/quickstart/tiny_llm.yaml \
        --train.max_steps "$STEPS" --train.output_dir "$out" --train.eval_interval 0 --train.sample_prompt null \
        --data.train_path "$REPO_ROOT/data/cache/stdlib/train" --data.eval_path null \
        --checkpoint.interval 0 --checkpoint.save_final false --log.progress_bar false >"$out.log" 2>&1) \
        || { echo "run $rev failed, see $out.log" >&2; exit 1; }
    python - "$out/metrics.jsonl" <<'EOF'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
print(statistics.median(r["tokens_per_s"] for r in rows if "tokens_per_s" in r and r["step"] > 5))
EOF
}

declare -A runs=([$OLD]="" [$NEW]="")
for round in $(seq 1 "$ROUNDS"); do
    if [ $((round % 2)) = 1 ]; then order=("$OLD" "$NEW"); else order=("$NEW" "$OLD"); fi
    for rev in "${order[@]}"; do
        value="$(run "$rev" "$round")"
        runs[$rev]+="$value "
        printf 'round %d  %s  %8.1f tokens/s\n' "$round" "$rev" "$value"
    done
done
python - "$OLD" "${runs[$OLD]}" "$NEW" "${runs[$NEW]}" <<'EOF'
import statistics, sys
old, old_runs, new, new_runs = sys.argv[1], sys.argv[2].split(), sys.argv[3], sys.argv[4].split()
a, b = statistics.median(map(float, old_runs)), statistics.median(map(float, new_runs))
print(f"median tokens/s  {old} (old): {a:.1f}   {new} (new): {b:.1f}   new/old = {b / a:.3f}")
EOF
