"""What the configuration and the stages both need, importing neither (so the package's imports
run one way: `config` and every stage import `base`, never each other in a circle).

layout.py       `Layout`: the instance layout of an EP group (expert e's master on rank
                e // E_m, masters then slots); `check_divisible`
activations.py  `ACTIVATIONS`: the gated experts' activations, by name
arguments.py    `check_int`, `check_positive_int`, `check_finite`: one-line checks of the
                values a user gives
operands.py     which operands and devices the grouped-matmul kernels take (`MgpuTiles`,
                `mgpu_unsupported`, `mosaic_tpu_unsupported`, `is_hopper`): the facts the
                resolver's predicates read (`config.resolve`)
"""
