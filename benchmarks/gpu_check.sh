#!/usr/bin/env bash
# psring on a GPU machine, in one go. Two sets of parts (GPU_CHECK_PARTS):
#   ps (default, issue 45): `psring compare` timed, with its report and predictions,
#      printed as soon as it ends; compare's workload under ps (1 and 2 servers) and
#      allreduce on CUDA, traced, with where each ps step goes
#      (benchmarks/ps_breakdown.py); bench_ps.py --quick on all the cores and on two
#      (`taskset -c 0,1`: a fixed cost stays, a core-bound one grows); then the CUDA
#      tests (the examples and compare on CUDA among them) with what is left.
#   profiles (issue 29): the CUDA tests, the pinned copy rates, profiles of the seeds'
#      models at their published sizes, and a timed `single` run for device mode.
# Every result lands in RESULTS (a folder it creates), and all but the models' weights
# are packed beside it as RESULTS.tar.gz. Each part has its own time limit, so the
# whole stays under 8 minutes and a part that fails leaves the others.
#
#   benchmarks/gpu_check.sh RESULTS          # on the GPU machine, from the repository
#   GPU_CHECK_PARTS=profiles benchmarks/gpu_check.sh RESULTS
#   GPU_CHECK_DRY=1 benchmarks/gpu_check.sh /tmp/dry   # here: tiny sizes, no GPU needed
#
# pyzmq may be missing there: a wheel in .whl/ (see docs/benchmarks.md) is installed
# into /tmp/site first. Nothing is fetched from the network.
set -u
RESULTS=${1:?usage: benchmarks/gpu_check.sh RESULTS}
cd "$(dirname "$0")/.." || exit 1
mkdir -p "$RESULTS/profiles" "$RESULTS/runs"
RESULTS=$(cd "$RESULTS" && pwd)
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
PY=${PYTHON:-python3}
if ! $PY -c "import zmq" 2>/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
        || { echo "gpu_check: pyzmq is missing and no wheel in .whl/ installs"; exit 2; }
    export PYTHONPATH=/tmp/site
