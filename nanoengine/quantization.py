"""Weight-only quantization: the formats, their round trips, and the layouts the kernel reads.

A decode step at batch 1 reads every weight once per token, so its speed is set by the bytes of
weight it streams (gpt-fast's lesson). Storing weights in 8 or 4 bits cuts those bytes.

- ``int8``: one scale per output channel (row), symmetric: w ~ q * scale, q in [-127, 127].
- ``int4``: groups of ``GROUP_SIZE`` along the input dimension, each with a scale and a minimum
  (GGUF's Q4_1), both float16: w ~ q * scale + min, q in [0, 15]. 0.625 bytes per weight.

The matmul over them is cpu_quantized_linear.cpp (through ``cpu_kernels.quantized_linear``),
which needs the weight in its own layout: ``pack_int8`` and ``pack_int4`` make it,
``dequantize_packed`` reads it back (the fallback where the kernel cannot be built).
torch's own weight-only CPU ops were measured against it and lost at nearly every size (docs/quantization.md).
"""

from typing import Iterator

import torch

FORMATS = ("int8", "int4")
GROUP_SIZE = 32  # weights sharing a scale (int4), and the kernel's block of x values (both)
TILE = 8  # rows the kernel reads together, stored side by side
INT4_GROUP_BYTES = TILE * (GROUP_SIZE // 2 + 2 + 2)  # a tile's group: 8 rows of nibbles, 8 float16 scales, 8 mins
INT4_LANE = 4  # int4 values of one row that the kernel multiplies in one 32-bit lane
QUANTIZE_BLOCK = 1 << 20  # weights quantized together (whole tiles of rows): float32 temporaries of 4 MB


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w ``[out, in]`` as int8 ``q`` and float32 ``scales [out]``: each row's largest magnitude
    maps to 127, so every weight is off by at most half a step (scale / 2)."""
    scales = w.float().abs().amax(dim=1).clamp(min=1e-12) / 127
    q = torch.round(w.float() / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return q.float() * scales.float()[:, None]


def quantize_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w ``[out, in]`` as ``q`` (uint8 values 0..15, same shape) and ``scales`` and ``mins``
    ``[out, in / GROUP_SIZE]``, float32 values that float16 holds exactly: each group's range
    split into 15 steps, so every weight is off by at most half a step (scale / 2), plus float16's
    rounding of the minimum."""
    out_features, in_features = w.shape
    groups = w.float().reshape(out_features, in_features // GROUP_SIZE, GROUP_SIZE)
    mins, maxs = groups.amin(dim=-1), groups.amax(dim=-1)
    scales = ((maxs - mins) / 15).half().float()
    mins = mins.half().float()
    safe = torch.where(scales > 0, scales, 1.0)  # a constant group is all minimum
    q = torch.round((groups - mins[..., None]) / safe[..., None]).clamp(0, 15).to(torch.uint8)
    return q.reshape(out_features, in_features), scales, mins


def dequantize_int4(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    out_features, in_features = q.shape
    groups = q.float().reshape(out_features, in_features // GROUP_SIZE, GROUP_SIZE)
    return (groups * scales[..., None] + mins[..., None]).reshape(out_features, in_features)


def can_quantize(out_features: int, in_features: int) -> bool:
    """Whether the kernel takes a weight of this shape: whole tiles of rows, whole groups along a row."""
    return out_features % TILE == 0 and in_features % GROUP_SIZE == 0


def _tiles(t: torch.Tensor) -> torch.Tensor:
    """``[out, in / GROUP_SIZE, ...]`` as ``[out / TILE, in / GROUP_SIZE, TILE, ...]``: a tile's
    groups one after another, each with its TILE rows side by side."""
    return t.reshape(-1, TILE, *t.shape[1:]).transpose(1, 2)


def _untiles(t: torch.Tensor) -> torch.Tensor:
    """``_tiles``' inverse."""
    return t.transpose(1, 2).flatten(0, 1)


def pack_int8(q: torch.Tensor) -> torch.Tensor:
    """q ``[out, in]`` as int8 ``[out / 8, in / 32, 8, 32]``."""
    out_features, in_features = q.shape
    return _tiles(q.reshape(out_features, in_features // GROUP_SIZE, GROUP_SIZE)).contiguous()


def pack_int4(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """q, scales, mins from ``quantize_int4`` as uint8 ``[out / 8, in / 32, INT4_GROUP_BYTES]``.

    Per group: the tile's q as 8 vectors of 32 values, vector g holding values 4g .. 4g + 3 of each
    of the 8 rows (row j at 4j .. 4j + 3), so the kernel's 32-bit lane j works on row j; packed
    two to a byte, vector c in the low nibbles and vector c + 4 in the high ones (128 bytes). Then
    the 8 rows' float16 scales and their 8 float16 mins.
    """
    out_features, in_features = q.shape
    lanes = _tiles(q.reshape(out_features, in_features // GROUP_SIZE, GROUP_SIZE // INT4_LANE, INT4_LANE))
    vectors = lanes.transpose(2, 3).flatten(3)  # [tiles, groups, 8 vectors, 8 rows x 4 values]
    half = vectors.shape[2] // 2
    nibbles = vectors[:, :, :half] | (vectors[:, :, half:] << 4)
    as_bytes = [nibbles.flatten(2)] + [_tiles(t.half()).contiguous().view(torch.uint8) for t in (scales, mins)]
    return torch.cat(as_bytes, dim=-1).contiguous()


def unpack_int8(packed: torch.Tensor) -> torch.Tensor:
    """The kernel's int8 tiles back as q ``[out, in]``."""
    return _untiles(packed).flatten(1).contiguous()


def unpack_int4(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``pack_int4``'s inverse."""
    tiles, groups, _ = packed.shape
    q_bytes = TILE * GROUP_SIZE // 2
    nibbles = packed[..., :q_bytes].reshape(tiles, groups, -1, TILE * INT4_LANE)
    vectors = torch.cat([nibbles & 15, nibbles >> 4], dim=2)
    lanes = vectors.reshape(tiles, groups, -1, TILE, INT4_LANE).transpose(2, 3)  # [tiles, groups, rows, 8, 4]
    q = _untiles(lanes.reshape(tiles, groups, TILE, GROUP_SIZE)).reshape(tiles * TILE, groups * GROUP_SIZE)
    scales, mins = (_untiles(packed[..., start:start + 2 * TILE].contiguous().view(torch.float16)).float()
                    for start in (q_bytes, q_bytes + 2 * TILE))
    return q, scales, mins


def quantize_weight(w: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(qweight, scales)`` in the kernel's layout: int8's packed q and per-row scales, or int4's
    packed groups (their scales inside) and None.

    A block of about ``QUANTIZE_BLOCK`` weights at a time, its tiles written into place: the float32
    temporaries of quantizing are a block's, not the weight's (a 1B model's LM head, whole, took
    several float32 copies of 400 MB each), and no block's packed copy is held beside the result.
    Every row is quantized alone, so the blocks give the bits the whole weight would.
    """
    if not can_quantize(*w.shape):
        raise ValueError(f"a {tuple(w.shape)} weight cannot be quantized (see can_quantize)")
    out_features, in_features = w.shape
    tiles, groups = out_features // TILE, in_features // GROUP_SIZE
    if fmt == "int8":
        qweight = torch.empty(tiles, groups, TILE, GROUP_SIZE, dtype=torch.int8, device=w.device)
        scales = torch.empty(out_features, dtype=torch.float32, device=w.device)
    else:
        qweight, scales = torch.empty(tiles, groups, INT4_GROUP_BYTES, dtype=torch.uint8, device=w.device), None
    for start in range(0, out_features, block_rows(in_features)):
        rows = w[start:start + block_rows(in_features)]
        end = start + rows.shape[0]
        if scales is None:
            qweight[start // TILE:end // TILE] = pack_int4(*quantize_int4(rows))
        else:
            q, scales[start:end] = quantize_int8(rows)  # the block's scales written into place
            qweight[start // TILE:end // TILE] = pack_int8(q)
    return qweight, scales


def block_rows(in_features: int) -> int:
    """Rows of a block of about ``QUANTIZE_BLOCK`` weights: whole tiles, at least one."""
    return max(1, QUANTIZE_BLOCK // in_features // TILE) * TILE


def packed_row_blocks(qweight: torch.Tensor,
                      scales: torch.Tensor | None) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
    """``quantize_weight``'s output as ``(qweight, scales)`` of ``block_rows`` rows each, in order, for
    ``dequantize_packed`` to read back a block at a time."""
    tiles_per_block = block_rows(qweight.shape[1] * GROUP_SIZE) // TILE
    for start in range(0, qweight.shape[0], tiles_per_block):
        rows = slice(start * TILE, (start + tiles_per_block) * TILE)
        yield qweight[start:start + tiles_per_block], None if scales is None else scales[rows]


def dequantize_packed(qweight: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """The float32 ``[out, in]`` weight that ``quantize_weight``'s output stands for."""
    if scales is None:
        return dequantize_int4(*unpack_int4(qweight))
    return dequantize_int8(unpack_int8(qweight), scales)
