"""Pieces of the online softmax that every kernel and blockwise loop shares.

The running state of a row is ``(acc, m, l)``: the unnormalised weighted sum of
values, the running maximum logit and the running denominator. The Triton
kernels work in base 2 (logits pre-multiplied by log2(e), ``exp2``); the rest
in base e. All functions are plain ``jnp``/``lax`` on arrays, so they trace the
same inside a Pallas kernel, a ``lax`` loop or plain XLA.
"""

import math

import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["LN2", "LOG2E", "any_false", "clean_unless_garbage", "finish_exp2", "finite_keys",
           "group_sink_column", "join_sink", "lse_exp2", "lse_parts", "lse_parts_exp2",
           "running_max", "sink_grad", "sink_rescale", "snap_ties", "step_exp", "step_exp2",
           "times_log2e"]

F32 = jnp.float32
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


def join_sink(acc, m, l, sink, *, exp=jnp.exp):
    """The state with a sink logit joined: it adds to the denominator only.

    ``sink`` broadcasts with ``m`` (in the state's base: pass ``exp=jnp.exp2``
    and a sink times log2(e) for base 2); ``m`` and ``l`` have one entry per row,
    with or without a trailing axis of 1, and ``acc`` a trailing value axis.
    Returns ``(acc, m, l)``.

    Infinite sinks are defined, not NaN: a sink of -inf is no sink (a row that
    saw nothing keeps ``m = -inf, l = 0``), and a sink of +inf takes all the
    mass (``m = +inf, l = 1, acc = 0``: out 0 and lse +inf).
    """
    a, m, l = sink_rescale(m, l, sink, exp=exp)
    acc = acc * (a[..., None] if a.ndim < acc.ndim else a)
    return acc, m, l


def running_max(m, s, axis: int = -1):
    """The row maximum after a tile of logits ``s``: ``max(m, s.max(axis))``,
    under ``lax.stop_gradient``.

    The maximum only shifts the exponentials: ``out`` and ``lse = m + log(l)``
    do not depend on it, so a constant shift gives them their exact
    derivatives, and the tangent pass (``jax.jvp`` of the blockwise forward)
    skips the derivative of the maximum. That derivative is fragile besides:
    JAX splits it among the logits *equal* to the maximum, and when XLA:CPU's
    fusion computes the same logits twice with different rounding (a fused
    multiply-add in one copy only; an ALiBi slope times a distance plus the
    scores), no logit equals the maximum, and the split is 0 / 0 = NaN. (The
    binary maximum with a sink, :func:`sink_rescale`, keeps its derivative:
    it splits ties without a count, and carries the derivative of lse at a
    sink of +inf.)

    >>> import jax
    >>> jax.grad(lambda s: running_max(jnp.float32(0.0), s).sum())(jnp.ones((2, 3)))
    Array([[0., 0., 0.],
           [0., 0., 0.]], dtype=float32)
    """
    return lax.stop_gradient(jnp.maximum(m, s.max(axis)))


def sink_rescale(m, l, sink, *, exp=jnp.exp):
    """``(a, m, l)`` of :func:`join_sink` without the accumulator: the factor
    ``a`` (one per row) the accumulator is multiplied by, and the joined ``m``
    and ``l``. Elementwise only, so that kernels whose row vectors cannot gain
    an axis (Mosaic GPU's register layouts) scale the accumulator their own way.

    >>> a, m, l = sink_rescale(jnp.array([0.0, -jnp.inf]), jnp.array([1.0, 0.0]), 0.0)
    >>> a.tolist(), m.tolist(), l.tolist()
    ([1.0, 0.0], [0.0, 0.0], [2.0, 1.0])
    """
    m_fin = jnp.maximum(m, sink)
    # -inf: nothing seen and no sink, shift by 0 so both exponentials give 0.
    m_use = jnp.where(m_fin == -jnp.inf, 0.0, m_fin)
    a = exp(m - m_use)
    # sink == m_use covers sink = +inf, where sink - m_use would be inf - inf.
    l = l * a + jnp.where(sink == m_use, 1.0, exp(sink - m_use))
    return a, m_fin, l


