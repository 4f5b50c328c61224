#!/usr/bin/env bash
# The checks a session runs when it is lent a GPU machine (a few minutes in all), in order of priority:
#
#   1. the GPU tests that CI skips (the publisher's side stream and pinned copies, tests/unit/test_publisher.py);
#   2. benchmarks/bench_learner.py on cuda: how long a publish blocks the training stream;
#   3. a real `ddiloco run` with two TinyGPT learners on the GPU (syncer, learners and evaluator as processes);
#   4. benchmarks/bench_syncer.py core at 16 M, 128 M and 1 B on two cores of that machine (1 and 2 threads), and
#      at 128 M on up to 8: the syncer's thread scaling, which the 2-core VM cannot show (its memory bandwidth does
#      not grow with the second core).
#
# It needs a python3 with torch (CUDA), grpcio and protobuf; ddiloco comes from this checkout (PYTHONPATH) and its
# C kernels are built in place. Each step has its own time limit and log under $OUT (default /tmp/gpu_checks);
# a failed step does not stop the next.
#
#     DEVICE=cuda bash benchmarks/gpu_checks.sh        # DEVICE=cpu runs the same steps without a GPU
#
# The generated gRPC code needs protobuf >= 7.35 and grpcio >= 1.85 (pyproject.toml). On a machine without a
# network, bring their wheels where its own may be older: on the lent H200 machine (2026-12-04, torch 2.11, Python
# 3.12) grpcio 1.85.3 and protobuf 7.36.2 were carried, `pip install --no-index --no-deps --target /tmp/site
# .whl/*.whl`, then `PYTHONPATH=/tmp/site bash benchmarks/gpu_checks.sh` (about 160 s).
set -u
OUT=${OUT:-/tmp/gpu_checks}
DEVICE=${DEVICE:-cuda}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"

step() {  # step NAME SECONDS COMMAND...: runs COMMAND under a time limit, its output in $OUT/NAME.log
    local name=$1 limit=$2 started=$SECONDS rc
    shift 2
    timeout -k 5 "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    echo "== $name: rc $rc in $((SECONDS - started)) s"
    tail -n "${TAIL:-25}" "$OUT/$name.log"
}

{
    nvidia-smi -L 2>/dev/null
    nproc
    "$PYTHON" -c "import torch, grpc, google.protobuf as p; print('torch', torch.__version__, 'grpc', grpc.__version__,
'protobuf', p.__version__, 'cuda', torch.cuda.is_available())"
} 2>&1 | tee "$OUT/machine.log"
step build 120 "$PYTHON" setup.py build_ext --inplace
"$PYTHON" -c "import ddiloco.kernels as k; print('compiled kernels:', k.compiled is not None)" 2>&1 | tee -a "$OUT/build.log"
step gpu_tests 150 "$PYTHON" -m pytest -q -p no:cacheprovider -o addopts= tests/unit/test_publisher.py \
    tests/unit/test_compression.py
step bench_learner 150 "$PYTHON" benchmarks/bench_learner.py --device "$DEVICE" --steps 6 --json
RUN_DIR=$(mktemp -d)/run
TAIL=12 step run 150 "$PYTHON" -m ddiloco.cli run --learners 2 --device "$DEVICE" --inner-steps 300 \
    --run-dir "$RUN_DIR"
# Two threads on two cores of their own: on the H200 machine (16 vCPUs in a VM), vCPUs 0 and 1 behave as one core's
# two hyper-threads (the add_ floor scales 1.6x on them, 1.95x on 0 and 8), so an unpinned run measures where the
# scheduler put the threads as much as the syncer. PIN='' runs unpinned.
PIN=${PIN-0,2}
PINNED=()
[ -n "$PIN" ] && command -v taskset >/dev/null && PINNED=(taskset -c "$PIN")
step bench_syncer 200 "${PINNED[@]}" "$PYTHON" benchmarks/bench_syncer.py core --params 16M,128M --threads 1,2
step bench_syncer_1b 240 "${PINNED[@]}" "$PYTHON" benchmarks/bench_syncer.py core --params 1B --fragments 24 --threads 1,2
step bench_syncer_cores 200 "$PYTHON" benchmarks/bench_syncer.py core --params 128M --threads 1,2,4,8
