"""Inputs every rank can regenerate, and the two references every result is checked against."""

from __future__ import annotations

import hashlib
import random

import torch

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int32]
OPS = ["sum", "avg", "max", "min"]


def ops_for(dtype):
    return [op for op in OPS if not (dtype == torch.int32 and op == "avg")]


def make_input(seed: int, case: int, rank: int, numel: int, dtype, device="cpu") -> torch.Tensor:
    """Fresh random data (never zeros) that any rank can rebuild for any other rank, generated on `device`
    (CUDA's generator gives the same numbers on every GPU of a kind, so GPU ranks need not go through the CPU)."""
    g = torch.Generator(device=device).manual_seed(seed * 1_000_003 + case * 101 + rank)
    if dtype == torch.int32:
        return torch.randint(-1000, 1000, (numel,), generator=g, dtype=torch.int32, device=device)
    return (torch.randn(numel, generator=g, dtype=torch.float64, device=device) * 3 + 0.5).to(dtype)


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fills an output with a value no correct all-reduce produces here."""
    return t.fill_(-123456789 if t.dtype == torch.int32 else float("nan"))


def sequential_fp32(inputs: list[torch.Tensor], op: str) -> torch.Tensor:
    """The exact bits rocenante promises: rank order, fp32 accumulation (int32 wraps), one final rounding."""
    dtype = inputs[0].dtype
    acc = inputs[0].to(torch.int64 if dtype == torch.int32 else torch.float32)
    for x in inputs[1:]:
        x = x.to(acc.dtype)
        if op in ("sum", "avg"):
            acc = acc + x
        elif op == "max":
            acc = torch.maximum(acc, x)  # a NaN wins, as in rocenante
        else:
            acc = torch.minimum(acc, x)
    if dtype == torch.int32:
        return ((acc + 2**31) % 2**32 - 2**31).to(torch.int32)
    if op == "avg":
        acc = acc / torch.tensor(float(len(inputs)), dtype=torch.float32)
    return acc.to(dtype)


def check_against_float64(out: torch.Tensor, inputs: list[torch.Tensor], op: str) -> None:
    """The result is within the dtype's rounding of the float64 all-reduce."""
    xs = torch.stack([x.double().cpu() for x in inputs])
    ref = {"sum": xs.sum(0), "avg": xs.mean(0), "max": xs.max(0).values, "min": xs.min(0).values}[op]
    got = out.double().cpu()
    assert not torch.isnan(got).any(), "output has unwritten (NaN-poisoned) elements"
    if op in ("max", "min") or out.dtype == torch.int32:
        assert torch.equal(got, ref), f"{op} differs from the float64 reference"
        return
    eps = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}[out.dtype]
    scale = xs.abs().sum(0) / (len(inputs) if op == "avg" else 1)
    err = (got - ref).abs()
    bound = eps * scale * (len(inputs) + 1) + 1e-30
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"error {worst:.2f}x the bound for {out.dtype} {op}"


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def add_rmsnorm_float64(partials: list[torch.Tensor], residual: torch.Tensor, gamma: torch.Tensor, eps: float,
                        weight_bias: float):
    """The float64 reference of FlashInfer's kARResidualRMSNorm over the ranks' `partials`: residual_out and
    norm_out, each with the scale its rounding error is bounded by (first order: the sum and residual_out are
    rounded to the dtype, norm_out = residual_out * s * g carries that error times s * |g|, then its own)."""
    xs = torch.stack([p.double().cpu() for p in partials])
    res, g = residual.double().cpu(), gamma.double().cpu() + weight_bias
    r = xs.sum(0) + res
    s = torch.rsqrt(r.square().mean(-1, keepdim=True) + eps)
    norm = r * s * g
    r_scale = xs.abs().sum(0) + res.abs()
    return r, r_scale, norm, r_scale * s * g.abs() + norm.abs()


def check_within(got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor, what: str) -> None:
    """|got - want| <= 8 units of the dtype's rounding times scale, elementwise; no NaN (an unwritten output)."""
    eps = {torch.float32: 2.0**-23, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}[got.dtype]
    got64 = got.double().cpu()
    assert not torch.isnan(got64).any(), f"{what}: NaN (unwritten)"
    worst = ((got64 - want).abs() / (8 * eps * (scale + 1e-3))).max().item()
    assert worst <= 1.0, f"{what}: error {worst:.2f}x the bound for {got.dtype}"


_INT_VIEW = {torch.float32: torch.int32, torch.int32: torch.int32, torch.float16: torch.int16,
             torch.bfloat16: torch.int16}


def bits(t: torch.Tensor) -> torch.Tensor:
    """An integer view: equal views are equal bits (-0.0 and NaN payloads included)."""
    return t.contiguous().view(_INT_VIEW[t.dtype])


def random_bits(seed: int, case: int, rank: int, numel: int, dtype) -> torch.Tensor:
    """Any bit pattern of the dtype (NaN payloads included), the first element -0.0 on odd ranks, a NaN on even."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + case * 101 + rank)
    view = _INT_VIEW[dtype]
    top = 2 ** (8 * torch.empty((), dtype=view).element_size() - 1)
    raw = torch.randint(-top, top, (numel,), generator=g, dtype=torch.int64).to(view)
    raw[0] = -top if rank % 2 else -1
    return raw.view(dtype)


def reduced(inputs, op) -> torch.Tensor:
    """The bits every reduction returns: rank order, fp32 accumulation, one rounding (sequential_fp32), with
    -0.0 as +0.0 (csrc/layout.h: results are sanitized like inputs)."""
    out = sequential_fp32(inputs, op)
    if out.dtype != torch.int32:
        out[out == 0] = 0
    return out


def split_rows(seed: int, case: int, world: int, most: int) -> list[list[int]]:
    """A split all-to-all's rows, rows[s][t] from rank s to rank t, every rank alike: zeros, `most` and `most - 1`
    (a block at its largest and just below), 1, and random sizes."""
    rng = random.Random(seed * 7919 + case)
    picks = [0, 1, most, max(most - 1, 0)]
    return [[rng.choice(picks) if rng.random() < 0.5 else rng.randint(0, most) for _ in range(world)]
            for _ in range(world)]


def split_block(seed: int, case: int, sender: int, receiver: int, world: int, rows: int, row: int, dtype):
    """The block `sender` sends `receiver`: rows x row elements of any bits (-0.0 and NaN payloads included)."""
    if rows == 0:
        return torch.empty(0, row, dtype=dtype)
    return random_bits(seed, case, sender * world + receiver, rows * row, dtype).reshape(rows, row)