fi
# psring as a user installs it (workers/ and servers/ become psring.workers and
# psring.servers: setup.py), run from a folder outside the repository so that Python
# finds the installed copy, not the source tree, first
REPO=$PWD
if ! $PY -c "import psring.servers" 2>/dev/null; then
    if ! $PY -m pip install -q --no-deps --no-build-isolation --no-index --no-compile \
            --target /tmp/psring-site "$REPO"; then
        # (an old setuptools): the same layout as links into the source tree
        echo "gpu_check: pip could not install psring; linking its packages instead"
        mkdir -p /tmp/psring-site/psring
        ln -sf "$REPO"/psring/* /tmp/psring-site/psring/
        ln -sfn "$REPO/workers" /tmp/psring-site/psring/workers
        ln -sfn "$REPO/servers" /tmp/psring-site/psring/servers
    fi
    export PYTHONPATH="/tmp/psring-site${PYTHONPATH:+:$PYTHONPATH}"
fi
mkdir -p /tmp/gpu_check_cwd && cd /tmp/gpu_check_cwd || exit 1
DRY=${GPU_CHECK_DRY:-}
PARTS=${GPU_CHECK_PARTS:-ps}
case "$PARTS" in ps|profiles) ;; *) echo "gpu_check: GPU_CHECK_PARTS is ps or profiles, not $PARTS"; exit 2;; esac
DEVICE=cuda
[ -n "$DRY" ] && DEVICE=cpu
T0=$SECONDS
BUDGET=${GPU_CHECK_BUDGET:-500}  # seconds for all the parts; packing comes after
stamp() { echo "[gpu_check +$((SECONDS - T0))s] $*"; }
limit() {  # a part's time limit: its own, or what is left of the budget if less
    local left=$((BUDGET - (SECONDS - T0)))
    [ "$left" -lt "$1" ] && echo $((left > 5 ? left : 5)) || echo "$1"
}

machine() {
    nvidia-smi || true
    $PY - <<'EOF'
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("gpu", p.name, f"{p.total_memory / 2**30:.1f} GiB", p.multi_processor_count, "SMs")
    print("cudnn", torch.backends.cudnn.version(), "nccl", torch.cuda.nccl.version())
    print("matmul allow_tf32", torch.backends.cuda.matmul.allow_tf32,
          "cudnn allow_tf32", torch.backends.cudnn.allow_tf32)
EOF
    nproc
}
stamp "machine"
machine > "$RESULTS/machine.txt" 2>&1
cat "$RESULTS/machine.txt"

# the CUDA tests (skipped with their reason where torch sees no GPU), the GPU choices
# made without one, and the process starts of a GPU build of torch; or, with arguments,
# LOG LIMIT PYTEST-ARGS...: those tests alone, within LIMIT seconds, into LOG.log
cuda_tests() {
local log=cuda_tests lim=270 sel=("$REPO/tests/cuda" "$REPO/tests/unit/test_gpu_choices.py"
    "$REPO/tests/multiproc/test_forking.py")
[ $# -ge 2 ] && { log=$1; lim=$2; shift 2; sel=("$@"); }
stamp "CUDA tests ($log)"
grep -E "^(python|gpu|cudnn) " "$RESULTS/machine.txt" > "$RESULTS/$log.log"  # the log names its GPU
# (--import-mode=append: the installed psring, psring.servers with it, comes before the
# source tree, which has no psring/servers; tests.helpers still come from the repository)
timeout "$(limit "$lim")" $PY -m pytest "${sel[@]}" -n 4 --dist loadgroup -p no:cacheprovider \
    --import-mode=append -rA --durations=0 >> "$RESULTS/$log.log" 2>&1
echo "exit $?" >> "$RESULTS/$log.log"
tail -n 45 "$RESULTS/$log.log" | grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed|exit"
}

if [ "$PARTS" = ps ]; then
    source "$REPO/benchmarks/gpu_check_ps.sh"
else
cuda_tests

# 2. pinned and pageable copies between host and device
stamp "copy rates"
if [ -z "$DRY" ]; then
    timeout "$(limit 60)" $PY "$REPO/benchmarks/gpu_copy.py" --out "$RESULTS/copy_rates.json"
fi

# 3. profiles of the seeds' models at their published sizes (fp32), one at a time
profile() {  # NAME FLAGS...
    local name=$1; shift
    stamp "profile $name"
    timeout "$(limit 75)" $PY -m psring profile --device "$DEVICE" --threads 4 "$@" \
        --out "$RESULTS/runs/$name" > "$RESULTS/runs/$name.log" 2>&1 \
        && cp "$RESULTS/runs/$name/profile.json" "$RESULTS/profiles/$name.json" \
        || { echo "profile $name failed:"; tail -n 5 "$RESULTS/runs/$name.log"; }
}
if [ -n "$DRY" ]; then
    profile resnet50 --model resnet50 --image-size 32 --batch-size 4 --classes 1000 --steps 4
else
    profile resnet50 --model resnet50 --image-size 224 --batch-size 64 --classes 1000
    profile resnet101 --model resnet101 --image-size 224 --batch-size 64 --classes 1000
    profile vgg16 --model vgg16 --image-size 224 --batch-size 64 --classes 1000
    profile inception_v3 --model inception_v3 --image-size 299 --batch-size 64 --classes 1000
    # (2.6 s a step in float32: 6 steps, so that it fits its time limit)
    profile mlstm4096 --model mlstm --width 4096 --seq-len 256 --classes 256 --batch-size 256 \
        --steps 6
    profile gpt2-small --model gpt --width 768 --depth 12 --seq-len 1024 --classes 50257 \
        --batch-size 8
fi

# 4. a timed single run (no trace), for `--compute device` from the resnet50 profile
stamp "single resnet50"
if [ -n "$DRY" ]; then SIZE=(--image-size 32 --batch-size 4 --steps 6); else
    SIZE=(--image-size 224 --batch-size 64 --steps 20); fi
timeout "$(limit 90)" $PY -m psring run --strategy single --device "$DEVICE" --threads 4 \
    --model resnet50 --classes 1000 "${SIZE[@]}" --samples 512 --eval-samples 0 \
    --out "$RESULTS/runs/single-resnet50" > "$RESULTS/runs/single-resnet50.log" 2>&1 \
    || { echo "single run failed:"; tail -n 5 "$RESULTS/runs/single-resnet50.log"; }

fi

stamp "packing"
# (the weights are hundreds of MB and say nothing the steps do not)
tar czf "$RESULTS.tar.gz" -C "$(dirname "$RESULTS")" --exclude model.pt \
    --exclude checkpoints "$(basename "$RESULTS")"
ls -l "$RESULTS.tar.gz"
$PY - "$RESULTS" <<'EOF'
import json, pathlib, statistics, sys
root = pathlib.Path(sys.argv[1])
for p in sorted((root / "profiles").glob("*.json")):
    d = json.loads(p.read_text())
    step = d["forward_s"] + d["backward_s"] + d["update_s"]
    print(f"{p.stem:14s} batch {d['batch_size']:4d}  fwd {d['forward_s']*1e3:8.1f} ms  "
          f"bwd {d['backward_s']*1e3:8.1f} ms  upd {d['update_s']*1e3:6.1f} ms  "
          f"{d['batch_size'] / step:8.1f} samples/s  last grad at "
          f"{max(d['ready_s']) / max(d['backward_s'], 1e-9):.2f} of bwd")
steps = root / "runs" / "single-resnet50" / "steps.jsonl"
if steps.exists():
    rs = [json.loads(x) for x in steps.read_text().splitlines()][5:]
    print("single resnet50 median step", round(statistics.median(r["step_s"] for r in rs) * 1e3, 1),
          "ms over", len(rs), "steps")
EOF
stamp "done"
