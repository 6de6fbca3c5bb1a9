#!/usr/bin/env bash
# The GPU runs, by stage: tests and benchmarks on a CUDA machine, each stage fitting one 10-minute device call with
# others; every stage writes its logs and result files under $OUT and prints its table.
# Usage (device): OUT=/some/dir bash benchmarks/gpu_stages.sh [stage ...]
#   tests    every test file on the GPU (gpu-marked tests add bf16/fp16 cases) -> gpu_tests.log
#   kernels  kernel benchmark, all layer shapes, ranks 16 and 64                 -> kernels.json, kernels.log
#   tune     tile sweep of both kernels                                           -> tune.json, tune.log
#   layer    host time of one whole patched layer                                 -> layer_host.log
#   e2e-8b   end to end, 8B, r=16, 1/8/32 distinct, PEFT rows included (~7 min)  -> e2e_8b.json
#   e2e-1b   the same for 1B (~4 min)                                               -> e2e_1b.json
#   profile  cProfile of eager 1B decode steps: base, PEFT one adapter, csgmv     -> profile_decode_1b.txt
#   pstatic  static-cache generate, 1B: prefill vs decode step, GPU kernels per step (base, PEFT, csgmv) -> profile_static_1b.*
#   ranks    end to end, 1B, r=64 and mixed ranks 8/16/64 (PEFT one adapter vs csgmv) -> e2e_1b_r64.json, ...
#   static   transformers' static cache (compiled decode), 1B and 8B, all rows (~7 min; split in two device calls
#            if need be: bench_static.py --model 1b / 8b) -> static_{1b,8b}.json
#   memory   adapter memory with csgmv vs PEFT alone; 1000 adapters with the host tier; the tier's bookkeeping per move
#            (~6 min) -> memory_1b.json, tier_host.log
#   tier     the host tier's bookkeeping per move alone (bench_tier_host.py --phases --repoint, ~2 min) -> tier_host.log
#   tiercold the host tier's cold calls alone (1000 adapters loaded, 4 calls of 32 from host memory), then tier
#            -> memory_1b_cold.json, memory_1b_cold.log, tier_host.log
#   offload  a model accelerate offloads on one GPU: the offload tests (gpu-marked ones included), then 8B with half
#            its layers offloaded to the CPU: base, PEFT one adapter, csgmv 32 distinct and one adapter, csgmv with the
#            offloaded stacks kept on the GPU; three alternating rounds (~5 min) -> gpu_offload.log, offload_8b.json,
#            offload_8b.log
#   multi    two GPUs (the nvidia-h200-x2 kind): 8B with device_map over both vs one; data-parallel generate -> multi_gpu.json
#   fp32     end to end with PEFT's default fp32 adapters, 1B and 8B (PEFT one adapter vs csgmv) -> e2e_{1b,8b}_fp32.json
#   beside   GPU time of compiled 1B/8B blocks, the LoRA after vs beside the base product (~2 min) -> beside.json
#   cli      the batch command, 1B, 2048 rows: continuous batching with eager steps vs static batches on the dynamic
#            and the static cache -> cli_1b.json
#   continuous  continuous batching with an adapter per request, 1B, 256 requests (prompts 32-1024, answers 16-512):
#            base model (csgmv's loop and transformers' defaults), stock PEFT one adapter, csgmv 32 distinct (~6 min)
#            -> continuous_1b.json
#   cligoal  the batch command on uneven work, 1B, prompts of ~32-1024 tokens, each line its own max_new_tokens of
#            16-512 standing for answers that end at different points, the first 512 of the 1024 lines of the other
#            cli stages (a static batch's speed does not depend on how many follow it; all 1024 take the blind run
#            past a call's 10 minutes): the command's default before continuous batching on such answers
#            (bench_cli.py's blind run: eager static batches of 16 by prompt length, every line decoded to 512, each
#            line's own limit counted; ~5 min), then the command's default today (attention per request) and
#            continuous batching with SDPA's attention on the same lines (~2 min) -> cli_1b_goal.json
#   clisweep the batch command on the uneven work of cligoal, continuous batching under CUDA graphs at 32, 64 and
#            128 (its default with SDPA) requests a step: with SDPA a step attends over every running request's
#            cache, so fewer requests a step cost less attention per token (~9 min) -> cli_1b_sweep.json
#   clicap   the batch command, 1B, 2048 rows: continuous batching with its cap of requests per step, then with
#            transformers' own (1024), then static-cache batches (~6 min) -> cli_1b_cap.json
#   serve    the server (peft-csgmv serve), 1B, 256 requests from 64 streaming clients, against generate_batch on the
#            same requests, all at once and fed at the clients' concurrency (needs wheels/serve:
#            benchmarks/serve_wheels.sh; carry wheels; ~6 min) -> serve_1b.json
#   cbgraphs continuous batching under transformers' CUDA graphs, 1B, the issue's 1024 requests (prompts 32-1024,
#            answers 16-512): base model and csgmv 32 distinct, both with use_cuda_graph=True, at most 128 requests a
#            step as the batch command runs them with SDPA (transformers' own sizing ran out of memory there; ~6 min)
#            -> continuous_1b_graphs.json
#   cbgraphs8b the same for 8B over 256 requests (~6 min) -> continuous_8b_graphs.json
#   cbvarlen attention per request by torch's own flash kernel (peft_csgmv.attention; --varlen-attention): its GPU
#            tests, then the 1B layout's 1024 requests of cbgraphs under CUDA graphs with it and no cap of requests
#            per step, base model and csgmv 32 distinct (~6 min; against cbgraphs' SDPA rows)
#            -> gpu_attention.log, continuous_1b_varlen.json
#   cbvarlen8b  the same for 8B over cbgraphs8b's 256 requests, without the tests (~4 min) -> continuous_8b_varlen.json
#   clivarlen  the batch command on the uneven work of cligoal (1024 lines) with --varlen-attention under CUDA graphs
#            (~2 min), which ran out of GPU memory under transformers 5.17 while the benchmark's own process held
#            4.9 GiB; where it fails again: eager steps, then CUDA graphs with 70% of the free memory for the cache,
#            then CUDA graphs with the allocator's expandable segments (PYTORCH_CUDA_ALLOC_CONF; ~5 min more)
#            -> cli_1b_varlen.json (cli_1b_varlen_tries.json, cli_1b_varlen_expandable.json)
#   clidefault  the batch command's default: attention's GPU tests, then on the uneven work of cligoal (1024 lines;
#            continuous batching, CUDA graphs, attention per request with the allocator's expandable segments as
#            varlen_attention sets them at run time), the same with them set for the whole process by
#            PYTORCH_CUDA_ALLOC_CONF, then on 2048 even lines (64 new tokens each: static-cache batches by rule)
#            against continuous batching under CUDA graphs (~8 min) -> gpu_attention.log, cli_1b_default.json,
#            cli_1b_default_env.json, cli_1b_even.json
#   cbasync  as cbgraphs, with asynchronous batching too (use_async_batching=True) -> continuous_1b_async.json
#   cligraphs  the batch command on the uneven work of cligoal: continuous batching with --cuda-graphs, then
#            static-cache batches (~8 min) -> cli_1b_graphs.json
#   cbtier   continuous batching over 1000 adapters (copies of 32), 1B, 96 requests (answers 16-256): all resident, then
#            max_resident_adapters=64 (~5 min) -> continuous_1b_tier.json
#   peer     PEFT's own mixed-batch tests through csgmv's Triton kernels, fp32 then bf16 models (needs
#            `python benchmarks/peft_tests/run.py --fetch <the image's PEFT version>` here first; carry wheels)
#            -> peer_fp32.log, peer_bf16.log
#   clitier  the batch command, 1B, 2048 rows, 32 adapters: fp32 adapters (its default), then bf16 with
#            --max-resident-adapters 8 (the host tier), both caches each (~6 min) -> cli_1b_{fp32,tier}.*
#   pstatic8b  as pstatic, for the 8B layout                                     -> profile_static_8b.*
#   sbeside  static cache, 8B and 1B: base model, csgmv 32 distinct (the LoRA beside the base product), and the LoRA
#            after the base product (~6 min) -> static_{8b,1b}_beside.json
#   smin     static cache, 1B then 8B: base model, csgmv 32 distinct (all beside), after, and only base weights of
#            >= 16 MiB beside (PEFT_CSGMV_BESIDE_MIN_MIB; ~7 min) -> static_{1b,8b}_min.json
#   sfusedproj  static cache, lean: the 1B Llama layout and the same sizes with fused q/k/v and gate/up projections
#            (Phi-3's layout, LoRA on its 4 projections) -> static_1b_lean.json, static_phi3_1b.json
#   pvariants  as pstatic (base, csgmv) with each decode graph's GPU span, then csgmv with all launches serial
#            (no PDL, no side stream) -> profile_static_1b_{span,serial}.*
#   reuse    static cache, 1B lean (+ after): a new cache per generate vs one kept by the caller -> static_1b_{fresh,kept}.*
#   groups   sibling groups (on by default): their GPU tests, then static cache 1B and 8B lean with and without
#            them (PEFT_CSGMV_GROUPS=0) (~6 min) -> gpu_group.log, static_{1b,8b}_groups.*
#   gbeside1b  sibling groups beside their base products (PEFT_CSGMV_GROUPS=beside): the group GPU tests, then
#            compiled-block GPU time three times (rows in order, reversed, in order), then static cache 1B full with
#            them (10 MiB floor) and without (~6 min) -> gpu_gbeside.log, beside_groups_order.log, static_1b_gbeside.*
#   gbeside8b  static cache 8B full, groups beside (10 MiB floor) against the default (~5 min) -> static_8b_gbeside.*
#   compile  compile time, 1B: base model and csgmv alternated over 3 rounds, each row a process of its own with empty
#            caches (~9 min on a slow machine; read the rows that are not the machine's first process) -> compile_1b.*
#   verify   the GPU tests of what changed last (the MoE plan in one launch and the experts' own-rank stacks, adapters
#            brought in ahead, continuous batching's compute stream and its CUDA graphs, offload, the server; installs
#            the serve wheels; ~6 min) -> gpu_verify.log
#   cbprof   continuous batching, 1B, 32 requests (answers 16-128), base model then csgmv 32 distinct, each run again
#            under torch.profiler (every thread; host syncs shown): their busiest ops (~3 min) -> continuous_1b_prof.log
#   pmoe     eager MoE decode step, Qwen3-30B-A3B's layout cut to 8 layers: wall time against its GPU kernels' sum and
#            the ops with the most GPU and host time, base model and csgmv 32 distinct (~2 min) -> profile_moe_decode.log
#   smoe     static cache (compiled), MoE expert LoRA, qwen3-30b-a3b then gpt-oss-20b cut to 16 layers: base model,
#            PEFT one adapter, csgmv 8/32 distinct (~9 min; one layout per call if need be) -> static_moe_{qwen3,gptoss}.json
#   moe      end to end, MoE expert LoRA (r=16 on attention and experts), batch 32, prompt 256: qwen3-30b-a3b and
#            gpt-oss-20b cut to 16 layers; base model, PEFT one adapter (rebuilds the experts' weights each forward: 2
#            repeats), csgmv 1/8/32 distinct; 3 rounds, the base model measured 3 times (~3 min each, ~6 min; a row
#            out of memory reads NaN)
#            -> e2e_moe_{qwen3,gptoss}.json
# With no stage given: all of them but tune (more than one 10-minute call; split them).
# TRANSFORMERS=newest runs the stages under the newer transformers of wheels/tf (benchmarks/tf_wheels.sh; carry
# wheels/tf) instead of the image's; give it an OUT of its own (the result files keep their names), e.g.
#   OUT=$OUT/image bash benchmarks/gpu_stages.sh cbgraphs; TRANSFORMERS=newest OUT=$OUT/newest bash ... cbgraphs
set -u
export PYTHONUNBUFFERED=1
# The package from this checkout (the GPU image has no editable install of it): scripts import peft_csgmv.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ "${TRANSFORMERS:-image}" = newest ]; then
  bash benchmarks/tf_wheels.sh install || exit 1
  export PYTHONPATH="$PWD/wheels/tf/site:$PYTHONPATH"
