#!/usr/bin/env bash
# Utility of correlated noise (issue 37): validation loss (and accuracy) of DP-SGD vs DP-BandMF vs the
# planner's choice (`--config.dp.mechanism=auto`) at equal steps, several seeds, on CPU-sized versions of
# the two jobs, in the regime the literature reports gains in (many steps, several epochs):
#
#   pretrain  experiments.pretrain_gpt2: GPT-2 2 blocks x 64 wide (135k parameters), bpe512, seq 32,
#             on 59 State of the Union addresses cut to 4,000 characters (every 4th of the bundled corpus:
#             N ~ 3,100 windows), expected batch 32, 500 steps (~5 epochs), lr 3e-3.
#   finetune  experiments.finetune, full fine-tuning with the label-only loss, of a non-DP pretraining run
#             of the same model (seq 96, 300 steps) on every 3rd Rotten Tomatoes snippet (3,522: ~3,170
#             train, 350 held out for accuracy), expected batch 16, 200 steps (~1 epoch), seq 96, lr 3e-3.
#
#   bash benchmarks/correlated_noise_utility.sh all        # pretrain, finetune, then the table
#   bash benchmarks/correlated_noise_utility.sh pretrain   # one stage; `table` only prints
#
# Runs one job at a time under `nice -n 5`; a run whose summary.json exists is skipped, so rerunning
# finishes an interrupted grid. Settings by environment: ROOT (run directories, default
# /tmp/correlated_noise_utility), EPSILONS ("2 8"), PT_SEEDS ("0 1 2"), FT_SEEDS ("0 1"), PT_MECHS
# ("dpsgd auto bandmf4"), PT_LR (the pretraining learning rate, 3e-3; runs at another go to
# $ROOT/pretrain_lr<PT_LR>/), FT_MECHS ("dpsgd auto"), RT (a rotten_tomatoes.jsonl already written by
# `python -m experiments.rotten_tomatoes`; default: that command, which pip-downloads its sdist).
# A mechanism is dpsgd | auto | bandmf<b> | blt | nondp (the non-DP baseline, once per seed, no epsilon).
# Measured numbers: notebook/2026-11-28-correlated-noise-utility.md.
set -euo pipefail
cd "$(dirname "$0")/.."

ROOT=${ROOT:-/tmp/correlated_noise_utility}
EPSILONS=${EPSILONS:-"2 8"}
PT_SEEDS=${PT_SEEDS:-"0 1 2"}
FT_SEEDS=${FT_SEEDS:-"0 1"}
PT_MECHS=${PT_MECHS:-"dpsgd auto bandmf4"}
PT_LR=${PT_LR:-3e-3}
PT_DIR=$ROOT/pretrain$([[ $PT_LR == 3e-3 ]] || echo "_lr$PT_LR")
FT_MECHS=${FT_MECHS:-"dpsgd auto"}
mkdir -p "$ROOT/logs"
COMMON=(--config.data.cache_dir="$ROOT/cache" --config.compilation_cache_dir="$ROOT/xla" --config.sample.num=0)
PT=(--config.data.path="$ROOT/corpus.jsonl" --config.data.tokenizer=bpe512 --config.model.n_layer=2
    --config.model.n_head=2 --config.model.d_model=64 --config.model.max_seq_len=32 --config.seq_len=32
    --config.batch_size=32 --config.steps=500 --config.log_every=50 --config.eval_every=250
    --config.checkpoint_every=500 --config.eval_windows=128 --config.learning_rate="$PT_LR")
FT_INIT=(--config.data.path="$ROOT/corpus.jsonl" --config.data.tokenizer=bpe512 --config.model.n_layer=2
         --config.model.n_head=2 --config.model.d_model=64 --config.model.max_seq_len=96 --config.seq_len=96
         --config.batch_size=32 --config.steps=300 --config.log_every=50 --config.eval_every=300
         --config.checkpoint_every=300 --config.eval_windows=128 --config.seed=0 --config.dp.enabled=False)
FT=(--config.finetune.init="$ROOT/ft_init" --config.data.path="$ROOT/rt_small.jsonl" --config.finetune.method=full
    --config.seq_len=96 --config.batch_size=16 --config.steps=200 --config.learning_rate=3e-3
    --config.log_every=50 --config.eval_every=200 --config.checkpoint_every=200
    --config.finetune.accuracy_examples=400)

mechanism_flags() {  # $1: dpsgd | auto | bandmf<b> | blt | nondp
  case "$1" in
    nondp) echo "--config.dp.enabled=False" ;;
    bandmf*) echo "--config.dp.mechanism=bandmf --config.dp.bands=${1#bandmf}" ;;
    *) echo "--config.dp.mechanism=$1" ;;
  esac
}

run() {  # $1: run directory, $2: module, rest: flags
  local dir=$1 module=$2; shift 2
  if [[ -f "$dir/summary.json" ]]; then echo "done already: $dir"; return; fi
  local start=$SECONDS log="$ROOT/logs/$(basename "$(dirname "$dir")")_$(basename "$dir").log"
  if nice -n 5 python -m "$module" --config.workdir="$dir" "${COMMON[@]}" "$@" >"$log" 2>&1; then
    echo "$dir: $((SECONDS - start)) s, $(grep -m1 -o 'val loss *[0-9.]*' "$log" | tr -s ' ')"
  else
    echo "$dir: FAILED ($(grep -m1 '^error' "$log" || tail -1 "$log"))"
  fi
}

