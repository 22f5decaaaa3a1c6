"""Configuration of a training run: a frozen dataclass, validated on construction.

`TrainConfig` holds the run's own settings and, in ``model``, the model's shape (a
`models.moe_lm.ModelConfig`). Outside Python both are flat: every field, the model's included, is
one flag of the same name (``--d_model`` sets ``model.d_model``), and ``config.json`` holds the
same flat names (`TrainConfig.to_json`, `TrainConfig.from_flat`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from experiments.lab.cli import AUTO, check_capacity_factor
from experiments.lab.cli import parse_capacity_factor as parse_capacity_factor  # the flag's parser
from experiments.lab.dataclass_flags import flag_text
from experiments.lab.training.mesh_sizes import mesh_sizes, one_ep_rank_error
from models.moe_lm import ModelConfig, check_positive_ints
from ultraep_jax.config import DEFAULT_MIN_TOKENS_PER_RANK, BalancerConfig, Execution
from ultraep_jax.tools import check_int

# ``capacity_factor``'s default, AUTO, is resolved on construction by `auto_capacity_factor`.
#: The receive buffer of a balanced run, as a multiple of the mean routed load: room for the
#: balanced load (within ``balance_eps``) plus rounding, so nothing is dropped in practice.
BALANCED_CAPACITY_FACTOR = 1.05

#: The model's fields (flat names in flags and ``config.json``).
MODEL_FIELDS = tuple(field.name for field in dataclasses.fields(ModelConfig))
#: Fields that fix the shape of the model and optimizer state: a workdir's checkpoints can only
#: be resumed with the same values.
STATE_FIELDS = MODEL_FIELDS
#: Fields that only say how long to train and how often to report: free to change on resume.
SCHEDULE_FIELDS = ("steps", "checkpoint_every", "eval_every", "print_every", "profile_steps")
# TrainConfig's fields that must be ints >= 1.
_POSITIVE = (
    "steps",
    "max_corpus_bytes",
    "batch_size",
    "seq_len",
    "tensor_size",
    "min_tokens_per_replica",
    "checkpoint_every",
    "eval_every",
    "print_every",
)


#: --balance: plain EP, balanced, or the force-balanced ideal (a timing reference).
BALANCE_MODES = ("none", "ultraep", "ideal")
#: Printed at the start of a --balance=ideal run: what it is, so that nobody keeps its model.
IDEAL_NOTE = (
    "note: --balance=ideal is the force-balanced ideal, a timing reference: every MoE layer's "
    "router choices are replaced by an even assignment (its weights kept), so the loss is not a "
    "model's; compare its step time, not its loss"
)


def check_profile_steps(profile_steps: int, steps: int) -> None:
    """Raises ValueError (one line) unless ``--profile_steps`` is in [0, steps - 2]: the first
    step compiles and at least one more is timed untraced (train and bench.step alike)."""
    top = max(steps - 2, 0)
    if not 0 <= profile_steps <= top:
        raise ValueError(
            f"--profile_steps={profile_steps} must be in [0, {top}] with --steps={steps} (the "
            "first step compiles, and one more is timed untraced)"
        )


def check_profile_devices(profile_steps: int, local_devices: int) -> None:
    """Raises ValueError (one line) when ``--profile_steps`` would split the step of a process
    holding ``local_devices`` > 1 devices: its profile holds every device's ops, whose times add
    up past the step (on 8 simulated CPU devices, 3-4x the step and a negative rest), so the
    split means something only with one device per process."""
    if profile_steps and local_devices > 1:
        raise ValueError(
            f"--profile_steps={profile_steps} splits a process's step into terms, but a process "
            f"holding {local_devices} devices adds their work up (the terms would sum to several "
            "times the step): run one device per process (--pinned_ranks=2 measures each rank's "
            "step), or --profile_steps=0"
        )


def auto_capacity_factor(balance: str) -> float | None:
    """The capacity factor that ``"auto"`` stands for: `BALANCED_CAPACITY_FACTOR` when the run
    balances or runs the force-balanced ideal (the buffer fits the balanced load), None
    (dropless, worst-case buffers) without."""
    return BALANCED_CAPACITY_FACTOR if balance in ("ultraep", "ideal") else None


def default_workdir(preset: str | None, model_values: Mapping[str, object]) -> str:
    """The workdir of a run given no ``--workdir``: ``runs/default`` for the default model
    (``preset`` None), ``runs/<preset>`` for a preset, then ``-<name>=<value>`` for each model
    flag in ``model_values`` (in `ModelConfig`'s field order). Runs of different models thus get
    different folders: one model's checkpoints cannot be resumed by another."""
    unknown = sorted(set(model_values) - set(MODEL_FIELDS))
    if unknown:
        raise ValueError(f"not model fields: {', '.join(unknown)}")
    name = preset or "default"
    name += "".join(
        f"-{field}={flag_text(model_values[field])}"
        for field in MODEL_FIELDS
        if field in model_values
    )
    return f"runs/{name}"


def execution_of(planner: str, transfer_chunks: int) -> Execution:
    """The `uep.Execution` of ``--planner`` and ``--transfer_chunks`` (the library's checks, its
    one-line errors naming the flag)."""
    try:
        return Execution(planner=planner, transfer_chunks=transfer_chunks)
    except (TypeError, ValueError) as err:
        raise type(err)(str(err).replace("Execution: ", "--", 1)) from None


def balancer_options(max_fanout: int, ranks_per_domain: int) -> dict:
    """The `uep.BalancerConfig` keywords of ``--max_fanout`` and ``--ranks_per_domain`` (0: one
    domain, None), checked by the library (its one-line errors naming the flag)."""
    if isinstance(ranks_per_domain, int) and not isinstance(ranks_per_domain, bool):
        if ranks_per_domain < 0:
            raise ValueError(
                f"--ranks_per_domain must be >= 0 (0: one domain), got {ranks_per_domain}"
            )
        ranks_per_domain = ranks_per_domain or None
    options = {"max_fanout": max_fanout, "ranks_per_domain": ranks_per_domain}
    try:
        BalancerConfig(**options)
    except (TypeError, ValueError) as err:
        raise type(err)(str(err).replace("BalancerConfig.", "--", 1)) from None
    return options


def one_ep_rank_note(cfg: TrainConfig, ep_size: int, num_devices: int) -> str:
    """The note of a balanced run (--balance=ultraep) on one EP rank of several devices (an
    explicit --ep_size=1: `TrainConfig.check_devices` refuses the implicit one): nothing to
    balance; "" otherwise."""
    if cfg.balance != "ultraep" or ep_size != 1 or num_devices == 1:
        return ""
    return (
        f"note: one EP rank of {num_devices} devices: --balance=ultraep has nothing to balance "
        "(every expert on the one EP rank; the layers run plain expert parallelism)"
    )


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything a training run needs; `experiments.train` builds it from flags.

    After construction ``capacity_factor`` is a float or None: ``"auto"`` (the default) is
    replaced by `auto_capacity_factor` of ``balance``.

    Attributes:
      workdir: output folder (created if needed); rerun with it to continue. Without it:
        runs/default, or runs/<preset> for another --preset, plus -<flag>=<value> for each model
        flag given (runs/deepseek_v3-num_layers=4), so that another model gets a folder of its
        own.
      balance: expert load balancing: none, ultraep, or ideal (the force-balanced ideal: the
        router's choices replaced by an even assignment; a timing reference that changes the
        model's math, never a model to keep).
      steps: training steps (total, across resumes).
      data: text files: a path, folder or glob (default: the Python standard library's source
        files).
      max_corpus_bytes: corpus size cap.
      eval_fraction: held-out tail of the corpus.
      eval_batches: batches per evaluation (0: no evaluation).
      batch_size: global batch (sequences).
      seq_len: sequence length (bytes); at most ``max_seq_len``.
      model: the model's shape; each of its fields is a flag of its own.
      slots_per_rank: replica slots per rank (>= 1 with --balance=ultraep).
      min_tokens_per_replica: least tokens a replica carries.
      balance_eps: balance tolerance over the mean.
      min_tokens_per_rank: with --balance=ultraep, MoE layers whose ranks hold fewer tokens than
        this run plain expert parallelism at the same buffer (BalancerConfig.min_tokens_per_rank;
        0: always balance).
      capacity_factor: receive buffer per rank as a multiple of the pairs it routes; pairs beyond
        it are dropped. auto: 1.05 with --balance=ultraep (room for the balanced load), dropless
        with none; none: dropless (worst-case buffers); or a number.
      learning_rate: AdamW learning rate.
      seed: initialisation seed.
      ep_size: devices on the expert axis (0: all but the tensor axis's); the rest is data.
      tensor_size: devices on a "tensor" axis that splits each expert's hidden width d_ff (expert
        tensor parallelism: `uep.ExpertParallel`'s tensor_axis); the mesh is then (data, expert,
        tensor), the tokens the same on each tensor rank. 1: no tensor axis.
      planner: the planner of the balanced layers: auto (the native FFI handler on CPU, and on
        CUDA where it was built; the planner written in JAX elsewhere), native, or portable (the
        same plans, bit for bit).
      max_fanout: the relay bound of the replica weight transfer: an expert's master sends its
        weights to at most this many replicas, and each replica forwards them to at most this
        many more (0: no bound; the plans are the same for every value).
      transfer_chunks: the replica weights move as this many transfers of d_ff / n hidden
        columns each, so that XLA may overlap the transfer with the experts' matmuls (1: one
        transfer; at most --d_ff / --tensor_size). Each chunk is its own transfer and slot
        matmuls in the compiled step, so compile time and fixed costs grow with n: chunks stop
        paying once a chunk is narrower than a kernel tile (d_ff / (tensor_size * n) < 128
        columns) and on CPU (nothing overlaps there: keep 1); at tiny widths many chunks only
        cost compile time.
      ranks_per_domain: EP ranks joined by fast links (the GPUs of one node), each domain that
        many consecutive ranks of the expert axis: the planner prefers targets near each expert
        and the replica weights cross the slow links once per domain that needs them; must
        divide the EP size. 0: one domain.
      checkpoint_every: checkpoint interval (steps).
      eval_every: eval interval (steps).
      print_every: progress line interval (steps).
      profile_loads: record per-step, per-layer expert and rank loads before/after balancing to
        <workdir>/loads.jsonl.
      profile_steps: trace the last this many steps with the JAX profiler on every process and
        write each process's step split into terms (experiments.lab.step_terms) to
        <workdir>/terms_rank<process>.json; those steps are left out of the median step time.
        Only with one device per process (--pinned_ranks, or --num_processes with
        --cpu_devices=1): a process of several devices would add their work up. At most
        --steps - 2 (the first step compiles, one more is timed). 0: none.
    """

    workdir: str = "runs/default"
    balance: str = "ultraep"
    steps: int = 200
    data: str | None = None
    max_corpus_bytes: int = 16 << 20
    eval_fraction: float = 0.02
    eval_batches: int = 4
    batch_size: int = 16
    seq_len: int = 128
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    slots_per_rank: int = 2
    min_tokens_per_replica: int = 8
    balance_eps: float = 0.01
    min_tokens_per_rank: int = DEFAULT_MIN_TOKENS_PER_RANK
    capacity_factor: float | str | None = AUTO
    learning_rate: float = 3e-3
    seed: int = 0
    ep_size: int = 0
    tensor_size: int = 1
    planner: str = Execution.planner
    max_fanout: int = BalancerConfig.max_fanout
    transfer_chunks: int = Execution.transfer_chunks
    ranks_per_domain: int = 0
    checkpoint_every: int = 50
    eval_every: int = 50
    print_every: int = 10
    profile_loads: bool = False
    profile_steps: int = 0

    def __post_init__(self):
        if self.balance not in BALANCE_MODES:
            raise ValueError(
                f"unknown --balance={self.balance!r}; expected one of {', '.join(BALANCE_MODES)}"
            )
        check_positive_ints(self, _POSITIVE, "--")
        object.__setattr__(self, "eval_batches", check_int("--eval_batches", self.eval_batches, 0))
        if self.slots_per_rank < 0 or self.ep_size < 0 or self.min_tokens_per_rank < 0:
            raise ValueError("--slots_per_rank, --ep_size and --min_tokens_per_rank must be >= 0")
        execution_of(self.planner, self.transfer_chunks)
        balancer_options(self.max_fanout, self.ranks_per_domain)
        check_profile_steps(self.profile_steps, self.steps)
        if self.balance == "ultraep" and self.slots_per_rank == 0:
            # Balancing would plan nothing, and the 1.05x buffer sized for it would drop pairs.
            raise ValueError(
                "--slots_per_rank=0 leaves --balance=ultraep no spare slot to replicate into; "
                "use --slots_per_rank >= 1, or --balance=none"
            )
        if not isinstance(self.model, ModelConfig):
            raise TypeError(f"model must be a ModelConfig, got {type(self.model).__name__}")
        if self.seq_len > self.model.max_seq_len:
            raise ValueError(
                f"--seq_len={self.seq_len} exceeds --max_seq_len={self.model.max_seq_len}, the "
                f"positions the model learns; raise --max_seq_len"
            )
        if not 0 < self.eval_fraction < 1:
            raise ValueError(f"--eval_fraction must be in (0, 1), got {self.eval_fraction}")
        cf = check_capacity_factor(self.capacity_factor, auto_capacity_factor(self.balance))
        object.__setattr__(self, "capacity_factor", cf)
        for name in ("learning_rate", "balance_eps"):  # nan and inf would train to a nan loss
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"--{name} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"--{name} must be finite, got {value}")
        if self.learning_rate <= 0:
            raise ValueError(f"--learning_rate must be > 0, got {self.learning_rate}")
        if self.balance_eps < 0:
            raise ValueError(f"--balance_eps must be >= 0, got {self.balance_eps}")
        if not self.workdir:
            raise ValueError("--workdir must be set")

    @classmethod
    def from_flat(cls, values: Mapping[str, object], model: ModelConfig | None = None):
        """The configuration of flat ``values`` (the names of the flags and of ``config.json``):
        TrainConfig's own fields, and model fields that replace those of ``model`` (default:
        ``ModelConfig()``); every field not in ``values`` keeps its default.

        Raises:
          ValueError: a name is no field, or a value is invalid (one line).
        """
        own = {f.name for f in dataclasses.fields(cls)} - {"model"}
        unknown = sorted(set(values) - own - set(MODEL_FIELDS))
        if unknown:
            raise ValueError(f"unknown configuration field(s): {', '.join(unknown)}")
        model_values = {k: v for k, v in values.items() if k in MODEL_FIELDS}
        model = dataclasses.replace(model or ModelConfig(), **model_values)
        return cls(model=model, **{k: v for k, v in values.items() if k in own})

    def check_devices(self, num_devices: int) -> tuple[int, int, int]:
        """(data, ep, tensor) mesh shape for ``num_devices`` (`mesh_sizes`); raises ValueError
        when they do not fit, or the batch does not split over them."""
        sizes = mesh_sizes(
            num_devices,
            ep_size=self.ep_size,
            tensor_size=self.tensor_size,
            num_experts=self.model.num_experts,
            d_ff=self.model.d_ff,
            ranks_per_domain=self.ranks_per_domain,
            transfer_chunks=self.transfer_chunks,
        )
        if self.balance == "ultraep" and sizes[1] == 1 < num_devices and self.ep_size == 0:
            raise ValueError(one_ep_rank_error(num_devices, sizes[2]))
        if self.batch_size % num_devices:
            raise ValueError(
                f"--batch_size={self.batch_size} is not divisible by the {num_devices} devices"
            )
        return sizes

    def check_process(self, local_devices: int) -> None:
        """Raises ValueError (one line) when this process, holding ``local_devices`` devices,
        cannot run the configuration: ``--profile_steps`` with more than one
        (`check_profile_devices`)."""
        check_profile_devices(self.profile_steps, local_devices)

    def to_json(self) -> dict:
        """The configuration by flat name, model fields in place of ``model`` (what
        ``<workdir>/config.json`` holds; `from_flat` reads it back)."""
        out = {}
        for field in dataclasses.fields(self):
            if field.name == "model":
                out.update(dataclasses.asdict(self.model))
            else:
                out[field.name] = getattr(self, field.name)
        return out

    def compare_saved(self, saved: dict) -> tuple[list[str], list[str]]:
        """How this configuration differs from ``saved`` (a `to_json` of an earlier run).

        Returns:
          ``(blocking, changed)``: ``"--name=<saved> (given: <this>)"`` for every `STATE_FIELDS`
          value that differs (the earlier run's checkpoints do not fit this configuration), and
          ``"--name=<saved> -> <this>"`` for every other differing field except `SCHEDULE_FIELDS`
          and ``workdir`` (allowed, but the run no longer follows one configuration). A name
          missing from ``saved`` is not compared.
        """
        if "max_seq_len" not in saved and "seq_len" in saved:
            # Written before max_seq_len was a field: the positions then covered seq_len.
            saved = {**saved, "max_seq_len": saved["seq_len"]}
        blocking, changed = [], []
        for name, new in self.to_json().items():
            if name in SCHEDULE_FIELDS or name == "workdir" or name not in saved:
                continue
            old = saved[name]
            if old == new:
                continue
            if name in STATE_FIELDS:
                blocking.append(f"--{name}={flag_text(old)} (given: {flag_text(new)})")
            else:
                changed.append(f"--{name}={flag_text(old)} -> {flag_text(new)}")
        return blocking, changed
