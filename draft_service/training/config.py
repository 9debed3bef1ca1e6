"""Settings of one draft-training run, validated at construction."""

from __future__ import annotations

from dataclasses import asdict, dataclass

EXPORT_DTYPES = ("float32", "bfloat16", "float16")

# Fields that may change between a run and its --resume; all others must match.
RESUMABLE_CHANGES = frozenset({"steps", "checkpoint_every", "eval_every", "log_every", "max_minutes",
                               "stop_after", "export_dtype"})
# Fields that define the generated sequences (a data cache is reused only when they match).
DATA_FIELDS = ("seed", "num_sequences", "seq_len", "prompt_len", "gen_batch_size", "gen_temperature",
               "greedy_fraction")


@dataclass(frozen=True)
class TrainConfig:
    # Data: prompts of prompt_len tokens from --data, continued by the target to seq_len tokens.
    num_sequences: int = 4096
    seq_len: int = 256
    prompt_len: int = 64
    gen_batch_size: int = 256
    gen_temperature: float = 0.8  # for the sampled share of continuations
    greedy_fraction: float = 0.5  # share of continuations decoded greedily (what greedy serving sees)
    val_fraction: float = 0.02
    # Draft shape; None means "as the target" (hidden size always is).
    draft_vocab_size: int | None = None  # None: min(32000, target vocabulary), as SpecForge
    draft_intermediate_size: int | None = None
    draft_heads: int | None = None
    draft_kv_heads: int | None = None
    feature_layers: tuple[int, ...] | None = None  # inputs of these target layers; None: SGLang's default
    # Optimisation.
    steps: int = 2000
    batch_size: int = 32
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    ttt_steps: int = 7
    ttt_decay: float = 0.8
    seed: int = 0
    # Bookkeeping.
    checkpoint_every: int = 500
    eval_every: int = 250
    log_every: int = 10
    max_minutes: float | None = None
    stop_after: int | None = None  # stop (no export) after this many steps, as an interruption would
    export_dtype: str = "float32"

    def __post_init__(self) -> None:
        positive = ("num_sequences", "seq_len", "prompt_len", "gen_batch_size", "steps", "batch_size",
                    "ttt_steps", "checkpoint_every", "eval_every", "log_every")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.prompt_len >= self.seq_len:
            raise ValueError(f"prompt_len ({self.prompt_len}) must be below seq_len ({self.seq_len}): the "
                             f"target must continue each prompt")
        if self.ttt_steps > self.seq_len - 2:
            raise ValueError(f"ttt_steps ({self.ttt_steps}) needs sequences longer than ttt_steps + 1")
        if not 0 <= self.greedy_fraction <= 1:
            raise ValueError("greedy_fraction must be in [0, 1]")
        if self.gen_temperature <= 0 and self.greedy_fraction < 1:
            raise ValueError("gen_temperature must be positive for sampled continuations")
        if not 0 <= self.val_fraction < 0.5:
            raise ValueError("val_fraction must be in [0, 0.5)")
        if not 0 < self.ttt_decay <= 1:
            raise ValueError("ttt_decay must be in (0, 1]")
        if self.lr <= 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError("lr must be positive and min_lr_ratio in [0, 1]")
        if self.export_dtype not in EXPORT_DTYPES:
            raise ValueError(f"export_dtype must be one of {EXPORT_DTYPES}")
        for name in ("draft_vocab_size", "draft_intermediate_size", "draft_heads", "draft_kv_heads",
                     "stop_after"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.feature_layers is not None and not self.feature_layers:
            raise ValueError("feature_layers, when given, must name at least one layer")

    @property
    def gen_len(self) -> int:
        return self.seq_len - self.prompt_len

    def data_key(self) -> dict:
        return {k: getattr(self, k) for k in DATA_FIELDS}

    def resume_key(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k not in RESUMABLE_CHANGES}
