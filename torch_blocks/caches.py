"""Caches for incremental decoding, shared by the torch blocks and stacks: a new cache
(`new_cache`) and the context of a cached call over the next chunk (`cached_context`). Twins of
`flax_blocks.caches` (an overflow always raises here, eagerly)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from flax_blocks.core.config import check_cached_call, check_new_cache, overflow_message
from flax_blocks.core.context import Context

from .attention import Mask, cache_mask
from .layers import as_batched

Cache = dict[str, Any]


def new_cache(module, batch_size: int, max_length: int, make, memory=None, memory_key_padding_mask=None) -> Cache:
    """An empty cache of `max_length` positions for `module` (a block or a stack; its
    `init_cache`): `make(batch, length, dtype, ...)` builds the modules' key / value caches,
    from `memory` (B, S, E) too for a decoder (their cross-attention keys and values, once)."""
    cfg = module.cfg
    check_new_cache(cfg, type(module).__name__, batch_size, max_length)
    p = next(module.parameters())
    # "overflow": the Flax twin's flag for traced calls; here an overflow always raises, so it stays False
    cache: Cache = {"index": 0, "valid": torch.zeros(batch_size, max_length, dtype=torch.bool, device=p.device),
                    "overflow": False,
                    "position": torch.zeros(batch_size, dtype=torch.long, device=p.device)}  # each row's next position
    if memory is not None:
        memory, _ = as_batched(cfg, memory, "memory")
        if memory.shape[0] != batch_size:
            raise ValueError(f"memory has batch {memory.shape[0]}, the cache batch_size {batch_size}")
        with torch.no_grad():
            cache["layers"] = make(batch_size, max_length, p.dtype, p.device, memory)
        kpm = memory_key_padding_mask
        if kpm is not None and (kpm.dtype != torch.bool or tuple(kpm.shape) != tuple(memory.shape[:2])):
            raise ValueError(f"memory_key_padding_mask must be a boolean (batch, memory length) = "
                             f"{tuple(memory.shape[:2])} tensor, got {kpm.dtype} {tuple(kpm.shape)}")
        cache["memory_valid"] = torch.ones(memory.shape[:2], dtype=torch.bool, device=p.device) if kpm is None else ~kpm
    else:
        cache["layers"] = make(batch_size, max_length, p.dtype, p.device)
    return cache


def checked_positions(positions: Tensor | None, shape: tuple[int, ...]) -> Tensor | None:
    """positions (B, T), checked against x's (B, T); None stays None."""
    if positions is None:
        return None
    if positions.dtype.is_floating_point or positions.dtype == torch.bool or tuple(positions.shape) != shape:
        raise ValueError(f"positions must be an integer (batch, seq) = {shape} tensor (HF's position_ids), "
                         f"got {positions.dtype} {tuple(positions.shape)}")
    return positions


def cached_context(module, x, cache, key_padding_mask, attn_mask, memory, memory_mask, return_intermediates,
                   positions=None) -> tuple[Context, Cache]:
    """The context of a cached call of `module` (a block or a stack) over x (B, T, E), the chunk
    after the cache's positions, and the cache after it but for its "layers" (which the
    call writes: the context's `written`, or the stack's)."""
    b, t, length = check_cached_call(module.cfg, type(module).__name__, cache, tuple(x.shape),
                                     masks=attn_mask is not None or memory_mask is not None,
                                     memory=memory is not None)
    index = int(cache["index"])
    message = overflow_message(t, index, length)
    if message:
        raise ValueError(message)
    kpm = key_padding_mask
    if kpm is not None and (kpm.dtype != torch.bool or tuple(kpm.shape) != (b, t)):
        raise ValueError(f"the key padding mask of a cached call must be a boolean (batch, chunk) = {(b, t)} "
                         f"tensor, got {kpm.dtype} {tuple(kpm.shape)}")
    valid = cache["valid"].clone()
    valid[:, index:index + t] = True if kpm is None else ~kpm
    shown = valid  # a cache_window keeps the last W - 1 keys before the chunk (HF's sliding-window cache)
    if "window" in cache:
        shown = valid & (torch.arange(length, device=valid.device)[None, :] > index - cache["window"])
    masks = {"self": cache_mask(index, t, shown)}
    if positions is None and "position" in cache:  # per-row positions: given, or each row's next ones
        positions = cache["position"][:, None] + torch.arange(t, device=x.device)
    if "memory_valid" in cache:
        mv = cache["memory_valid"][:, None, None, :].expand(b, 1, t, -1)
        rows = mv.any(dim=-1, keepdim=True)
        masks["cross"] = Mask(~mv & rows, rows)
    ctx = Context(masks, path=None, index=index, positions=positions, weights=return_intermediates,
                  cache=cache["layers"])
    new = {**cache, "index": index + t, "valid": valid}
    if "position" in cache:
        new["position"] = positions[:, -1] + 1
    return ctx, new
