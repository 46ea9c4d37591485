"""model_parallel: one process, one model split over devices by a device map. Does it train the same?

The DDP tutorial's "distributed model parallel" example (docs/tutorials.md) wraps the whole model in DDP: that is data
parallelism again, nothing is split. Real (naive) model parallelism puts different layers on
different devices and moves the activations between them: fc1 on GPU 0, fc2 on GPU 1. One process
drives all devices in turn; only one device computes at a time (the pipeline experiment fixes that).

The plan comes from Accelerate's big-model tools: `--device_map auto` asks `infer_auto_device_map`
for a placement within `--max_memory` per device (JSON, e.g. '{"0": "300KB", "1": "1MB", "cpu": "1GB"}')
with `no_split_module_classes`; `--device_map '{"fc1": 0, "fc2": 1}'` is the explicit form. The plan is
printed (module, planned device, placed device, bytes). Devices the machine lacks fall back to the
CPU with a notice, so a plan made for 2 GPUs still runs here.

Why not `dispatch_model`: Accelerate documents its big-model path for inference, and its offload
hooks keep `cpu`/`disk`-offloaded weights on the `meta` device, where they get NO gradients. To TRAIN,
we place each mapped module with `.to(device)` and give it a forward pre-hook that moves its inputs to
its device. `.to()` is differentiable, so backward flows back across devices. Plans with `disk` or
`meta` are refused for the same reason.

Checks: the split model's outputs equal the unsplit model's; after --max_steps SGD steps its
parameters equal the same training on one device (float32, --parity_atol); an `auto` plan never puts
more bytes on a device than --max_memory allows.

Run it (one process; device maps and DDP replicas do not mix, so a multi-process launch is refused):
    python experiments/model_parallel.py --hidden_features 256 --n_layers 4 --device_map auto \\
        --max_memory '{"0": "300KB", "1": "1MB", "cpu": "1GB"}'
    accelerate launch --config_file accelerate_configs/model_parallel.yaml experiments/model_parallel.py \\
        --device_map '{"fc1": 0, "fc2": 1}'
"""

from __future__ import annotations

import copy
import json
import os
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if __name__ == "__main__":  # Ctrl-C during the imports below: one line, exit 130 (common/interrupt.py)
    from common.interrupt import one_line_on_ctrl_c

    one_line_on_ctrl_c("model_parallel.py")

import torch
import torch.nn.functional as F
from accelerate import infer_auto_device_map
from accelerate.utils import compute_module_sizes, convert_file_size_to_int

from common.config import TrainArgs, UsageError, flag, parse_config, require, require_positive, run_cli
from common.data import iterate_batches, make_regression_dataset, shard_tensors
from common.models import build_mlp
from common.reference import max_abs_difference
from common.run import start_run
from common.runtime import launched_world_size

EXPERIMENT = "model_parallel"


@dataclass
class Config(TrainArgs):
    device_map: str = flag(
        '{"fc1": 0, "fc2": 1}',
        "'auto' (plan within --max_memory) or a JSON map of module name -> device index / 'cpu'",
    )
    max_memory: str = flag(
        '{"0": "300KB", "1": "1MB", "cpu": "1GB"}',
        "JSON budget per device for --device_map auto (keys: GPU index, 'cpu')",
    )
    n_features: int = flag(10, "input features (the tutorial's 10)")
    hidden_features: int = flag(
        50, "hidden width (the tutorial's 50); make it large to get a model that does not fit one GPU"
    )
    n_layers: int = flag(2, "Linear layers fc1..fcN (the tutorial's 2)")
    n_samples: int = flag(1000, "rows of synthetic regression data")
    batch_size: int = flag(32, "rows per step")
    lr: float = flag(0.05, "SGD learning rate")
    max_steps: int = flag(50, "SGD steps through the split model")
    detach_between_devices: bool = flag(
        False,
        "the classic bug: move activations with .detach() (fc1 then gets no gradient); the checks catch it",
    )
    parity_atol: float = flag(
        1e-6, "largest allowed |split - one device| parameter or output difference in float32 (> 0)"
    )

    def validate(self) -> None:
        super().validate()
        require_positive(self, "n_features", "hidden_features", "n_samples", "batch_size")
        require(self.n_layers >= 2, f"--n_layers must be >= 2 (something to split), got {self.n_layers}")
        require(
            self.lr > 0 and self.parity_atol > 0,
            f"--lr and --parity_atol must be > 0, got {self.lr}, {self.parity_atol}",
        )
        require(
            launched_world_size(self) == 1,
            "model_parallel is one process that drives every device (device maps and DDP replicas do not mix); "
            "launch it with accelerate_configs/model_parallel.yaml or plain python, "
            "and use ddp_linear for data parallelism",
        )


