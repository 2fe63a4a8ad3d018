"""Tolerances for low-precision results, derived from the formats' arithmetic, never measured on one machine.

Results in bf16 and fp16 depend on which kernels take the sums and in what order, and that differs from one
CPU to another (AVX-512 BF16 against AMX-BF16) and with XLA's code generation (``--xla_cpu_max_isa``). So a
bound in this suite is one of two kinds:

**A priori, for one operation.** Rounding to nearest puts a value within the unit roundoff ``u = 2^-p`` of
itself, relative, for a format with ``p`` significand bits (the implicit bit counted): bf16 ``2^-8``, fp16
``2^-11``, fp32 ``2^-24``. A sum of ``n`` terms accumulated in fp32, in any order and any blocking, is within
``gamma_n = n u32 / (1 - n u32)`` of the exact sum, relative to the sum of the terms' magnitudes (Higham,
*Accuracy and Stability of Numerical Algorithms*, eq. 3.4). So a product of bf16 operands accumulated in fp32
and rounded once to bf16 is within

    |got - exact| <= u_out |exact| + (1 + u_out) gamma_n (|a| @ |b|)

of the exact product (:func:`product_bound`).

**Relative to a reference, for whole models and runs.** Errors compound through a network's layers and through
many optimizer steps, and no useful a-priori bound exists there. Such a test runs three things: the exact
computation in fp32, a trusted low-precision reference (autodiff's own product, the in-memory mixed-precision
loop), and zinfjax. zinfjax must be no farther from fp32 than the reference is (:func:`assert_no_farther`): it
loses no more to the compute dtype than the reference does. Two roundings of the same computation lie at the
same distance from the exact one up to the spread of that distance; ``SLACK`` allows a quarter for that spread.
A defect (a wrong transpose, a dropped scale, a stale layer) puts zinfjax O(1) away from fp32, far outside it.

>>> unit_roundoff("bf16"), unit_roundoff("fp16"), unit_roundoff("float32") == 2.0**-24
(0.00390625, 0.00048828125, True)
>>> round(gamma(64) / 2.0**-24, 3)  # 64 terms in fp32: about 64 units of fp32
64.0
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np

from tests.support.engine_helpers import relative_error

SLACK = 1.25  # zinfjax's distance from fp32 may exceed the reference's by a quarter (see the module docstring)
LOSS_SLACK = 2.0  # a run's few losses are scalars, whose distances from fp32 scatter more (see loss_distance)
_NAMES = {"bf16": jnp.bfloat16, "fp16": jnp.float16, "fp32": jnp.float32}


def unit_roundoff(dtype) -> float:
    """``2^-p`` for a float format with ``p`` significand bits: one rounding to nearest is within it, relative."""
    return 2.0 ** -(jnp.finfo(_NAMES.get(dtype, dtype)).nmant + 1)


def gamma(n: int, dtype="fp32") -> float:
    """The bound on the relative error of an ``n``-term sum accumulated in ``dtype``, against the terms' sum of
    magnitudes: ``n u / (1 - n u)``."""
    nu = n * unit_roundoff(dtype)
    assert nu < 1, f"{n} terms exceed what {dtype} accumulation bounds"
    return nu / (1 - nu)


def product_bound(a: np.ndarray, b: np.ndarray, out_dtype) -> np.ndarray:
    """Per value, how far ``a @ b`` taken with fp32 accumulation and rounded to ``out_dtype`` may lie from the exact
    product (float64 operands, contracted over ``a``'s last and ``b``'s first axis)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    u = unit_roundoff(out_dtype)
    return u * np.abs(a @ b) + (1 + u) * gamma(a.shape[-1]) * (np.abs(a) @ np.abs(b))


def assert_rounds_once(got, a, b) -> None:
    """``got`` (a low-precision product) is within :func:`product_bound` of the exact ``a @ b``."""
    exact = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
    excess = np.abs(np.asarray(got, np.float64) - exact) - product_bound(a, b, got.dtype)
    assert np.all(excess <= 0), f"{int(np.sum(excess > 0))} values beyond the bound, by up to {excess.max():.2e}"


def loss_distance(a, b) -> float:
    """The largest relative difference between two runs' losses, step by step.

    A parameter tree's distance averages the roundings of 10^5 values, so two roundings of one computation sit
    at nearly the same distance from fp32. A run's losses are 5 to 10 scalars, each the rounding of one long
    sum, and their distances scatter as single draws do; held with ``LOSS_SLACK``, they are allowed twice the
    reference's largest distance: zinfjax's losses stay inside the band bf16 opens around the fp32 run.
    """
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b) / np.abs(a)))


def assert_no_farther(exact, reference, ours, distance=relative_error,
                      slack: float | None = None) -> tuple[float, float]:
    """``ours`` is no farther from ``exact`` (the fp32 computation) than ``reference`` is, within ``slack``.

    ``distance`` is whole-tree relative L2 by default, less the leaves whose true gradient is zero
    (``tests.support.engine_helpers.relative_error``); :func:`loss_distance` compares two runs' losses. Returns both
    distances, so a test can print them.
    """
    if slack is None:
        slack = LOSS_SLACK if distance is loss_distance else SLACK
    ref, got = distance(exact, reference), distance(exact, ours)
    if os.environ.get("ZINFJAX_PRINT_TOLERANCES"):
        print(f"\ntolerance: {got:.3e} against {ref:.3e}, {got / ref:.2f} of {slack}")
    assert ref > 0, "the reference equals the fp32 computation: it tests nothing about low precision"
    assert got <= slack * ref, f"{got:.3e} from fp32, against the reference's {ref:.3e} (slack {slack})"
    return ref, got
