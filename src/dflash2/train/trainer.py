"""``train_drafter``: self-distil data, train a DFlash drafter on the target's features, export it.

The drafter is built and run by ``dflash2.drafters.dflash`` itself, so what is trained is exactly
what is served; it shares the target's embedding and LM head (frozen). Checkpoints (weights,
AdamW state, step, data order) are safetensors + JSON under ``out/checkpoints`` and a new run
resumes from the latest whole one. The result is exported in the z-lab format to ``out/drafter``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import random
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors.torch import load_file, save_file
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from dflash2.api import Model, load
from dflash2.drafters.dflash import DFlashLayer, DFlashModel, DFlashSpec, DraftPart, ours_to_zlab, spread_layers
from dflash2.drafters.vocabulary import DRAFT_VOCAB_FILE, read_draft_vocab
from dflash2.errors import DrafterError
from dflash2.runtime.device import resolve_device
from dflash2.runtime.loader import load_safetensors
from dflash2.runtime.model import MLP, DecoderLayer, rms_norm
from dflash2.tokenize import encode_prompt
from dflash2.train import corpus, distributed, onpolicy, realistic
from dflash2.train.config import TrainConfig
from dflash2.train.data import (
    TrainingSequence,
    cache_features,
    generate_responses,
    load_sequences,
    with_features,
    writing,
)
from dflash2.train.distributed import Group
from dflash2.train.objective import (
    Blocks,
    layout,
    mix_anchors,
    pack,
    position_weights,
    sample_anchors,
    visibility,
    weighted_loss,
)
from dflash2.train.vocab import covering_vocab

_TARGET_KEYS = (
    "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
    "rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings", "vocab_size", "attention_bias",
)  # fmt: skip


def drafter_config(target: Model, cfg: TrainConfig) -> dict[str, Any]:
    """The z-lab ``config.json`` of a new drafter for ``target``."""
    raw = json.loads((target.checkpoint / "config.json").read_text())
    spec = target.target.spec
    config: dict[str, Any] = {k: raw[k] for k in _TARGET_KEYS if raw.get(k) is not None}
    config.update(
        architectures=["DFlashDraftModel"],
        model_type="qwen3",
        hidden_act="silu",
        head_dim=spec.head_dim,
        num_key_value_heads=spec.num_kv_heads,
        attention_bias=False,
        num_hidden_layers=cfg.num_layers,
        tie_word_embeddings=False,
        num_target_layers=spec.num_layers,
        dflash_config={
            "block_size": cfg.block_size,
            "mask_token_id": mask_token(target, cfg),
            "target_layer_ids": list(cfg.target_layer_ids or spread_layers(spec.num_layers, 3)),
        },
    )
    return config


def mask_token(target: Model, cfg: TrainConfig) -> int:
    """An existing embedding row the data never uses: the last special token that is not EOS/BOS/pad."""
    if cfg.mask_token_id is not None:
        return cfg.mask_token_id
    tok = target.tokenizer
    taken = {tok.bos_token_id, tok.pad_token_id, *target.eos_token_ids}
    special = [i for i in tok.all_special_ids if i not in taken and i < target.target.spec.vocab_size]
    return max(special) if special else target.target.spec.vocab_size - 1


def new_drafter(spec: DFlashSpec, target: Model, seed: int, init: str = "random") -> DFlashModel:
    """A fresh drafter: random (std 0.02), or (``init="target"``) its layers copied from the target's last ones."""
    torch.manual_seed(seed)
    model = DFlashModel(spec, target.max_context + 128).to(target.device)
    for name, param in model.named_parameters():
        if param.dim() >= 2:
            torch.nn.init.normal_(param, std=0.02)
        elif "norm" in name or name.endswith("layernorm"):
            torch.nn.init.ones_(param)
        else:
            torch.nn.init.zeros_(param)
    if init == "target":
        _copy_target_layers(model, target)
    return model


