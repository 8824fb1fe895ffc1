"""The error an fp8 matmul may make, derived from the formats (for tests/test_fp8.py).

A value ``v`` cast with scale ``s`` (``s · amax = fmax``, or up to 2x less when scales
are rounded down to powers of 2) is stored as ``q = round(s·v)`` in a format with ``m``
mantissa bits. For a normal ``q`` the rounding error is at most half a unit in the last
place: ``|q − s·v| <= 2^-(m+1) · |s·v|``, so ``u = 2^-4`` for e4m3 (3 bits) and ``2^-3``
for e5m2 (2 bits). Below the smallest normal number the spacing is fixed (2^-9 for e4m3,
2^-16 for e5m2), so the error is at most half of it in scaled units, ``d = 2^-10 / s``
(e4m3) or ``2^-17 / s`` (e5m2), also for values flushed to zero. Hence, per element,

    |v̂ − v| <= u |v| + d.

A product of two cast values then errs by ``|âb̂ − ab| <= (ua + ub + ua·ub)|a||b| +
(1 + ub) d_a |b| + (1 + ua) d_b |a| + d_a d_b``, and a dot product of K terms by the sum
of those (the fp32 accumulation adds ~K·2^-24, negligible), plus the rounding of the
result to its dtype (bf16: ``2^-8`` relative). That is :func:`worst_case`, a bound every
element must meet.

It is loose (the K rounding errors have random signs), so it cannot tell e4m3 from e5m2.
:func:`rms_model` is the typical size instead: a rounding error is uniform over half an
ULP either way, ``2^-(m+1)·2^e`` at most; relative to a value whose mantissa is spread
over [1, 2) log-uniformly its mean square is ``u²/3 · E[1/mant²] = u²/3 · 3/(8 ln 2)``.
With independent errors the output error's mean square is the sum over the K terms of
``(r_a² + r_b²)·a²b²``. A test checks the measured RMS against this model within a
factor (2x above, 4x below), which a cast in the wrong format (2x the error) fails.
"""

from __future__ import annotations

import math

import torch

FORMATS = {  # mantissa bits, largest finite value, subnormal spacing
    torch.float8_e4m3fn: (3, 448.0, 2.0**-9),
    torch.float8_e5m2: (2, 57344.0, 2.0**-16),
}
BF16_REL = 2.0**-8  # bf16 rounding of a result: 7 stored mantissa bits, half an ULP


def unit(dtype: torch.dtype) -> float:
    """Relative rounding error of a normal number: half an ULP, ``2^-(m+1)``."""
    return 2.0 ** -(FORMATS[dtype][0] + 1)


def floor(dtype: torch.dtype, amax: torch.Tensor, pow2: bool) -> torch.Tensor:
    """The absolute error below the normal range, in the tensor's own units: half the
    subnormal spacing over the scale (``fmax / amax``, halved at worst by pow2 rounding)."""
    _, fmax, spacing = FORMATS[dtype]
    scale = fmax / amax.double().clamp(min=1e-12) / (2.0 if pow2 else 1.0)
    return spacing / 2 / scale


def worst_case(
    a: torch.Tensor, b: torch.Tensor, fa: torch.dtype, fb: torch.dtype, pow2: bool, out_rel: float
) -> torch.Tensor:
    """Per-element bound on ``|fp8(a) @ fp8(b) − a @ b|`` for a (M, K), b (K, N) cast
    tensorwise (a row/column scale is at least the tensor's, so the bound covers the
    rowwise recipes too), plus ``out_rel`` of the result's rounding."""
    a64, b64 = a.double().abs(), b.double().abs()
    ua, ub = unit(fa), unit(fb)
    da, db = floor(fa, a64.max(), pow2), floor(fb, b64.max(), pow2)
    k = a.shape[1]
    exact = (a.double() @ b.double()).abs()
    bound = (ua + ub + ua * ub) * (a64 @ b64)
    bound += (1 + ub) * da * b64.sum(0, keepdim=True) + (1 + ua) * db * a64.sum(1, keepdim=True)
    bound += k * da * db
    return bound + out_rel * (exact + bound)


def rms_model(a: torch.Tensor, b: torch.Tensor, fa: torch.dtype, fb: torch.dtype) -> float:
    """The RMS of the error of ``fp8(a) @ fp8(b)`` if every rounding error were
    independent (see the module docstring)."""
    mean_sq = 3 / (8 * math.log(2)) / 3
    ra2, rb2 = unit(fa) ** 2 * mean_sq, unit(fb) ** 2 * mean_sq
    var = (ra2 + rb2) * (a.double().square() @ b.double().square())
    return var.mean().sqrt().item()