def lse_parts(m, l, *, log=jnp.log, scale=1.0):
    """``(lse, lse_lo)`` of a finished row state: ``lse = scale * (m + log(l))``
    rounded to float32, and ``lse_lo`` its rounding error, so that
    ``lse + lse_lo`` carries about twice float32's precision.

    The backward recomputes ``p = exp((s - lse) - lse_lo)``: when every logit
    of a row is huge in magnitude (a bias of -1e30 or ``finfo.min`` on a whole
    row, the usual additive padding mask) ``s - lse`` is exact and ``lse_lo``
    restores the ``log(l)`` that ``lse`` could not hold; ``exp(s - lse)`` alone
    would make the row's probabilities sum to anything from 0 to Tk. Rows with
    ``l = 0`` (nothing seen) give ``lse = -inf``; ``m = +inf`` (an infinite
    sink) gives ``+inf``; a NaN state (a row that saw a non-finite key) gives
    NaN; ``lse_lo`` is 0 for all three. ``scale`` converts a base-2
    state (``log=jnp.log2, scale=ln 2``) to natural logs.
    """
    # l == 0 (not l > 0) picks the empty rows, so that a NaN l stays NaN in lse.
    safe = jnp.where(l == 0, 1.0, l)
    log_l = log(safe) * scale
    m = m * scale
    hi = m + log_l
    lse = jnp.where(l == 0, -jnp.inf, hi)
    # Fast2Sum: exact when |m| >= log_l, which is when it matters (|m| large).
    lo = jnp.where(jnp.isfinite(hi), log_l - (hi - m), 0.0)
    return lse, jnp.where(l == 0, 0.0, lo)


def finite_keys(k, v, *, k_axis: int = -1, v_axis: int = -1, triton: bool = False):
    """``(k, v, bad)`` for keys whose features lie along ``k_axis`` of ``k`` and
    ``v_axis`` of ``v``: non-finite entries replaced by 0 (``where``, never a
    product) and ``bad`` true for the keys whose K or V held one (the two axes
    reduced away must leave the same shape).

    The rule every lowering follows with it: the logits of bad keys become NaN
    *before* the mask (``where(bad, nan, s)``, then ``where(allowed, s, -inf)``),
    so a key a row may not see contributes exactly nothing to it, whatever its
    bits (unused cache slots, pages a sequence does not own, padding), and a row
    that does see a non-finite key gets NaN. The zeroed values keep ``p @ v``
    (p = 0) and, in a backward, ``dS @ k`` (dS = 0) finite.

    ``triton=True`` (inside a Pallas Triton kernel) finds ``bad`` with the
    operations Triton lowers: a float max of 0/1 flags, no boolean reduction
    (and no max of the values themselves, which Triton's ``maxnumf`` takes
    without their NaN). Elsewhere a boolean reduction, which XLA fuses into its
    pass over the keys, where on a CPU it wrote the float flags of the whole
    cache out first (decode, B=8, S=4096, Hkv=2, D=64, f32: 64 MB of
    temporaries against 40).
    """
    fk, fv = jnp.isfinite(k), jnp.isfinite(v)
    if triton:
        bad = jnp.maximum(any_false(fk, k_axis), any_false(fv, v_axis)) > 0
    else:
        bad = jnp.any(~fk, axis=k_axis) | jnp.any(~fv, axis=v_axis)
    return jnp.where(fk, k, jnp.zeros_like(k)), jnp.where(fv, v, jnp.zeros_like(v)), bad


def any_false(x, axis=None, *, keepdims=False):
    """float32 1 where the boolean ``x`` is False somewhere along ``axis``, else 0:
    a float max rather than a boolean reduction, so that Triton kernels lower it
    as XLA does.

    >>> any_false(jnp.array([[True, False], [True, True]]), 1).tolist()
    [1.0, 0.0]
    """
    return jnp.max(jnp.where(x, jnp.float32(0), jnp.float32(1)), axis=axis, keepdims=keepdims)


