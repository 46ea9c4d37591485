#!/usr/bin/env bash
# The first GPU run, in one command: every experiment's GPU path on the GPUs this machine has (ddp_linear,
# collectives, manual_data_parallel, loss_normalization, model_parallel, train_gpt under one process, dp_replicate,
# dp_shard, ZeRO-2, tp + SP, pp, ep, cp's refusal, dp_shard x tp, DeepSpeed ZeRO-2, fault_tolerance over NCCL,
# and the `gpu` pytest tier), each train_gpt run beside at_scale's estimate and PREDICTED step for the same
# layout. One report: runs/gpu_check/gpu_check.md (and .json). Checks that need more GPUs than are visible are
# listed as not run. The 1-GPU part takes a few minutes on one H100 (each run is a tiny model, 100 steps).
#
#   bash scripts/gpu_check.sh              # run it
#   bash scripts/gpu_check.sh --dry_run    # every command, nothing run
#   bash scripts/gpu_check.sh --help       # the flags (--only, --max_steps, --hardware, --timeout_s, --output_dir)
#
# Install first (on a GPU machine the torch pin resolves to its CUDA build): python3 -m pip install -r requirements-dev.txt
set -euo pipefail
cd "$(dirname "$0")/.."
exec python3 -m tools.gpu_check "$@"
