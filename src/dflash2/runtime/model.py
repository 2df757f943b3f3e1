"""A Llama / Qwen2 / Qwen3 / Qwen3-MoE decoder on ``scaled_dot_product_attention`` with a static KV cache.

One readable file in the spirit of gpt-fast: RMSNorm, RoPE, grouped-query attention (with
q/k-norm for Qwen3), SwiGLU MLP (or a mixture of SwiGLU experts, ``runtime.moe``), tied or
untied LM head. q/k/v and gate/up projections are
fused into one matrix each. The forward takes a block of T new tokens at once (prefill,
decoding, verification of a draft), writes their keys/values into the cache and can return
the hidden states of chosen layers for exactly those tokens.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from dflash2.runtime.kv_cache import KVCache
from dflash2.runtime.linear import Linear, pack_linears
from dflash2.runtime.moe import SparseMoE
from dflash2.runtime.quant import WeightFormat, quantize_linears
from dflash2.runtime.spec import ModelSpec
from dflash2.runtime.workers import one_thread


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm bit-identical to transformers: fp32 statistics, weight applied in the input dtype."""
    if x.dtype == torch.float32:  # the fused kernel gives the same bits in fp32
        return F.rms_norm(x, weight.shape, weight, eps)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [B, T, H, D] by the tables [T, 1, D] of its positions.

    Equals transformers' ``x * cos + rotate_half(x) * sin``: ``rotate_half(x)`` is ``roll(x)``
    with the first half negated, and that sign lives in ``signed_sin`` instead.
    """
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def block_causal_mask(start: int, new: int, device: torch.device) -> torch.Tensor | None:
    """Boolean mask [new, start + new]: token i of the block sees cache positions <= start + i."""
    if new == 1:
        return None
    cols = torch.arange(start + new, device=device)
    rows = torch.arange(start, start + new, device=device)
    return cols[None, :] <= rows[:, None]


def branch_positions(start: int, new: int, branches: Sequence[int], device: torch.device) -> torch.Tensor:
    """Positions [new] of a block whose last ``len(branches)`` rows are side branches (see
    :meth:`Decoder.forward`): the chain rows at ``start ..``, branch j at its chain row's position."""
    chain = new - len(branches)
    return torch.tensor([*range(start, start + chain), *(start + row for row in branches)], device=device)


def branch_mask(start: int, positions: torch.Tensor) -> torch.Tensor:
    """Boolean mask [T, start + T] of a block at ``positions`` (:func:`branch_positions`): each row
    sees the cache slots before its position and its own slot (``start + row``), so the chain rows
    are causal and branch j sees the cache, the chain rows before its chain row, and itself."""
    new = positions.shape[0]
    cols = torch.arange(start + new, device=positions.device)
    own = torch.arange(start, start + new, device=positions.device)
    return (cols[None, :] < positions[:, None]) | (cols[None, :] == own[:, None])


@dataclass(frozen=True)
class Part:
    """The rows of a forward's block that belong to one cache: its keys and values go there, and
    its queries attend over that cache only (under ``mask``). A plain forward is one part of all
    rows; a packed forward (:meth:`Decoder.forward_packed`) has one per request."""

    cache: KVCache
    rows: slice
    mask: torch.Tensor | None  # as ``attend`` takes it: made once per forward by ``grouped_mask``
    positions: torch.Tensor | None = None  # static steps: where the keys go (see ``KVCache.write``)
    rows_alone: bool = False  # attention row by row (:func:`attend_rows`): a quantized target's eager causal parts
    branches: tuple[int, ...] = ()  # the chain rows the last rows branch from (see ``Decoder.forward``)