def clean_unless_garbage(compute):
    """``compute(sanitize)`` without :func:`finite_keys`'s passes over the keys
    unless the cache holds non-finite values somewhere.

    ``compute(False)`` must return ``(*results, finite)`` with ``finite`` true
    when no logit before the mask and no output is non-finite: then no hidden
    key can have reached a result (a non-finite K gives a non-finite logit, and
    a non-finite V reaches an output as 0 * NaN = NaN). Otherwise, and only
    then, ``compute(True)`` runs: the exact rule, hidden keys contributing
    nothing and the rows that see a non-finite key NaN. The sanitising passes
    copy the whole cache on a CPU (XLA does not fuse them into the products),
    which made decode 2-7x slower when they always ran. Under ``vmap`` the
    ``cond`` becomes a select and both run. Not for differentiating: the
    ``compute(False)`` results' backward would see zero cotangents times NaN;
    a backward differentiates ``compute(True)`` itself.
    """
    *results, finite = compute(False)
    return lax.cond(finite, lambda: tuple(results), lambda: tuple(compute(True)[:-1]))


def delta_rows(out, d_out, d_lse, dtype=F32):
    """``rowsum(out * d_out) - d_lse``, (B, Hq, Tq) in ``dtype``, from "bthd" ``out``
    and ``d_out``: the row statistic of every flash backward, with the lse
    cotangent folded in (``dS = P * (dP - delta)``).

    >>> out = d_out = jnp.ones((1, 2, 1, 3))
    >>> delta_rows(out, d_out, jnp.array([[[0.5, 1.0]]])).tolist()
    [[[2.5, 2.0]]]
    """
    return (jnp.einsum("bthd,bthd->bht", out.astype(dtype), d_out.astype(dtype))
            - d_lse.astype(dtype))


def backward_rows(lse, lse_lo, delta, *, natural: bool, split: bool = False) -> tuple:
    """The per-row statistics a backward kernel recomputes P from, (B, H, Tq)
    each:

    * ``(lse2, delta)`` in base 2 (:func:`lse2_rows`, P = ``exp2(s * c -
      lse2)``): logits within a soft-cap;
    * ``split`` (base 2 without a cap, whose logits from ``q.k`` may be huge):
      ``(hi, delta, exp2(-lo))`` with ``hi + lo`` the forward's base-2 ``m +
      log2(l)`` (:func:`lse_parts_exp2`), P = ``exp2(s * c - hi) * exp2(-lo)``:
      the forward's own weights at any size of logit. (``exp2(s * c - hi)`` is
      the forward's own expression, ``exp2(s * c - m)``, so that a compiler
      that fuses its multiply and subtraction in one fuses them in both);
    * ``natural`` (a bias or position term without soft-cap, whose logits may
      all be huge): ``(lse, delta, lse_lo)``, P = ``exp2(((s - lse) - lse_lo) *
      log2(e))``, exact for such rows.

    The first is +inf where lse is not finite (and the third 0 there), so that
    P = 0 on those rows. A kernel pads the first with +inf (its padding rows
    see nothing) and the others with 0.

    >>> lse, lo = jnp.array([1.0, -jnp.inf]), jnp.array([0.5, 0.0])
    >>> [x.tolist() for x in backward_rows(lse, lo, jnp.zeros(2), natural=True)]
    [[1.0, inf], [0.0, 0.0], [0.5, 0.0]]
    """
    if natural:
        finite = jnp.isfinite(lse)
        return jnp.where(finite, lse, jnp.inf), delta, jnp.where(finite, lse_lo, 0.0)
    if not split:
        return lse2_rows(lse, lse_lo), delta
    hi, lo = times_log2e(lse)
    finite = jnp.isfinite(lse)
    return (jnp.where(finite, hi, jnp.inf), delta,
            jnp.where(finite, jnp.exp2(-(lo + lse_lo * LOG2E)), 1.0))


