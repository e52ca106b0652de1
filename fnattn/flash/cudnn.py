"""The flash lowering that runs cuDNN's fused attention: impl="auto" on NVIDIA GPUs
for the specs cuDNN computes exactly as fnattn does.

**Routing** (:func:`reasons`; decided at trace time, per call, from static facts only):
a spec goes to cuDNN when every row of this table holds, and to the Pallas kernels
otherwise: the Mosaic GPU forward (:mod:`fnattn.flash.mosaic_gpu`) on Hopper GPUs
for the specs it takes, the Triton kernels (:mod:`fnattn.flash.triton`) for the
rest (:func:`fnattn.flash.api.cuda_kernel`).

===================  ==========================================================
what                 routed to cuDNN when
===================  ==========================================================
dtype                float16 or bfloat16
head dims            D == Dv, D a multiple of 8, D <= 128 (256 on Hopper and later)
mask                 none, or an ``&`` of: ``causal()`` and ``sliding_window(left,
                     right)`` aligned top-left (Tq == Tk or ``q_offset=0``; a window
                     with ``right > 0`` only under ``causal()``), ``lengths(...)``
                     with one length per batch row
bias, sinks          none (the Pallas kernels take them)
position terms       none (``fnattn.position_bias``: the Triton kernels take them)
softcap, dropout     none
block sizes          not set (``TritonBlockSizes`` choose the Triton kernels)
sizes                static (``jax.export`` with symbolic sizes: the XLA lowering)
cuDNN                present when the program is traced
===================  ==========================================================

Soft-capped and chunked specs, masks built with ``|`` and ``~``, segment ids,
prefix-LM and sinks go to the Mosaic GPU kernels on Hopper
(:func:`fnattn.flash.mosaic_gpu.route`); ``from_array`` masks, a bias, and
(until an H100 timing) dropout and position terms go to the Triton kernels,
which skip empty tiles of any mask, as does every spec on other NVIDIA GPUs.

**The contract kept.** Rows that see no key (past their query length, with a
length-0 key sequence, or past a window's reach) give ``out = 0`` and
``lse = -inf``: they are handed to cuDNN as padding (their query length is cut to
the last row that sees a key) and their outputs are set afterwards. Keys past
the key length and queries past the query length are zeroed before cuDNN reads
them (queries in the backward only: in the forward such a row reaches only its own
output), so NaN or inf in unused cache slots cannot reach the output through
``0 * NaN``, forward or backward. One difference remains, for non-finite inputs
only: a key that causal masking hides from some rows but shows to later ones is
read by cuDNN in the shared tile, so NaN or inf in it (which already poisons the
rows that see it) may also reach the earlier rows of that tile; the Triton
kernels keep those rows clean.

**Backward.** cuDNN's backward kernel runs from the forward's residuals (``out``
and ``lse``, which are cuDNN's softmax statistics), so forward plus backward costs
what ``jax.nn.dot_product_attention(implementation="cudnn")`` costs. cuDNN takes
no cotangent for ``lse``: when a program differentiates through ``lse`` (merging
partial results), that backward runs the Triton kernels from the same residuals.

cuDNN is reached through the functions ``jax.nn.dot_product_attention`` itself
calls (``jax._src.cudnn.fused_attention_stablehlo``, through
:mod:`fnattn._jax_private`: no public API returns the softmax statistics or runs
the backward from them); the backward's entry point is checked against the
signatures fnattn knows (:data:`_BWD_SIGNATURES`: jax 0.10 and 0.11 take one,
jax 0.12 added a ``score_mod`` parameter and a residual) when the program is
traced, and if a JAX release changes it again the Triton backward runs instead
(and ``tests/flash/test_cudnn.py`` fails, naming the signature found).
"""

import inspect

import jax
import jax.numpy as jnp

from fnattn import _checks, _jax_private, masks, position_bias
from fnattn._dispatch import Lowering
from fnattn.flash import triton

__all__ = ["reasons", "LOWERING", "route"]

F32 = jnp.float32

