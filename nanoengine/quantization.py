"""Weight-only quantization: the formats, their round trips, and the matmul over each.

A decode step at batch 1 reads every weight once per token, so its speed is set by the bytes of
weight it streams (gpt-fast's lesson). Storing weights in 8 or 4 bits cuts those bytes; the
activations stay in the model's dtype and each weight is widened as it is read.

- ``int8``: one scale per output channel (row), symmetric: w ~ q * scale, q in [-127, 127].
- ``int4``: groups of ``GROUP_SIZE`` along the input dimension, each with a scale and a minimum
  (GGUF's Q4_1): w ~ q * scale + min, q in [0, 15].

The matmuls are torch's own CPU ops (``torch._weight_int8pack_mm``, gpt-fast's int8 path, and
``aten._weight_int4pack_mm_for_cpu``); ``layers.Linear.quantize`` switches a layer over to them.
"""

import torch

FORMATS = ("int8", "int4")
GROUP_SIZE = 32  # int4: input-dimension weights sharing one scale and minimum, as in GGUF's Q4_1


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w ``[out, in]`` as int8 ``q`` and float32 ``scales [out]``: each row's largest magnitude
    maps to 127, so every weight is off by at most half a step (scale / 2)."""
    scales = w.float().abs().amax(dim=1).clamp(min=1e-12) / 127
    q = torch.round(w.float() / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return q.float() * scales.float()[:, None]


def quantize_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w ``[out, in]`` as ``q`` (uint8 values 0..15, same shape) and float32 ``scales`` and
    ``mins`` ``[out, in / GROUP_SIZE]``: each group's range split into 15 steps, so every weight
    is off by at most half a step (scale / 2)."""
    out_features, in_features = w.shape
    groups = w.float().reshape(out_features, in_features // GROUP_SIZE, GROUP_SIZE)
    mins, maxs = groups.amin(dim=-1), groups.amax(dim=-1)
    scales = (maxs - mins).clamp(min=1e-12) / 15
    q = torch.round((groups - mins[..., None]) / scales[..., None]).clamp(0, 15).to(torch.uint8)
    return q.reshape(out_features, in_features), scales, mins


def dequantize_int4(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    out_features, in_features = q.shape
    groups = q.float().reshape(out_features, in_features // GROUP_SIZE, GROUP_SIZE)
    return (groups * scales[..., None] + mins[..., None]).reshape(out_features, in_features)


def can_quantize(out_features: int, in_features: int, fmt: str) -> bool:
    """Whether torch's op for ``fmt`` takes a weight of this shape: int4 packs 16 rows at a time;
    the int8 op in bf16 crashes (torch 2.13, 64+ rows) unless in_features is a multiple of 8."""
    if fmt == "int8":
        return in_features % 8 == 0
    return in_features % GROUP_SIZE == 0 and out_features % 16 == 0


def quantize_weight(w: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(qweight, scales)`` in the layout ``linear`` reads, scales in w's dtype (the ops want
    them in the activations' dtype).

    int8: q ``[out, in]`` and ``scales [out]``. int4: q packed two to a byte by torch's
    ``_convert_weight_to_int4pack_for_cpu``, and ``scales`` ``[in / GROUP_SIZE, out, 2]``, each
    group's scale and "zero" as the op defines them: w = (q - 8) * scale + zero, so zero is
    min + 8 * scale.
    """
    if not can_quantize(*w.shape, fmt):
        raise ValueError(f"a {tuple(w.shape)} weight cannot be quantized to {fmt} (see can_quantize)")
    if fmt == "int8":
        q, scales = quantize_int8(w)
        return q, scales.to(w.dtype)
    q, scales, mins = quantize_int4(w)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    scales_and_zeros = torch.stack([scales, mins + 8 * scales], dim=-1).transpose(0, 1).contiguous()
    return packed, scales_and_zeros.to(w.dtype)


def linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ W.T + bias`` with W held as ``quantize_weight`` left it; the format is read from
    qweight's dtype (int8, or the int4 ops' packed uint8). The ops take 2-D, row-contiguous x."""
    x2d = x.reshape(-1, x.shape[-1]).contiguous()
    if qweight.dtype == torch.int8:
        out = torch._weight_int8pack_mm(x2d, qweight, scales)
    else:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(x2d, qweight, GROUP_SIZE, scales)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], out.shape[-1])
