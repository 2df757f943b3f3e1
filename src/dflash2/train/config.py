"""``TrainConfig``: every setting of ``dflash2 train-drafter``, validated once."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dflash2.errors import InvalidOptionError


@dataclass(frozen=True)
class TrainConfig:
    """Distil a DFlash block drafter from ``target`` (DFlash recipe, CPU-sized defaults).

    Data: ``samples`` prompts (the offline default corpus, ``prompts`` jsonl or ``text`` dir)
    answered by the target itself (a share ``greedy_share`` of the generation batches greedily, the
    rest at ``temperature``; up to ``max_new_tokens``), cached with the
    target's features under ``out/data``. Model: ``num_layers`` drafter layers reading
    ``target_layer_ids`` (default: spread over the target). Objective: ``anchors`` random blocks per
    sequence, cross-entropy on block positions 1..B-1 weighted ``exp(-(k-1)/gamma)``; a share
    ``predraft`` of blocks is trained for pre-drafting (context features stop up to a block before
    the anchor, the tokens in between given as clean embeddings). ``labels``: ``"greedy"`` trains
    on the target's teacher-forced argmax (what greedy verification accepts), ``"sampled"`` on the
    response tokens themselves (the published recipe). The exported drafter drafts only the tokens
    that make up ``draft_vocab_coverage`` of the labels (a smaller LM head), and the training
    softmax runs over exactly those tokens. With coverage 1.0 (every token draftable) it runs over
    the tokens of the data plus ``negatives`` random others per step (the LM head is most of a CPU
    step), or over the whole vocabulary with -1. On a GPU: ``features="online"`` (the target's
    features computed each step instead of cached), ``batch`` sequences per forward,
    ``precision="bf16"``; ``max_minutes`` bounds the run; ``export_dtype`` and ``max_shard_mib``
    shape the export. Under ``torchrun`` the processes share the prompts and average gradients.
    """

    target: str
    out: Path
    prompts: Path | None = None
    text: Path | None = None
    corpus: str = "templates"  # without prompts or text: "templates" or "users" (train/realistic.py)
    samples: int = 512
    max_new_tokens: int = 192
    max_prompt_tokens: int = 256
    temperature: float = 0.7
    greedy_share: float = 0.5
    generation_batch: int = 16
    block_size: int = 8
    num_layers: int = 1
    init: str = "random"  # or "target": drafter layers start as copies of the target's last layers
    target_layer_ids: tuple[int, ...] | None = None
    mask_token_id: int | None = None
    steps: int = 1000
    anchors: int = 32
    accumulate: int = 4
    lr: float = 6e-4
    warmup: float = 0.04
    gamma: float | None = None
    predraft: float = 0.25
    labels: str = "greedy"  # or "sampled"
    draft_vocab_coverage: float = 0.999  # drafting vocabulary: tokens covering this share of the labels; 1: all
    negatives: int = 2048  # LM head rows per step: the data's tokens + this many random others; -1: all
    checkpoint_every: int = 100
    keep_every: int = 200  # checkpoints kept for good (besides the last two), for learning curves
    seed: int = 0
    device: str = "auto"
    features: str = "auto"  # "cache" (fp16 files under out/data) or "online" (each step, on the device)
    batch: int = 1  # sequences packed into one drafter forward (each micro-step)
    precision: str = "fp32"  # or "bf16": the target in bfloat16 and the drafter's forward under bf16 autocast
    export_dtype: str = "float32"  # or "bfloat16": the exported weights (never affects exactness)
    max_shard_mib: float | None = None  # export in safetensors shards of at most this size (MiB)
    max_minutes: float | None = None  # stop training (checkpoint + export) this long after the start
    refine: Path | None = None  # a drafter to refine on-policy (its own steps on the prompts) instead of a new one
    replay: float = 0.5  # with refine: share of a sequence's anchors taken where that drafter's blocks were rejected

    def __post_init__(self) -> None:
        positive = ("samples", "max_new_tokens", "max_prompt_tokens", "generation_batch", "num_layers", "steps")
        for name in (*positive, "batch", "anchors", "accumulate", "checkpoint_every", "keep_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidOptionError(f"{name} must be a positive int, got {value!r}.")
        if not 2 <= self.block_size <= 64:
            raise InvalidOptionError(f"block_size must be in [2, 64], got {self.block_size}.")
        if self.prompts is not None and self.text is not None:
            raise InvalidOptionError("pass either prompts (a .jsonl file) or text (a directory), not both.")
        if not isinstance(self.negatives, int) or self.negatives < -1:
            raise InvalidOptionError(
                f"negatives must be an int >= -1 (-1: all of the vocabulary), not {self.negatives!r}."
            )
        if self.labels not in ("greedy", "sampled"):
            raise InvalidOptionError(f"labels must be 'greedy' or 'sampled', got {self.labels!r}.")
        if self.init not in ("random", "target"):
            raise InvalidOptionError(f"init must be 'random' or 'target', got {self.init!r}.")
        if not 0.0 <= self.predraft <= 1.0:
            raise InvalidOptionError(f"predraft is a share of blocks in [0, 1], got {self.predraft}.")
        if not 0.5 <= self.draft_vocab_coverage <= 1.0:
            raise InvalidOptionError(f"draft_vocab_coverage must be in [0.5, 1], got {self.draft_vocab_coverage}.")
        if not 0.0 <= self.greedy_share <= 1.0:
            raise InvalidOptionError(f"greedy_share is a share of the prompts in [0, 1], got {self.greedy_share}.")
        if not 0.0 <= self.temperature <= 2.0:
            raise InvalidOptionError(f"temperature must be in [0, 2], got {self.temperature}.")
        if not 0.0 <= self.replay <= 1.0:
            raise InvalidOptionError(f"replay is a share of the anchors in [0, 1], got {self.replay}.")
        if self.refine is not None and not (Path(self.refine) / "config.json").is_file():
            raise InvalidOptionError(f"refine: {self.refine} is not a drafter directory (no config.json).")
        if self.corpus not in ("templates", "users"):
            raise InvalidOptionError(f"corpus must be 'templates' or 'users', got {self.corpus!r}.")
        if self.features not in ("auto", "cache", "online"):
            raise InvalidOptionError(f"features must be 'auto', 'cache' or 'online', got {self.features!r}.")
        if self.precision not in ("fp32", "bf16"):
            raise InvalidOptionError(f"precision must be 'fp32' or 'bf16', got {self.precision!r}.")
        if self.export_dtype not in ("float32", "bfloat16"):
            raise InvalidOptionError(f"export_dtype must be 'float32' or 'bfloat16', got {self.export_dtype!r}.")
        if self.max_shard_mib is not None and not self.max_shard_mib > 0:
            raise InvalidOptionError(f"max_shard_mib must be > 0 (MiB) or None, got {self.max_shard_mib!r}.")
        if self.max_minutes is not None and not self.max_minutes > 0:
            raise InvalidOptionError(f"max_minutes must be > 0 or None, got {self.max_minutes!r}.")
        if not self.lr > 0 or not 0.0 <= self.warmup < 1.0:
            raise InvalidOptionError("lr must be > 0 and warmup a share of the steps in [0, 1).")

    @property
    def loss_gamma(self) -> float:
        """Decay of the position weights: the DFlash recipe's 7 / 5 / 4 for blocks of 16 / 10 / 8."""
        if self.gamma is not None:
            return self.gamma
        return {16: 7.0, 10: 5.0, 8: 4.0}.get(self.block_size, max(1.0, self.block_size / 2.2))
