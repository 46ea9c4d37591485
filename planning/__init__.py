"""What predicts a layout at scale, above the strategies it predicts: the step-time and memory model
(cost_model.py), the hardware profiles it prices ops on (hardware.yaml, each figure with its source) and the
published runs and shapes it is set beside (published.py). Used by experiments/at_scale.py, tools/plan.py and
the benchmarks; nothing in common/ or strategies/ imports it (layers point down only)."""