@torch.no_grad()
def _copy_target_layers(model: DFlashModel, target: Model) -> None:
    """Start each drafter layer from one of the target's last layers (same shapes: the drafter is built so)."""
    layers = target.target.layers
    q_rows = model.spec.num_heads * model.spec.head_dim
    for drafter_layer, target_layer in zip(model.layers, layers[len(layers) - len(model.layers) :], strict=True):
        mine, theirs = cast(DFlashLayer, drafter_layer), cast(DecoderLayer, target_layer)
        if not isinstance(theirs.mlp, MLP):
            raise DrafterError(
                "init='target' copies the target's last layers, which are mixture-of-experts layers here; "
                "use init='random'."
            )
        qkv = theirs.attn.qkv.weight
        mine.attn.q_proj.weight.copy_(qkv[:q_rows])
        mine.attn.kv_proj.weight.copy_(qkv[q_rows:])
        mine.attn.o_proj.weight.copy_(theirs.attn.o.weight)
        mine.mlp.gate_up.weight.copy_(theirs.mlp.gate_up.weight)
        mine.mlp.down.weight.copy_(theirs.mlp.down.weight)
        mine.input_layernorm.copy_(theirs.attn_norm)
        mine.post_attention_layernorm.copy_(theirs.mlp_norm)


@dataclass(frozen=True)
class Batch:
    """Training blocks of one or more sequences packed into one drafter forward."""

    features: torch.Tensor  # [N, F] the sequences' context features, concatenated
    context_positions: torch.Tensor  # [N] each feature's position in its own sequence
    blocks: Blocks
    offsets: torch.Tensor  # [A] first feature row of each block's sequence


def batch_of(sequences: Sequence[TrainingSequence], parts: Sequence[Blocks]) -> Batch:
    """Pack ``parts[i]``, the blocks of ``sequences[i]``, into one ``Batch``."""
    lengths = [seq.features.shape[0] for seq in sequences]
    blocks, offsets = pack(list(parts), lengths)
    positions = torch.cat([torch.arange(n) for n in lengths])
    features = sequences[0].features if len(sequences) == 1 else torch.cat([seq.features for seq in sequences])
    return Batch(features, positions, blocks, offsets)


def draft_logits(model: DFlashModel, target: Model, batch: Batch, vocab: torch.Tensor | None = None) -> torch.Tensor:
    """Drafter logits [A, B - 1, vocab] of the masked positions of every block, in one forward.

    ``vocab`` (ids) restricts the LM head to those rows (a sampled softmax; see ``TrainConfig``).
    """
    spec, device, blocks = model.spec, model.device, batch.blocks
    a, width = blocks.ids.shape
    context = model.project_context(batch.features[None].to(device=device, dtype=model.dtype))
    n = context.shape[1]
    x = target.target.embed(blocks.ids.to(device)).reshape(1, a * width, -1) * spec.input_embedding_scale
    q_pos = blocks.positions.flatten().to(device)
    rope_q = model.rope.at(q_pos)
    rope_k = model.rope.at(torch.cat([batch.context_positions.to(device), q_pos]))
    mask = visibility(blocks, n, batch.offsets).to(device)
    part = DraftPart(context, rope_q, rope_k, None, [mask] * len(model.layers))
    for i, layer in enumerate(model.layers):
        x = layer(x, [part], i)
    hidden = rms_norm(x, model.norm, spec.rms_norm_eps).view(a, width, -1)[:, width - spec.block_size + 1 :]
    if vocab is None:
        return model.logits(hidden, target.target.lm_head)
    return F.linear(hidden, target.target.lm_head.weight[vocab]) * spec.output_multiplier


class _Drafting(torch.nn.Module):
    """``draft_logits`` as a module's forward, so that ``DistributedDataParallel`` can wrap it;
    the frozen target is held outside the module's parameters."""

    def __init__(self, drafter: DFlashModel, target: Model) -> None:
        super().__init__()
        self.drafter = drafter
        self._target = (target,)

    def forward(self, batch: Batch, vocab: torch.Tensor | None) -> torch.Tensor:
        return draft_logits(self.drafter, self._target[0], batch, vocab)


def sampled_vocab(data_ids: torch.Tensor, size: int, negatives: int, generator: torch.Generator) -> torch.Tensor:
    """Every id of the data plus ``negatives`` random others (so that the rest are pushed down too)."""
    others = torch.randint(0, size, (negatives,), generator=generator)
    return torch.unique(torch.cat([data_ids, others]))


def whole_checkpoints(directory: Path) -> list[Path]:
    """The checkpoints under ``directory``, oldest first (a folder without its ``state.json`` was
    cut off while it was written and is not one)."""
    found = [p for p in directory.glob("step-*") if (p / "state.json").is_file()]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


