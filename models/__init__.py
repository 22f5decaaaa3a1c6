"""Models built from the balanced MoE layer."""
