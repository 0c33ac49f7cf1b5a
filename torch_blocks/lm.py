"""A whole language model in PyTorch, the twin of `flax_blocks.lm.LanguageModel`: the same
parts (declared once in `flax_blocks.core.lm_config`), the same torch names (embed.weight,
pos.weight, token_type.weight, embed_norm.*, encoder.*, head.*), so
`twin.load_state_dict(tb.to_tensors(fb.torch_state_dict(flax_lm)))` and
`fb.load_torch_state_dict(flax_lm, twin.state_dict())` move a model either way.

Token masks take Hugging Face's convention, as the Flax twin: attention_mask (B, T), 1 /
True = real token. `generate` is the twin's own cached greedy loop (one token per step).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from flax_blocks.core.config import BlockConfig, check_cache_window
from flax_blocks.core.declarations import Component
from flax_blocks.core.lm_config import OPTIONAL, LMConfig, Resolved, build_order, default_positions, resolve

from .layers import Linear, Norm, create_params
from .stacks import Encoder

Cache = dict[str, Any]


class Embedding(nn.Module):
    """A lookup table. Params: weight (rows, E)."""

    weight: nn.Parameter  # registered by create_params

    def __init__(self, cfg: BlockConfig, component: Component, *, generator: torch.Generator | None = None):
        super().__init__()
        create_params(self, component, cfg, generator)

    def forward(self, ids: Tensor) -> Tensor:
        return nn.functional.embedding(ids, self.weight)


_MODULES = {"embedding": Embedding, "norm": Norm, "linear": Linear}


def _check(ids: Tensor, mask: Tensor | None, vocab: int) -> Tensor | None:
    if ids.dim() != 2 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"input_ids must be an integer (batch, seq) tensor, got {ids.dtype} {tuple(ids.shape)}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ValueError(f"input_ids hold ids outside the vocabulary [0, {vocab})")
    if mask is None:
        return None
    if tuple(mask.shape) != tuple(ids.shape):
        raise ValueError(f"attention_mask must have the tokens' shape {tuple(ids.shape)}, got {tuple(mask.shape)}")
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("attention_mask must hold 1 (real token) and 0 (padding), HF's convention")
    if not bool((mask > 0).any(dim=1).all()):
        raise ValueError("attention_mask marks no real token in some row: 1 / True = real token (HF's convention)")
    return mask > 0


class LanguageModel(nn.Module):
    """Token embedding (+ learned positions, token types, embedding norm), the Encoder, and
    a head tied or not (see `flax_blocks.core.lm_config.LMConfig`)."""

    # Registered from lm_config.build_order (names and components); None: a part this model lacks (OPTIONAL).
    embed: Embedding
    project_in: Linear | None
    pos: Embedding | None
    token_type: Embedding | None
    embed_norm: Norm | None
    encoder: Encoder  # lm_config.ENCODER
    project_out: Linear | None
    head: Linear | None

    def __init__(self, cfg: BlockConfig, lm: LMConfig, *, generator: torch.Generator | None = None):
        super().__init__()
        self.cfg, self.lm = cfg, lm
        for name in OPTIONAL:
            setattr(self, name, None)
        for name, comp in build_order(lm, cfg):
            setattr(self, name, Encoder(cfg, num_layers=lm.num_layers, final_norm=lm.final_norm, generator=generator)
                    if comp is None else _MODULES[comp.kind](cfg, comp, generator=generator))

    def init_cache(self, batch_size: int, max_length: int) -> Cache:
        """The stack's cache, and the model's cache_window when it has one (`flax_blocks.lm`)."""
        check_cache_window(self.cfg, self.lm.cache_window)
        cache = self.encoder.init_cache(batch_size, max_length)
        if self.lm.cache_window is not None:
            cache["window"] = self.lm.cache_window
        return cache

    def hidden(self, input_ids: Tensor, attention_mask: Tensor | None = None, positions: Tensor | None = None,
               token_type_ids: Tensor | None = None, *, cache: Cache | None = None, return_intermediates: bool = False):
        """input_ids (B, T) -> last hidden state (B, T, E); with a cache, (hidden, cache);
        with return_intermediates, (hidden, intermediates) as the Flax twin's."""
        if return_intermediates and cache is not None:
            raise ValueError("return_intermediates is for calls without a cache")
        mask = _check(input_ids, attention_mask, self.lm.vocab_size)
        b, t = input_ids.shape
        low = 0  # a derived -1 (padding, OPT's and RoBERTa's default positions) reads row position_offset - 1
        if positions is None and cache is None and self.lm.default_positions != "arange" and (
                mask is not None or self.lm.default_positions == "ids"):
            real = mask
            if self.lm.default_positions == "ids":
                assert self.lm.pad_token_id is not None  # LMConfig pairs it with default_positions="ids"
                real = input_ids.ne(self.lm.pad_token_id)  # (!=, which torch's stubs type as bool)
            assert real is not None  # the condition above: a mask, or positions from the ids
            positions, low = default_positions(self.lm, real.long()), -1
        if positions is None:
            start = cache["position"][:, None] if cache is not None else torch.zeros(b, 1, dtype=torch.long)
            positions = start.to(input_ids.device) + torch.arange(t, device=input_ids.device)
        x = self.embed(input_ids)
        if self.lm.embed_scale is not None:  # HF's float32 buffer cast to the embeddings' dtype (Gemma)
            scale = torch.tensor(self.lm.embed_scale, dtype=torch.float32 if x.element_size() <= 4 else x.dtype)
            x = x * scale.to(x.dtype)
        if self.project_in is not None:  # OPT-350m: narrower embeddings, projected to the stack's width
            x = self.project_in(x)
        if self.pos is not None:
            limit = self.lm.max_positions
            assert limit is not None  # a position table (pos) comes with max_positions
            if int(positions.max()) >= limit or int(positions.min()) < low:
                raise ValueError(f"positions up to {int(positions.max())}, but the model has {limit} "
                                 "learned positions")
            x = x + self.pos(positions + self.lm.position_offset)
        if self.token_type is not None:
            x = x + self.token_type(torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids)
        if self.embed_norm is not None:
            x = self.embed_norm(x)
        padding = None if mask is None else ~mask  # torch's key padding convention inside the stack
        if cache is not None:
            y, cache = self.encoder(x, src_key_padding_mask=padding, cache=cache, positions=positions)
            return self._out(y), cache
        if not return_intermediates:
            return self._out(self.encoder(x, src_key_padding_mask=padding, positions=positions))
        y, inter = self.encoder(x, src_key_padding_mask=padding, positions=positions, return_intermediates=True)
        y = self._out(y)
        return y, {"embedded": x, "output": y, **inter}

    def _out(self, y: Tensor) -> Tensor:
        """The stack's output as the model's last hidden state: projected back where the
        embeddings are narrower (project_out)."""
        return y if self.project_out is None else self.project_out(y)

    def logits(self, h: Tensor) -> Tensor:
        if self.lm.head == "none":
            raise ValueError("this model has no head (head='none'): it returns hidden states")
        y = self.head(h) if self.head is not None else h @ self.embed.weight.T
        if self.lm.logit_scale is not None:  # Cohere: logits * logit_scale
            y = y * self.lm.logit_scale
        if self.lm.logits_divisor is not None:
            y = y / self.lm.logits_divisor  # Granite's logits_scaling
        cap = self.lm.final_logit_softcap
        return y if cap is None else torch.tanh(y / cap) * cap  # HF's order: / c, tanh, * c

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, positions: Tensor | None = None,
                token_type_ids: Tensor | None = None, *, cache: Cache | None = None,
                return_intermediates: bool = False):
        """input_ids (B, T) -> logits (B, T, V) (hidden states for head="none"); with a
        cache, (out, cache); with return_intermediates, (out, intermediates). As the Flax twin's call."""
        out = self.hidden(input_ids, attention_mask, positions, token_type_ids, cache=cache,
                          return_intermediates=return_intermediates)
        h, extra = out if cache is not None or return_intermediates else (out, None)
        y = h if self.lm.head == "none" else self.logits(h)
        return y if extra is None else (y, extra)


