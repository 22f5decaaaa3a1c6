"""ultraep_jax in other stacks, one subpackage each, each behind an optional extra.

`hf` maps Hugging Face checkpoints of seven MoE families onto `ultraep_jax.MoE` and back (extra
``hf``); `maxtext` runs MaxText's MoE blocks balanced, in MaxText's own trainer (extra
``maxtext``). Nothing in the core package imports them.
"""