# What the backward's entry point (``_dot_product_attention_bwd_rule``) takes, per
# jax release, and how many of its residuals precede the softmax statistics and
# the output (``res[:n]``: q, k, v, bias, q_seqlen, kv_seqlen, q_offsets,
# kv_offsets, page_table_k, page_table_v, and from jax 0.12 score_mod_args).
_BWD_SIGNATURES = {
    # jax 0.10.x and 0.11.x
    ("scale", "seed", "dropout_rate", "variadic_args", "mask_type", "layout",
     "sliding_window_length", "is_training", "return_residual", "res", "grad_output"): 10,
    # jax 0.12.x: a score_mod (None: none) and its arguments (a residual)
    ("scale", "seed", "dropout_rate", "variadic_args", "mask_type", "layout",
     "sliding_window_length", "score_mod", "cudnn_version", "return_residual", "res",
     "grad_output"): 11,
}
_SEED = 42  # no dropout: cuDNN ignores it


def _fused():
    return _jax_private.get("cudnn_fused_attention")


def _max_head_dim() -> int:
    """128, or 256 where the local GPU is a Hopper or later."""
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        return 128
    try:
        major = int(str(gpus[0].compute_capability).split(".")[0])
    except (AttributeError, ValueError, IndexError):
        return 128
    return 256 if major >= 9 else 128


class _Plan:
    """What cuDNN is told about a routable mask (static parts and array parts)."""

    def __init__(self, causal=False, left=None, q_lengths=None, kv_lengths=None):
        self.causal = causal
        self.left = left                  # window: keys q - left .. q (with causal)
        self.q_lengths = q_lengths        # arrays (B|1,) or None
        self.kv_lengths = kv_lengths

    @property
    def padded(self) -> bool:
        return self.q_lengths is not None or self.kv_lengths is not None


def _plan(mask, cfg):
    """The cuDNN form of ``mask`` under ``cfg``, or a reason it has none."""
    d = cfg.dims
    parts = masks.conjuncts(mask)
    causal = any(isinstance(m, masks.Causal) for m in parts)
    windows = [m for m in parts if isinstance(m, masks.SlidingWindow)]
    lens = [m for m in parts if isinstance(m, masks.Lengths)]
    other = [m for m in parts if not isinstance(m, (masks.Causal, masks.SlidingWindow,
                                                    masks.Lengths))]
    if other:
        return f"mask {other[0]!r} (cuDNN takes causal, one left window and lengths)"
    if causal or windows:
        offset = cfg.q_offset if cfg.q_offset is not None else d.kv_len - d.q_len
        if offset != 0:
            return ("causal or window alignment with Tq != Tk or q_offset != 0 (cuDNN "
                    "aligns them at the top left only)")
    left = None
    if len(windows) > 1:
        return "more than one sliding window"
    if windows:
        (w,) = windows
        right_ok = (w.right is not None and w.right == 0) or (causal and (
            w.right is None or w.right >= 0))
        if not right_ok:
            return f"{w!r} reaching right of the diagonal without causal()"
        if w.left is not None:
            if w.left < 0:
                return f"{w!r} with a negative left reach"
            left = int(w.left)
        causal = True
    q_lengths = kv_lengths = None
    for m in lens:
        for name, arr in (("q", m.q_lengths), ("kv", m.kv_lengths)):
            if arr is None:
                continue
            if jnp.ndim(arr) > 1 or (jnp.ndim(arr) == 1 and jnp.shape(arr)[0] not in (1, d.batch)):
                return f"{name} lengths of shape {jnp.shape(arr)} (cuDNN takes one per batch row)"
            if (q_lengths if name == "q" else kv_lengths) is not None:
                return f"two {name} length masks"
            if name == "q":
                q_lengths = arr
            else:
                kv_lengths = arr
    return _Plan(causal, left, q_lengths, kv_lengths)


