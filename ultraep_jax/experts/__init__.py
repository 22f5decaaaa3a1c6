"""The experts stage: gated MLPs (SwiGLU by default) over rows grouped by local instance.

registry.py     `grouped_glu` / `local_experts`: each kernel name's code ("auto" and what a name
                is on a platform: `ultraep_jax.config.resolve`)
dense.py        `dense_glu`: one expert on every token (the shared expert)
tiled.py        the tiled loop ("auto" on CPU)
gmm_mgpu.py     JAX's Mosaic GPU ragged-dot kernels ("auto" on Hopper where the operands suit
                them; "auto" elsewhere on CUDA is XLA's `ragged_dot`)
gmm_tokamax.py  tokamax's ragged dot with the platform's implementation ("auto" on TPU where
                tokamax is installed: its Mosaic TPU kernel)

The GPU and tokamax grouped matmuls are imported when a layer using them is traced. The gated
activations by name are `ultraep_jax.base.activations`; which operands each kernel takes,
`ultraep_jax.base.operands`.
"""
