"""Weights kept quantized, in the layout of cpu_quantized_format.h: every weight is
`code * d + m`, with unsigned codes of 4 or 8 bits and a float16 (d, m) per output column and group
of 16 or 32 input features. One layout covers GGUF's Q4_0 (m = -8d), Q4_1, Q4_K (its sub-block
scales), Q8_0 (code = q + 128, m = -128d), Q6_K (groups of 16, m = -32d) and our int8
weight-only quantization (per-column symmetric scales: the same d in every group).

Codes sit in 16-column blocks: per block and group, pairs of consecutive k, 32 bytes per pair
(column by column; 4-bit: pair p in the low nibbles, pair p + 8 in the high ones).
`dequantize_rows` reads the layout back with torch ops: the embedding lookup of a quantized tied
embedding, the reference the kernel is tested against, and the path where the kernels cannot be
built."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

COLUMNS = 16  # output columns per block: one float32 vector
FORMATS = ((4, 32), (8, 32), (8, 16))  # (bits, group) the kernel has


@dataclass(frozen=True)
class QuantizedWeight:
    codes: torch.Tensor  # uint8 [blocks, groups, group * 16 * bits / 8]
    scales: torch.Tensor  # float16 [blocks, groups, 2 (d, m), 16]
    out_features: int
    in_features: int
    bits: int
    group: int

    @property
    def nbytes(self) -> int:
        """What a matmul reads: codes and scales."""
        return self.codes.nbytes + self.scales.nbytes


def pack_quantized(
    codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bits: int, group: int
) -> QuantizedWeight:
    """codes [N, K] (one code per byte, < 2**bits), d and m [N, K / group] -> the kernel's layout."""
    if (bits, group) not in FORMATS:
        raise ValueError(f"quantization: no kernel for {bits}-bit codes in groups of {group}; have {FORMATS}")
    n, k = codes.shape
    if k % 32 or d.shape != (n, k // group) or m.shape != d.shape:
        raise ValueError(f"quantization: a [{n}, {k}] weight needs K % 32 == 0 and [N, K / {group}] scales")
    blocks = -(-n // COLUMNS)
    pad = blocks * COLUMNS - n
    codes = torch.nn.functional.pad(codes, (0, 0, 0, pad)).to(torch.uint8)
    pairs = codes.view(blocks, COLUMNS, k // group, group // 2, 2).permute(0, 2, 3, 1, 4)
    if bits == 4:  # pairs 0-7 in the low nibbles, 8-15 in the high ones
        pairs = pairs[:, :, :8] | (pairs[:, :, 8:] << 4)
    packed = pairs.reshape(blocks, k // group, -1).contiguous()

    def by_block(s: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(s.float(), (0, 0, 0, pad)).view(blocks, COLUMNS, -1).transpose(1, 2)

    scales = torch.stack((by_block(d), by_block(m)), dim=2).to(torch.float16).contiguous()
    return QuantizedWeight(packed, scales, n, k, bits, group)


def stack_quantized(weights: list[QuantizedWeight]) -> QuantizedWeight | None:
    """Weights of one shape and format (a layer's experts) as one: codes and scales with a leading
    expert dimension (out_features and in_features stay each one's); None where they differ."""
    first = weights[0]
    shape = (first.out_features, first.in_features, first.bits, first.group)
    if any((w.out_features, w.in_features, w.bits, w.group) != shape for w in weights):
        return None
    codes, scales = torch.stack([w.codes for w in weights]), torch.stack([w.scales for w in weights])
    return replace(first, codes=codes, scales=scales)


def unstacked(stacked: QuantizedWeight, index: int) -> QuantizedWeight:
    """One weight of stack_quantized's: views of its codes and scales."""
    return replace(stacked, codes=stacked.codes[index], scales=stacked.scales[index])


def quantize_int8(weight: torch.Tensor) -> QuantizedWeight:
    """Int8 weight-only, symmetric, one scale per output column (max |w| / 127, in float16)."""
    w = weight.detach().float()
    d = (w.abs().amax(dim=1, keepdim=True) / 127).to(torch.float16).float()
    q = torch.where(d > 0, w / d, 0).round().clamp(-127, 127)
    groups = w.shape[1] // 32
    return pack_quantized((q + 128).to(torch.uint8), d.expand(-1, groups), -128 * d.expand(-1, groups), 8, 32)


def dequantize_rows(weight: QuantizedWeight, rows: torch.Tensor) -> torch.Tensor:
    """Float32 [len(rows), K]: the given output rows (token ids, for an embedding) dequantized."""
    rows = rows.reshape(-1).long()
    count, group = rows.numel(), weight.group
    raw = weight.codes[rows // COLUMNS]  # [R, groups, bytes]
    if weight.bits == 8:
        pairs = raw.view(count, -1, group // 2, COLUMNS, 2)
    else:
        nibbles = raw.view(count, -1, 8, COLUMNS, 2)
        pairs = torch.cat((nibbles & 0x0F, nibbles >> 4), dim=2)
    picked = torch.arange(count, device=rows.device)
    lane = rows % COLUMNS
    codes = pairs.permute(0, 3, 1, 2, 4)[picked, lane].reshape(count, -1, group)  # [R, groups, group]
    scales = weight.scales[rows // COLUMNS].permute(0, 3, 1, 2)[picked, lane].float()  # [R, groups, 2]
    return (codes.float() * scales[..., :1] + scales[..., 1:]).reshape(count, weight.in_features)


def dequantize(weight: QuantizedWeight) -> torch.Tensor:
    """The whole weight, float32 [N, K]."""
    return dequantize_rows(weight, torch.arange(weight.out_features, device=weight.codes.device))