corpus() {
  [[ -f "$ROOT/corpus.jsonl" ]] || python - "$ROOT/corpus.jsonl" <<'EOF'
import gzip, json, sys
docs = [json.loads(line)["text"] for line in gzip.open("jaxdp/data/corpora/sotu.jsonl.gz", "rt")]
with open(sys.argv[1], "w") as f:
    f.writelines(json.dumps({"text": d[:4000]}) + "\n" for d in docs[::4])
EOF
}

pretrain() {
  corpus
  for seed in $PT_SEEDS; do
    for mech in $PT_MECHS; do
      if [[ $mech == nondp ]]; then
        run "$PT_DIR/nondp_s$seed" experiments.pretrain_gpt2 "${PT[@]}" --config.seed="$seed" --config.dp.enabled=False
        continue
      fi
      for eps in $EPSILONS; do
        # shellcheck disable=SC2046
        run "$PT_DIR/e${eps}_${mech}_s$seed" experiments.pretrain_gpt2 "${PT[@]}" --config.seed="$seed" \
          --config.dp.target_epsilon="$eps" $(mechanism_flags "$mech")
      done
    done
  done
}

finetune() {
  corpus
  if [[ ! -f "$ROOT/rt_small.jsonl" ]]; then
    local rt=${RT:-$ROOT/rotten_tomatoes.jsonl}
    [[ -f "$rt" ]] || python -m experiments.rotten_tomatoes --out="$rt"
    sed -n '3~3p' "$rt" >"$ROOT/rt_small.jsonl"
  fi
  run "$ROOT/ft_init" experiments.pretrain_gpt2 "${FT_INIT[@]}"
  for seed in $FT_SEEDS; do
    for mech in $FT_MECHS; do
      for eps in $EPSILONS; do
        # shellcheck disable=SC2046
        run "$ROOT/finetune/e${eps}_${mech}_s$seed" experiments.finetune "${FT[@]}" --config.seed="$seed" \
          --config.dp.target_epsilon="$eps" $(mechanism_flags "$mech")
      done
    done
  done
}

table() {
  python - "$ROOT" <<'EOF'
import collections, glob, json, os, re, statistics, sys
jobs = sorted(os.path.basename(p) for p in glob.glob(os.path.join(sys.argv[1], "pretrain*"))) + ["finetune"]
for job in jobs:
    groups = collections.defaultdict(list)
    for d in sorted(glob.glob(os.path.join(sys.argv[1], job, "*_s*"))):
        if not os.path.exists(os.path.join(d, "summary.json")):
            continue
        s = json.load(open(os.path.join(d, "summary.json")))
        name = os.path.basename(d)
        p = json.load(open(os.path.join(d, "privacy.json"))).get("noise_mechanism") or {}
        params = p.get("parameters") or {}
        ran = ("-" if not s["dp"] else f"blt {params.get('buffers')} buffers" if p.get("mechanism") == "blt"
               else f"bandmf b={params['bands']}" if p.get("mechanism") == "bandmf" else "dpsgd")
        acc = (s.get("heldout_accuracy") or {}).get("accuracy")
        groups[re.sub(r"_s\d+$", "", name)].append((name, ran, s.get("noise_multiplier"), s["val_loss"], acc))
    if not groups:
        continue
    print(f"\n{job}: val loss mean +- sd over seeds (per seed){'; accuracy mean (per seed)' if job == 'finetune' else ''}")
    print("| epsilon | mechanism | ran as | sigma | seeds | val loss | per seed |" + (" accuracy | per seed |" if job == "finetune" else ""))
    print("|---|---|---|---|---|---|---|" + ("---|---|" if job == "finetune" else ""))
    def key(g):
        m = re.match(r"e([\d.]+)_(.*)", g)
        return (float(m.group(1)), m.group(2)) if m else (float("inf"), g)
    for g in sorted(groups, key=key):
        rows = groups[g]
        eps, mech = key(g)
        losses = [r[3] for r in rows]
        sd = f" +- {statistics.stdev(losses):.4f}" if len(losses) > 1 else ""
        sigma = rows[0][2]
        line = (f"| {'inf' if eps == float('inf') else f'{eps:g}'} | {mech} | {', '.join(sorted({r[1] for r in rows}))} | "
                f"{'-' if sigma is None else f'{sigma:.3f}'} | {len(rows)} | {statistics.mean(losses):.4f}{sd} | "
                f"{' '.join(f'{x:.4f}' for x in losses)} |")
        if job == "finetune":
            accs = [r[4] for r in rows if r[4] is not None]
            line += (f" {statistics.mean(accs):.3f} | {' '.join(f'{a:.3f}' for a in accs)} |" if accs else " - | - |")
        print(line)
EOF
}

case "${1:-all}" in
  pretrain) pretrain ;;
  finetune) finetune ;;
  table) table ;;
  all) pretrain; finetune; table ;;
  *) echo "usage: $0 [all|pretrain|finetune|table]" >&2; exit 2 ;;
esac
