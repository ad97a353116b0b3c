#!/usr/bin/env bash
# One device call of checks before the notebook's runs: the GPU tests of the inference actor and the learner
# (the pinned evaluation network's among them), then the preset's learner alone (`python -m rayzero.bench.learner
# --preset atari`: the rate a training run's colocated learner is held against, issue 11), in the colocated
# actor as training runs it, compiled in its own process (no background helper: its eager updates would be timed).
#
#   source .device/install.sh && bash scripts/device_checks.sh
#   TESTS=tests/test_learner_gpu.py BENCH=0 ...   (a subset; BENCH=0 skips the bench, TESTS= skips the tests;
#   BENCH_VARIANTS="preset whole" benches the preset's learner and then the same with its loss compiled whole)
#
# Then the eager step's rate in NCHW and NHWC (EAGER=0 skips it), the compile's cost, whole against as regions
# (scripts/compile_cost.py; COMPILE=0 skips it; COMPILE_VARIANTS=parts_alone,early times the early compile's
# parts alone and then all at once, as a run starts them), and small-batch whole-search latency, eager against the compiled
# recurrent step (scripts/search_latency.py; LATENCY=0 skips it). Lands in $OUT: gpu_tests.txt, and checks.tgz with
# the rest (bench_learner_*.json and .txt, compile_cost.json and .txt, compile_times.txt, search_latency.json and
# .txt). The 31 tests took more than 250 s on 2026-12-04 (24 had run; the learner's compile-heavy ones come last);
# the inference tests alone 51 s; the bench ~140 s.
set -u
out=${OUT:-/tmp/device_checks}
mkdir -p "$out"
tests=${TESTS-tests/test_inference_gpu.py tests/test_learner_gpu.py}
if [ -n "$tests" ]; then
    # -v: one line per test, so a timeout still says which ran and which did not.
    # shellcheck disable=SC2086  # the test files are separate words
    timeout "${TESTS_TIMEOUT:-420}" python3 -m pytest -v -p no:cacheprovider $tests > "$out/gpu_tests.txt" 2>&1
    echo "GPU tests (rc $?):"; grep -cE " PASSED" "$out/gpu_tests.txt" | sed 's/$/ passed/'
    grep -E " (FAILED|ERROR)|passed|failed" "$out/gpu_tests.txt" | tail -20
fi
if [ "${BENCH:-1}" = 1 ]; then
    # BENCH_VARIANTS="preset whole": the preset, then its loss compiled whole (learner.compile_regions=false),
    # each alone and in its own process: the steady rate of each step, as a run's colocated learner has it.
    for variant in ${BENCH_VARIANTS:-preset}; do
        case $variant in
            whole) extra=learner.compile_regions=false ;;
            regions) extra=learner.compile_regions=true ;;
            *) extra= ;;
        esac
        # shellcheck disable=SC2086  # $extra: one override or none
        timeout "${BENCH_TIMEOUT:-240}" python3 -m rayzero.bench.learner --preset atari --short \
            --json "$out/bench_learner_$variant.json" learner.background_compile=false $extra \
            > "$out/bench_learner_$variant.txt" 2>&1
        echo "bench learner --preset atari, $variant (rc $?):"
        grep -E "compiled step|learner: warm|samples/s" "$out/bench_learner_$variant.txt" | cut -c1-400 | tail -6
    done
fi
if [ "${EAGER:-1}" = 1 ]; then
    # The eager step as a run's first minute trains with it (under the step graph, while the helpers compile), in
    # NCHW and in NHWC (learner.channels_last): bf16 convolutions ran 1.6x faster through NHWC in the inference
    # actor, and inductor picks NHWC for its convolutions on its own, which eager does not.
    for layout in false true; do
        timeout "${EAGER_TIMEOUT:-150}" python3 -m rayzero.bench.learner --preset atari --short \
            --json "$out/bench_learner_eager_cl_$layout.json" learner.compile=false "learner.channels_last=$layout" \
            > "$out/bench_learner_eager_cl_$layout.txt" 2>&1
        echo "bench learner --preset atari, eager, channels_last=$layout (rc $?):"
        grep -E "samples/s" "$out/bench_learner_eager_cl_$layout.txt" | cut -c1-400 | tail -3
    done
fi
if [ "${COMPILE:-1}" = 1 ]; then
    # The preset's step compiled whole against as regions (learner.compile_regions), cold each, in inductor's
    # 'default' mode as the colocated learner compiles it: seconds to the first fast update, and ms a step.
    timeout "${COMPILE_TIMEOUT:-300}" python3 scripts/compile_cost.py --variants "${COMPILE_VARIANTS:-cold,regions}" \
        --steps "${COMPILE_STEPS:-30}" --json "$out/compile_cost.json" --log-dir "$out" learner.compile_mode=default \
        > "$out/compile_cost.txt" 2>&1
    echo "compile cost (rc $?):"
    grep -A4 "^variant" "$out/compile_cost.txt" || tail -5 "$out/compile_cost.txt"
fi
if [ "${LATENCY:-1}" = 1 ]; then
    # The preset's 50 simulations eager and with the compiled recurrent step, and an evaluation's 16
    # (run.eval_simulations).
    timeout "${LATENCY_TIMEOUT:-240}" python3 scripts/search_latency.py --rows 1,10,32 --requests 200 \
        --variants "plain;compile_recurrent=true;simulations=16" --json "$out/search_latency.json" \
        > "$out/search_latency.txt" 2>&1
    echo "search latency (rc $?):"
    grep -A10 "^variant" "$out/search_latency.txt" || tail -5 "$out/search_latency.txt"
fi
# At most 8 files come back from the device: everything but the tests' log, packed into one.
(cd "$out" && find . -type f ! -name gpu_tests.txt ! -name checks.tgz | tar czf checks.tgz -T - \
    && find . -type f ! -name gpu_tests.txt ! -name checks.tgz -delete)
