"""``dflash2 check-drafter``: what a DFlash checkpoint says, whether its weights are all there,
and whether it fits a target, read from the files' headers without loading any weights."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from dflash2.drafters.dflash import DFlashModel, DFlashSpec, ours_to_zlab
from dflash2.drafters.vocabulary import check_vocab, read_draft_vocab
from dflash2.errors import DFlash2Error, DrafterError
from dflash2.runtime.loader import load_hf_config, read_config, resolve_checkpoint, safetensors_files
from dflash2.runtime.spec import ModelSpec, rope_parameters_of


@dataclass(frozen=True)
class DrafterCheck:
    """What the checkpoint says (``facts``, in reading order) and what is wrong (``problems``)."""

    facts: dict[str, str]
    problems: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return not self.problems

    def render(self) -> str:
        width = max(len(k) for k in self.facts)
        lines = [f"{k:<{width}}  {v}" for k, v in self.facts.items()]
        if self.problems:
            lines += ["", "problems:", *(f"  - {p}" for p in self.problems)]
        else:
            lines += ["", "ok: " + ("it fits the target." if "target" in self.facts else "the checkpoint is complete.")]
        return "\n".join(lines)


def check_drafter(drafter: str | os.PathLike[str], target: str | os.PathLike[str] | None = None) -> DrafterCheck:
    """Read the DFlash checkpoint ``drafter`` (a directory or hub id) and, given ``target``, check it fits."""
    checkpoint = resolve_checkpoint(drafter)
    raw = read_config(checkpoint)
    if not DFlashSpec.is_dflash_config(raw):
        raise DrafterError(
            f"{checkpoint} is not a DFlash drafter (no dflash_config and no DFlash architecture in config.json); "
            "an autoregressive draft model needs no check beyond sharing the target's tokenizer."
        )
    spec = DFlashSpec.from_config(raw)
    facts = {
        "checkpoint": str(checkpoint),
        "format": f"DFlash{'2' if spec.version == 2 else ''} (z-lab)",
        "block size": f"{spec.block_size} (drafts up to {spec.block_size - 1} tokens a step)",
        "mask token id": str(spec.mask_token_id),
        "target layers": f"{list(spec.target_layer_ids)}"
        + (f" (derived from num_target_layers={spec.num_target_layers})" if spec.layers_derived else ""),
        "trained for": f"{spec.num_target_layers}-layer targets" if spec.num_target_layers else "not recorded",
        "hidden size": str(spec.hidden_size),
        "drafter layers": ", ".join(_layer(c, w) for c, w in zip(spec.causal, spec.sliding_windows, strict=True)),
        "vocabulary": str(spec.vocab_size),
        "RoPE": _rope(spec),
    }
    if spec.version == 2:
        facts["DFlash2"] = (
            f"convolution kernel {spec.conv_kernel_size} (groups of {spec.conv_group_size}), "
            f"selector top-{spec.selector_top_k} rank {spec.selector_rank}"
        )
    problems = _weights(spec, checkpoint)
    vocab = None
    try:
        vocab = read_draft_vocab(checkpoint)
        facts["drafting vocabulary"] = "the whole vocabulary" if vocab is None else f"{len(vocab)} tokens"
    except DrafterError as err:
        problems.append(str(err))
    if target is not None:
        t = ModelSpec.from_hf_config(load_hf_config(resolve_checkpoint(target)))
        shape = f"{t.model_type}, {t.num_layers} layers, hidden {t.hidden_size}, vocab {t.vocab_size}"
        facts["target"] = f"{target}: {shape}"
        problems += spec.misfits(t)
        if vocab is not None:
            try:
                check_vocab(vocab, t.vocab_size)
            except DrafterError as err:
                problems.append(str(err))
    return DrafterCheck(facts, problems)


def _layer(causal: bool, window: int | None) -> str:
    kind = "causal" if causal else "bidirectional"
    return f"{kind}, window {window}" if window is not None else kind


def _rope(spec: DFlashSpec) -> str:
    params = rope_parameters_of(spec.hf_config)
    extra = {k: v for k, v in params.items() if k not in ("rope_theta", "rope_type", "type")}
    return f"{params['rope_type']}, theta {float(params['rope_theta']):g}" + (f", {extra}" if extra else "")


def _weights(spec: DFlashSpec, checkpoint: Path) -> list[str]:
    """Missing, unexpected or misshapen tensors, from the safetensors headers."""
    try:
        names = safetensors_files(checkpoint)
    except DFlash2Error as err:
        return [str(err)]
    found: dict[str, tuple[int, ...]] = {}
    for name in names:
        try:
            with safe_open(str(checkpoint / name), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    found[key] = tuple(f.get_slice(key).get_shape())
        except (OSError, SafetensorError) as err:
            return [f"{checkpoint / name} cannot be read ({err}); download it again"]
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in ours_to_zlab(spec, DFlashModel(spec, 8).state_dict()).items()}
    for codebook in ("predecessor_codebook", "successor_codebook"):  # stored with or without ".weight"
        key = f"candidate_selector.{codebook}"
        if key + ".weight" in found and key in expected:
            expected[key + ".weight"] = expected.pop(key)
    problems = []
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    wrong = sorted(k for k in set(expected) & set(found) if expected[k] != found[k])
    if missing:
        problems.append(f"{len(missing)} weights missing, e.g. {missing[:3]}")
    if unexpected:
        problems.append(f"{len(unexpected)} weights the config does not explain, e.g. {unexpected[:3]}")
    for key in wrong[:3]:
        problems.append(f"{key} has shape {list(found[key])}, the config implies {list(expected[key])}")
    return problems