def _eos_hit(tokens: Tensor, eos: tuple[int, ...]) -> Tensor:
    """tokens (B,) -> (B,) bool: the token is one of the eos ids."""
    return (tokens[:, None] == torch.tensor(eos, dtype=tokens.dtype, device=tokens.device)).any(-1)


def _choose(logits: Tensor, run: Resolved, generator: torch.Generator | None) -> Tensor:
    """logits (B, V) -> (B,) tokens: argmax, or a draw from HF's warpers' logits (temperature,
    top-k, top-p) with `generator`."""
    if not run.sample:
        return logits.argmax(-1)
    logits = logits.float() / run.temperature
    if run.top_k is not None and run.top_k < logits.shape[-1]:
        logits = logits.masked_fill(logits < torch.topk(logits, run.top_k)[0][..., -1:], float("-inf"))
    if run.top_p is not None:  # HF's TopPLogitsWarper
        sorted_logits, order = torch.sort(logits, descending=False)
        drop = sorted_logits.softmax(-1).cumsum(-1) <= 1 - run.top_p
        drop[..., -1] = False
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0]


@torch.no_grad()
def generate(model: LanguageModel, input_ids: Tensor, attention_mask: Tensor | None = None, *,
             max_new_tokens: int, do_sample: bool | None = None, temperature: float | None = None,
             top_k: int | None = None, top_p: float | None = None, generator: torch.Generator | None = None,
             eos_token_id: int | list[int] | None = None, pad_token_id: int | None = None) -> Tensor:
    """Cached generation, the prompt in one chunk then one token per step (a Python loop):
    (B, T + N), N = max_new_tokens or fewer once every row has emitted an eos, rows that ended
    padded with pad_token_id, as HF's generate. Arguments left None come from the model's
    generation settings (`model.lm.generation`), as `fb.generate`
    (`flax_blocks.core.lm_config.resolve`); sampling draws with `generator`.
    Left-padded prompts get HF's positions (cumsum(mask) - 1, 0 at padding). A model with a
    recompute_length recomputes every key once there, as `fb.generate`."""
    run = resolve(model.lm.generation, eos_token_id=eos_token_id, pad_token_id=pad_token_id, do_sample=do_sample,
                  temperature=temperature, top_k=top_k, top_p=top_p)
    eos, pad = run.eos, run.pad
    b, t = input_ids.shape
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.long()
    if not bool(mask[:, -1].all()):
        raise ValueError("the last token of every row must be real: left-pad the prompts")
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    cache = model.init_cache(b, t + max_new_tokens)
    h, cache = model.hidden(input_ids, mask, positions, cache=cache)
    token = _choose(model.logits(h[:, -1]), run, generator)
    done = torch.zeros(b, dtype=torch.bool) if eos is None else _eos_hit(token, eos)
    out = [token]
    again = model.lm.recompute_length  # HF's Phi-3 generate: all keys recomputed once the sequence passes it
    for step in range(1, max_new_tokens):
        if eos is not None and bool(done.all()):
            break  # HF's generate stops once every row has ended
        if again is not None and t + step == again + 1:  # the whole sequence so far, from a fresh cache
            so_far = torch.cat([input_ids, torch.stack(out, 1)], dim=1)
            full = torch.cat([mask, torch.ones(b, step, dtype=mask.dtype)], dim=1)
            cache = model.init_cache(b, t + max_new_tokens)
            h, cache = model.hidden(so_far, full, (full.cumsum(1) - 1).clamp(min=0), cache=cache)
        else:
            h, cache = model.hidden(token[:, None], cache=cache)
        nxt = _choose(model.logits(h[:, -1]), run, generator)
        if eos is not None:
            assert pad is not None  # resolve: pad defaults to eos[0]
            nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
            done = done | _eos_hit(nxt, eos)
        token = nxt
        out.append(token)
    return torch.cat([input_ids, torch.stack(out, 1)], dim=1)