def parse_json_flag(name: str, text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise UsageError(
            f'--{name} {text!r} is not valid JSON ({error.msg}); e.g. \'{{"fc1": 0, "fc2": 1}}\''
        ) from None
    if not isinstance(value, dict) or not value:
        raise UsageError(f"--{name} {text!r} must be a non-empty JSON object")
    return value


def plan_device_map(cfg: Config, model: torch.nn.Module) -> tuple[dict, dict | None]:
    """--device_map -> ({module name: device}, budget in bytes per device or None)."""
    if cfg.device_map == "auto":
        budget = {}
        for key, size in parse_json_flag("max_memory", cfg.max_memory).items():
            device = int(key) if str(key).isdigit() else key
            if device not in ("cpu", "mps") and not isinstance(device, int):
                raise UsageError(f"--max_memory key {key!r}: allowed are GPU indices and 'cpu'")
            try:
                budget[device] = convert_file_size_to_int(size)
            except ValueError:
                raise UsageError(
                    f"--max_memory {key!r}: {size!r} is not a size like '300KB' or '2GiB'"
                ) from None
        plan = dict(infer_auto_device_map(model, max_memory=dict(budget), no_split_module_classes=["Linear"]))
        if "" in plan:
            plan = {name: plan[""] for name in model.layer_names}  # the whole model fit one device
        return plan, budget
    plan = parse_json_flag("device_map", cfg.device_map)
    known = set(model.layer_names)
    for name, device in plan.items():
        if name not in known:
            raise UsageError(
                f"--device_map names module {name!r}, which the model does not have; "
                f"modules: {', '.join(model.layer_names)}"
            )
        if not (type(device) is int and device >= 0) and device not in (
            "cpu",
            "mps",
        ):  # JSON true is an int to isinstance
            raise UsageError(
                f"--device_map {name!r}: {device!r} is not a device index or 'cpu' (disk/meta cannot train)"
            )
    missing = [name for name in model.layer_names if name not in plan]
    if missing:
        raise UsageError(
            f"--device_map leaves {', '.join(missing)} unplaced; map every module of: {', '.join(model.layer_names)}"
        )
    return plan, None


def to_real_device(planned, session) -> torch.device:
    """A planned device this machine lacks falls back to the CPU, with a notice."""
    if planned in ("disk", "meta"):
        raise UsageError(
            f"the plan puts a module on {planned!r}, which holds no trainable weights; raise --max_memory"
        )
    if isinstance(planned, int):
        accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
        if accelerator is not None and planned < torch.accelerator.device_count():
            return torch.device(accelerator.type, planned)
        session.print(
            f"notice: device {planned} does not exist here ({torch.accelerator.device_count()} accelerators); using cpu"
        )
        return torch.device("cpu")
    return torch.device(planned)


def place(
    model: torch.nn.Module, placement: dict[str, torch.device], detach: bool = False
) -> torch.nn.Module:
    """Move each module to its device; a forward pre-hook moves its inputs there. `.to()` is
    differentiable, so gradients flow back across devices; `.detach()` (the bug) would cut them."""
    for name, device in placement.items():
        module = model.get_submodule(name).to(device)

        def move_inputs(_module, args, device=device):
            return tuple((a.detach() if detach else a).to(device) for a in args)

        module.register_forward_pre_hook(move_inputs)
    return model


def run(cfg: Config) -> int:
    with start_run(cfg, EXPERIMENT) as session:
        reference = build_mlp(cfg.n_features, cfg.hidden_features, 1, seed=cfg.seed, n_layers=cfg.n_layers)
        plan, budget = plan_device_map(cfg, reference)
        module_bytes = compute_module_sizes(reference)
        # one notice each
        real_device = {planned: to_real_device(planned, session) for planned in dict.fromkeys(plan.values())}
        placement = {name: real_device[planned] for name, planned in plan.items()}
        session.print(f"{'module':<10}{'planned':>10}{'placed on':>12}{'bytes':>12}")
        for name in plan:
            session.print(f"{name:<10}{plan[name]!s:>10}{placement[name]!s:>12}{module_bytes[name]:>12,}")
        if budget is not None:
            used = {
                device: sum(module_bytes[n] for n, d in plan.items() if d == device)
                for device in set(plan.values())
            }
            over = {d: (used[d], budget.get(d, 0)) for d in used if used[d] > budget.get(d, 0)}
            session.check(
                "plan_respects_max_memory",
                not over,
                ", ".join(f"{d}: {used[d]:,} of {budget.get(d, 0):,} bytes" for d in used)
                + (f"; OVER: {over}" if over else ""),
            )

        # same initial weights as the reference
        split_model = place(copy.deepcopy(reference), placement, detach=cfg.detach_between_devices)
        first_device, last_device = placement[reference.layer_names[0]], placement[reference.layer_names[-1]]
        reference.to(first_device)  # the reference lives on ONE device
        dataset, _ = make_regression_dataset(cfg.n_samples, cfg.n_features, 0.1, cfg.seed)
        x_all, y_all = shard_tensors(dataset, 0, 1)
        with torch.no_grad():
            output_diff = (
                (split_model(x_all[:256]).cpu() - reference(x_all[:256].to(first_device)).cpu())
                .abs()
                .max()
                .item()
            )
        session.parity_check(
            "outputs_match_unsplit", output_diff, cfg.parity_atol, "max |split - unsplit| on 256 rows"
        )

        optimizers = [torch.optim.SGD(m.parameters(), lr=cfg.lr) for m in (split_model, reference)]
        batches = iterate_batches(x_all, y_all, cfg.batch_size, cfg.seed)
        for step in range(1, cfg.max_steps + 1):
            x, y = next(batches)
            losses = []
            for model, optimizer, device in zip(
                (split_model, reference), optimizers, (last_device, first_device), strict=True
            ):
                # the split model's output is on the last device
                loss = F.mse_loss(model(x.to(first_device)), y.to(device))
                optimizer.zero_grad()
                loss.backward()  # through the .to() between devices, back to fc1
                optimizer.step()
                losses.append(loss.item())
            if step % cfg.log_every == 0 or step == cfg.max_steps:
                session.log(step, {"loss": losses[0], "reference_loss": losses[1]})
        parameter_diff = max_abs_difference(split_model, reference)
        session.parity_check(
            "trains_like_one_device",
            parameter_diff,
            cfg.parity_atol,
            f"after {cfg.max_steps} steps max |split - one device|",
        )
        session.metrics.update(
            plan={k: str(v) for k, v in plan.items()},
            placement={k: str(v) for k, v in placement.items()},
            module_bytes={n: module_bytes[n] for n in plan},
            output_max_abs_diff=output_diff,
            parameter_max_abs_diff=parameter_diff,
            final_loss=losses[0],
        )
    return session.exit_code


def main(argv: list[str] | None = None) -> int:
    return run(parse_config(Config, argv, description=__doc__.split("\n")[0]))


if __name__ == "__main__":
    run_cli(main)