def reasons(cfg, dtype, mask, bias, sinks) -> list[str]:
    """Why the spec does not go to cuDNN (empty: it does). Static facts only.

    >>> import jax.numpy as jnp
    >>> from fnattn import masks
    >>> from fnattn._checks import Dims
    >>> from fnattn._dispatch import Config
    >>> cfg = Config(Dims(2, 256, 256, 8, 2, 64, 64), 0.125, None, 0.0, None)
    >>> reasons(cfg, jnp.bfloat16, masks.causal(), None, None)
    []
    >>> for why in reasons(cfg, jnp.float32, masks.segments(jnp.zeros((2, 256), int)),
    ...                    None, None):
    ...     print(why)
    float32 inputs (cuDNN takes float16 and bfloat16)
    mask segments(...) (cuDNN takes causal, one left window and lengths)
    """
    d = cfg.dims
    why = []
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)):
        why.append(f"{jnp.dtype(dtype).name} inputs (cuDNN takes float16 and bfloat16)")
    if d.v_head_dim != d.head_dim:
        why.append(f"a value head dim Dv={d.v_head_dim} different from D={d.head_dim}")
    elif isinstance(d.head_dim, int):
        top = _max_head_dim()
        if d.head_dim % 8 or d.head_dim > top:
            why.append(f"head dim {d.head_dim} (cuDNN takes multiples of 8 up to {top} here)")
    if bias is not None:
        why.append("bias")
    if sinks is not None:
        why.append("sinks")
    if cfg.softcap is not None:
        why.append("softcap")
    if cfg.dropout_rate > 0:
        why.append("dropout")
    if cfg.block_sizes is not None:
        why.append(f"block sizes {type(cfg.block_sizes).__name__} set for the kernels")
    if _checks.symbolic_sizes(B=d.batch, Tq=d.q_len, Tk=d.kv_len):
        why.append("symbolic sizes")
    if position_bias.present(mask):
        why.append("position bias")
        if isinstance(mask, position_bias.Biased):
            mask = mask.mask
    plan = _plan(mask, cfg)
    if isinstance(plan, str):
        why.append(plan)
    return why


def available() -> str | None:
    """None when cuDNN can be traced in this process, else why not."""
    try:
        _fused().check_cudnn_version()
    except (RuntimeError, ImportError, AttributeError) as e:
        return f"cuDNN is not available when tracing ({e})"
    return None


def route(cfg, dtype, mask, bias, sinks) -> bool:
    """Whether impl="auto" on cuda runs this call on cuDNN."""
    return not reasons(cfg, dtype, mask, bias, sinks) and available() is None


# ----------------------------------------------------------------------------------
# The calls into cuDNN (module functions, so tests can stand an emulation in)
# ----------------------------------------------------------------------------------

def _mask_type(plan):
    mt = _fused().MaskType
    if plan.padded:
        return mt.PADDING_CAUSAL if plan.causal else mt.PADDING
    return mt.CAUSAL if plan.causal else mt.NO_MASK


def _window(plan):
    # cuDNN's window holds the sliding_window_length keys ending at the row: left + 1.
    return None if plan.left is None else plan.left + 1


def cudnn_forward(q, k, v, q_len, kv_len, *, scale, plan):
    """cuDNN's forward on bthd arrays: ``(out, stats)``, stats float32 (B, Hq, Tq)."""
    f = _fused()
    out, stats = f.dot_product_attention(
        q, k, v, None, None, q_len, kv_len, scale=scale, mask_type=_mask_type(plan),
        seed=_SEED, qkv_layout="BTNH", sliding_window_length=_window(plan),
        return_residual=True)
    return out, stats


def bwd_signature():
    """The parameter names of this jax's cuDNN backward entry point (None: it has none)."""
    rule = getattr(_fused(), "_dot_product_attention_bwd_rule", None)
    if rule is None:
        return None
    try:
        return tuple(inspect.signature(rule).parameters)
    except (TypeError, ValueError):
        return None


def _bwd_entry():
    """cuDNN's backward entry point and its residuals' count before the statistics,
    or None if it is not one fnattn knows."""
    n = _BWD_SIGNATURES.get(bwd_signature())
    return None if n is None else (_fused()._dot_product_attention_bwd_rule, n)


