"""What predicts a layout at scale, above the strategies it predicts: the step-time model (cost_model.py: compute
and the step; communication.py: each collective; memory.py: a rank's peak), the hardware profiles it prices ops on
(hardware.yaml, each figure with its source; hardware.py reads them) and the
published runs and shapes it is set beside (published.py). Used by experiments/at_scale.py, tools/plan.py and
the benchmarks; nothing in common/ or strategies/ imports it (layers point down only)."""
