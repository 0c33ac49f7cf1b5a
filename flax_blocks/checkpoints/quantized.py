"""Published quantized weights read as float, dequantized as they are read: the formats
transformers 5.24 loads with `dequantize=True` (framework-free: numpy and ml_dtypes).

Block-scaled FP8 (`quantization_config.quant_method == "fp8"`: DeepSeek-V3 / R1, Kimi K2,
the Qwen3 "-FP8" releases): a linear's `X.weight` (out, in) is stored as float8_e4m3fn beside
`X.weight_scale_inv`, float32 (ceil(out / bo), ceil(in / bi)) for `weight_block_size`
[bo, bi] (one scalar without it): W[r, c] = W8[r, c] * scale[r // bo, c // bi], the blocks
at the matrix's bottom and right edges partial (uint8 scales, `scale_fmt` ue8m0, are
2 ** (byte - 127)). `activation_scale` tensors (static activation scheme) are dropped, as
transformers' dequantization drops them.

MXFP4 (`quant_method == "mxfp4"`: GPT-OSS's experts): `X_blocks` uint8 (E, R, G, 16), two
E2M1 values a byte, low nibble first, and `X_scales` uint8 (E, R, G), one e8m0 exponent
(bias 127) per 32 values: row r of expert e holds v[e, r, 32 g + j] = e2m1[j] * 2 ** (s - 127).
transformers names the result `X` and holds it transposed, (E, G * 32, R)
(integrations/mxfp4.py, `convert_moe_packed_tensors`): GPT-OSS's `mlp.experts.gate_up_proj`
(E, hidden, 2 * expert_dim) and `mlp.experts.down_proj` (E, expert_dim, hidden).

`dequantize(config, sd, dtype)` replaces each quantized pair of a lazily read state dict by
one `stream.Lazy` of the dequantized name, shape and dtype: a read (a device's slice) reads
only the stored bytes and scales it needs, dequantizes in float32 and rounds once into the
dtype placed, a piece of at most about `stream.STAGE_BYTES` at a time.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from . import stream
from .family import QUANT_METHODS as METHODS
from .io import ConversionError
from .stream import Index, Lazy, _copy, _positions, _size

log = logging.getLogger("flax_blocks")

# E2M1: sign, 2 exponent bits, 1 mantissa bit; the value of each nibble 0..15
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
E8M0_BIAS = 127
MX_BLOCK = 32  # values per MXFP4 scale


# ----------------------------------------------------------------------------------------
# The formats, on arrays in memory
# ----------------------------------------------------------------------------------------


def e8m0(scales: np.ndarray) -> np.ndarray:
    """uint8 e8m0 exponents -> float32 2 ** (s - 127) (any shape)."""
    return np.ldexp(np.float32(1.0), scales.astype(np.int32) - E8M0_BIAS).astype(np.float32)


def fp8_scales(scale: np.ndarray) -> np.ndarray:
    """A stored scale_inv as float32 multipliers: uint8 (ue8m0) exponents unpacked."""
    return e8m0(scale) if scale.dtype == np.uint8 else scale.astype(np.float32)


def _float8_table(dtype: np.dtype) -> np.ndarray:
    """The float32 value of each of a float8 dtype's 256 bytes (a table lookup is ~15x faster
    than ml_dtypes' cast)."""
    return np.arange(256, dtype=np.uint8).view(dtype).astype(np.float32)


def float8_to_float32(w8: np.ndarray) -> np.ndarray:
    """A float8 array's values as float32 (any other dtype: cast)."""
    if w8.dtype.itemsize != 1 or not str(w8.dtype).startswith("float8"):
        return w8.astype(np.float32)
    return np.take(_float8_table(w8.dtype), w8.view(np.uint8))


