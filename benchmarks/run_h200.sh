#!/usr/bin/env bash
# Everything the H200 needs to prove, in one call: every test on the GPU, kernel and layer benchmarks, end to end 8B and 1B.
# Usage (device): OUT=/some/dir bash benchmarks/run_h200.sh [quick]
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-results}
mkdir -p "$OUT"
python3 -m pytest tests -q -p no:cacheprovider 2>&1 | tail -15 | tee "$OUT/gpu_tests.log"
python3 benchmarks/bench_kernels.py ${1:+--quick} --out "$OUT/kernels.json" > "$OUT/kernels.log" 2>&1
grep -A 12 "^| module" "$OUT/kernels.log"
python3 benchmarks/bench_layer_host.py 2>&1 | grep "^|" | tee "$OUT/layer_host.log"
python3 benchmarks/bench_e2e.py --model 8b --repeats 5 --out "$OUT/e2e_8b.json" 2>&1 | grep -v -i warn > "$OUT/e2e_8b.log"
grep "^| 8b" "$OUT/e2e_8b.log"
python3 benchmarks/bench_e2e.py --model 1b --repeats 5 --out "$OUT/e2e_1b.json" 2>&1 | grep -v -i warn > "$OUT/e2e_1b.log"
grep "^| 1b" "$OUT/e2e_1b.log"
