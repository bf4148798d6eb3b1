"""Smaller payloads: average the change since the last round, compressed, with error feedback.

With `payload` = fp32 (the default) a round allreduces the float32 parameters, as Su & Chen
(2015). Otherwise every rank i sends its block's change d_i = W_i - W_g, W_g the global model
the block started from (the same on every rank), in fewer bits:

bf16, fp16
    each value rounded to nearest in the 16-bit format (fp16 saturates at its largest finite
    value, 65504, rather than overflowing to inf): 2 n bytes.
int (payload_bits b in 4, 8, 16)
    per chunk of CHUNK = 1024 values one float32 scale s = max|x| / q, q = 2^(b-1) - 1, and
    symmetric integer codes c = round(x / s) in [-q, q] (round half to even: deterministic, no
    stochastic rounding), decoded as c s; 4-bit codes are stored as c + 8 in one nibble, two
    per byte (the even index in the low nibble). n b / 8 bytes of codes (rounded up for
    b = 4) + 4 ceil(n / CHUNK) of scales. |x - c s| <= s / 2 = max|x| / (2 q) per chunk.

Error feedback (Seide et al. 2014, "1-bit stochastic gradient descent and its application to
data-parallel distributed training of speech DNNs", Sec. 3; Karimireddy et al. 2019, "Error
Feedback Fixes SignSGD and other Gradient Compression Schemes", Algorithm 2, EF-SGD): each
rank keeps what compression dropped, e_i, and adds it to its next change:
    v_i = d_i + e_i,   c_i = Q(v_i),   e_i <- v_i - deQ(c_i)
so the sum of what a rank has sent differs from the sum of its changes by e_i alone, bounded
by one round's quantisation error, instead of drifting with the number of rounds.

The ranks gather every c_i (one allgather of bytes, the backend's `allgather`); each rank
decodes all N and adds them in rank order, so every rank computes bitwise the same
    W̄ = W_g + (1/N') Σ_i deQ(c_i)      (in float32, N' the finite ranks)
and the method's outer update (labavg.averaging.methods) runs on W̄ as with fp32. A rank whose
parameters are not finite sends the code of zero, is left out of N', keeps its residual, and
takes W̄ like the others, as labavg.averaging.mean does for fp32.
"""

from __future__ import annotations

import math
import time

import torch

from labavg.averaging.mean import AverageStats, agree
from labavg.comm.base import Communicator
from labavg.averaging.settings import PAYLOAD_BITS, PAYLOADS

CHUNK = 1024  # values sharing one float32 scale in payload = int
_FLOATS = {"bf16": torch.bfloat16, "fp16": torch.float16}
_INTS = {8: torch.int8, 16: torch.int16}


def lossy(payload: str) -> bool:
    """Whether `payload` sends compressed changes rather than the fp32 parameters."""
    return payload != "fp32"


def check(payload: str, bits: int) -> None:
    """ValueError unless `payload` and `bits` name a format."""
    if payload not in PAYLOADS:
        raise ValueError(f"unknown payload {payload!r}; known: {', '.join(PAYLOADS)}")
    if payload == "int" and bits not in PAYLOAD_BITS:
        raise ValueError(f"payload_bits = {bits}: quantisation bits must be 4, 8 or 16")


def payload_bytes(n: int, payload: str, bits: int = 8) -> int:
    """Bytes one rank sends per round for `n` parameters."""
    check(payload, bits)
    if payload == "fp32":
        return 4 * n
    if payload in _FLOATS:
        return 2 * n
    codes = (n + 1) // 2 if bits == 4 else n * bits // 8
    return codes + 4 * math.ceil(n / CHUNK)


def _qmax(bits: int) -> int:
    return 2 ** (bits - 1) - 1


def encode(x: torch.Tensor, payload: str, bits: int = 8) -> torch.Tensor:
    """`x` (flat float32) in the payload's format, as one flat uint8 tensor."""
    check(payload, bits)
    if payload == "fp32":
        return x.detach().clone().view(torch.uint8)
    if payload in _FLOATS:
        dtype = _FLOATS[payload]
        big = torch.finfo(dtype).max
        # Saturate: an overflow to inf would make the whole average non-finite.
        return x.clamp(-big, big).to(dtype).view(torch.uint8)
    n = x.numel()
    q = _qmax(bits)
    chunks = math.ceil(n / CHUNK)
    padded = torch.zeros(chunks * CHUNK, dtype=torch.float32, device=x.device)
    padded[:n] = x
    blocks = padded.view(chunks, CHUNK)
    scales = blocks.abs().amax(dim=1) / q
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(blocks / safe[:, None]).clamp_(-q, q).reshape(-1)[:n]
    if bits == 4:
        nibbles = (codes + 8).to(torch.uint8)
        if n % 2:
            nibbles = torch.cat([nibbles, nibbles.new_full((1,), 8)])
        packed = nibbles[0::2] | (nibbles[1::2] << 4)
    else:
        packed = codes.to(_INTS[bits]).view(torch.uint8)
    return torch.cat([scales.view(torch.uint8), packed])