def fp8_dequantize(w8: np.ndarray, scale: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """(..., out, in) FP8 weights times their per-block scales (..., ceil(out / bo),
    ceil(in / bi)) -> float32 (..., out, in); the edge blocks partial."""
    rows, cols = w8.shape[-2:]
    s = np.repeat(np.repeat(fp8_scales(scale), block[0], axis=-2)[..., :rows, :], block[1], axis=-1)[..., :cols]
    return float8_to_float32(w8) * s


FP8_MAX = 448.0  # the largest float8_e4m3fn


def fp8_quantize(w: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """float (..., out, in) -> (float8_e4m3fn weights, float32 scale_inv (..., ceil(out / bo),
    ceil(in / bi))): each block's largest magnitude mapped to 448 (transformers' Fp8Quantize),
    the edge blocks partial."""
    import ml_dtypes

    (rows, cols), lead = w.shape[-2:], w.shape[:-2]
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    pad = np.zeros((*lead, grid[0] * block[0], grid[1] * block[1]), np.float32)
    pad[..., :rows, :cols] = w
    tiles = pad.reshape(*lead, grid[0], block[0], grid[1], block[1])
    amax = np.abs(tiles).max(axis=(-3, -1))
    scale = np.where(amax > 0, np.float32(FP8_MAX) / np.where(amax > 0, amax, 1), 1).astype(np.float32)
    q = np.clip(tiles * scale[..., :, None, :, None], -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
    return q.reshape(pad.shape)[..., :rows, :cols], (1 / scale).astype(np.float32)


def mxfp4_unpack(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """MXFP4 (..., G, 16) uint8 blocks and (..., G) e8m0 scales -> float32 (..., G * 32),
    in storage order (not transposed)."""
    v = np.stack([E2M1[blocks & 0x0F], E2M1[blocks >> 4]], axis=-1)  # low nibble first
    v = v.reshape(*blocks.shape[:-1], 2 * blocks.shape[-1])
    return np.ldexp(v, scales.astype(np.int32)[..., None] - E8M0_BIAS).reshape(*scales.shape[:-1], -1)


def mxfp4_dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """(E, R, G, 16) blocks and (E, R, G) scales -> float32 (E, G * 32, R), transformers'
    layout of the dequantized experts."""
    return np.swapaxes(mxfp4_unpack(blocks, scales), -1, -2)


# ----------------------------------------------------------------------------------------
# Lazy dequantized tensors
# ----------------------------------------------------------------------------------------


class Dequantized(Lazy):
    """A quantized tensor read as float: `_values(index)` gives float32 values at a
    normalised index; a read rounds them once into the dtype asked; `read_into` goes in
    pieces of about STAGE_BYTES / 4 of float32 along `piece_axis` (one position of axis 0 at a time when
    that is another axis)."""

    piece_axis: int

    def _values(self, index: Index) -> np.ndarray:
        raise NotImplementedError

    def _read(self, index: Index) -> np.ndarray:
        return self._values(index).astype(self.dtype)

    def astype(self, dtype: Any, copy: bool = True) -> Lazy:
        """The same tensor dequantized straight into `dtype` (one rounding, as transformers)."""
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__, dtype=np.dtype(dtype))
        return new

    def _read_into(self, out: np.ndarray, index: Index) -> None:
        ax = self.piece_axis
        firsts = [(index[0], slice(None))] if ax == 0 else \
            [(np.array([p]), slice(j, j + 1)) for j, p in enumerate(_positions(index[0], self.shape[0]))]
        pos = _positions(index[ax], self.shape[ax])
        width = math.prod(_size(i, n) for a, (i, n) in enumerate(zip(index, self.shape, strict=True))
                          if a not in (0, ax))
        step = max(1, stream.STAGE_BYTES // (16 * max(width, 1)))  # float32 values of STAGE_BYTES / 4 (their
        # temporaries: the bytes read, a table lookup's int64 indices, the values rounded: ~4x that)
        for first, okey in firsts:
            for s in range(0, len(pos), step):
                sub, key = list(index), [slice(None)] * self.ndim
                sub[0], key[0] = first, okey
                sub[ax], key[ax] = pos[s:s + step], slice(s, s + step)
                x = self._values(tuple(sub))
                stream._count(x.nbytes, "staged")
                _copy(out[tuple(key)], x.astype(out.dtype, copy=False))  # rounded here: the copy moves bytes

    def major_axis(self) -> int | None:
        return self.piece_axis


class FP8Weight(Dequantized):
    """`weight` (..., out, in) float8 times `scale` per (bo, bi) block; `block` None: one scale."""

    def __init__(self, weight: Lazy, scale: Lazy, block: tuple[int, int] | None, dtype: Any):
        rows, cols = weight.shape[-2:]
        self.block = (rows, cols) if block is None else (int(block[0]), int(block[1]))
        self.weight, self.scale = weight, scale
        self.shape, self.dtype = weight.shape, np.dtype(dtype)
        self.piece_axis = self.ndim - 2

    def _values(self, index: Index) -> np.ndarray:
        lead, (r, c) = index[:-2], index[-2:]
        scale = self.scale._read(lead + (None,) * (self.scale.ndim - len(lead)))
        scale = fp8_scales(scale).reshape(*scale.shape[:len(lead)], *self.grid())
        rows, cols = self.shape[-2:]
        scale = np.take(scale, _positions(r, rows) // self.block[0], axis=-2)  # (..., rows read, column blocks)
        w = float8_to_float32(self.weight._read(index))
        if c is None and cols % self.block[1] == 0:  # whole rows of whole blocks: a broadcast, in place
            w.reshape(*w.shape[:-1], -1, self.block[1])[...] *= scale[..., None]
            return w
        return w * np.take(scale, _positions(c, cols) // self.block[1], axis=-1)

    def grid(self) -> tuple[int, int]:
        rows, cols = self.shape[-2:]
        return -(-rows // self.block[0]), -(-cols // self.block[1])


class MXFP4Weight(Dequantized):
    """`blocks` (E, R, G, 16), `scales` (E, R, G) read as transformers' (E, G * 32, R)."""

    def __init__(self, blocks: Lazy, scales: Lazy, dtype: Any):
        e, r, g, _ = blocks.shape
        self.blocks, self.scales = blocks, scales
        self.shape, self.dtype = (e, g * MX_BLOCK, r), np.dtype(dtype)
        self.piece_axis = 2

    def _values(self, index: Index) -> np.ndarray:
        ke = _positions(index[1], self.shape[1])
        groups = np.unique(ke // MX_BLOCK)
        b = self.blocks._read((index[0], index[2], groups, None))
        s = self.scales._read((index[0], index[2], groups))
        v = mxfp4_unpack(b, s)  # (e, r, len(groups) * 32)
        if index[1] is not None:  # the values asked among their groups'
            v = np.take(v, np.searchsorted(groups, ke // MX_BLOCK) * MX_BLOCK + ke % MX_BLOCK, axis=-1)
        return np.swapaxes(v, 1, 2)


# ----------------------------------------------------------------------------------------
# A state dict's quantized tensors, dequantized
# ----------------------------------------------------------------------------------------


def not_converted(name: str, patterns: list[str] | None) -> bool:
    """Whether module `name` is one `modules_to_not_convert` keeps in full precision
    (transformers' quantizers_utils.should_convert_module, negated)."""
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    return any(re.match(rf"(?:{p}){boundary}", name) or name.endswith(p) for p in patterns or ())


def method_of(config: Mapping[str, Any]) -> str | None:
    """The quant_method of a config's quantization_config (None: not quantized)."""
    q = config.get("quantization_config")
    return None if not q else str(q.get("quant_method")) if isinstance(q, Mapping) else repr(q)


def quantized_notes(config: Mapping[str, Any]) -> tuple[str, ...]:
    """The load report's note on a folder read dequantized (none for a plain one)."""
    method = method_of(config)
    if method not in METHODS:
        return ()
    return (f"quantization_config {method}: the quantized weights were dequantized while read, to the config's "
            "dtype or the dtype asked (as transformers' dequantize=True load); fb.save_hf writes them dequantized, "
            "without quantization_config",)


def dequantize(config: Mapping[str, Any], sd: dict[str, Any], dtype: Any = None) -> dict[str, Any]:
    """The state dict with every quantized tensor replaced by its dequantized Lazy, of a
    lazily read folder whose config carries `quantization_config` (fp8 or mxfp4; others are
    refused by the config's audit). dtype: what the dequantized tensors hold (the config's
    dtype; None: float32). Raises ConversionError naming every tensor the format cannot read."""
    method = method_of(config)
    if method not in METHODS:
        return sd
    q, dtype = config["quantization_config"], _np_dtype(dtype)
    skip = q.get("modules_to_not_convert")
    fn = _fp8 if method == "fp8" else _mxfp4
    out, problems = fn(q, sd, dtype)
    for name, a in out.items():
        if isinstance(a, Dequantized) and not_converted(name.rsplit(".", 1)[0], skip):
            problems.append(f"{name}: stored {method}-quantized, while quantization_config.modules_to_not_convert "
                            f"{skip} keeps its module in full precision")
    if problems:
        raise ConversionError(problems, header=f"cannot read this {method}-quantized checkpoint")
    return out


def _np_dtype(dtype: Any) -> np.dtype:
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16) if str(dtype) == "bfloat16" else np.dtype(dtype or np.float32)


def _fp8(q: Mapping[str, Any], sd: dict[str, Any], dtype: np.dtype) -> tuple[dict[str, Any], list[str]]:
    block = q.get("weight_block_size")
    out: dict[str, Any] = {}
    problems: list[str] = []
    for name, a in sd.items():
        if name.endswith(("_scale_inv", ".activation_scale", ".input_scale")):
            if name.endswith("_scale_inv") and name.removesuffix("_scale_inv") not in sd:
                problems.append(f"{name}: a scale without its weight {name.removesuffix('_scale_inv')}")
            continue
        scale = sd.get(name + "_scale_inv")
        if scale is None:
            if str(a.dtype).startswith("float8"):
                problems.append(f"{name}: stored {a.dtype} without a {name}_scale_inv")
            out[name] = a
            continue
        if a.ndim < 2 or not str(a.dtype).startswith("float8"):
            problems.append(f"{name}: expected a float8 matrix beside its scale_inv, got {a.dtype} {tuple(a.shape)}")
            continue
        w = FP8Weight(a, scale, None if block is None else tuple(block), dtype)
        want = (*a.shape[:-2], *w.grid()) if block is not None else None
        if (want is not None and tuple(scale.shape) != want) or (want is None and scale.size != 1):
            problems.append(f"{name}_scale_inv: shape {tuple(scale.shape)}, expected "
                            f"{want if want is not None else 'one scale'} for a weight {tuple(a.shape)} in blocks "
                            f"{block}")
            continue
        out[name] = w
    _warn_edges([(n, w) for n, w in out.items() if isinstance(w, FP8Weight)], block)
    return out, problems


def _warn_edges(weights: list[tuple[str, FP8Weight]], block: Any) -> None:
    """A warning naming the weights whose partial edge blocks transformers' dequantize=True
    reads otherwise: it takes the block from the scale grid (rows // grid rows), which for
    them is not weight_block_size (or fails); we read weight_block_size's blocks, as
    transformers' FP8Linear kernels and DeepSeek's weight_dequant do."""
    odd = [f"{n} {w.shape[-2:]}" for n, w in weights
           if any(d > b and d % b for d, b in zip(w.shape[-2:], w.block, strict=True))]
    if block is not None and odd:
        log.warning("fp8: %d weights end in partial %s blocks (%s); read with weight_block_size's blocks as "
                    "transformers' FP8 kernels compute them, where its dequantize=True load takes the block from "
                    "the scale grid and differs (or fails)", len(odd), list(block), ", ".join(odd[:3]))


def _mxfp4(q: Mapping[str, Any], sd: dict[str, Any], dtype: np.dtype) -> tuple[dict[str, Any], list[str]]:
    out: dict[str, Any] = {}
    problems: list[str] = []
    for name, a in sd.items():
        if name.endswith("_scales") and name.removesuffix("_scales") + "_blocks" in sd:
            continue
        if not name.endswith("_blocks"):
            out[name] = a
            continue
        base = name.removesuffix("_blocks")
        scales = sd.get(base + "_scales")
        if scales is None:
            problems.append(f"{name}: MXFP4 blocks without their {base}_scales")
            continue
        if (a.dtype != np.uint8 or scales.dtype != np.uint8 or a.ndim != 4 or a.shape[-1] != MX_BLOCK // 2
                or tuple(scales.shape) != tuple(a.shape[:-1])):
            problems.append(f"{name} {a.dtype} {tuple(a.shape)} / {base}_scales {scales.dtype} "
                            f"{tuple(scales.shape)}: expected uint8 (E, R, G, 16) blocks and uint8 (E, R, G) scales")
            continue
        out[base] = MXFP4Weight(a, scales, dtype)
    return out, problems


# ----------------------------------------------------------------------------------------
# Writing the FP8 format back
# ----------------------------------------------------------------------------------------

FP8_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
              "modules_to_not_convert": None}


def fp8_requantize(w: np.ndarray, block: tuple[int, int], stored: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """(float8 weights, scale_inv) of `w`: with the `stored` scales of the folder it was read
    from, when they give back exactly `w` (in its dtype) once dequantized (an unchanged
    weight: its file's own bytes); else fresh ones (`fp8_quantize`)."""
    import ml_dtypes

    if stored is not None and stored.shape == (*w.shape[:-2], -(-w.shape[-2] // block[0]),
                                               -(-w.shape[-1] // block[1])):
        rows, cols = w.shape[-2:]
        s = np.repeat(np.repeat(fp8_scales(stored), block[0], -2)[..., :rows, :], block[1], -1)[..., :cols]
        q = np.clip(w.astype(np.float32) / s, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
        if np.array_equal(fp8_dequantize(q, stored, block).astype(w.dtype).view(np.uint8), w.view(np.uint8)):
            return q, stored
    return fp8_quantize(w, block)


def fp8_tensors(tensors: Mapping[str, Any], config: Mapping[str, Any], stored: Mapping[str, Any]
                ) -> dict[str, Any]:
    """The tensors to write in block-scaled FP8 (config's quantization_config, fp8): every
    weight the source folder stored quantized (`stored`: its raw tensors, {} for none), else
    every 2-D weight of the layers (`layers.` in its name) that modules_to_not_convert does not
    keep, each beside its `_scale_inv`; the rest as they are."""
    q = config["quantization_config"]
    block = tuple(q.get("weight_block_size") or (0, 0))
    if len(block) != 2 or min(block) < 1:
        raise ValueError(f"quantization_config.weight_block_size={q.get('weight_block_size')!r}: save_hf writes "
                         "block-scaled FP8 only (two block sizes, e.g. [128, 128])")
    skip = q.get("modules_to_not_convert")
    out: dict[str, Any] = {}
    for name, a in tensors.items():
        chosen = name + "_scale_inv" in stored if stored else \
            (name.endswith(".weight") and "layers." in name and np.ndim(a) == 2
             and not not_converted(name.rsplit(".", 1)[0], skip))
        if not chosen:
            out[name] = a
            continue
        scale = stored.get(name + "_scale_inv")
        out[name], out[name + "_scale_inv"] = fp8_requantize(np.asarray(a), block,
                                                             None if scale is None else np.asarray(scale))
    return out

