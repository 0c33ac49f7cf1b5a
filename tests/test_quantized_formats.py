"""The quantized formats (`flax_blocks.checkpoints.quantized`) against a numpy reference written
here element by element (block-scaled FP8: the partial blocks at a matrix's edges; MXFP4: the
nibble order, the e8m0 bias, the experts' layout), each with a wrong variant the comparison
rejects, and against transformers' own dequantization functions; the lazy readers read a
slice from its own bytes only, and a state dict's quantized tensors are named, shaped and
refused as the loader needs."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from flax_blocks.checkpoints import quantized as qz
from flax_blocks.checkpoints import stream
from flax_blocks.checkpoints.io import ConversionError

E4M3 = ml_dtypes.float8_e4m3fn


def _fp8_case(rows: int, cols: int, block=(128, 128), lead=(), seed=0):
    rng = np.random.default_rng(seed)
    w8 = rng.normal(0, 100, (*lead, rows, cols)).clip(-448, 448).astype(E4M3)
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    scale = rng.uniform(1e-4, 1e-2, (*lead, *grid)).astype(np.float32)
    return w8, scale


def fp8_reference(w8, scale, block, edge=True):
    """W[r, c] = W8[r, c] * scale[r // bo, c // bi], element by element. edge=False is the
    wrong variant: blocks of rows // grid rows (the last partial block spread over all)."""
    rows, cols = w8.shape[-2:]
    bo, bi = block if edge else (rows // scale.shape[-2], cols // scale.shape[-1])
    out = np.empty(w8.shape, np.float32)
    for r in range(rows):  # row by row: each column c takes the scale of its block c // bi
        out[..., r, :] = w8[..., r, :].astype(np.float32) * scale[..., r // bo, np.arange(cols) // bi]
    return out


def mxfp4_reference(blocks, scales, low_first=True, bias=127):
    """Experts (E, R, G, 16) bytes and (E, R, G) exponents -> (E, G * 32, R), element by
    element: byte j of a block holds values 2j (low nibble) and 2j + 1 (high nibble), each
    E2M1 (sign, 2 exponent bits with bias 1, 1 mantissa bit) times 2 ** (scale - bias)."""
    def e2m1(n):
        sign, exp, man = -1.0 if n & 8 else 1.0, (n >> 1) & 3, n & 1
        return sign * (man / 2 if exp == 0 else (1 + man / 2) * 2.0 ** (exp - 1))

    e, r, g, _ = blocks.shape
    out = np.empty((e, g * 32, r), np.float32)
    for x in range(e):
        for row in range(r):
            for k in range(g * 32):
                byte = int(blocks[x, row, k // 32, (k % 32) // 2])
                first, second = (byte & 15, byte >> 4) if low_first else (byte >> 4, byte & 15)
                out[x, k, row] = e2m1(first if k % 2 == 0 else second) * 2.0 ** (int(scales[x, row, k // 32]) - bias)
    return out


@pytest.mark.parametrize("rows, cols, block", [(200, 300, (128, 128)), (256, 128, (128, 128)), (7, 45, (4, 16)),
                                               (24, 40, (8, 8))])
def test_fp8_blocks_and_their_partial_edges_match_the_reference(rows, cols, block):
    w8, scale = _fp8_case(rows, cols, block)
    want = fp8_reference(w8, scale, block)
    np.testing.assert_array_equal(qz.fp8_dequantize(w8, scale, block), want)
    lazy = qz.FP8Weight(stream.Array(w8), stream.Array(scale), block, np.float32)
    np.testing.assert_array_equal(lazy.read(), want)
    rows_, cols_ = np.array([rows - 1, 0, rows // 2]), np.arange(cols // 3, cols)
    np.testing.assert_array_equal(lazy.read((rows_, cols_)), want[rows_][:, cols_])
    out = np.empty((cols, rows), ml_dtypes.bfloat16)  # a transposed view, rounded once into bfloat16
    lazy.T.read_into(out)
    np.testing.assert_array_equal(out, want.T.astype(ml_dtypes.bfloat16))
    if rows % block[0] or cols % block[1]:  # the wrong variant: the partial block spread over the grid
        wrong = fp8_reference(w8, scale, block, edge=False) if rows % scale.shape[0] == 0 == cols % scale.shape[1] \
            else None
        assert wrong is None or not np.array_equal(wrong, want)


def test_fp8_per_expert_scales_and_e8m0_scales():
    w8, scale = _fp8_case(20, 36, (8, 16), lead=(3,))
    want = np.stack([fp8_reference(w8[i], scale[i], (8, 16)) for i in range(3)])
    lazy = qz.FP8Weight(stream.Array(w8), stream.Array(scale), (8, 16), np.float32)
    np.testing.assert_array_equal(lazy.read(), want)
    np.testing.assert_array_equal(lazy.read((np.array([2, 0]), None, np.arange(17, 36))), want[[2, 0]][..., 17:])
    exps = np.array([[120, 127], [130, 0]], np.uint8)  # ue8m0 scale_inv bytes: 2 ** (b - 127)
    w8 = _fp8_case(16, 32, (8, 16))[0]
    np.testing.assert_array_equal(qz.fp8_dequantize(w8, exps, (8, 16)),
                                  fp8_reference(w8, 2.0 ** (exps.astype(np.float32) - 127), (8, 16)))


def test_fp8_quantize_round_trips_to_within_e4m3():
    rng = np.random.default_rng(1)
    w = rng.normal(0, 0.05, (40, 70)).astype(np.float32)
    q, inv = qz.fp8_quantize(w, (16, 32))
    assert q.dtype == E4M3 and inv.shape == (3, 3) and inv.dtype == np.float32
    back = qz.fp8_dequantize(q, inv, (16, 32))
    assert np.abs(back - w).max() <= np.abs(w).max() * 2.0 ** -4
    tiles = np.abs(q.astype(np.float32))  # each block's largest value maps to 448
    assert tiles[:16, :32].max() == 448 and tiles[32:, 64:].max() == 448


def _mx_case(e=2, r=3, g=2, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 256, (e, r, g, 16), dtype=np.uint8),
            rng.integers(118, 136, (e, r, g), dtype=np.uint8))


def test_mxfp4_matches_the_reference_and_rejects_swapped_nibbles_and_bias_128():
    blocks, scales = _mx_case()
    want = mxfp4_reference(blocks, scales)
    got = qz.mxfp4_dequantize(blocks, scales)
    np.testing.assert_array_equal(got, want)
    assert not np.array_equal(got, mxfp4_reference(blocks, scales, low_first=False))
    assert not np.array_equal(got, mxfp4_reference(blocks, scales, bias=128))
    lazy = qz.MXFP4Weight(stream.Array(blocks), stream.Array(scales), np.float32)
    assert lazy.shape == (2, 64, 3)
    np.testing.assert_array_equal(lazy.read(), want)
    k = np.array([63, 0, 31, 32, 5])  # values across both scale groups, out of order
    np.testing.assert_array_equal(lazy.read((np.array([1]), k, np.array([2, 0]))), want[[1]][:, k][:, :, [2, 0]])
    out = np.empty((2, 3, 64), ml_dtypes.bfloat16)
    lazy.transpose(0, 2, 1).read_into(out)
    np.testing.assert_array_equal(out, np.swapaxes(want, 1, 2).astype(ml_dtypes.bfloat16))


def test_mxfp4_equals_transformers_dequantization():
    torch = pytest.importorskip("torch")
    mx = pytest.importorskip("transformers.integrations.mxfp4")
    blocks, scales = _mx_case(e=3, r=5, g=3, seed=2)
    for dtype, np_dtype in ((torch.float32, np.float32), (torch.bfloat16, ml_dtypes.bfloat16)):
        theirs = mx.convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=dtype)
        theirs = theirs.float().numpy()
        lazy = qz.MXFP4Weight(stream.Array(blocks), stream.Array(scales), np_dtype)
        np.testing.assert_array_equal(lazy.read().astype(np.float32), theirs)


def test_fp8_equals_transformers_dequantization_where_its_blocks_are_the_format():
    """transformers' Fp8Dequantize derives the block from the scale grid (rows // grid rows):
    the format's blocks wherever a dimension is a multiple of its block or within one block.
    Where it is not (200 rows in blocks of 128: transformers splits 100 / 100), we read the
    format (weight_block_size's blocks, as transformers' FP8Linear kernels and DeepSeek's own
    weight_dequant do) and the two differ."""
    torch = pytest.importorskip("torch")
    fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
    op = fp8.Fp8Dequantize(None)
    for rows, cols in ((256, 384), (64, 100), (200, 256)):
        w8, scale = _fp8_case(rows, cols)
        theirs = op._dequantize_one(torch.from_numpy(w8.view(np.uint8)).view(torch.float8_e4m3fn),
                                    torch.from_numpy(scale), output_dtype=torch.float32).numpy()
        ours = qz.FP8Weight(stream.Array(w8), stream.Array(scale), (128, 128), np.float32).read()
        assert np.array_equal(ours, theirs) == (rows != 200), (rows, cols)


def test_a_slice_reads_its_own_bytes(tmp_path):
    from safetensors.numpy import save_file

    w8, scale = _fp8_case(256, 512)
    blocks, scales = _mx_case(e=4, r=8, g=4)
    path = tmp_path / "q.safetensors"
    save_file({"w": w8, "w_scale_inv": scale, "b": blocks, "s": scales}, str(path))
    sd = stream.read_safetensors(path)
    lazy = qz.FP8Weight(sd["w"], sd["w_scale_inv"], (128, 128), np.float32)
    before = stream.bytes_read()
    out = np.empty((64, 512), np.float32)
    lazy.read_into(out, (np.arange(128, 192),))  # a device's rows: those rows' bytes and the scales
    assert stream.bytes_read() - before == 64 * 512 + scale.nbytes
    np.testing.assert_array_equal(out, fp8_reference(w8, scale, (128, 128))[128:192])
    mx = qz.MXFP4Weight(sd["b"], sd["s"], np.float32)
    before = stream.bytes_read()
    part = mx.read((np.array([3]), None, np.arange(2, 4)))  # one expert's two output rows
    assert stream.bytes_read() - before == 2 * (4 * 16 + 4)
    np.testing.assert_array_equal(part, qz.mxfp4_dequantize(blocks, scales)[3:4, :, 2:4])


def _fp8_sd(**extra):
    w8, scale = _fp8_case(16, 32, (8, 16))
    sd = {"model.layers.0.mlp.up_proj.weight": stream.Array(w8),
          "model.layers.0.mlp.up_proj.weight_scale_inv": stream.Array(scale),
          "model.norm.weight": stream.Array(np.ones(16, ml_dtypes.bfloat16))}
    return {**sd, **extra}


def test_a_state_dict_is_dequantized_by_name_and_refused_by_name():
    config = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [8, 16]}}
    sd = qz.dequantize(config, _fp8_sd(**{"model.layers.0.mlp.up_proj.activation_scale": stream.Array(np.ones(()))}),
                       "bfloat16")
    assert sorted(sd) == ["model.layers.0.mlp.up_proj.weight", "model.norm.weight"]
    assert sd["model.layers.0.mlp.up_proj.weight"].dtype == ml_dtypes.bfloat16
    assert sd["model.layers.0.mlp.up_proj.weight"].astype(np.float32).read().dtype == np.float32
    bad = {"model.layers.0.mlp.down_proj.weight": stream.Array(np.zeros((16, 16), E4M3)),
           "model.layers.0.mlp.up_proj.weight_scale_inv": stream.Array(np.ones((1, 1), np.float32))}
    with pytest.raises(ConversionError) as e:
        qz.dequantize({"quantization_config": {"quant_method": "fp8", "weight_block_size": [8, 16],
                                               "modules_to_not_convert": ["mlp.up_proj"]}}, _fp8_sd(**bad))
    msg = str(e.value)
    assert "down_proj.weight: stored float8_e4m3fn without a model.layers.0.mlp.down_proj.weight_scale_inv" in msg
    assert "up_proj.weight_scale_inv: shape (1, 1), expected (2, 2)" in msg
    with pytest.raises(ConversionError, match="modules_to_not_convert"):
        qz.dequantize({"quantization_config": {"quant_method": "fp8", "weight_block_size": [8, 16],
                                               "modules_to_not_convert": ["mlp.up_proj"]}}, _fp8_sd())
    blocks, scales = _mx_case(e=2, r=4, g=1)
    sd = qz.dequantize({"quantization_config": {"quant_method": "mxfp4"}},
                       {"model.layers.0.mlp.experts.gate_up_proj_blocks": stream.Array(blocks),
                        "model.layers.0.mlp.experts.gate_up_proj_scales": stream.Array(scales),
                        "model.layers.0.mlp.experts.gate_up_proj_bias": stream.Array(np.zeros((2, 4), np.float32))})
    assert {k: v.shape for k, v in sd.items()} == {"model.layers.0.mlp.experts.gate_up_proj": (2, 32, 4),
                                                    "model.layers.0.mlp.experts.gate_up_proj_bias": (2, 4)}
    with pytest.raises(ConversionError, match="down_proj_blocks: MXFP4 blocks without"):
        qz.dequantize({"quantization_config": {"quant_method": "mxfp4"}},
                      {"model.layers.0.mlp.experts.down_proj_blocks": stream.Array(blocks)})


def test_the_config_reads_fp8_and_mxfp4_and_refuses_other_methods_by_name():
    from flax_blocks.checkpoints.family import FAMILIES, audit

    llama = {"model_type": "llama", "hidden_size": 32, "num_attention_heads": 4}
    for method in ("fp8", "mxfp4"):
        assert audit({**llama, "quantization_config": {"quant_method": method}}, FAMILIES["llama"])[0] == []
    problems = audit({**llama, "quantization_config": {"quant_method": "gptq", "bits": 4}}, FAMILIES["llama"])[0]
    assert problems[0].startswith("quantization_config={'quant_method': 'gptq', 'bits': 4}: quantized weights")
    assert "fp8 and mxfp4" in problems[0]


def test_partial_edge_blocks_are_named_in_a_warning(caplog):
    w8, scale = _fp8_case(200, 128)
    sd = {"model.layers.0.self_attn.kv_a_proj.weight": stream.Array(w8),
          "model.layers.0.self_attn.kv_a_proj.weight_scale_inv": stream.Array(scale)}
    config = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    with caplog.at_level("WARNING", logger="flax_blocks"):
        qz.dequantize(config, sd)
    assert "1 weights end in partial [128, 128] blocks (model.layers.0.self_attn.kv_a_proj.weight (200, 128))" \
        in caplog.text