class _Checkpoints:
    """The last two checkpoints, and every ``keep_every`` steps one for good (curves of the run).

    A checkpoint is written in a hidden folder renamed to ``step-NNNNNN`` once complete, so a run
    cut off while saving (killed, out of disk) resumes from the last whole checkpoint."""

    def __init__(self, directory: Path, keep_every: int) -> None:
        self.directory = directory
        self.keep_every = keep_every

    def latest(self) -> Path | None:
        found = whole_checkpoints(self.directory)
        return found[-1] if found else None

    def save(self, step: int, model: DFlashModel, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        path = self.directory / f"step-{step:06d}"
        partial = self.directory / f".partial-{path.name}"
        weights = {k: v.contiguous() for k, v in model.state_dict().items()}
        moments: dict[str, torch.Tensor] = {}
        for index, param_state in optimizer.state_dict()["state"].items():
            for key, value in param_state.items():
                moments[f"{index}.{key}"] = torch.as_tensor(value).contiguous()
        try:
            with writing(f"the checkpoint of step {step}", self.directory):
                shutil.rmtree(partial, ignore_errors=True)
                partial.mkdir(parents=True)
                save_file(weights, str(partial / "model.safetensors"))
                save_file(moments, str(partial / "optimizer.safetensors"))
                (partial / "state.json").write_text(json.dumps({"step": step, **state}))
                shutil.rmtree(path, ignore_errors=True)
                partial.rename(path)
        finally:
            shutil.rmtree(partial, ignore_errors=True)
        for old in whole_checkpoints(self.directory)[:-2]:
            if int(old.name.split("-")[1]) % self.keep_every:
                shutil.rmtree(old, ignore_errors=True)

    def restore(self, path: Path, model: DFlashModel, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        model.load_state_dict(load_file(str(path / "model.safetensors")))
        moments = load_file(str(path / "optimizer.safetensors"))
        saved = optimizer.state_dict()
        state: dict[int, dict[str, torch.Tensor]] = {}
        for key, value in moments.items():
            index, name = key.split(".", 1)
            state.setdefault(int(index), {})[name] = value
        saved["state"] = state
        optimizer.load_state_dict(saved)
        restored: dict[str, Any] = json.loads((path / "state.json").read_text())
        return restored


def _lr_factor(step: int, total: int, warmup: float) -> float:
    warm = max(1, round(warmup * total))
    if step < warm:
        return (step + 1) / warm
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warm) / max(1, total - warm))))


def prompts_for(cfg: TrainConfig) -> list[corpus.Prompt]:
    if cfg.prompts is not None:
        return corpus.load_prompts(cfg.prompts)[: cfg.samples]
    if cfg.text is not None:
        return list(corpus.load_text(cfg.text)[: cfg.samples])
    if cfg.corpus == "users":
        return realistic.users_corpus(cfg.samples, seed=cfg.seed)
    return corpus.default_corpus(cfg.samples, seed=cfg.seed)


def prepare_data(
    target: Model, cfg: TrainConfig, layer_ids: Sequence[int], group: Group, progress: bool
) -> list[TrainingSequence]:
    """Every training sequence; with cached features they are loaded, online they come without."""
    data = cfg.out / "data"
    answer = functools.partial(
        generate_responses,
        target,
        prompts_for(cfg),
        data / ("responses.jsonl" if group.world == 1 else f"responses.rank{group.rank}.jsonl"),
        cfg.max_new_tokens,
        cfg.max_prompt_tokens,
        cfg.temperature,
        cfg.greedy_share,
        cfg.generation_batch,
        cfg.seed,
    )
    pairs = answer(progress, (group.rank, group.world))
    group.barrier()
    if group.world > 1:  # every process's answers, now that all are written
        pairs = answer(False, (group.rank, group.world))
    return _sequences(target, cfg, pairs, layer_ids, "features", group, progress)


def _sequences(
    target: Model,
    cfg: TrainConfig,
    pairs: dict[int, tuple[list[int], list[int]]],
    layer_ids: Sequence[int],
    name: str,
    group: Group,
    progress: bool,
) -> list[TrainingSequence]:
    """The sequences of ``pairs`` (in index order): online, as they are; otherwise with their
    features, cached under ``out/data/<name>-<layers>`` (each process caching its share)."""
    if _online(cfg):
        kept = [(p, r) for p, r in pairs.values() if len(r) >= 2]
        return [TrainingSequence(torch.tensor(p + r), len(p)) for p, r in kept]
    directory = cfg.out / "data" / f"{name}-{'-'.join(map(str, layer_ids))}"
    mine = {i: pair for i, pair in pairs.items() if i % group.world == group.rank}
    cache_features(target, mine, layer_ids, directory, progress)
    group.barrier()
    files = [directory / f"{i:05d}.safetensors" for i in pairs]
    return load_sequences([f for f in files if f.is_file()])


