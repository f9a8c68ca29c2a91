#!/usr/bin/env bash
# One short run of the bench/loop cluster with its console visible (diagnostics on a GPU machine).
# usage: bench/gpu_smoke.sh OUT_DIR STEPS STALENESS MODE
set -u
out=$1; steps=$2; staleness=$3; mode=$4
root=$(mktemp -d /tmp/smoke-XXXX)
python3 - "$root" "$steps" "$staleness" "$mode" <<'PY'
import sys
from bench.loop import HOSTS
root, steps, staleness, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
open(f"{root}/hosts.toml", "w").write(HOSTS.format(
    model="qwen2-0.5b-shape", device="cuda", dtype="bfloat16", group=8, groups=16, steps=steps,
    staleness=staleness, mode=mode, threads=4, dp=1, w0="cuda", w1="cuda", sync="disk"))
PY
timeout 200 python3 -m launch.cluster "$root/hosts.toml" --run-dir "$root/run" 2>&1 | tail -40
for f in "$root"/run/logs/*.log; do tail -n 15 "$f" > "$out/$(basename "$f")"; done
cp "$root/run/metrics.jsonl" "$out/" 2>/dev/null