fi
OUT=${OUT:-results}
mkdir -p "$OUT"
tier_host() {  # the host tier's bookkeeping per move (stages memory and tier)
  python3 benchmarks/bench_tier_host.py --phases --repoint 2>&1 | grep "^|" | tee "$OUT/tier_host.log"
}
cli_uneven() {  # the batch command on uneven work (the cli stages): $1 the runs, $2 the result's name, $3 the lines
  python3 benchmarks/bench_cli.py --rows "${3:-1024}" --words 5,160 --limits 16,512 --new-tokens 512 \
    --runs "$1" --out "$OUT/$2.json" 2>&1 | grep --line-buffered -v -i warn > "$OUT/$2.log"
  grep -E "^\|" "$OUT/$2.log" || tail -25 "$OUT/$2.log"
}
for stage in ${*:-tests kernels layer e2e-8b e2e-1b ranks}; do
  echo "== $stage $(date -u +%T)"
  case $stage in
    tests)
      # QLoRA tests need bitsandbytes, which the GPU image lacks: its wheel travels in wheels/ (carry it).
      if ls wheels/bitsandbytes-*.whl > /dev/null 2>&1; then bash benchmarks/bnb_wheel.sh install; fi
      if ls wheels/serve/*.whl > /dev/null 2>&1; then bash benchmarks/serve_wheels.sh install; fi
      python3 -m pytest tests -q -p no:cacheprovider -rf --tb=short > "$OUT/gpu_tests.log" 2>&1
      grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.log" | tail -15 ;;
    kernels)
      python3 benchmarks/bench_kernels.py --ranks 16,64 --fused-sweep --out "$OUT/kernels.json" > "$OUT/kernels.log" 2>&1
      grep -A 12 "^| module" "$OUT/kernels.log" ;;
    tune)
      python3 benchmarks/tune_kernels.py --budget-s 240 --out "$OUT/tune.json" > "$OUT/tune.log" 2>&1
      tail -3 "$OUT/tune.log" ;;
    layer)
      python3 benchmarks/bench_layer_host.py 2>&1 | grep "^|" | tee "$OUT/layer_host.log" ;;
    e2e-8b|e2e-1b)
      m=${stage#e2e-}
      python3 benchmarks/bench_e2e.py --model $m --repeats 5 --out "$OUT/e2e_$m.json" 2>&1 | grep -v -i warn \
        > "$OUT/e2e_$m.log"
      grep "^| $m" "$OUT/e2e_$m.log" || tail -25 "$OUT/e2e_$m.log" ;;
    profile)
      python3 benchmarks/profile_decode.py --model 1b --out "$OUT/profile_decode_1b.txt" 2>&1 | grep -v -i warn \
        | head -60 ;;
    pstatic)
      python3 benchmarks/profile_static.py --model 1b --out "$OUT/profile_static_1b.json" 2>&1 \
        | grep --line-buffered -v -i -E "warn|USDT|profiler" > "$OUT/profile_static_1b.log"
      cat "$OUT/profile_static_1b.log" | tail -70 ;;
    ranks)
      for r in 64 8,16,64; do
        tag=$(echo $r | tr , -)
        python3 benchmarks/bench_e2e.py --model 1b --ranks $r --csgmv-only --repeats 5 \
          --out "$OUT/e2e_1b_r$tag.json" 2>&1 | grep "^| 1b" | tee "$OUT/e2e_1b_r$tag.log"
      done ;;
    static)
      python3 benchmarks/bench_static.py --model 1b --repeats 3 --out "$OUT/static_1b.json" 2>&1 | grep -v -i warn \
        > "$OUT/static_1b.log"
      python3 benchmarks/bench_static.py --model 8b --repeats 2 --out "$OUT/static_8b.json" 2>&1 | grep -v -i warn \
        > "$OUT/static_8b.log"
      grep -h "^| [18]b" "$OUT/static_1b.log" "$OUT/static_8b.log" ;;
    memory)
      python3 benchmarks/bench_memory.py --out "$OUT/memory_1b.json" 2>&1 | grep --line-buffered -v -i warn > "$OUT/memory_1b.log"
      grep "^|" "$OUT/memory_1b.log" || tail -25 "$OUT/memory_1b.log"
      tier_host ;;
    tier)
      tier_host ;;
    tiercold)  # the host tier's cold calls (32 adapters from host memory, 1000 loaded) and its bookkeeping per move
      python3 benchmarks/bench_memory.py --memory-cases "" --cold-rounds 4 --profile-call "$OUT/call_profile.txt" \
        --out "$OUT/memory_1b_cold.json" 2>&1 \
        | grep --line-buffered -v -i warn > "$OUT/memory_1b_cold.log"
      grep -E "^\||cold calls" "$OUT/memory_1b_cold.log" || tail -25 "$OUT/memory_1b_cold.log"
      tier_host ;;
    fp32)
      for m in 1b 8b; do
        python3 benchmarks/bench_e2e.py --model $m --fp32-adapters --csgmv-only --distinct 1,32 --repeats 5 \
          --rounds 2 --out "$OUT/e2e_${m}_fp32.json" 2>&1 | grep --line-buffered -v -i warn > "$OUT/e2e_${m}_fp32.log"
        grep "^| $m" "$OUT/e2e_${m}_fp32.log" || tail -25 "$OUT/e2e_${m}_fp32.log"
      done ;;
    moe)
      for pair in qwen3:qwen3-30b-a3b gptoss:gpt-oss-20b; do
        tag=${pair%%:*} m=${pair#*:}
        python3 benchmarks/bench_e2e.py --model $m --layers 16 --repeats 3 --peft-one-repeats 2 --rounds 3 \
          --out "$OUT/e2e_moe_$tag.json" 2>&1 | grep --line-buffered -v -i warn > "$OUT/e2e_moe_$tag.log"
        grep "^| $m" "$OUT/e2e_moe_$tag.log" || tail -25 "$OUT/e2e_moe_$tag.log"
      done ;;
    verify)
      if ls wheels/serve/*.whl > /dev/null 2>&1; then bash benchmarks/serve_wheels.sh install; fi
      python3 -m pytest tests/test_moe_plan.py tests/test_moe.py tests/test_moe_kernels.py tests/test_moe_tier.py \
        tests/test_moe_compiled.py tests/test_host_tier.py tests/test_continuous.py \
        tests/test_continuous_graphs.py tests/test_offload.py tests/test_serve.py -q -p no:cacheprovider -rf --tb=short \
        > "$OUT/gpu_verify.log" 2>&1
      grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_verify.log" | tail -15 ;;
    cbprof)
      python3 benchmarks/bench_continuous.py --model 1b --requests 32 --new-max 128 --rows base,csgmv --profile \
        2>&1 | grep --line-buffered -v -i "warn\|eos_token" > "$OUT/continuous_1b_prof.log"
      grep -E "tok/s|^--" "$OUT/continuous_1b_prof.log"; tail -60 "$OUT/continuous_1b_prof.log" | cut -c1-150 ;;
    pmoe)
      python3 benchmarks/profile_moe_decode.py 2>&1 | grep --line-buffered -v -i warn > "$OUT/profile_moe_decode.log"
      grep -E "^\||host" "$OUT/profile_moe_decode.log" ;;
    smoe)
      for pair in qwen3:qwen3-30b-a3b gptoss:gpt-oss-20b; do
        tag=${pair%%:*} m=${pair#*:}
        python3 benchmarks/bench_static.py --model $m --layers 16 --distinct 8,32 --new-tokens 32 --repeats 2 \
          --out "$OUT/static_moe_$tag.json" 2>&1 | grep --line-buffered -v -i warn > "$OUT/static_moe_$tag.log"
        grep "^| $m" "$OUT/static_moe_$tag.log" || tail -25 "$OUT/static_moe_$tag.log"
      done ;;
    cli)
      python3 benchmarks/bench_cli.py --out "$OUT/cli_1b.json" 2>&1 | grep --line-buffered -v -i warn > "$OUT/cli_1b.log"
      grep -E "^\||identical" "$OUT/cli_1b.log" || tail -25 "$OUT/cli_1b.log" ;;
    cligoal)
      cli_uneven blind,default,graphs+--no-varlen-attention cli_1b_goal 512 ;;
    serve)
      bash benchmarks/serve_wheels.sh install
      python3 benchmarks/bench_serve.py --model 1b --requests 256 --clients 64 --out "$OUT/serve_1b.json" 2>&1 \
        | grep --line-buffered -v -i "warn\|eos_token" > "$OUT/serve_1b.log"
      grep "^|" "$OUT/serve_1b.log" || tail -25 "$OUT/serve_1b.log" ;;
    clicap)
      python3 benchmarks/bench_cli.py --runs continuous,uncapped,static --out "$OUT/cli_1b_cap.json" 2>&1 \
        | grep --line-buffered -v -i warn > "$OUT/cli_1b_cap.log"
      grep -E "^\|" "$OUT/cli_1b_cap.log" || tail -25 "$OUT/cli_1b_cap.log" ;;
    cbtier)
      python3 benchmarks/bench_continuous.py --model 1b --requests 96 --new-max 256 --adapters 1000 \
        --max-resident-adapters 64 --rows csgmv,tier --out "$OUT/continuous_1b_tier.json" 2>&1 \
        | grep --line-buffered -v -i "warn\|eos_token" > "$OUT/continuous_1b_tier.log"
      grep "^|\|host tier\|enable" "$OUT/continuous_1b_tier.log" || tail -25 "$OUT/continuous_1b_tier.log" ;;
    cligraphs)
      cli_uneven graphs,static cli_1b_graphs ;;
    clisweep)
      cli_uneven graphs+--batch-size=32,graphs+--batch-size=64,graphs cli_1b_sweep ;;
    cbgraphs|cbgraphs8b)
      [ "$stage" = cbgraphs ] && m=1b n=1024 || m=8b n=256
      python3 benchmarks/bench_continuous.py --model $m --requests $n --rows base-graphs,csgmv-graphs --max-requests 128 \
        --out "$OUT/continuous_${m}_graphs.json" 2>&1 | grep --line-buffered -v -i "warn\|eos_token" \
        > "$OUT/continuous_${m}_graphs.log"
      grep "^|" "$OUT/continuous_${m}_graphs.log" || tail -25 "$OUT/continuous_${m}_graphs.log" ;;
    cbvarlen|cbvarlen8b)
      [ "$stage" = cbvarlen ] && m=1b n=1024 || m=8b n=256
      if [ $m = 1b ]; then
        python3 -m pytest tests/test_attention.py -q -p no:cacheprovider -rf --tb=short > "$OUT/gpu_attention.log" 2>&1
        grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_attention.log" | tail -5
      fi
      python3 benchmarks/bench_continuous.py --model $m --requests $n --rows base-varlen,csgmv-varlen \
        --out "$OUT/continuous_${m}_varlen.json" 2>&1 | grep --line-buffered -v -i "warn\|eos_token" \
        > "$OUT/continuous_${m}_varlen.log"
      grep "^|" "$OUT/continuous_${m}_varlen.log" || tail -25 "$OUT/continuous_${m}_varlen.log" ;;
    clivarlen)
      cli_uneven graphs+--varlen-attention cli_1b_varlen
      if grep -q '"failed"' "$OUT/cli_1b_varlen.json"; then
        cli_uneven "continuous+--varlen-attention,graphs+--varlen-attention+--cache-memory=0.7" cli_1b_varlen_tries
        PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True cli_uneven graphs+--varlen-attention cli_1b_varlen_expandable
      fi ;;
    clidefault)
      python3 -m pytest tests/test_attention.py -q -p no:cacheprovider -k gpu -rf --tb=short > "$OUT/gpu_attention.log" 2>&1
      grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_attention.log" | tail -5
      cli_uneven default cli_1b_default
      PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True cli_uneven default cli_1b_default_env
      python3 benchmarks/bench_cli.py --runs default,graphs --out "$OUT/cli_1b_even.json" 2>&1 | grep --line-buffered \
        -v -i warn > "$OUT/cli_1b_even.log"
      grep -E "^\|" "$OUT/cli_1b_even.log" || tail -25 "$OUT/cli_1b_even.log" ;;
    cbasync)
      python3 benchmarks/bench_continuous.py --model 1b --requests 1024 --rows base-async,csgmv-async --max-requests 128 \
        --out "$OUT/continuous_1b_async.json" 2>&1 | grep --line-buffered -v -i "warn\|eos_token" \
        > "$OUT/continuous_1b_async.log"
      grep "^|" "$OUT/continuous_1b_async.log" || tail -25 "$OUT/continuous_1b_async.log" ;;
    continuous)
      python3 benchmarks/bench_continuous.py --model 1b --requests 256 --out "$OUT/continuous_1b.json" 2>&1 \
        | grep --line-buffered -v -i "warn\|eos_token" > "$OUT/continuous_1b.log"
      grep "^|" "$OUT/continuous_1b.log" || tail -25 "$OUT/continuous_1b.log" ;;
    peer)
      version=$(python3 -c "import peft; print(peft.__version__)")
      if [ ! -d "wheels/peft-$version/tests" ]; then
        echo "no wheels/peft-$version/tests: run python benchmarks/peft_tests/run.py --fetch $version, carry wheels"
      else
        for dtype in fp32 bf16; do
          python3 benchmarks/peft_tests/run.py --tests-dir "wheels/peft-$version/tests" --workdir "$OUT/peer" \
            --backend triton --dtype "$dtype" 2>&1 | grep --line-buffered -v -i warn > "$OUT/peer_$dtype.log"
          grep -E "^(stock|csgmv)" "$OUT/peer_$dtype.log" || tail -25 "$OUT/peer_$dtype.log"
        done
      fi ;;
    clitier)
      python3 benchmarks/bench_cli.py --adapter-dtype fp32 --out "$OUT/cli_1b_fp32.json" 2>&1 \
        | grep --line-buffered -v -i warn > "$OUT/cli_1b_fp32.log"
      grep -E "^\||identical" "$OUT/cli_1b_fp32.log" || tail -25 "$OUT/cli_1b_fp32.log"
      python3 benchmarks/bench_cli.py --max-resident-adapters 8 --out "$OUT/cli_1b_tier.json" 2>&1 \
        | grep --line-buffered -v -i warn > "$OUT/cli_1b_tier.log"
      grep -E "^\||identical" "$OUT/cli_1b_tier.log" || tail -25 "$OUT/cli_1b_tier.log" ;;
    pstatic8b)
      python3 benchmarks/profile_static.py --model 8b --cprofile 25 --out "$OUT/profile_static_8b.json" 2>&1 \
        | grep --line-buffered -v -i -E "warn|USDT|profiler" > "$OUT/profile_static_8b.log"
      tail -70 "$OUT/profile_static_8b.log" ;;
    beside)
      python3 benchmarks/bench_beside.py --pdl-off --out "$OUT/beside.json" 2>&1 | grep --line-buffered -v -i warn > "$OUT/beside.log"
      grep "^|" "$OUT/beside.log" || tail -25 "$OUT/beside.log" ;;
    sbeside)
      for m in 8b 1b; do
        python3 benchmarks/bench_static.py --model $m --lean --after --repeats 3 --out "$OUT/static_${m}_beside.json" \
          2>&1 | grep --line-buffered -v -i warn > "$OUT/static_${m}_beside.log"
        grep "^| $m" "$OUT/static_${m}_beside.log" || tail -25 "$OUT/static_${m}_beside.log"
      done ;;
    smin)
      for m in 1b 8b; do
        python3 benchmarks/bench_static.py --model $m --lean --after --beside-min-mib 16 --repeats 3 \
          --out "$OUT/static_${m}_min.json" 2>&1 | grep --line-buffered -v -i warn > "$OUT/static_${m}_min.log"
        grep "^| $m" "$OUT/static_${m}_min.log" || tail -25 "$OUT/static_${m}_min.log"
      done ;;
    sfusedproj)
      # The 1B sizes with q/k/v and gate/up as one projection each (Phi-3's layout): what fewer LoRA layers per block
      # would give csgmv against the base model, next to the Llama layout in the same run.
      python3 -c "from transformers import Phi3Config as C; C(hidden_size=2048, intermediate_size=8192,
        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
        max_position_embeddings=4096, pad_token_id=0).save_pretrained('$OUT/phi3_1b')"
      python3 benchmarks/bench_static.py --model 1b --lean --repeats 3 --out "$OUT/static_1b_lean.json" 2>&1 \
        | grep --line-buffered -v -i warn > "$OUT/static_1b_lean.log"
      python3 benchmarks/bench_static.py --config "$OUT/phi3_1b" --targets qkv_proj,o_proj,gate_up_proj,down_proj \
        --lean --repeats 3 --out "$OUT/static_phi3_1b.json" 2>&1 | grep --line-buffered -v -i warn \
        > "$OUT/static_phi3_1b.log"
      grep -h "^| " "$OUT/static_1b_lean.log" "$OUT/static_phi3_1b.log" ;;
    pvariants)
      # The static-cache decode step of 1B: base and csgmv as they are, then csgmv with every launch serial (no PDL, no
      # side stream), whose kernel times are each kernel's own.
      python3 benchmarks/profile_static.py --model 1b --rows base,csgmv --out "$OUT/profile_static_1b_span.json" 2>&1 \
        | grep --line-buffered -v -i -E "warn|USDT|profiler" > "$OUT/profile_static_1b_span.log"
      PEFT_CSGMV_PDL=0 PEFT_CSGMV_BESIDE=0 python3 benchmarks/profile_static.py --model 1b --rows csgmv \
        --out "$OUT/profile_static_1b_serial.json" 2>&1 | grep --line-buffered -v -i -E "warn|USDT|profiler" \
        > "$OUT/profile_static_1b_serial.log"
      tail -40 "$OUT/profile_static_1b_span.log"; tail -25 "$OUT/profile_static_1b_serial.log" ;;
    reuse)
      # Static cache, 1B: transformers' new cache per generate against a cache each row keeps (the CUDA graph replays).
      for r in "" --reuse-cache; do
        tag=$([ -n "$r" ] && echo kept || echo fresh)
        python3 benchmarks/bench_static.py --model 1b --lean --after --repeats 3 $r --out "$OUT/static_1b_$tag.json" \
          2>&1 | grep --line-buffered -v -i warn > "$OUT/static_1b_$tag.log"
        grep "^| 1b" "$OUT/static_1b_$tag.log"
      done ;;
    groups)
      python3 -m pytest tests/test_group.py -q -p no:cacheprovider > "$OUT/gpu_group.log" 2>&1
      grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_group.log" | tail -5
      for m in 1b 8b; do
        python3 benchmarks/bench_static.py --model $m --lean --no-groups --repeats 3 --out "$OUT/static_${m}_groups.json" \
          2>&1 | grep --line-buffered -v -i warn > "$OUT/static_${m}_groups.log"
        grep -E "^\| $m|identical" "$OUT/static_${m}_groups.log" || tail -25 "$OUT/static_${m}_groups.log"
      done ;;
    gbeside1b)
      python3 -m pytest tests/test_group.py tests/test_beside.py -k "group" -q -p no:cacheprovider -rf --tb=short \
        > "$OUT/gpu_gbeside.log" 2>&1
      grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_gbeside.log" | tail -5
      for o in "" --reverse ""; do
        python3 benchmarks/bench_beside.py --models 1b --blocks 8 --groups $o 2>&1 | grep "^| 1b" | grep csgmv; echo
      done | tee "$OUT/beside_groups_order.log"
      PEFT_CSGMV_BESIDE_MIN_MIB=10 python3 benchmarks/bench_static.py --model 1b --repeats 3 --groups-beside \
        --out "$OUT/static_1b_gbeside.json" 2>&1 | grep --line-buffered -v -i warn > "$OUT/static_1b_gbeside.log"
      grep -E "^\| 1b|identical" "$OUT/static_1b_gbeside.log" || tail -25 "$OUT/static_1b_gbeside.log" ;;
    gbeside8b)
      PEFT_CSGMV_BESIDE_MIN_MIB=10 python3 benchmarks/bench_static.py --model 8b --repeats 2 --groups-beside \
        --out "$OUT/static_8b_gbeside.json" 2>&1 | grep --line-buffered -v -i warn > "$OUT/static_8b_gbeside.log"
      grep -E "^\| 8b|identical" "$OUT/static_8b_gbeside.log" || tail -25 "$OUT/static_8b_gbeside.log" ;;
    compile)
      python3 benchmarks/compile_time.py --model 1b --rows base,csgmv --rounds 3 --repeats 1 \
        --out "$OUT/compile_1b.json" 2>&1 | grep --line-buffered -v -i warn > "$OUT/compile_1b.log"
      grep "^| 1b" "$OUT/compile_1b.log" || tail -25 "$OUT/compile_1b.log" ;;
    offload)
      python3 -m pytest tests/test_offload.py -q -p no:cacheprovider -rf --tb=short > "$OUT/gpu_offload.log" 2>&1
      grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_offload.log" | tail -8
      python3 benchmarks/bench_offload.py --out "$OUT/offload_8b.json" 2>&1 | grep --line-buffered -v -i warn \
        > "$OUT/offload_8b.log"
      grep -E "^\||layers offloaded" "$OUT/offload_8b.log" || tail -25 "$OUT/offload_8b.log" ;;
    multi)
      python3 benchmarks/bench_multi_gpu.py --out "$OUT/multi_gpu.json" 2>&1 | grep --line-buffered -v -i warn \
        > "$OUT/multi_gpu.log"
      grep "^|" "$OUT/multi_gpu.log" || tail -25 "$OUT/multi_gpu.log" ;;
    *) echo "unknown stage $stage" ;;
  esac
done