def _view(data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`data`'s bytes as `dtype`; copied first where they do not start on its alignment (one
    rank's part of the gathered bytes, an int4 payload's scales)."""
    size = torch.empty((), dtype=dtype).element_size()
    if data.storage_offset() % size:
        data = data.clone()
    return data.view(dtype)


def decode(data: torch.Tensor, n: int, payload: str, bits: int = 8) -> torch.Tensor:
    """The float32 values (a new flat tensor of `n`) that `encode` wrote into `data`."""
    check(payload, bits)
    if data.numel() != payload_bytes(n, payload, bits):
        raise ValueError(f"a {payload} payload of {n} values holds "
                         f"{payload_bytes(n, payload, bits)} bytes, got {data.numel()}")
    if payload == "fp32":
        return _view(data.clone(), torch.float32)
    if payload in _FLOATS:
        return _view(data, _FLOATS[payload]).to(torch.float32)
    chunks = math.ceil(n / CHUNK)
    scales = _view(data[:4 * chunks], torch.float32)
    packed = data[4 * chunks:]
    if bits == 4:
        nibbles = torch.stack([packed & 0x0F, packed >> 4], dim=1).reshape(-1)[:n]
        codes = nibbles.to(torch.float32) - 8.0
    else:
        codes = _view(packed, _INTS[bits]).to(torch.float32)
    padded = torch.zeros(chunks * CHUNK, dtype=torch.float32, device=data.device)
    padded[:n] = codes
    return (padded.view(chunks, CHUNK) * scales[:, None]).reshape(-1)[:n]


def error_bound(x: torch.Tensor, payload: str, bits: int = 8) -> torch.Tensor:
    """Elementwise bound on |x - decode(encode(x))| (x finite and within fp16's range).

    Round to nearest: half an ulp of the 16-bit format (8 significant bits for bf16, 11 for
    fp16, plus fp16's subnormal spacing 2^-24); for int half a chunk's step, plus float32
    rounding of the division and the product.
    """
    check(payload, bits)
    a = x.abs()
    if payload == "fp32":
        return torch.zeros_like(a)
    if payload == "bf16":
        return a * 2.0**-8
    if payload == "fp16":
        return a * 2.0**-11 + 2.0**-25
    n = x.numel()
    chunks = math.ceil(n / CHUNK)
    padded = torch.zeros(chunks * CHUNK, dtype=torch.float32, device=x.device)
    padded[:n] = a
    step = padded.view(chunks, CHUNK).amax(dim=1) / _qmax(bits)
    per_value = step.repeat_interleave(CHUNK)[:n]
    return per_value * (0.5 + 2.0**-20) + a * 2.0**-22


def average_changes(flat: torch.Tensor, comm: Communicator, base: torch.Tensor,
                    residual: torch.Tensor | None, payload: str, bits: int = 8, *,
                    stop: bool = False) -> AverageStats:
    """Replace `flat` on every rank with W̄ = base + the mean of the ranks' decoded changes.

    `base` is W_g, the same on every rank; `residual` this rank's e_i (updated in place), None
    without error feedback. Every rank ends with bitwise the same `flat`. If no rank is finite,
    every rank takes `base` back. `bytes_sent` is this rank's encoded change.
    """
    check(payload, bits)
    start = time.perf_counter()
    finite, dropped, agreed_stop = agree(flat, comm, stop)
    if dropped == comm.size:
        flat.copy_(base)
        return AverageStats(0.0, time.perf_counter() - start, finite, dropped, agreed_stop)
    if comm.size == 1:
        return AverageStats(0.0, time.perf_counter() - start, finite, dropped, agreed_stop)
    n = flat.numel()
    if finite:
        v = flat - base
        if residual is not None:
            v.add_(residual)
        sent = encode(v, payload, bits)
        if residual is not None:
            torch.sub(v, decode(sent, n, payload, bits), out=residual)
    else:
        sent = encode(torch.zeros_like(flat), payload, bits)
    gathered = torch.empty(comm.size * sent.numel(), dtype=torch.uint8, device=sent.device)
    comm.allgather(sent, gathered)
    total = torch.zeros_like(flat)
    for part in gathered.view(comm.size, sent.numel()):
        total.add_(decode(part, n, payload, bits))
    total.div_(comm.size - dropped)
    before = flat.clone() if finite else None
    torch.add(base, total, out=flat)
    seconds = time.perf_counter() - start
    divergence = 0.0
    if before is not None:
        avg_norm = torch.linalg.vector_norm(flat).item()
        dist = torch.linalg.vector_norm(before - flat).item()
        divergence = dist / avg_norm if avg_norm > 0 else 0.0
    return AverageStats(divergence, seconds, finite, dropped, agreed_stop, sent.numel())