def _online(cfg: TrainConfig) -> bool:
    """Whether features are computed on the fly (``features="online"``, or ``"auto"`` on CUDA)."""
    if cfg.features == "auto":
        return resolve_device(cfg.device).type == "cuda"
    return cfg.features == "online"


def prepare_onpolicy(
    target: Model, cfg: TrainConfig, layer_ids: Sequence[int], group: Group, progress: bool
) -> list[TrainingSequence]:
    """The ``cfg.refine`` drafter's own runs on the prompts: the target's greedy answers, their
    features, and the anchors where that drafter's blocks were rejected (collected by the first
    process)."""
    assert cfg.refine is not None
    drafted = target.with_drafter(str(cfg.refine))
    prompts = [encode_prompt(target.tokenizer, p)[-cfg.max_prompt_tokens :] for p in prompts_for(cfg)]
    record = cfg.out / "data" / "onpolicy.jsonl"
    if group.main:
        onpolicy.collect(drafted, prompts, record, cfg.max_new_tokens, progress)
    group.barrier()
    runs = onpolicy.collect(drafted, prompts, record, cfg.max_new_tokens, False)  # every run is recorded now
    usable = {i: (run.prompt, run.response) for i, run in enumerate(runs) if len(run.response) >= 2}
    sequences = _sequences(target, cfg, usable, layer_ids, "features-onpolicy", group, progress)
    errors = [torch.tensor(runs[i].errors(), dtype=torch.long) for i in usable]
    return [replace(seq, errors=e) for seq, e in zip(sequences, errors, strict=True)]


def refined_drafter(spec: DFlashSpec, target: Model, checkpoint: Path) -> DFlashModel:
    """The drafter at ``checkpoint`` as a trainable model."""
    model = DFlashModel.from_zlab_state(spec, load_safetensors(checkpoint), target.max_context + 128, torch.float32)
    return model.to(target.device).train().requires_grad_(True)


def train_drafter(cfg: TrainConfig, progress: bool = True) -> Path:
    """Run (or resume) a training; return the exported drafter directory.

    Under ``torchrun`` each process answers and trains on its share of the prompts, gradients are
    averaged across processes and the first one writes checkpoints and the export."""
    group = distributed.join(cfg.device)
    try:
        return _train(cfg, group, progress and group.main)
    finally:
        distributed.leave(group)


