# gpu_check.sh's "ps" parts (issue 45), sourced by it: it sets PY, REPO, RESULTS, DEVICE,
# DRY and the functions stamp, limit and cuda_tests, and runs from a folder outside the
# repository. Each part prints its figures as it ends, the short ones first.

# 1. psring compare, timed (its own quick calibration included), and its predictions
stamp "compare"
CMP_FLAGS=()
[ -n "$DRY" ] && CMP_FLAGS=(--repeats 1)
T=$SECONDS
timeout "$(limit 220)" $PY -m psring compare --out "$RESULTS/compare" "${CMP_FLAGS[@]}" \
    > "$RESULTS/compare.log" 2>&1
echo "compare: exit $?, $((SECONDS - T)) s wall (target <= 60 s)" | tee "$RESULTS/compare.time"
$PY - "$RESULTS/compare" <<'EOF'
import json, pathlib, sys
root = pathlib.Path(sys.argv[1])
report = root / "report.md"
if not report.exists():
    sys.exit("compare wrote no report (see compare.log)")
text = report.read_text().split("## Step-time prediction", 1)
if len(text) == 2:  # the prediction table: measured, predicted, error per strategy
    print("\n".join(l for l in text[1].splitlines()[:16] if l.startswith("|")))
cal = root / "calibration.json"
if cal.exists():
    c = json.loads(cal.read_text())
    a, b = c.get("ps_round") or (None, None)
    print("calibration: cores", c.get("cores"), "zmq 1/beta %.2f GB/s" % (1 / c["zmq_beta"] / 1e9),
          "gloo 1/beta %.2f GB/s" % (1 / c["dist_beta"] / 1e9),
          "ps round %s" % (f"alpha {a * 1e3:.2f} ms, {1 / b / 1e9:.2f} GB/s a worker" if a else "-"))
EOF

# 2. the examples under psring launch on CUDA (issue 44), before anything long
EXAMPLES_TEST="$REPO/tests/cuda/test_cuda.py::test_the_examples_run_on_cuda_and_train_singles_model"
cuda_tests cuda_examples 200 "$EXAMPLES_TEST"

# 3. compare's workload under ps (1 and 2 servers) and allreduce on the GPU, traced,
#    and where each ps step goes; ps-t1 is ps with one torch thread a worker (torchrun's
#    OMP_NUM_THREADS=1) and ps-cpu the same on the box's CPU: whether the servers' stalls
#    (2026-11-27: pushes' sums p10 0.05 ms, p90 8 ms) come from cores the workers'
#    threads take, or from the CUDA workers themselves
stamp "ps traced"
WL=(--model mlp --width 1024 --depth 3 --batch-size 64 --steps 30 --eval-every 0
    --workers 2 --device "$DEVICE" --trace)
[ -n "$DRY" ] && WL=(--model mlp --width 256 --depth 2 --batch-size 16 --steps 8
    --eval-every 0 --workers 2 --device cpu --trace)
for name in ps ps2 allreduce ps-t1 ps-cpu; do
    case $name in ps) S=(--strategy ps);; ps2) S=(--strategy ps --servers 2);;
        allreduce) S=(--strategy allreduce);; ps-t1) S=(--strategy ps --threads 1);;
        ps-cpu) S=(--strategy ps --device cpu);; esac  # (S last: its --device wins)
    timeout "$(limit 60)" $PY -m psring run "${WL[@]}" "${S[@]}" --out "$RESULTS/runs/$name" \
        > "$RESULTS/runs/$name.log" 2>&1 || { echo "$name failed:"; tail -n 5 "$RESULTS/runs/$name.log"; }
done
$PY "$REPO/benchmarks/ps_breakdown.py" "$RESULTS/runs/ps" "$RESULTS/runs/ps2" \
    "$RESULTS/runs/allreduce" "$RESULTS/runs/ps-t1" "$RESULTS/runs/ps-cpu" 2>&1 | tee "$RESULTS/ps_breakdown.txt"
for name in ps ps2 allreduce; do
    [ -f "$RESULTS/runs/$name/trace.json" ] && timeout 30 $PY -m psring trace \
        "$RESULTS/runs/$name" > /dev/null 2>&1
done

# 4. the PS round against raw pyzmq: every core, then two (the control)
stamp "bench_ps"
if [ -z "$DRY" ]; then
    timeout "$(limit 100)" $PY "$REPO/benchmarks/bench_ps.py" --quick 2>&1 \
        | tee "$RESULTS/bench_ps.txt"
    stamp "bench_ps on cores 0,1"
    timeout "$(limit 100)" taskset -c 0,1 $PY "$REPO/benchmarks/bench_ps.py" --quick 2>&1 \
        | tee "$RESULTS/bench_ps_2cores.txt"
fi

# 5. the other CUDA tests with what is left (compare and the examples ran above)
cuda_tests cuda_tests 270 "$REPO/tests/cuda" "$REPO/tests/unit/test_gpu_choices.py" \
    "$REPO/tests/multiproc/test_forking.py" \
    -k "not test_the_examples_run_on_cuda and not test_compare_runs_on_cuda"