def _split12(x):
    """``(x1, x2)``: ``x1`` is float32 ``x`` with its significand cut to 12 bits
    (bits, not arithmetic), ``x2 = x - x1`` (exact, 12 bits at most): products
    of such halves are exact in float32."""
    bits = lax.bitcast_convert_type(x.astype(F32), jnp.uint32)
    x1 = lax.bitcast_convert_type(bits & jnp.uint32(0xFFFFF000), F32)
    return x1, x - x1


def _two_sum(a, b):
    """``(s, e)``: ``s = a + b`` rounded and ``e`` its rounding error, exactly
    (Knuth's TwoSum: additions only)."""
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


def _split12_const(x: float) -> tuple:
    """:func:`_split12` of a Python constant, with NumPy (no JAX work at import)."""
    x = np.float32(x)
    x1 = (x.view(np.uint32) & np.uint32(0xFFFFF000)).view(np.float32)
    return float(x1), float(x - x1)


_L1, _L2 = _split12_const(LOG2E)


def times_log2e(x):
    """``(hi, lo)``: ``x * log2(e)`` (float32 ``x`` times float32 ``log2(e)``)
    as an unevaluated sum of two float32, to about 2**-48 of it.

    Built from exact products of 12-bit halves and exact sums, so the same
    ``x`` gives the same bits in any program and under any compiler: no
    product is rounded, so fusing a multiply and an add into one
    (a fused multiply-add, which XLA and Triton may or may not do) changes
    nothing. The forward (:func:`lse_parts_exp2`) and the backward
    (:func:`backward_rows`) each call it on the same ``lse`` and agree to the
    last bit. Infinite or NaN ``x`` give a NaN ``lo``.

    >>> hi, lo = times_log2e(jnp.float32(3.0))
    >>> float(hi) + float(lo) - 3.0 * float(jnp.float32(LOG2E))
    0.0
    """
    x1, x2 = _split12(x)
    hi, e1 = _two_sum(x1 * _L1, x1 * _L2)
    hi, e2 = _two_sum(hi, x2 * _L1)
    hi, e3 = _two_sum(hi, x2 * _L2)
    return hi, (e1 + e2) + e3


def lse2_rows(lse, lse_lo):
    """``(lse + lse_lo) * log2(e)``: the natural-log row statistic in base 2 (the
    kernels recompute ``P = exp2(s * c - lse2)``), and +inf where it is not
    finite (rows that saw no key, an infinite sink), so that P = 0 there. A NaN
    row (it saw a non-finite key) also gets +inf; its NaN delta keeps it NaN.

    >>> lse2_rows(jnp.array([0.0, -jnp.inf, jnp.inf]), jnp.zeros(3)).tolist()
    [0.0, inf, inf]
    """
    lse2 = lse * LOG2E + lse_lo * LOG2E
    return jnp.where(jnp.isfinite(lse) & jnp.isfinite(lse2), lse2, jnp.inf)


def sink_grad(sinks, lse, lse_lo, delta):
    """d(sinks) (Hq,), float32 (float64 for a float64 ``delta``), from a backward's
    row statistics (B, Hq, Tq): ``delta = rowsum(out * d_out) - d_lse``. The sink's probability is
    ``exp((sink - lse) - lse_lo)``: 0 for a sink of -inf (and for rows whose
    lse is -inf), 1 for a sink of +inf (whose rows have lse = +inf), so that
    ``d(sink) = d_lse`` summed over its rows there."""
    dt = jnp.promote_types(F32, delta.dtype)  # float64 for float64 inputs
    sink = sinks.astype(dt)[None, :, None]
    lse = lse.astype(dt)
    p_sink = jnp.where(sink == jnp.inf, 1.0,
                       jnp.exp((sink - jnp.where(jnp.isfinite(lse), lse, jnp.inf)) - lse_lo))
    return -(p_sink * delta).sum((0, 2))