def _train(cfg: TrainConfig, group: Group, progress: bool) -> Path:
    started = time.monotonic()  # max_minutes counts from here: loading and data included
    dtype = "bfloat16" if cfg.precision == "bf16" else "auto"
    target = load(cfg.target, device=group.device(cfg.device), dtype=dtype)
    if cfg.refine is not None:
        config = json.loads((cfg.refine / "config.json").read_text())
    else:
        config = drafter_config(target, cfg)
    spec = DFlashSpec.from_config(config)
    spec.check_target(target.target.spec)
    layer_ids = spec.target_layer_ids
    if cfg.refine is not None:  # what the loss weights and blocks need is the refined drafter's block
        cfg = replace(cfg, block_size=spec.block_size)
        sequences = prepare_onpolicy(target, cfg, layer_ids, group, progress)
    else:
        sequences = prepare_data(target, cfg, layer_ids, group, progress)
    if not sequences:
        raise DrafterError("no training sequences: every response was shorter than two tokens.")
    mine = sequences[group.rank :: group.world] or sequences
    if cfg.refine is not None:
        model = refined_drafter(spec, target, cfg.refine)
    else:
        model = new_drafter(spec, target, cfg.seed, cfg.init)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.95))
    checkpoints = _Checkpoints(cfg.out / "checkpoints", cfg.keep_every)
    start, history = 0, []
    latest = checkpoints.latest()
    if latest is not None:
        saved = checkpoints.restore(latest, model, optimizer)
        start, history = int(saved["step"]), list(saved.get("history", []))
    drafting_net: torch.nn.Module = _Drafting(model, target)
    if group.world > 1:  # gradients averaged across processes (the module's device: no device_ids)
        drafting_net = DistributedDataParallel(drafting_net)
    weights = position_weights(cfg.block_size, cfg.loss_gamma).to(target.device)
    if cfg.refine is not None:  # the refined drafter keeps its drafting vocabulary
        drafting = read_draft_vocab(cfg.refine)
    else:
        drafting = drafting_vocab(cfg, sequences, spec.vocab_size)
    fixed_index = None
    if drafting is not None:  # the softmax runs over exactly the tokens the drafter will draft
        drafting = drafting.to(target.device)
        fixed_index = position_index(drafting, spec.vocab_size)
    sampled = drafting is None and cfg.negatives >= 0
    data_ids = torch.unique(torch.cat([q.ids for q in sequences])) if sampled else None
    rng = random.Random(cfg.seed * 1_000_003 + start + 7_919 * group.rank)
    generator = torch.Generator().manual_seed(cfg.seed * 7_919 + start + 104_729 * group.rank)
    online = _online(cfg)
    autocast = torch.autocast(target.device.type, dtype=torch.bfloat16, enabled=cfg.precision == "bf16")
    began = time.monotonic()
    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, disable=not progress, desc="train")
    for step in bar:
        for group_ in optimizer.param_groups:
            group_["lr"] = cfg.lr * _lr_factor(step, cfg.steps, cfg.warmup)
        tally = torch.zeros(2 * (cfg.block_size - 1) + 1, device=target.device)  # correct, counted, loss
        for micro in range(cfg.accumulate):
            picked = [mine[rng.randrange(len(mine))] for _ in range(cfg.batch)]
            if online:
                picked = with_features(target, picked, layer_ids)
            batch = _blocks(cfg, spec.mask_token_id, picked, rng, generator)
            labels = batch.blocks.labels.to(target.device)
            if drafting is not None and fixed_index is not None:  # labels outside it are not learnt
                labels = torch.where(labels >= 0, fixed_index[labels.clamp(min=0)], labels)
                vocab: torch.Tensor | None = drafting
            elif data_ids is not None:  # labels as positions in the sampled vocabulary
                vocab = sampled_vocab(data_ids, spec.vocab_size, cfg.negatives, generator).to(target.device)
                index = position_index(vocab, spec.vocab_size)
                labels = torch.where(labels >= 0, index[labels.clamp(min=0)], labels)
            else:
                vocab = None
            last = micro + 1 == cfg.accumulate
            sync = contextlib.nullcontext() if last or group.world == 1 else drafting_net.no_sync()  # type: ignore[operator]
            with sync:
                with autocast:
                    logits = drafting_net(batch, vocab)
                    loss, c, n = weighted_loss(logits, labels, weights)
                (loss / cfg.accumulate).backward()  # type: ignore[no-untyped-call]
            tally += torch.cat([c, n, (loss.detach() / cfg.accumulate)[None]])
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        over_time = cfg.max_minutes is not None and time.monotonic() - started > 60 * cfg.max_minutes
        tally = group.sum(torch.cat([tally, torch.tensor([float(over_time)], device=tally.device)])).cpu()
        k = cfg.block_size - 1
        correct, counted, total_loss = tally[:k], tally[k : 2 * k], float(tally[2 * k]) / group.world
        accuracy = (correct / counted.clamp(min=1)).tolist()
        seconds = round(time.monotonic() - began, 3)  # since this run (or resumption) began training
        history.append(
            {"step": step + 1, "loss": total_loss, "accuracy": accuracy, "labels": counted.tolist(), "seconds": seconds}
        )
        bar.set_postfix(loss=f"{total_loss:.3f}", acc=" ".join(f"{a:.2f}" for a in accuracy[:4]))
        stop = float(tally[-1]) > 0  # any process out of time: all stop at this step
        if group.main and ((step + 1) % cfg.checkpoint_every == 0 or step + 1 == cfg.steps or stop):
            checkpoints.save(step + 1, model, optimizer, {"history": history})
        if stop:
            break
    bar.close()
    coverage = cfg.draft_vocab_coverage
    if cfg.refine is not None and drafting is not None:
        coverage = float(json.loads((cfg.refine / DRAFT_VOCAB_FILE).read_text()).get("coverage", coverage))
    directory = cfg.out / "drafter"
    if group.main:
        dtype_out = torch.bfloat16 if cfg.export_dtype == "bfloat16" else torch.float32
        with writing("the trained drafter", directory):
            export(model, config, directory, history, drafting, coverage, dtype_out, cfg.max_shard_mib)
    group.barrier()
    return directory


