"""model_parallel (one process, device map), for real: the plan, the budgets, training like one device,
the detach bug caught, bad maps refused."""

from __future__ import annotations

import pytest

from experiments.model_parallel import main as model_parallel_main
from helpers import REPO, launch, run_in_process, run_main_in_process

QUIET = ["--report_to", "none"]
MODEL_PARALLEL_YAML = str(REPO / "accelerate_configs" / "model_parallel.yaml")
MULTI_GPU_YAML = str(REPO / "accelerate_configs" / "multi_gpu_ddp.yaml")


def test_auto_plan_for_two_fake_gpus_splits_respects_budgets_and_trains_like_one_device(tmp_path, capsys):
    args = [
        *QUIET,
        "--hidden_features",
        "256",
        "--n_layers",
        "4",
        "--device_map",
        "auto",
        "--max_memory",
        '{"0": "300KB", "1": "1MB", "cpu": "1GB"}',
    ]
    finished = run_in_process(model_parallel_main, args, tmp_path / "run", capsys)
    assert finished.returncode == 0, finished.stderr[-3000:]
    summary = finished.summary
    plan = summary["metrics"]["plan"]
    assert set(plan.values()) == {"0", "1"}  # a real split, planned by infer_auto_device_map
    assert plan["fc1"] == "0" and plan["fc4"] == "1"
    assert set(summary["metrics"]["placement"].values()) == {"cpu"}  # no GPUs here: fallback, with a notice
    assert "notice: device 1 does not exist here" in finished.stdout
    assert summary["checks"]["plan_respects_max_memory"]["passed"]
    bytes_on_0 = sum(summary["metrics"]["module_bytes"][m] for m, d in plan.items() if d == "0")
    assert bytes_on_0 <= 300_000
    assert (
        summary["checks"]["outputs_match_unsplit"]["passed"]
        and summary["checks"]["trains_like_one_device"]["passed"]
    )


@pytest.mark.launch
def test_explicit_map_through_the_model_parallel_config(tmp_path):
    finished = launch(
        "model_parallel.py", [*QUIET, "--max_steps", "20"], tmp_path / "run", config=MODEL_PARALLEL_YAML
    )
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert finished.summary["metrics"]["plan"] == {"fc1": "0", "fc2": "1"} and finished.summary["passed"]


def test_cutting_the_graph_between_devices_is_caught(tmp_path, capsys):
    finished = run_in_process(
        model_parallel_main, [*QUIET, "--detach_between_devices"], tmp_path / "run", capsys
    )
    assert finished.returncode == 1
    checks = finished.summary["checks"]
    assert checks["outputs_match_unsplit"]["passed"]  # forward is still right...
    assert not checks["trains_like_one_device"]["passed"]  # ...but fc1 never learns


@pytest.mark.launch
def test_multi_gpu_ddp_launch_is_refused(tmp_path):
    finished = launch("model_parallel.py", QUIET, tmp_path / "run", config=MULTI_GPU_YAML, num_processes=2)
    assert finished.returncode != 0
    assert "device maps and DDP replicas do not mix" in finished.stderr
    assert not (tmp_path / "run" / "summary.json").exists()


@pytest.mark.parametrize(
    ("device_map", "message"),
    [
        ('{"fc1": 0, "fc9": 1}', "names module 'fc9', which the model does not have"),
        ('{"fc1": 0}', "leaves fc2 unplaced"),
        ('{"fc1": 0, "fc2": "disk"}', "'disk' is not a device index or 'cpu'"),
        ("{fc1: 0}", "is not valid JSON"),
    ],
)
def test_bad_device_maps(tmp_path, device_map, message, capsys):
    code, stderr = run_main_in_process(
        model_parallel_main,
        [*QUIET, "--output_dir", str(tmp_path / "run"), "--device_map", device_map],
        capsys,
    )
    assert code == 2 and message in stderr and stderr.strip().count("\n") == 0


def test_json_true_is_not_a_device_index(tmp_path, capsys):
    argv = [*QUIET, "--output_dir", str(tmp_path / "run"), "--device_map", '{"fc1": true, "fc2": 1}']
    code, stderr = run_main_in_process(model_parallel_main, argv, capsys)
    assert code == 2 and "True is not a device index or 'cpu'" in stderr
