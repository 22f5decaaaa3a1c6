"""Every target shape of ``experiments/``: model shapes, GPU clusters, parallel layouts and the
published setups the figures are compared against.

The figures, with the config files and datasheets they come from, are in ``shapes.toml`` next to
this file (the one place they are written); :data:`MODELS`, :data:`CLUSTERS`, :data:`SCENARIOS`
and :data:`SETUPS` hold them by name, in file order; :data:`TRACE_MODELS` the traced models whose
expert count fits none of the scenarios (not in :data:`MODELS`, which the simulator runs on
every scenario). A traced model's experts and top-k are its trace's
(`experiments.lab.loads.traces`): a model whose experts differ from its trace's is refused.
"""

from __future__ import annotations

import dataclasses
import pathlib
import tomllib

from experiments.lab.loads import traces


@dataclasses.dataclass(frozen=True)
class ExpertShape:
    """One routed SwiGLU expert and its token rows as the exchanges move them: the one statement
    of their bytes, for the step model's targets and the replay's shapes alike.

    Attributes:
      d_model, d_ff: D and F (w_gate, w_up [D, F], w_down [F, D]).
      itemsize: bytes per weight and activation element (2: bf16).
    """

    d_model: int
    d_ff: int
    itemsize: int

    def __post_init__(self):
        for field in ("d_model", "d_ff", "itemsize"):
            if getattr(self, field) < 1:
                raise ValueError(f"ExpertShape.{field}={getattr(self, field)} must be >= 1")

    def expert_bytes(self) -> int:
        """Bytes of one expert's weights (a replica copy): 3 x D x F x itemsize."""
        return 3 * self.d_model * self.d_ff * self.itemsize

    def row_bytes(self) -> int:
        """Bytes of one token row (D activations)."""
        return self.d_model * self.itemsize


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """A MoE transformer's shape, as far as the step-time model needs it.

    Attributes:
      name: short key.
      source: where the figures come from.
      hidden: model width D.
      expert_ffn: routed expert FFN width F (SwiGLU: w_gate, w_up [D, F], w_down [F, D]).
      num_experts: routed experts E.
      top_k: experts per token.
      moe_layers: layers with routed experts.
      dense_layers: leading dense-FFN layers.
      dense_ffn: FFN width of those dense layers.
      shared_experts, shared_ffn: always-on shared experts per MoE layer and their width.
      vocab: vocabulary (LM head).
      attention: ("gqa", heads, kv_heads, head_dim) or
        ("mla", heads, q_lora_rank, kv_lora_rank, qk_nope_dim, qk_rope_dim, v_head_dim).
      trace: the real expert-load trace used for this shape (same number of experts).
    """

    name: str
    source: str
    hidden: int
    expert_ffn: int
    num_experts: int
    top_k: int
    moe_layers: int
    dense_layers: int
    dense_ffn: int
    shared_experts: int
    shared_ffn: int
    vocab: int
    attention: tuple
    trace: str

    def experts(self, itemsize: int) -> ExpertShape:
        """One routed expert of this model at ``itemsize`` bytes per element (its bytes)."""
        return ExpertShape(self.hidden, self.expert_ffn, itemsize)


@dataclasses.dataclass(frozen=True)
class Cluster:
    """Per-GPU hardware figures (nominal; efficiencies are applied by the cost model).

    Attributes:
      name: short key.
      gpu: GPU model.
      peak_bf16_tflops: dense BF16 tensor-core peak per GPU.
      nvlink_gbps: NVLink bandwidth per GPU per direction, GB/s.
      nvlink_domain: GPUs that share one NVLink domain.
      ib_gbps: scale-out (InfiniBand) bandwidth per GPU per direction, GB/s.
      sources: where the figures come from.
    """

    name: str
    gpu: str
    peak_bf16_tflops: float
    nvlink_gbps: float
    nvlink_domain: int
    ib_gbps: float
    sources: str