def _blocks(
    cfg: TrainConfig,
    mask_id: int,
    sequences: Sequence[TrainingSequence],
    rng: random.Random,
    generator: torch.Generator,
) -> Batch:
    """Random training blocks of ``sequences`` (all plain, or all pre-draft layouts with the same
    number of clean tokens) packed into one ``Batch``; a sequence too short for a pre-draft is left
    out, and if all are, the blocks are plain ones (every sequence has at least one of those)."""
    predraft = rng.random() < cfg.predraft
    clean = rng.randint(2, cfg.block_size) if predraft else 1
    for layout_clean in (clean, 1):
        kept, parts = [], []
        for seq in sequences:
            anchors = sample_anchors(seq.prompt_len, seq.ids.shape[0], cfg.anchors, layout_clean, generator)
            if layout_clean == 1 and seq.errors.numel() > 0 and cfg.replay > 0:  # where the refined drafter was wrong
                valid = seq.errors[(seq.errors >= seq.prompt_len) & (seq.errors <= seq.ids.shape[0] - 2)]
                picked = valid[torch.randperm(valid.numel(), generator=generator)][: round(cfg.replay * cfg.anchors)]
                anchors = mix_anchors(anchors, picked, cfg.anchors)
            if anchors.numel() == 0:
                continue
            follows = seq.greedy if cfg.labels == "greedy" else None
            kept.append(seq)
            parts.append(layout(seq.ids, anchors, layout_clean, cfg.block_size, mask_id, follows))
        if parts:
            return batch_of(kept, parts)
    raise DrafterError("a training sequence has no block to learn (responses shorter than two tokens).")


def position_index(vocab: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Each token id's position in ``vocab`` (-100, ignored by the loss, for tokens outside it)."""
    index = torch.full((vocab_size,), -100, dtype=torch.long, device=vocab.device)
    index[vocab] = torch.arange(vocab.numel(), device=vocab.device)
    return index


def drafting_vocab(cfg: TrainConfig, sequences: Sequence[TrainingSequence], vocab_size: int) -> torch.Tensor | None:
    """The tokens making up ``cfg.draft_vocab_coverage`` of the labels (``None`` at coverage 1)."""
    if cfg.draft_vocab_coverage >= 1.0:
        return None
    greedy = cfg.labels == "greedy"  # online features: the argmax is not known yet, the responses stand in
    labels = (
        q.greedy[q.prompt_len - 1 : -1] if greedy and q.greedy.numel() else q.ids[q.prompt_len :] for q in sequences
    )
    return covering_vocab(labels, vocab_size, cfg.draft_vocab_coverage)


def export(
    model: DFlashModel,
    config: dict[str, Any],
    directory: Path,
    history: list[dict[str, Any]],
    vocab: torch.Tensor | None = None,
    coverage: float = 1.0,
    dtype: torch.dtype = torch.float32,
    max_shard_mib: float | None = None,
) -> Path:
    """Write the drafter in the z-lab format (``config.json`` + ``model.safetensors``, in ``dtype``;
    sharded with a ``model.safetensors.index.json`` when larger than ``max_shard_mib``), and its
    drafting vocabulary (``draft_vocab.json``, read by dflash2 only) when there is one."""
    directory.mkdir(parents=True, exist_ok=True)
    for stale in (*directory.glob("model*.safetensors"), directory / "model.safetensors.index.json"):
        stale.unlink(missing_ok=True)
    ours = {k: v.detach().to("cpu", dtype).contiguous() for k, v in model.state_dict().items()}
    state = ours_to_zlab(model.spec, ours)
    limit = round(max_shard_mib * 2**20) if max_shard_mib is not None else 2**50
    pattern = "model{suffix}.safetensors"
    split = split_torch_state_dict_into_shards(state, filename_pattern=pattern, max_shard_size=limit)
    for filename, names in split.filename_to_tensors.items():
        save_file({name: state[name] for name in names}, str(directory / filename), metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    dtype_name = str(dtype).removeprefix("torch.")
    config = {**model.spec.portable_config(config), "torch_dtype": dtype_name, "dtype": dtype_name}
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (directory / "training_log.json").write_text(json.dumps(history) + "\n")
    vocab_file = directory / DRAFT_VOCAB_FILE
    if vocab is not None:
        record = {"coverage": coverage, "token_ids": [int(i) for i in vocab.cpu()]}
        vocab_file.write_text(json.dumps(record) + "\n")
    elif vocab_file.is_file():
        vocab_file.unlink()
    return directory
