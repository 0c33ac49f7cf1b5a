"""The stacks of torch blocks: Encoder, Decoder (named like nn.TransformerEncoder /
nn.TransformerDecoder: layers.{i}., norm.) and Transformer (nn.Transformer's encoder.,
decoder.). Twins of `flax_blocks.stacks`."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import cast

import torch
import torch.utils.checkpoint
from torch import Tensor, nn

from flax_blocks.core import declarations
from flax_blocks.core.config import FINAL_NORM_BY_DEFAULT, BlockConfig, check_remat
from flax_blocks.core.context import Context
from flax_blocks.core.declarations import FINAL_NORM

from .attention import build_mask
from .blocks import DecoderBlock, TransformerBlock, _Block, call_context
from .caches import Cache, cached_context, checked_positions, new_cache
from .layers import Norm, as_batched, batched_memory


class _Stack(nn.Module):
    """`num_layers` independently initialised blocks and an optional final norm (layers.{i}.*,
    norm.*). `final_norm` defaults to True for pre-LN, Peri-LN and "out" (OLMo 2), False
    otherwise.
    remat: None, or any of the Flax twin's values ("full", a policy name): each layer is
    recomputed in the backward pass (torch.utils.checkpoint; torch has no named policies)."""

    block: type[_Block]
    norm: Norm | None  # the final norm (declarations.FINAL_NORM), set by name

    def __init__(self, cfg: BlockConfig, *, num_layers: int, final_norm: bool | None = None,
                 remat: str | None = None, generator: torch.Generator | None = None):
        super().__init__()
        check_remat(remat)
        self.remat = remat
        if not isinstance(num_layers, int) or isinstance(num_layers, bool) or num_layers < 1:
            raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
        self.cfg = cfg = cfg.resolve(num_layers)
        self.num_layers = num_layers
        self.layers = nn.ModuleList(self.block(cfg, generator=generator, mlp=declarations.layer_mlp(cfg, i + 1))
                                    for i in range(num_layers))  # each layer's own MLP (a mixed stack's differ)
        if final_norm is None:
            final_norm = cfg.norm in FINAL_NORM_BY_DEFAULT
        norm = Norm(cfg, declarations.norm(cfg, cfg.d_model), generator=generator) if final_norm else None
        setattr(self, FINAL_NORM, norm)

    @property
    def final_norm(self) -> Norm | None:
        return getattr(self, FINAL_NORM)

    def _blocks(self) -> Iterable[_Block]:
        """The layers, typed as the blocks they are (nn.ModuleList yields plain Modules)."""
        return cast("Iterable[_Block]", self.layers)

    def _stack_cache(self, batch, length, dtype, device, memory=None) -> Cache:
        """Every layer's block cache."""
        return {"layers": [layer._block_cache(batch, length, dtype, device, memory) for layer in self._blocks()]}

    def run_layers(self, x: Tensor, ctx: Context):
        """The layers over x (B, T, E), each with its own context (`Context.at`: its index and
        cache), then the final norm -> (y, stacked intermediates, caches)."""
        per_layer: list[dict[str, Tensor]] = []
        caches = []
        recompute = self.remat is not None and ctx.cache is None and torch.is_grad_enabled()
        for i, layer in enumerate(self._blocks()):
            layer_ctx = ctx.at(i + 1, None if ctx.cache is None else ctx.cache["layers"][i])
            if recompute:
                x = torch.utils.checkpoint.checkpoint(layer.run, x, layer_ctx, use_reentrant=False)
            else:
                x = layer.run(x, layer_ctx)
            caches.append(layer_ctx.written)
            if ctx.weights:
                per_layer.append({"residual": x, **layer_ctx.found})
        if self.final_norm is not None:
            x = self.final_norm(x)
        stacked = {k: torch.stack([d[k] for d in per_layer]) for k in per_layer[0]} if ctx.weights else {}
        return x, stacked, ({"layers": caches} if ctx.cache is not None else None)

    def _cached(self, x: Tensor, ctx: Context, cache: Cache, return_intermediates: bool):
        """A cached call's (y, cache) or (y, intermediates, cache), the layers' caches written."""
        y, stacked, layers = self.run_layers(x, ctx)
        cache = {**cache, "layers": layers}
        return (y, stacked, cache) if return_intermediates else (y, cache)

    def _finish_stack(self, y, stacked, unbatched, return_intermediates):
        if not return_intermediates:
            return y[0] if unbatched else y
        if unbatched:
            stacked = {k: (v[:, 0] if v.dim() > 1 else v) for k, v in stacked.items()}
        return (y[0] if unbatched else y), stacked