class RotaryTable(nn.Module):
    """cos/sin for every position up to the context length, precomputed once."""

    def __init__(self, inv_freq: torch.Tensor, scaling: float, max_positions: int, dtype: torch.dtype) -> None:
        super().__init__()
        with torch.device("cpu"):  # real values even when the model is built on "meta"
            inv_freq = inv_freq.to("cpu")
            positions = torch.arange(max_positions, dtype=torch.int64).float()
            freqs = positions[:, None] * inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            cos = (emb.cos() * scaling).to(dtype)
            sin = (emb.sin() * scaling).to(dtype)
            half = sin.shape[-1] // 2
            signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        self.cos: torch.Tensor
        self.signed_sin: torch.Tensor
        self.register_buffer("cos", cos[:, None, :], persistent=False)
        self.register_buffer("signed_sin", signed_sin[:, None, :], persistent=False)

    def forward(self, start: int, new: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tables [new, 1, head_dim] for positions ``start .. start + new - 1``."""
        return self.cos[start : start + new], self.signed_sin[start : start + new]

    def at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Tables [..., N, 1, head_dim] for arbitrary ``positions`` [..., N] (several blocks at once, static steps).

        Positions past the table get its last row: only a static step's padding goes there.
        """
        positions = positions.clamp_max(self.cos.shape[0] - 1)
        return self.cos[positions], self.signed_sin[positions]


def grouped_mask(mask: torch.Tensor | None, group: int, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean ``mask`` [..., T, S] (True = visible) in the form :func:`attend` takes as is:
    repeated for the ``group`` query heads that share a kv head, as an additive ``dtype`` mask (0
    where visible, -inf elsewhere: what SDPA makes of a boolean mask). A forward makes it once for
    all its layers instead of every layer repeating and converting it."""
    if mask is None:
        return None
    if group > 1:
        mask = mask.repeat(*([1] * (mask.dim() - 2)), group, 1)
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Grouped-query attention through SDPA: q [B, T, H, D], keys/values [B, KV, S, D] -> [B, T, H * D].

    The query heads sharing a kv head are folded into the query axis, [B, KV, group * T, D], so
    keys are never repeated. ``mask``: boolean [..., T, S] (True = visible), repeated here to
    match, or already in that shape (:func:`grouped_mask`, a floating-point mask).
    """
    b, t, h, d = q.shape
    kvh = keys.shape[1]
    group = h // kvh
    q = q.reshape(b, t, kvh, group, d).permute(0, 2, 3, 1, 4).reshape(b, kvh, group * t, d)
    if mask is not None and group > 1 and mask.dtype == torch.bool:
        mask = mask.repeat(*([1] * (mask.dim() - 2)), group, 1)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
    return out.view(b, kvh, group, t, d).permute(0, 3, 1, 2, 4).reshape(b, t, h * d)


def attend_rows(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, branches: Sequence[int] = ()
) -> torch.Tensor:
    """Causal attention one query row at a time over exactly the keys it sees, the last T of
    ``keys`` being the rows' own: each row gets the bits a one-token forward gives it, whatever
    the number of rows (SDPA's kernels round by the shapes they are given). ``branches``: the
    last rows are side branches (see :meth:`Decoder.forward`), each attending over the keys
    before its chain row and then its own key, as a one-token forward at its position would. SDPA
    runs on one thread here: its CPU kernel rounds a row by how many threads share the work, and
    the number of threads computing a forward changes as the engine measures (``runtime.threads``)."""
    t, s = q.shape[1], keys.shape[2]
    with one_thread():
        if t == 1:
            return attend(q, keys, values, None)
        chain = t - len(branches)
        seen = [s - t + i + 1 for i in range(chain)]
        rows = [attend(q[:, i : i + 1], keys[:, :, :n], values[:, :, :n], None) for i, n in enumerate(seen)]
        for j, row in enumerate(branches):
            before, own = s - t + row, s - len(branches) + j
            k = torch.cat((keys[:, :, :before], keys[:, :, own : own + 1]), dim=2)
            v = torch.cat((values[:, :, :before], values[:, :, own : own + 1]), dim=2)
            rows.append(attend(q[:, chain + j : chain + j + 1], k, v, None))
    return torch.cat(rows, 1)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.eps = spec.rms_norm_eps
        qkv_out = (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
        self.qkv = Linear(spec.hidden_size, qkv_out, bias=spec.attention_bias)
        self.o = Linear(spec.num_heads * spec.head_dim, spec.hidden_size, bias=False)
        self.q_norm = nn.Parameter(torch.ones(spec.head_dim)) if spec.qk_norm else None
        self.k_norm = nn.Parameter(torch.ones(spec.head_dim)) if spec.qk_norm else None

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], parts: Sequence[Part], layer: int
    ) -> torch.Tensor:
        """Projections over all rows at once (one read of the weights); attention part by part."""
        b, t, _ = x.shape
        h, kvh = self.num_heads, self.num_kv_heads
        qkv = self.qkv(x).view(b, t, h + 2 * kvh, self.head_dim)
        qk, v = qkv[:, :, : h + kvh], qkv[:, :, h + kvh :]
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qk.split([h, kvh], dim=2)
            qk = torch.cat((rms_norm(q, self.q_norm, self.eps), rms_norm(k, self.k_norm, self.eps)), dim=2)
        qk = apply_rope(qk, *rope)  # q and k rotated in one go
        q, k = qk[:, :, :h], qk[:, :, h:]
        outs = []
        for part in parts:
            rows = part.rows
            keys, values = part.cache.write(
                layer, k[:, rows].transpose(1, 2), v[:, rows].transpose(1, 2), part.positions
            )
            if part.rows_alone:
                outs.append(attend_rows(q[:, rows], keys, values, part.branches))
            else:
                outs.append(attend(q[:, rows], keys, values, part.mask))
        return self.o(outs[0] if len(outs) == 1 else torch.cat(outs, dim=1))


class MLP(nn.Module):
    """SwiGLU with gate and up fused into one projection."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up = Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, index: int = 0) -> None:
        super().__init__()
        self.eps = spec.rms_norm_eps
        self.attn_norm = nn.Parameter(torch.ones(spec.hidden_size))
        self.attn = Attention(spec)
        self.mlp_norm = nn.Parameter(torch.ones(spec.hidden_size))
        self.mlp: MLP | SparseMoE
        if spec.moe is not None and spec.sparse(index):
            m = spec.moe
            self.mlp = SparseMoE(spec.hidden_size, m.intermediate_size, m.experts, m.top_k, m.normalize)
        else:
            self.mlp = MLP(spec.hidden_size, spec.intermediate_size)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], parts: Sequence[Part], layer: int
    ) -> torch.Tensor:
        x = x + self.attn(rms_norm(x, self.attn_norm, self.eps), rope, parts, layer)
        return x + self.mlp(rms_norm(x, self.mlp_norm, self.eps))


@dataclass
class ForwardOutput:
    """Logits of the requested positions and the captured hidden states."""

    logits: torch.Tensor | None  # [B, T or 1, vocab]
    hidden: torch.Tensor | None  # [B, T, len(capture) * hidden], outputs of the captured layers


class Decoder(nn.Module):
    """The whole causal LM. Build with :meth:`from_hf_state`, run with :meth:`forward`."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.spec = spec
        self.weights: WeightFormat = "same"  # see quantize
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, i) for i in range(spec.num_layers))
        self.norm = nn.Parameter(torch.ones(spec.hidden_size))
        self.lm_head = Linear(spec.hidden_size, spec.vocab_size)
        if spec.tie_word_embeddings:
            self.lm_head.weight = cast(nn.Parameter, self.embed_tokens.weight)
        self.rope = RotaryTable(*spec.rope_inv_freq(), spec.max_position_embeddings, dtype)
        self.to(dtype)

    @property
    def device(self) -> torch.device:
        return self.norm.device

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.dtype

    def new_cache(self, capacity: int, batch: int = 1, zeroed: bool = False) -> KVCache:
        s = self.spec
        return KVCache(
            s.num_layers, s.num_kv_heads, s.head_dim, capacity,
            batch=batch, dtype=self.dtype, device=self.device, zeroed=zeroed,
        )  # fmt: skip

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def pack(self) -> None:
        """Pre-pack every projection for fast inference and drop the plain copies (see
        :mod:`dflash2.runtime.linear`), bf16 ones too; the LM head keeps its weight (drafters may
        share it)."""
        pack_linears(self, release=True, keep=(self.lm_head,))

    def quantize(self, fmt: WeightFormat) -> None:
        """Hold every projection and the LM head in ``fmt`` (:mod:`dflash2.runtime.quant`; loading
        through the cache: :func:`dflash2.runtime.packed.load_quantized`); call before :meth:`pack`.
        Its kernels round a row differently by how many rows they multiply, so every row must get
        the bits it gets alone: the projections are checked for that, and attention then runs row by
        row (:func:`attend_rows`). Verifying a block of drafts thus computes each token exactly as
        decoding it alone would. ``weights`` says which format the rows are computed alone for."""
        quantize_linears(self, fmt)
        self.weights = fmt

    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden, self.norm, self.spec.rms_norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor,
        cache: KVCache,
        *,
        logits: str = "all",
        capture: Sequence[int] = (),
        visible: torch.Tensor | None = None,
        start: torch.Tensor | None = None,
        branches: Sequence[int] = (),
    ) -> ForwardOutput:
        """Run T new tokens [B, T] after the ``cache.length`` cached ones and advance the cache.

        ``logits``: ``"all"`` (every new position), ``"last"`` or ``"none"``.
        ``capture``: layer ids whose outputs are returned for the new tokens, concatenated along
        the feature axis; layer i gives transformers' ``hidden_states[i + 1]`` (so the last
        layer's comes after the final norm, as there).
        ``visible``: [B, cache.length + T] bool, False at padding (batched generation of prompts
        of different lengths, left-padded); a padding token still sees itself.
        ``start``: the static step (see ``runtime.graphs``): a device tensor holding the cache
        length, 0-dim, or [B] for a cache whose rows hold different lengths (a packed static
        step). The tokens go at ``start ..``, attention covers the whole cache under a mask, and
        nothing on the host is read or changed (``cache.length`` is the caller's), so the same
        kernels serve every length and a CUDA graph can replay them.
        ``branches``: the last ``len(branches)`` tokens are side branches of the block's chain
        (the rows before them, causal as usual): branch j stands in for chain row
        ``branches[j]`` (≥ 1), at its position, seeing what that row sees but the row itself
        (a verify forward that checks a drafter's second choices beside its draft). Their keys
        and values go to the cache after the chain's; the caller keeps or moves what it accepts.
        """
        new = input_ids.shape[1]
        if branches and (start is not None or visible is not None or len(branches) >= new):
            raise ValueError("side branches need an eager forward without padding, after at least one chain row")
        x = self.embed(input_ids)
        positions: torch.Tensor | None = None
        if start is not None:
            if visible is not None:
                raise ValueError("a static step takes no padding mask")
            positions = start[..., None] + torch.arange(new, device=x.device)  # [T] or [B, T]
            rope = self.rope.at(positions)
            seen = torch.arange(cache.capacity, device=x.device) <= positions[..., None]
            mask: torch.Tensor | None = seen[:, None] if positions.dim() == 2 else seen  # [B, 1, T, S]: row by row
        else:
            begin = cache.length
            cache.check_room(new)
            if branches:
                at = branch_positions(begin, new, branches, x.device)
                rope, mask = self.rope.at(at), branch_mask(begin, at)
            else:
                rope = self.rope(begin, new)
                mask = block_causal_mask(begin, new, x.device)
            if visible is not None:
                keys = torch.arange(begin + new, device=x.device)
                itself = keys[None, :] == torch.arange(begin, begin + new, device=x.device)[:, None]
                causal = mask if mask is not None else torch.ones_like(itself)
                mask = (causal & visible[:, None, None, :]) | itself
        alone = self.weights != "same" and visible is None and start is None
        parts = [Part(cache, slice(None), self._grouped(mask), positions, rows_alone=alone, branches=tuple(branches))]
        x, normed, hidden = self._layers(x, rope, parts, capture, logits == "all")
        if start is None:
            cache.advance(new)
        if logits == "none":
            return ForwardOutput(None, hidden)
        if logits == "last":
            normed = self.final_norm(x[:, -1:]) if normed is None else normed[:, -1:]
        assert normed is not None
        return ForwardOutput(self.lm_head(normed), hidden)

    def _grouped(self, mask: torch.Tensor | None) -> torch.Tensor | None:
        return grouped_mask(mask, self.spec.num_heads // self.spec.num_kv_heads, self.dtype)

    def _layers(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        parts: Sequence[Part],
        capture: Sequence[int],
        normalize: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Every layer over ``x``: the last hidden state, its final norm (if ``normalize`` or the
        last layer is captured; else ``None``) and the captured features (or ``None``)."""
        wanted = set(capture)
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, parts, i)
            if i in wanted:
                captured[i] = x
        last = len(self.layers) - 1
        normed = self.final_norm(x) if normalize or last in wanted else None
        if normed is not None and last in wanted:
            captured[last] = normed  # transformers' last hidden state is after the final norm
        hidden = torch.cat([captured[i] for i in capture], dim=-1) if capture else None
        return x, normed, hidden

    def forward_packed(
        self, blocks: Sequence[tuple[torch.Tensor, KVCache, bool]], capture: Sequence[int] = ()
    ) -> list[ForwardOutput]:
        """Several requests' new tokens in one forward: ``(ids [T], cache, all_logits)`` each.

        The weights are read once for all rows (the projections and the LM head run over the
        packed block); each request's tokens attend over its own cache, as a forward of its own
        would, and its cache advances by T. Outputs per block: logits [1, T, vocab] (or [1, 1,
        vocab] for the last position only, ``all_logits=False``: a prefill) and the captured
        features [1, T, F].
        """
        device = self.device
        sizes = [int(ids.shape[0]) for ids, _, _ in blocks]
        caches = [cache for _, cache, _ in blocks]
        for cache, size in zip(caches, sizes, strict=True):
            cache.check_room(size)
        bounds = [0, *itertools.accumulate(sizes)]
        parts = [
            Part(
                cache,
                slice(bounds[i], bounds[i + 1]),
                self._grouped(block_causal_mask(cache.length, n, device)),
                rows_alone=self.weights != "same",
            )
            for i, (cache, n) in enumerate(zip(caches, sizes, strict=True))
        ]
        positions = torch.cat(
            [torch.arange(p.cache.length, p.cache.length + n, device=device) for p, n in zip(parts, sizes, strict=True)]
        )
        ids = torch.cat([ids.to(device) for ids, _, _ in blocks])[None]
        x, normed, hidden = self._layers(self.embed(ids), self.rope.at(positions), parts, capture, False)
        for cache, size in zip(caches, sizes, strict=True):
            cache.advance(size)
        rows: list[int] = []  # the rows whose logits are wanted, block after block
        for i, (_, _, every) in enumerate(blocks):
            rows += range(bounds[i], bounds[i + 1]) if every else [bounds[i + 1] - 1]
        counts = [size if every else 1 for size, (_, _, every) in zip(sizes, blocks, strict=True)]
        wanted = self.final_norm(x[:, rows]) if normed is None else normed[:, rows]
        logits = self.lm_head(wanted).split(counts, dim=1)
        return [
            ForwardOutput(logits[i], hidden[:, part.rows] if hidden is not None else None)
            for i, part in enumerate(parts)
        ]

    # ---------------------------------------------------------------- weights
    @classmethod
    def from_hf_state(
        cls, spec: ModelSpec, tensors: Mapping[str, torch.Tensor], dtype: torch.dtype, device: torch.device
    ) -> Decoder:
        """Build from transformers parameter names (``model.layers.0.self_attn.q_proj.weight``, ...)."""
        with torch.device("meta"):
            model = cls(spec, dtype)
        state = _fuse_hf_state(spec, tensors)
        model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True, assign=True)
        if spec.tie_word_embeddings:
            model.lm_head.weight = cast(nn.Parameter, model.embed_tokens.weight)
        if device.type != "cpu":  # the tensors were read to the CPU; weights left on "meta" stay there
            model = model.to(device)
        return model.eval().requires_grad_(False)


def _fuse_hf_state(spec: ModelSpec, t: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map transformers names onto ours, concatenating q/k/v and gate/up."""
    out: dict[str, torch.Tensor] = {
        "embed_tokens.weight": t["model.embed_tokens.weight"],
        "norm": t["model.norm.weight"],
    }
    out["lm_head.weight"] = out["embed_tokens.weight"] if spec.tie_word_embeddings else t["lm_head.weight"]
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        q = f"layers.{i}."
        out[q + "attn_norm"] = t[p + "input_layernorm.weight"]
        out[q + "mlp_norm"] = t[p + "post_attention_layernorm.weight"]
        out[q + "attn.qkv.weight"] = torch.cat([t[a + f"{n}_proj.weight"] for n in "qkv"])
        if spec.attention_bias:
            out[q + "attn.qkv.bias"] = torch.cat([t[a + f"{n}_proj.bias"] for n in "qkv"])
        out[q + "attn.o.weight"] = t[a + "o_proj.weight"]
        if spec.qk_norm:
            out[q + "attn.q_norm"] = t[a + "q_norm.weight"]
            out[q + "attn.k_norm"] = t[a + "k_norm.weight"]
        m = p + "mlp."
        if spec.sparse(i):
            out.update({q + "mlp." + k: v for k, v in _experts(spec, t, m).items()})
            continue
        out[q + "mlp.gate_up.weight"] = torch.cat([t[m + "gate_proj.weight"], t[m + "up_proj.weight"]])
        out[q + "mlp.down.weight"] = t[m + "down_proj.weight"]
    return out


def _experts(spec: ModelSpec, t: Mapping[str, torch.Tensor], m: str) -> dict[str, torch.Tensor]:
    """A sparse MLP's router and stacked experts, from per-expert names (``experts.3.gate_proj.weight``,
    as checkpoints on the hub store them) or from transformers 5's fused ``experts.gate_up_proj``."""
    assert spec.moe is not None
    out = {"router.weight": t[m + "gate.weight"]}
    if m + "experts.gate_up_proj" in t:
        out["gate_up"], out["down"] = t[m + "experts.gate_up_proj"], t[m + "experts.down_proj"]
        return out
    e = m + "experts."
    n = range(spec.moe.experts)
    out["gate_up"] = torch.stack([torch.cat([t[f"{e}{i}.gate_proj.weight"], t[f"{e}{i}.up_proj.weight"]]) for i in n])
    out["down"] = torch.stack([t[f"{e}{i}.down_proj.weight"] for i in n])
    return out