def cudnn_backward(q, k, v, q_len, kv_len, out, stats, d_out, *, scale, plan):
    """cuDNN's backward from the forward's residuals: ``(dq, dk, dv)``."""
    f = _fused()
    rule, n = _bwd_entry()
    unused = jnp.zeros(0, q.dtype)
    res = (q, k, v, unused, unused if q_len is None else q_len,
           unused if kv_len is None else kv_len, unused, unused, unused, unused)
    if n == 11:
        res += ((),)  # score_mod_args: no score_mod
    res += (stats, out)
    layout = f._normalize_layout("BTNH").value
    params = (scale, _SEED, 0.0, (False, False), _mask_type(plan), layout, _window(plan))
    if n == 11:
        params += (None,)  # score_mod
    dq, dk, dv = rule(*params, f.check_cudnn_version(), False, res, d_out)[:3]
    return dq, dk, dv


def backward_available() -> bool:
    return _bwd_entry() is not None


# ----------------------------------------------------------------------------------
# The lowering
# ----------------------------------------------------------------------------------

# The backward for what cuDNN's does not take (an lse cotangent); tests on a CPU
# stand the interpreted kernels in.
FALLBACK = triton.LOWERING


class _Rows:
    """Lengths as cuDNN sees them, and the rows and keys fnattn's mask leaves empty."""

    def __init__(self, plan, cfg):
        d = cfg.dims
        self.plan = plan
        self.q_len = self.kv_len = None
        if not plan.padded:
            return
        B = d.batch
        kvl = (jnp.full((B,), d.kv_len, jnp.int32) if plan.kv_lengths is None else
               jnp.broadcast_to(jnp.asarray(plan.kv_lengths, jnp.int32).reshape(-1), (B,)))
        ql = (jnp.full((B,), d.q_len, jnp.int32) if plan.q_lengths is None else
              jnp.broadcast_to(jnp.asarray(plan.q_lengths, jnp.int32).reshape(-1), (B,)))
        kvl = jnp.clip(kvl, 0, d.kv_len)
        ql = jnp.clip(ql, 0, d.q_len)
        # The rows that see a key: none when there are no keys; under a window of
        # left reach w, row i sees keys i - w .. i, none of which exist past kv + w.
        ql = jnp.where(kvl == 0, 0, ql)
        if plan.left is not None:
            ql = jnp.minimum(ql, kvl + plan.left)
        self.q_len, self.kv_len = ql, kvl

    def live_q(self, T):   # (B, T) bool, or None when every row is live
        return None if self.q_len is None else jnp.arange(T)[None, :] < self.q_len[:, None]

    def live_k(self, T):
        return None if self.kv_len is None else jnp.arange(T)[None, :] < self.kv_len[:, None]


def _zero_rows(x, live):
    """``x`` (B, T, H, D) with the rows where ``live`` (B, T) is False set to 0."""
    if live is None:
        return x
    return jnp.where(live[:, :, None, None], x, jnp.zeros((), x.dtype))


def _forward(cfg, q, k, v, bias, sinks, mask, seed):
    del bias, sinks, seed  # routed specs have none (``reasons``)
    plan = _plan(mask, cfg)
    rows = _Rows(plan, cfg)
    d = cfg.dims
    live_q = rows.live_q(d.q_len)
    live_k = rows.live_k(d.kv_len)
    # (a query row past its length reaches only its own output, set below)
    out, stats = cudnn_forward(q, _zero_rows(k, live_k), _zero_rows(v, live_k), rows.q_len,
                               rows.kv_len, scale=cfg.scale, plan=plan)
    lse = stats.astype(F32)
    if live_q is not None:
        out = _zero_rows(out, live_q)
        lse = jnp.where(live_q[:, None, :], lse, -jnp.inf)
    return out.astype(q.dtype), lse, jnp.zeros_like(lse)