@dataclasses.dataclass(frozen=True)
class Scenario:
    """A parallel layout: ``ep`` ranks per EP group (0: one expert per rank, ep = E), DP groups
    fill ``total_gpus``."""

    name: str
    cluster: str
    ep: int
    total_gpus: int
    note: str

    def ep_size(self, model: ModelShape) -> int:
        """EP size for ``model`` (``ep == 0`` means one expert per rank)."""
        return model.num_experts if self.ep == 0 else self.ep

    def dp_size(self, model: ModelShape) -> int:
        """DP groups: ``total_gpus // ep_size``."""
        return max(1, self.total_gpus // self.ep_size(model))


@dataclasses.dataclass(frozen=True)
class Setup:
    """A published expert-parallel setup: ``model`` over ``ep`` ranks with ``slots_per_rank``
    spare slots, ``tokens_per_rank`` tokens per rank, ``itemsize`` bytes per weight and
    activation; and what was published on it (shapes.toml says each field's meaning): per
    initial max/mean, the replicas and the most replicas of one expert; the final max/mean, the
    planner's GPU time range, the exposed overhead, % of the force-balanced ideal, the speedup
    over no balancing; ``zipf_targets``: our generators' targets for those initial loads."""

    name: str
    model: str
    ep: int
    slots_per_rank: int
    tokens_per_rank: int
    itemsize: int
    source: str
    initial_imbalance: tuple[float, ...]
    replicas: tuple[int, ...]
    max_replicas_per_expert: tuple[int, ...]
    final_imbalance: float
    plan_ms: tuple[float, float]
    exposed_overhead_ms: float
    pct_ideal: float
    speedup: float
    zipf_targets: tuple[float, ...]

    def __post_init__(self):
        for field in ("ep", "tokens_per_rank", "itemsize"):
            if getattr(self, field) < 1:
                raise ValueError(f"Setup.{field}={getattr(self, field)} must be >= 1")
        n = len(self.initial_imbalance)
        for field in ("replicas", "max_replicas_per_expert", "zipf_targets"):
            if len(getattr(self, field)) != n:
                raise ValueError(f"Setup.{field} needs one value per initial imbalance ({n})")
        if len(self.plan_ms) != 2 or self.plan_ms[0] > self.plan_ms[1]:
            raise ValueError(f"Setup.plan_ms={self.plan_ms} must be a range [low, high]")

    @property
    def shape(self) -> ModelShape:
        """The setup's model shape."""
        return MODELS[self.model]

    @property
    def pairs_per_rank(self) -> int:
        """(token, choice) pairs per rank: tokens x top-k."""
        return self.tokens_per_rank * self.shape.top_k

    @property
    def experts_per_rank(self) -> int:
        """E_m = E / R."""
        return self.shape.num_experts // self.ep


def _traced_sizes(row: dict) -> dict:
    """A trace model's routed experts and top-k: its trace's (`traces.TRACE_NUM_EXPERTS`,
    `traces.TRACE_TOP_K`, their one statement)."""
    return {
        "num_experts": traces.TRACE_NUM_EXPERTS[row["trace"]],
        "top_k": traces.TRACE_TOP_K[row["trace"]],
    }


def _models(table: dict, traced: bool = False) -> dict:
    """``{name: ModelShape}`` of a shapes file's table of models, in file order; ``traced``: the
    trace models, whose experts and top-k are their trace's. ValueError when a model's experts
    differ from its trace's."""
    models = {}
    for name, row in table.items():
        sizes = _traced_sizes(row) if traced else {}
        model = ModelShape(name=name, **{**row, **sizes, "attention": tuple(row["attention"])})
        if model.num_experts != traces.TRACE_NUM_EXPERTS[model.trace]:
            raise ValueError(
                f"shapes.toml: {name} has {model.num_experts} experts, its trace {model.trace} "
                f"{traces.TRACE_NUM_EXPERTS[model.trace]}"
            )
        models[name] = model
    return models


def _read(path: pathlib.Path) -> tuple[dict, dict, dict, dict, dict]:
    """``(models, trace_models, clusters, scenarios, setups)`` of a shapes file, each ``{name:
    shape}`` in file order."""
    with path.open("rb") as f:
        tables = tomllib.load(f)
    models, trace_models = _models(tables["models"]), _models(tables["trace_models"], True)
    clusters = {name: Cluster(name=name, **row) for name, row in tables["clusters"].items()}
    scenarios = {name: Scenario(name=name, **row) for name, row in tables["scenarios"].items()}
    setups = {
        name: Setup(
            name=name, **{k: tuple(v) if isinstance(v, list) else v for k, v in row.items()}
        )
        for name, row in tables["setups"].items()
    }
    return models, trace_models, clusters, scenarios, setups


MODELS, TRACE_MODELS, CLUSTERS, SCENARIOS, SETUPS = _read(
    pathlib.Path(__file__).with_name("shapes.toml")
)
#: UltraEP's published EP64 setup (DeepSeek-V3, 8192 tokens per rank): the real shape of every
#: program that charges a layer at a real model's bytes.
ANCHOR = SETUPS["ultraep-ep64"]