def snap_ties(shift, m):
    """``shift = s - m`` with the logits within a few units in the last place
    of the row maximum ``m`` set to exactly 0 (under ``lax.stop_gradient``
    of the snap itself: the derivative is ``shift``'s).

    For the XLA lowerings of a position term without a cap, whose logits may
    be huge: XLA may compute ``s`` once for the maximum and again in the
    fusion of ``exp(s - m)``, one copy with a fused multiply-add and one
    without, and at 4e31 the two roundings differ by 1e24: ``exp`` of the
    largest logit was inf (or 0). A logit within ``|m| * 2**-20`` of the
    maximum (8 to 16 units in the last place) is the maximum here: that
    moves such a logit's weight by a relative ``|m| * 1e-6`` at most (1e-5
    for a row maximum of 10).
    """
    tol = jnp.abs(m) * (2.0 ** -20)
    near = jnp.abs(shift) <= tol
    return jnp.where(near, shift - lax.stop_gradient(shift), shift)


def lse_parts_exp2(m, l):
    """``(lse, lse_lo)`` of a finished base-2 row state (``m`` in base 2, ``l``
    its denominator) for a backward that recomputes P in base 2
    (:func:`backward_rows` with ``split``).

    ``lse`` is the natural ``(m + log2(l)) * ln 2`` rounded, as
    :func:`lse_parts` gives it (-inf where ``l`` is 0, +inf for ``m = +inf``,
    NaN for a NaN state). ``lse_lo`` is the rest of ``m + log2(l)`` beyond
    ``lse * log2(e)``, which :func:`times_log2e` computes exactly, times
    ``ln 2``: the backward's ``hi + lo`` is then ``m + log2(l)`` up to the
    rounding of this small rest, not of ``m``, so its ``exp2(s * c - hi) *
    exp2(-lo)`` gives back the forward's own ``exp2(s * c - m) / l`` whatever
    the size of the logits. (One float32 ``lse2`` is off by up to a unit in the
    last place of ``m``: a factor of 2 on every weight of a row whose logits
    are about 1e7.) For natural consumers ``lse + lse_lo`` is the natural lse
    to within a unit in the last place of ``lse``. 0 where ``lse`` is not
    finite.

    Computed by XLA on the kernels' ``(m, l)`` outputs, never inside a
    kernel, where a compiler may fold ``(m * ln 2) * log2(e)`` into ``m``.

    >>> lse, lo = lse_parts_exp2(jnp.array([831943232.0, 0.0]), jnp.array([3.0, 0.0]))
    >>> hi, lo2 = times_log2e(lse)            # what the backward computes
    >>> want = 831943232.0 + math.log2(3.0)
    >>> abs(float(hi[0]) + float(lo2[0] + lo[0] * LOG2E) - want) < 1e-5
    True
    >>> round(float(lse[0] * LOG2E) - want, 3)  # one float32 instead: 62 off
    62.415
    >>> float(lse[1]), float(lo[1])
    (-inf, 0.0)
    """
    lse, _ = lse_parts(m, l, log=jnp.log2, scale=LN2)
    hi, lo = times_log2e(lse)
    log2_l = jnp.log2(jnp.where(l == 0, 1.0, l))
    rest = ((m - hi) - lo) + log2_l
    return lse, jnp.where(jnp.isfinite(lse), rest * LN2, 0.0)


def lse_exp2(m, l, *, natural: bool = False):
    """Natural-log ``lse`` of a base-2 row state ``(m, l)``: -inf where ``l``
    is 0 (a row that saw nothing). ``natural``: ``m`` is in natural units
    (:func:`step_exp2`).

    >>> float(lse_exp2(jnp.float32(1.0), jnp.float32(2.0)))  # (1 + log2 2) ln 2
    1.3862943649291992
    """
    log2_l = jnp.log2(jnp.where(l > 0, l, 1.0))
    lse = m + log2_l * LN2 if natural else (m + log2_l) * LN2
    return jnp.where(l > 0, lse, -jnp.inf)


