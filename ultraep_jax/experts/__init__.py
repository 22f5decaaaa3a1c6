"""The experts stage: gated MLPs (SwiGLU by default) over rows grouped by local instance.

registry.py    `grouped_glu` / `local_experts`: the kernel table, one entry per kernel name
dense.py       `dense_glu`: one expert on every token (the shared expert)
tiled.py       the tiled loop (CPU); gmm_mgpu.py (JAX's Mosaic GPU kernels, "auto" on Hopper)
               and gmm_pallas.py (Pallas on its Triton backend, deprecated by JAX 0.12: an
               explicit choice): the GPU grouped matmuls, imported when a layer using them is
               traced; "auto" elsewhere on CUDA is XLA's `ragged_dot`

The gated activations by name are `ultraep_jax.base.activations`.
"""