class Encoder(_Stack):
    """TransformerBlocks and an optional final norm, named like nn.TransformerEncoder."""

    block = TransformerBlock

    def init_cache(self, batch_size: int, max_length: int) -> Cache:
        """An empty cache for incremental decoding of up to `max_length` positions (causal only)."""
        return new_cache(self, batch_size, max_length, self._stack_cache)

    def forward(self, src: Tensor, mask: Tensor | None = None, src_key_padding_mask: Tensor | None = None,
                *, return_intermediates: bool = False, cache: Cache | None = None, positions: Tensor | None = None):
        """src: (B, T, E) or (T, E) -> same shape. With return_intermediates, also
        {"residual": (L, B, T, E), "attention_weights": (L, B, H, T, T), "attention_logits_max": (L,)}.
        cache (from `init_cache`): src is the next chunk; returns (y, cache).
        positions: (B, T) integer rotary positions per row (HF's position_ids); None: 0..T-1,
        or with a cache each row's next position onwards."""
        x, unbatched = as_batched(self.cfg, src)
        positions = checked_positions(positions, tuple(x.shape[:2]))
        if cache is not None:
            if unbatched:
                raise ValueError("a cached call takes batched input (batch, chunk, d_model)")
            ctx, cache = cached_context(self, x, cache, src_key_padding_mask, mask, None, None, return_intermediates,
                                        positions)
            return self._cached(x, ctx, cache, return_intermediates)
        ctx = call_context(self, x, mask, src_key_padding_mask, return_intermediates)
        ctx.positions = positions
        y, stacked, _ = self.run_layers(x, ctx)
        return self._finish_stack(y, stacked, unbatched, return_intermediates)


class Decoder(_Stack):
    """DecoderBlocks and an optional final norm, named like nn.TransformerDecoder."""

    block = DecoderBlock

    def init_cache(self, batch_size: int, max_length: int, memory: Tensor,
                   memory_key_padding_mask: Tensor | None = None) -> Cache:
        """An empty self-attention cache per layer and every layer's cross-attention keys
        and values of `memory` (B, S, E), computed once."""
        return new_cache(self, batch_size, max_length, self._stack_cache, memory, memory_key_padding_mask)

    def forward(self, tgt: Tensor, memory: Tensor | None = None, tgt_mask: Tensor | None = None,
                memory_mask: Tensor | None = None, tgt_key_padding_mask: Tensor | None = None,
                memory_key_padding_mask: Tensor | None = None, *, return_intermediates: bool = False,
                cache: Cache | None = None):
        """tgt (B, T, E) or (T, E), memory (B, S, E) or (S, E); masks as `DecoderBlock`."""
        x, unbatched = as_batched(self.cfg, tgt)
        if cache is not None:
            if unbatched:
                raise ValueError("a cached call takes batched input (batch, chunk, d_model)")
            ctx, cache = cached_context(self, x, cache, tgt_key_padding_mask, tgt_mask, memory, memory_mask,
                                        return_intermediates)
            return self._cached(x, ctx, cache, return_intermediates)
        if memory is None:
            raise ValueError("Decoder needs a memory (B, S, d_model), or a cache made with one")
        ctx = call_context(self, x, tgt_mask, tgt_key_padding_mask, return_intermediates)
        ctx.memory = batched_memory(self.cfg, memory, x, unbatched)
        ctx.masks["cross"] = build_mask(self.cfg, x.shape[0], x.shape[1], memory_mask, memory_key_padding_mask,
                                        x.device, keys=ctx.memory.shape[1], causal=False)
        y, stacked, _ = self.run_layers(x, ctx)
        return self._finish_stack(y, stacked, unbatched, return_intermediates)


class Transformer(nn.Module):
    """An Encoder and a Decoder, named like nn.Transformer (encoder.*, decoder.*).

    `cfg` serves both; the encoder is never causal, the decoder's self-attention is causal
    when cfg.causal. Both have a final norm by default, as nn.Transformer."""

    def __init__(self, cfg: BlockConfig, *, num_encoder_layers: int = 6, num_decoder_layers: int = 6,
                 final_norm: bool = True, generator: torch.Generator | None = None):
        super().__init__()
        self.cfg = cfg
        self.encoder = Encoder(replace(cfg, causal=False), num_layers=num_encoder_layers, final_norm=final_norm,
                               generator=generator)
        self.decoder = Decoder(cfg, num_layers=num_decoder_layers, final_norm=final_norm, generator=generator)

    def forward(self, src: Tensor, tgt: Tensor, src_mask: Tensor | None = None, tgt_mask: Tensor | None = None,
                memory_mask: Tensor | None = None, src_key_padding_mask: Tensor | None = None,
                tgt_key_padding_mask: Tensor | None = None, memory_key_padding_mask: Tensor | None = None) -> Tensor:
        """src (B, S, E), tgt (B, T, E) -> (B, T, E); masks as nn.Transformer's."""
        memory = self.encoder(src, src_mask, src_key_padding_mask)
        return self.decoder(tgt, memory, tgt_mask, memory_mask, tgt_key_padding_mask, memory_key_padding_mask)