def finish_exp2(acc, m, l, *, natural: bool = False):
    """Normalised output (float32) and natural-log ``lse`` of a base-2 state (m (M,),
    l (M,), acc (M, Dv)); rows that saw nothing give 0 and -inf. ``natural``:
    ``m`` is in natural units (:func:`step_exp2`)."""
    out = acc * (1.0 / jnp.where(l > 0, l, 1.0))[:, None]
    return out, lse_exp2(m, l, natural=natural)


def step_exp2(carry, s, allowed, load_v, *, scale: float, softcap=None, bias=None,
              natural: bool = False):
    """One kv-tile of the online softmax in base 2, as the serving Triton kernels
    run it: ``s`` holds the raw products ``q @ k.T`` (float32), ``allowed`` the
    keys each row may see (None: all of them), and ``load_v()`` loads the tile's values (called
    after the probabilities, where the kernels have always loaded them).
    ``bias``: a float32 term added to the scaled logits before the cap (a
    position term), or None.

    A row that has seen no visible key keeps ``m = -inf``, and is shifted by 0
    instead, so that ``exp2`` gives 0, not NaN.

    ``natural`` (for a ``bias`` without ``softcap``, whose logits may be huge;
    ignored with a cap): ``m`` is kept in natural units and P is
    ``exp2((s - m) * log2(e))``, exact for the row's largest logits. In base 2
    a compiler may fuse ``s * log2(e) - m`` into one multiply-add, whose
    result for the largest logit is the rounding error of ``m`` (up to 6e-8
    of it) instead of 0: its weight is off by a percent from logits of about
    2e5, and ``exp2`` may overflow from about 1.5e9 (an ALiBi slope of 1e8
    at distance 15).
    """
    acc, m, l = carry
    natural = natural and softcap is None
    if bias is not None:
        s, scale = s * scale + bias, 1.0
    if natural:
        c = scale
    elif softcap is None:
        c = scale * LOG2E
    else:
        s = jnp.tanh(s * (scale / softcap))
        c = softcap * LOG2E
    s = s * c if allowed is None else jnp.where(allowed, s * c, -jnp.inf)
    m_new = jnp.maximum(m, s.max(axis=1))
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    if natural:
        p = jnp.exp2((s - m_use[:, None]) * LOG2E)
        alpha = jnp.exp2((m - m_use) * LOG2E)
    else:
        p = jnp.exp2(s - m_use[:, None])
        alpha = jnp.exp2(m - m_use)
    l = l * alpha + p.sum(axis=1)
    v = load_v()
    acc = acc * alpha[:, None] + jnp.dot(p.astype(v.dtype), v, preferred_element_type=F32)
    return acc, m_new, l


def step_exp(carry, s, v):
    """One kv-tile of the online softmax in base e, as the serving Mosaic kernels
    run it: ``carry`` is ``(m, l, acc)`` with ``m`` and ``l`` (rows, 1) columns,
    ``s`` the tile's logits with invisible keys at -inf, ``v`` its values.

    A row that has seen no visible key keeps ``m = -inf``, and is shifted by 0
    instead, so that ``exp`` gives 0, not NaN.
    """
    m, l, acc = carry
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = jnp.exp(s - m_use)
    alpha = jnp.exp(m - m_use)
    l = alpha * l + jnp.sum(p, axis=1, keepdims=True)
    pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                         preferred_element_type=F32)
    return m_new, l, acc * alpha + pv


def group_sink_column(sinks_ref, h, G: int, Gp: int, M: int):
    """An (M, 1) float32 column whose row ``r`` holds the sink of query head
    ``h * G + r % Gp`` (rows are token-major, ``Gp`` a power of two >= G; padded
    heads get 0), read from a flat SMEM ref one scalar per head of the group."""
    g_col = lax.broadcasted_iota(jnp.int32, (M, 1), 0) & (Gp - 1)
    sink = jnp.zeros((M, 1), F32)
    for g in range(G):
        sink = jnp.where(g_col == g, sinks_ref[h * G + g], sink)
    return sink

