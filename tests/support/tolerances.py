"""Tolerances derived from the formats' arithmetic or from an exact run, never measured on one machine.

Results depend on which kernels take the sums and in what order, and that differs from one CPU to another
(AVX-512 against AVX2 or AMX, blocked products of other widths) and with XLA's code generation
(``--xla_cpu_max_isa``). That holds for fp32 as much as for bf16: a fused whole-model backward and per-layer
backwards sum in other orders, and Adam turns the rounding into lr-sized differences in near-zero leaves. So a
bound in this suite is one of three kinds:

**Bitwise, for the same arithmetic.** Two zinfjax paths that run the same compiled operations in the same order
(tier against tier, prefetch depth, reuse, donation, resume) must agree to the bit (``assert_bitwise``).

**A priori, for one operation.** Rounding to nearest puts a value within the unit roundoff ``u = 2^-p`` of
itself, relative, for a format with ``p`` significand bits (the implicit bit counted): bf16 ``2^-8``, fp16
``2^-11``, fp32 ``2^-24``. A sum of ``n`` terms accumulated in fp32, in any order and any blocking, is within
``gamma_n = n u32 / (1 - n u32)`` of the exact sum, relative to the sum of the terms' magnitudes (Higham,
*Accuracy and Stability of Numerical Algorithms*, eq. 3.4). So a product of bf16 operands accumulated in fp32
and rounded once to bf16 is within

    |got - exact| <= u_out |exact| + (1 + u_out) gamma_n (|a| @ |b|)

of the exact product (:func:`product_bound`).

**Relative to an exact run, for whole models and runs.** Errors compound through a network's layers and through
many optimizer steps, and no useful a-priori bound exists there. Such a test runs three things: a computation
that does not depend on the summation order, a trusted reference in the format under test, and zinfjax. For an
fp32 run the exact computation is the same in-memory loop in float64 (``jax.enable_x64``, from the same fp32
initial parameters: ``tests.support.engine_helpers.exact_run``); for a bf16 run it is the fp32 run. zinfjax
must be no farther from it than the reference is (:func:`assert_no_farther`): it loses no more to the format
than the reference does.

Why these slacks, and why a defect is still caught. Every sum zinfjax takes has the same terms and the same
length ``n`` as the reference's, only in another order or blocking, so the a-priori bound ``gamma_n`` on its
rounding is the reference's too. Their distances from the exact run are two draws of one error: a part both
share (each step's rounding of the parameters to the format, the element-wise ops) and an order-dependent
part of the same size for both. Two draws of an error spread over ``k`` independent values have norms whose
squared ratio is F(k, k)-distributed; its spread shrinks as ``k`` grows (log-variance about ``4 / k``):

- bf16 against fp32: the error is spread over the 10^5 and more values of a parameter tree, and a quarter
  (``SLACK``) covers the spread (mixed-precision engine 1.42e-3 against 2.09e-3, docs/engine.md).
- fp32 against float64: the shared part dominates where the orders agree (the engine on device against the
  optax loop, 1.086e-6 and 1.086e-6 after 20 steps), but Adam turns the rounding of near-zero gradients into
  lr-sized steps, so a few values can carry most of the error and ``k`` is far smaller. So ``k`` is measured:
  the reference's error ``e`` (its values less the exact run's) counts ``(sum e^2)^2 / sum e^4`` effective
  values (:func:`effective_values`: ``n`` for an error spread evenly over ``n`` values, 1 for one value). The
  norm ratio of two such draws has a log of standard deviation about ``1 / sqrt(k)``, so it passes
  ``exp(4.75 / sqrt(k))`` with probability under 1e-6 (:func:`fp32_slack`); never less than ``FP32_SLACK``
  (2), which covers 50 effective values and more. Measured: the remat trainer and the tile-streamed engine
  at 1.33-1.37 of the fp32 loop's distance, a frozen-half GPT-2 at 1.78 under the SSE4.2 kernels.
- A run's losses are 5 to 20 scalars, single draws that scatter more: ``LOSS_SLACK`` allows twice.

A defect (a wrong gradient, a missed update, a stale layer, a wrong transpose) puts zinfjax 100 times or more
beyond what these allow (tests/test_tolerances.py plants each).

>>> unit_roundoff("bf16"), unit_roundoff("fp16"), unit_roundoff("float32") == 2.0**-24
(0.00390625, 0.00048828125, True)
>>> round(gamma(64) / 2.0**-24, 3)  # 64 terms in fp32: about 64 units of fp32
64.0
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from tests.support.engine_helpers import ZERO_GRADIENT_LEAVES, relative_error

SLACK = 1.25  # zinfjax's distance from the exact run may exceed the reference's by a quarter (module docstring)
LOSS_SLACK = 2.0  # a run's few losses are scalars, whose distances from the exact run scatter more (loss_distance)
FP32_SLACK = 2.0  # fp32 against float64, the least slack: 50 effective values or more (fp32_slack, docstring)
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
                      slack: float | None = None, floor: float = 0.0) -> tuple[float, float]:
    """``ours`` is no farther from ``exact`` than ``reference`` is (or than ``floor``, where larger), within ``slack``.

    ``floor`` is for one computation whose a-priori bound is known: a single update whose longest sum has ``n``
    terms may lie ``gamma(n)`` from the exact one in any order, and a reference that lands nearer by chance
    (XLA's tree reductions often do) is no bar another order must clear.

    ``exact`` is the order-independent truth: the float64 run for fp32 results, the fp32 run for bf16 ones.
    ``distance`` is whole-tree relative L2 by default, less the leaves whose true gradient is zero
    (``tests.support.engine_helpers.relative_error``); :func:`loss_distance` compares two runs' losses. Returns both
    distances, so a test can print them (``ZINFJAX_PRINT_TOLERANCES=1`` prints every one).
    """
    if slack is None:
        fp32 = distance is not loss_distance and _is_float64(exact)
        slack = LOSS_SLACK if distance is loss_distance else fp32_slack(exact, reference) if fp32 else SLACK
    ref, got = distance(exact, reference), distance(exact, ours)
    bar = max(ref, floor)
    if os.environ.get("ZINFJAX_PRINT_TOLERANCES"):
        print(f"\ntolerance: {got:.3e} against {ref:.3e}{f' (at least {floor:.3e})' if floor else ''}, "
              f"{got / bar:.3f} of {slack:.2f}")
    assert bar > 0, "the reference equals the exact computation: it tests nothing about rounding"
    assert got <= slack * bar, (f"{got:.3e} from the exact run, against the reference's {ref:.3e}"
                                f"{f' (at least {floor:.3e})' if floor else ''} (slack {slack})")
    return ref, got


def effective_values(exact, reference) -> float:
    """Over how many values the reference's error is spread: ``(sum e^2)^2 / sum e^4`` for ``e = reference -
    exact``, less the leaves whose true gradient is zero (as ``relative_error`` leaves them out).

    >>> round(effective_values([np.zeros(100)], [np.full(100, 1e-7)])), effective_values([np.zeros(4)], [np.eye(4)[0]])
    (100, 1.0)
    """
    e = np.concatenate([np.ravel(np.float64(r) - np.float64(x)) for x, r in _kept(exact, reference)] or [np.zeros(1)])
    e2 = e * e
    return float(np.sum(e2) ** 2 / np.sum(e2 * e2)) if np.any(e2) else float("inf")


def fp32_slack(exact, reference) -> float:
    """The slack of an fp32 result against float64: ``exp(4.75 / sqrt(k))`` for ``k`` :func:`effective_values`,
    at least ``FP32_SLACK`` (module docstring).

    >>> fp32_slack([np.zeros(100)], [np.full(100, 1e-7)]), round(fp32_slack([np.zeros(2)], [np.ones(2)]), 2)
    (2.0, 28.75)
    """
    return max(FP32_SLACK, float(np.exp(4.75 / np.sqrt(effective_values(exact, reference)))))


def _kept(a, b):
    """The pairs of leaves ``relative_error`` compares: less those whose true gradient is zero."""
    pairs = [(jax.tree_util.keystr(p), x) for p, x in jax.tree_util.tree_leaves_with_path(a)]
    return [(x, y) for (k, x), y in zip(pairs, jax.tree.leaves(b), strict=True) if k not in ZERO_GRADIENT_LEAVES]


def _is_float64(tree) -> bool:
    """Whether ``tree`` is an exact run in float64 (its floating leaves are), so the fp32 rule applies."""
    floats = [np.asarray(x).dtype for x in jax.tree.leaves(tree) if np.issubdtype(np.asarray(x).dtype, np.floating)]
    return bool(floats) and all(d == np.float64 for d in floats)


def in_float64(tree):
    """``tree``'s floating leaves as float64 numpy arrays (the others as they are): an fp32 run's starting point,
    for its exact twin under ``jax.enable_x64``.

    >>> in_float64({"w": np.ones(2, np.float32), "n": np.int32(3)})["w"].dtype
    dtype('float64')
    """
    def one(x):
        x = np.asarray(x)
        return x.astype(np.float64) if np.issubdtype(x.dtype, np.floating) else x
    return jax.tree.map(one, tree)


def assert_run_no_farther(exact, reference, ours) -> None:
    """A run's parameters and its losses, each no farther from ``exact`` than ``reference``'s: each argument is a
    run's ``(losses, params)``, as ``tests.support.engine_helpers.reference_run`` and ``exact_run`` return them.

    The reference's distance counts as at least :func:`steps_floor`: each of the run's steps rounds every parameter
    to fp32 once, so ``s`` steps may lie ``s u`` from the exact run in any order, and a reference that lands nearer
    by chance (lamb over 5 steps: 5.4e-8, under one unit) is no bar another order must clear.
    """
    floor = steps_floor(len(exact[0]))
    assert_no_farther(exact[1], reference[1], ours[1], floor=floor)
    assert_no_farther(exact[0], reference[0], ours[0], loss_distance, floor=floor)


def steps_floor(steps: int) -> float:
    """How far ``steps`` fp32 steps may lie from the exact run by the rounding of their updates alone: ``steps u``.

    >>> steps_floor(5) == 5 * 2.0**-24
    True
    """
    return steps * unit_roundoff("fp32")


def assert_loss_no_farther(exact, reference, ours, terms: int) -> tuple[float, float]:
    """Losses of a forward pass from the same parameters, or of a run a few steps long (whose distances from the
    exact run are still a few units of fp32): each no farther from the exact loss than the reference's, within
    ``LOSS_SLACK`` (:func:`loss_distance`), the reference's distance taken as at least ``gamma(terms)``.

    Such a loss is the mean of ``terms`` token losses of one sign, and the order of that last sum alone moves an fp32
    result by up to ``gamma(terms)`` of it (a priori, module docstring): a reference that lands nearer the exact
    value by chance is no bar another order must clear. Returns both distances.

    >>> assert_loss_no_farther([1.0], [1.0 + 2**-24], [1.0 - 2**-22], terms=64)
    (5.960464477539063e-08, 2.384185791015625e-07)
    """
    exact, reference, ours = (np.atleast_1d(np.asarray(x, np.float64)) for x in (exact, reference, ours))
    ref, got = loss_distance(exact, reference), loss_distance(exact, ours)
    bar = max(ref, gamma(terms))
    if os.environ.get("ZINFJAX_PRINT_TOLERANCES"):
        print(f"\ntolerance: {got:.3e} against {ref:.3e} (at least {gamma(terms):.3e}), {got / bar:.3f} of "
              f"{LOSS_SLACK}")
    assert got <= LOSS_SLACK * bar, f"{got:.3e} from the exact loss, against the reference's {ref:.3e} (at least " \
                                    f"gamma({terms}) = {gamma(terms):.3e}; slack {LOSS_SLACK})"
    return ref, got
