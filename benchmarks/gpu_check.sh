#!/usr/bin/env bash
# One command for a CUDA machine, about 8 minutes: the test suite's CUDA variants, `convgrad bench` on a
# subset of the layer suite, and per-sample gradients (convgrad against torch.func and a plain backward; no
# library to install beyond `pip install -e ".[dev]" -c constraints.txt`). Every result lands in one folder;
# every step runs under `timeout`, none for more than 10 minutes, and a step that fails or times out does not
# stop the others: summary.txt lists each step's exit status (124: timed out).
#
#   benchmarks/gpu_check.sh [--out DIR] [--dry-run]
#
#   --out DIR   the results folder (default: gpu-check-<date>-<time>)
#   --dry-run   print the steps and their time limits, run nothing (works without CUDA)
#
# Exit status: 0 when every step passed, 1 when one failed or timed out, 2 on bad usage or without CUDA.
set -uo pipefail
cd "$(dirname "$0")/.."

out="gpu-check-$(date +%Y%m%d-%H%M%S)"
dry_run=0
while (($#)); do
    case "$1" in
        --out) [[ $# -ge 2 ]] || { echo "gpu_check.sh: --out needs a folder" >&2; exit 2; }; out="$2"; shift 2 ;;
        --dry-run) dry_run=1; shift ;;
        -h|--help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument '$1' (use --out DIR, --dry-run)" >&2; exit 2 ;;
    esac
done
python="${PYTHON:-python}"
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"

# name, limit in seconds, command: the limits add up to 8 minutes
steps=(
    "environment|30|$python -c 'import torch, convgrad; print(torch.__version__, torch.version.cuda, convgrad.__version__); print(torch.cuda.get_device_name())' && nvidia-smi"
    "tests-cuda|210|$python -m pytest -q -k cuda -p no:cacheprovider --junitxml=$out/tests-cuda.xml"
    "bench|150|$python -m convgrad bench --device cuda --dtype float32 --repeats 5 --quiet --out $out/bench --layers 'resnet50.3x3@*' 'resnet50.1x1*' 'mobilenetv2.*' 'wav2vec2.*' 'r3d18.*' 'dcgan.*' 'unet.*'"
    "per-sample|90|$python benchmarks/gpu_per_sample.py --device cuda --repeats 10 --out $out/per-sample"
)

if ((dry_run)); then
    for step in "${steps[@]}"; do
        IFS='|' read -r name limit command <<< "$step"
        echo "$name (timeout ${limit}s): $command"
    done
    exit 0
fi

if ! "$python" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2> /dev/null; then
    echo "gpu_check.sh: torch sees no CUDA device (torch.cuda.is_available() is False); run it on a CUDA machine" >&2
    exit 2
fi

mkdir -p "$out" || exit 2
failed=0
for step in "${steps[@]}"; do
    IFS='|' read -r name limit command <<< "$step"
    echo "== $name (at most ${limit}s) -> $out/$name.log"
    start=$SECONDS
    timeout --kill-after=10 "$limit" bash -c "$command" > "$out/$name.log" 2>&1
    status=$?
    echo "$name: exit $status after $((SECONDS - start)) s" | tee -a "$out/summary.txt"
    ((status == 0)) || failed=1
done
echo "results in $out/ (summary.txt, *.log, bench/results.md, per-sample/per_sample.md)"
exit "$failed"
