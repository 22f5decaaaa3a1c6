"""The shape `experiments.bench.memory` compiles and the compiler it compiles with: `MemoryConfig`
(its flags), by default DeepSeek-V3's routed experts as `experiments/lab/stepmodel/shapes.toml`
states them (`DEEPSEEK_V3`), on simulated CPU devices (`TARGETS`)."""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from experiments.lab.stepmodel.shapes import MODELS
from ultraep_jax.config import Execution
from ultraep_jax.tools import DEVICE_KINDS

#: DeepSeek-V3's shape (shapes.toml's ``[models."deepseek-v3-671b"]``): D, F, E and top-k.
DEEPSEEK_V3 = MODELS["deepseek-v3-671b"]
#: The dtypes of x and the parameters.
DTYPES = ("bfloat16", "float32")
#: What the program compiles for: XLA:CPU's simulated devices, or XLA:GPU's compile-only GPUs of a
#: device kind (`ultraep_jax.tools.DEVICE_KINDS`: one node of up to 8, else nodes of 8).
TARGETS = ("cpu", *DEVICE_KINDS)


@dataclasses.dataclass(frozen=True)
class MemoryConfig:
    """The layer shape compiled at every EP size and mode (default: DeepSeek-V3's MoE layer,
    `DEEPSEEK_V3`).

    Attributes:
      d_model: D, the token width.
      d_ff: F, each routed expert's hidden width.
      num_experts: E, routed experts; divisible by every EP size.
      top_k: experts per token.
      tokens_per_rank: T, tokens on each device (x is [R, T, D], one sequence per device).
      dtype: x's and the parameters' dtype, bfloat16 or float32 (router math is float32).
      balanced_factor: receive buffer of the balanced layer and the ideal, x the pairs a rank
        routes (T x top_k).
      plain_factor: receive buffer of the capped plain layer, x the pairs a rank routes.
      slots_per_rank: S, spare expert slots per rank of the balanced layer.
      target: the compiler and devices, one of `TARGETS`: "cpu" (XLA:CPU, simulated CPU
        devices) or a GPU kind ("h100", "h200": XLA:GPU for compile-only GPUs of that kind,
        nodes of 8; needs JAX >= 0.12 with its CUDA plugin, docs/gpu.md).
      expert_kernel: the layers' ``expert_kernel`` (`ultraep_jax.config.Execution`): "auto" is
        resolved for the mesh's platform (tiled on CPU).
    """

    d_model: int = DEEPSEEK_V3.hidden
    d_ff: int = DEEPSEEK_V3.expert_ffn
    num_experts: int = DEEPSEEK_V3.num_experts
    top_k: int = DEEPSEEK_V3.top_k
    tokens_per_rank: int = 4096
    dtype: str = "bfloat16"
    balanced_factor: float = 1.05
    plain_factor: float = 1.25
    slots_per_rank: int = 2
    target: str = "cpu"
    expert_kernel: str = "auto"

    def __post_init__(self):
        for name in ("d_model", "d_ff", "num_experts", "top_k", "tokens_per_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if self.top_k > self.num_experts:
            raise ValueError(f"--top_k={self.top_k} exceeds --num_experts={self.num_experts}")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        for name in ("balanced_factor", "plain_factor"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ValueError(f"--{name} must be a finite number > 0, got {getattr(self, name)}")
        if self.slots_per_rank < 1:
            raise ValueError(f"--slots_per_rank must be >= 1, got {self.slots_per_rank}")
        if self.target not in TARGETS:
            raise ValueError(f"--target must be one of {', '.join(TARGETS)}, got {self.target!r}")
        try:
            Execution(expert_kernel=self.expert_kernel)
        except (TypeError, ValueError) as err:
            raise ValueError(f"--{str(err).removeprefix('Execution: ')}") from None

    @property
    def device_kind(self) -> str | None:
        """The GPUs' device kind (XLA's device description), None on CPU."""
        return DEVICE_KINDS.get(self.target)

    @property
    def itemsize(self) -> int:
        """Bytes of one element of x and of the parameters."""
        return jnp.dtype(self.dtype).itemsize

    @property
    def pairs_per_rank(self) -> int:
        """(token, choice) pairs each rank routes: T x top_k."""
        return self.tokens_per_rank * self.top_k


def check_ep_size(config: MemoryConfig, ep_size: int) -> None:
    """Raises ValueError (one line) when ``ep_size`` does not divide E or is < 1."""
    if ep_size < 1 or config.num_experts % ep_size:
        raise ValueError(f"EP size {ep_size} does not divide --num_experts={config.num_experts}")
