"""`experiments.bench.memory` at a tiny shape, in-process: XLA's memory analysis of each layer's
compiled training step, the receive buffers as the layer sizes them, the arguments as the
layer's shardings split them."""

import math

import pytest

from experiments.bench import memory, memory_config, memory_report
from experiments.lab.stepmodel import shapes


@pytest.mark.slow  # five layers' training steps compiled
def test_memory_sweep_fields_and_buffers():
    R = 4
    config = memory_config.MemoryConfig(
        d_model=16, d_ff=8, num_experts=8, top_k=2, tokens_per_rank=32, dtype="bfloat16"
    )
    rows = memory.sweep(config, [R], memory.MODES, report=lambda line: None)
    by_mode = {r["mode"]: r for r in rows}
    assert list(by_mode) == list(memory.MODES)
    for r in rows:
        for name in ("temp_bytes", "argument_bytes", "output_bytes"):
            assert r[name] > 0, (r["mode"], name)
        assert 0 < r["receive_share"] < 1 and r["compile_s"] > 0
    pairs = 32 * 2
    # The layer's sizing (ExpertParallel.capacity): dropless holds every pair of every rank.
    assert by_mode["dropless"]["capacity_rows"] == R * pairs
    assert by_mode["balanced"]["capacity_rows"] == math.ceil(1.05 * pairs)
    assert by_mode["plain"]["capacity_rows"] == math.ceil(1.25 * pairs)
    for r in rows:
        assert r["receive_buffer_bytes"] == r["capacity_rows"] * 16 * 2
    dropless, balanced = by_mode["dropless"], by_mode["balanced"]
    assert dropless["receive_buffer_bytes"] * math.ceil(1.05 * pairs) == (
        R * pairs * balanced["receive_buffer_bytes"]
    )
    # Per device: the router kernel [D, E] (replicated), E / R experts' three [D, F] matrices,
    # x's [1, T, D]; all bf16.
    params = 16 * 8 + (8 // R) * 3 * 16 * 8
    assert by_mode["plain"]["argument_bytes"] == 2 * (params + 32 * 16)
    # One program, a larger buffer: more temporaries.
    assert dropless["temp_bytes"] > by_mode["plain"]["temp_bytes"]
    assert by_mode["ideal"]["temp_vs_ideal"] == 1.0
    assert balanced["replica_block_bytes"] == R * 2 * 3 * 16 * 8 * 2
    assert len(memory_report.table(rows, config)) == 2 + len(rows) + 3


def test_config_errors_are_one_line():
    config = memory_config.MemoryConfig(num_experts=8)
    for bad in (3, 0):
        with pytest.raises(ValueError, match=f"^EP size {bad} does not divide --num_experts=8$"):
            memory_config.check_ep_size(config, bad)
    with pytest.raises(ValueError, match="^--dtype must be one of bfloat16, float32, got"):
        memory_config.MemoryConfig(dtype="float16")


def test_the_default_shape_is_deepseek_v3_as_shapes_toml_states_it():
    """DeepSeek-V3's D, F, E and top-k are stated once, in shapes.toml; the program's defaults
    read them there."""
    config, model = memory_config.MemoryConfig(), shapes.MODELS["deepseek-v3-671b"]
    shape = (config.d_model, config.d_ff, config.num_experts, config.top_k)
    assert shape == (model.hidden, model.expert_ffn, model.num_experts, model.top_k)
    assert model.hidden == 7168  # the published hidden_size (deepseek-ai/DeepSeek-V3)