def _backward(cfg, q, k, v, bias, sinks, mask, seed, out, lse, lse_lo, d_out, d_lse):
    if d_out is None:
        d_out = jnp.zeros_like(out)
    if d_lse is not None or not backward_available():
        if d_lse is None:
            d_lse = jnp.zeros_like(lse)
        return FALLBACK.bwd(cfg, q, k, v, bias, sinks, mask, seed, out, lse, lse_lo,
                            d_out, d_lse)
    plan = _plan(mask, cfg)
    rows = _Rows(plan, cfg)
    d = cfg.dims
    live_q = rows.live_q(d.q_len)
    live_k = rows.live_k(d.kv_len)
    # Rows that see no key: P = exp(s - inf) = 0 there, with zero q, out (the
    # forward set it) and dO, so that nothing of them reaches dk and dv whatever
    # cuDNN does with padding rows.
    stats = lse if live_q is None else jnp.where(live_q[:, None, :], lse, jnp.inf)
    dq, dk, dv = cudnn_backward(
        _zero_rows(q, live_q), _zero_rows(k, live_k), _zero_rows(v, live_k),
        rows.q_len, rows.kv_len, out, stats, _zero_rows(d_out.astype(out.dtype), live_q),
        scale=cfg.scale, plan=plan)
    dq = _zero_rows(dq, live_q)
    dk = _zero_rows(dk, live_k)
    dv = _zero_rows(dv, live_k)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


# The backward takes None for a zero cotangent: a zero lse cotangent is what lets
# cuDNN's own backward run.
LOWERING = Lowering("flash-cudnn", _forward, _backward, takes_absent_cotangents=True)


def pick(kernel, needs_xla):
    """impl="auto" on cuda: cuDNN where :func:`route` says so, else
    ``kernel(cfg, q, bias, sinks, mask)`` (the Mosaic GPU or the Triton lowering,
    :func:`fnattn.flash.api.cuda_kernel`), or the XLA one where
    ``needs_xla(cfg)`` says the kernels cannot take the call (symbolic sizes, a
    function they do not compile)."""
    from fnattn.flash import xla

    def choose(cfg, q, bias, sinks, mask):
        if route(cfg, q.dtype, mask, bias, sinks):
            return LOWERING
        return xla.LOWERING if needs_xla(cfg) else kernel(cfg, q, bias, sinks, mask)

    def fwd(cfg, q, k, v, bias, sinks, mask, seed):
        low = choose(cfg, q, bias, sinks, mask)
        if low is LOWERING:
            try:
                return low.fwd(cfg, q, k, v, bias, sinks, mask, seed)
            except NotImplementedError:
                # cuDNN's own checks refused it (a GPU or version limit this table
                # does not know): the kernels, whose residuals are the same.
                low = kernel(cfg, q, bias, sinks, mask)
        return low.fwd(cfg, q, k, v, bias, sinks, mask, seed)

    def bwd(cfg, q, k, v, bias, sinks, mask, seed, out, lse, lse_lo, d_out, d_lse):
        low = choose(cfg, q, bias, sinks, mask)
        if low is LOWERING:
            try:
                return low.bwd(cfg, q, k, v, bias, sinks, mask, seed, out, lse, lse_lo,
                               d_out, d_lse)
            except NotImplementedError:
                low = kernel(cfg, q, bias, sinks, mask)
        if not low.takes_absent_cotangents:
            d_out = jnp.zeros_like(out) if d_out is None else d_out
            d_lse = jnp.zeros_like(lse) if d_lse is None else d_lse
        return low.bwd(cfg, q, k, v, bias, sinks, mask, seed, out, lse, lse_lo, d_out, d_lse)

    def needs_devices(cfg, q, k, v, bias, sinks, mask, seed, *rest):
        # cuDNN's lowering (a custom_partitioning) needs the devices
        return route(cfg, q.dtype, mask, bias, sinks)

    return Lowering("flash-auto-cuda", fwd, bwd, triton.LOWERING.jvp,
                    takes_absent_cotangents=True, needs_devices=needs_devices)
