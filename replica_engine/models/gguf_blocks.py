"""GGUF's quantized blocks read as they are, into codes and scales (`code * d + m`) that
kernels.quantized_weight packs: no value is dequantized or requantized on the way. Block layouts
are llama.cpp's (ggml-quants.c); each decoder is tested against gguf-py's dequantize."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from replica_engine.kernels.quantized_weight import QuantizedWeight, pack_quantized


@dataclass(frozen=True)
class BlockCodes:
    codes: torch.Tensor  # uint8 [N, K], one code per byte
    d: torch.Tensor  # float32 [N, K / group]
    m: torch.Tensor
    bits: int
    group: int

    def packed(self) -> QuantizedWeight:
        return pack_quantized(self.codes, self.d, self.m, self.bits, self.group)

    def rows(self, rows: torch.Tensor) -> BlockCodes:
        """These output rows, in this order."""
        return BlockCodes(self.codes[rows], self.d[rows], self.m[rows], self.bits, self.group)


def _half(raw: torch.Tensor, offset: int) -> torch.Tensor:
    """The float16 at `offset` of every block, as float32 [..., 1]."""
    return raw[..., offset : offset + 2].contiguous().view(torch.float16).float()


def _blocks(data: torch.Tensor, block_bytes: int) -> torch.Tensor:
    rows = data.shape[0]
    return data.reshape(rows, -1, block_bytes)  # [N, blocks per row, bytes]


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(x.shape[0], -1)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """16 bytes -> 32 codes: the low nibbles are elements 0-15, the high ones 16-31."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1)


def q4_0(data: torch.Tensor) -> BlockCodes:  # d fp16, 16 bytes of nibbles; w = d * (q - 8)
    raw = _blocks(data, 18)
    d = _half(raw, 0)
    return BlockCodes(_rows(_nibbles(raw[..., 2:])), _rows(d), _rows(-8 * d), 4, 32)


def q4_1(data: torch.Tensor) -> BlockCodes:  # d, m fp16, 16 bytes of nibbles; w = d * q + m
    raw = _blocks(data, 20)
    return BlockCodes(_rows(_nibbles(raw[..., 4:])), _rows(_half(raw, 0)), _rows(_half(raw, 2)), 4, 32)


def q8_0(data: torch.Tensor) -> BlockCodes:  # d fp16, 32 int8; w = d * q = d * (q + 128) - 128 d
    raw = _blocks(data, 34)
    d = _half(raw, 0)
    codes = (raw[..., 2:].view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
    return BlockCodes(_rows(codes), _rows(d), _rows(-128 * d), 8, 32)


def q4_k(data: torch.Tensor) -> BlockCodes:
    """256 values: d, dmin fp16, 12 bytes of 6-bit (scale, min) pairs for 8 sub-blocks of 32, 128
    bytes of nibbles (each 32 bytes: a sub-block in the low nibbles, the next in the high ones).
    w = d * scale * q - dmin * min."""
    raw = _blocks(data, 144)
    d, dmin = _half(raw, 0), _half(raw, 2)
    s = raw[..., 4:16].to(torch.int32)
    low = torch.cat((s[..., 0:4] & 63, (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)), dim=-1)
    mins = torch.cat((s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)), dim=-1)
    qs = raw[..., 16:].reshape(*raw.shape[:2], 4, 32)
    codes = torch.stack((qs & 0x0F, qs >> 4), dim=3)  # [N, blocks, 4, 2, 32]: sub-blocks in order
    return BlockCodes(_rows(codes), _rows(d * low), _rows(-dmin * mins), 4, 32)


def q6_k(data: torch.Tensor) -> BlockCodes:
    """256 values: 128 bytes of low nibbles, 64 of 2-bit high parts, 16 int8 scales (one per 16
    values), d fp16. w = d * scale * (q - 32), q of 6 bits."""
    raw = _blocks(data, 210)
    ql = raw[..., :128].reshape(*raw.shape[:2], 2, 64)  # two halves of 128 values
    qh = raw[..., 128:192].reshape(*raw.shape[:2], 2, 1, 32)
    scales = raw[..., 192:208].view(torch.int8).float()
    d = _half(raw, 208)
    low = torch.stack((ql[..., :32] & 0x0F, ql[..., 32:] & 0x0F, ql[..., :32] >> 4, ql[..., 32:] >> 4), dim=3)
    high = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)) & 3  # [N, blocks, 2, 4, 32]
    codes = low | (high << 4)  # value 32 * part + l of each half
    sub_scale = d * scales  # [N, blocks, 16]
    return BlockCodes(_rows(codes), _rows(sub_scale), _rows(-32 * sub_scale), 8, 16)


DECODERS: dict[str, Callable[[torch.Tensor], BlockCodes]] = {
    "Q4_0": q4_0,
    "Q4_1": q4_1,
    "Q8_0": q8_0,
    "Q4_K": q4_k,
    "Q6_K": q6_k,
}
