"""Serve the local:global model of ``local_global_scan.py`` from a paged cache, its
layers in one ``lax.scan``, with speculative verification of a draft tree.

The model is the one ``local_global_scan.py`` trains: five sliding-window layers
(with sinks) to one global layer, window sizes as data. Serving keeps one
:class:`fnattn.LayeredPagedKVCache` for the whole model (one page table, one set of
lengths, the layers' pools stacked on axis 0) and runs every layer of a step in
one ``lax.scan`` whose ``xs`` are the layer weights, the per-layer window
(``masks.NO_WINDOW`` on the global layer), sinks, RoPE bases and pools::

    cache = cache.allocate(seq_ids)                          # once per step
    meta, pos = cache.ragged_metadata(seq_ids, return_positions=True)
    def layer(x, xs):
        p, left, has_sinks, base, kp, vp = xs
        spec = AttentionSpec(mask=masks.causal() & masks.sliding_window(left=left),
                             sinks=jnp.where(has_sinks, p["sinks"], -jnp.inf))
        res, kp, vp = fnattn.ragged_paged_attention_with_update(
            spec, q, k, v, kp, vp, **meta, draft_parents=parents)
        ...

Three steps, each one compiled program for every request in it:

1. **Ragged prefill**: two prompts of different lengths in one call, packed.
2. **Tree verification**: request 0 proposes a tree of five draft tokens
   (``0 -> 1 -> 3`` and ``0 -> 2 -> 4``) while request 1 decodes one token; each
   draft sees its request's context and its own ancestors, at position
   ``context + depth`` (``fnattn.draft_positions``, for RoPE and the windows).
   Every draft token's logits are checked against the model run without a
   cache over the prompt followed by that draft's root-to-node path.
3. **Accept and continue**: ``accept_drafts`` keeps path ``0 -> 2 -> 4`` of
   request 0 (checked against its tree with ``parents=``) and request 1's token,
   rolling the rest back in every layer; a further decode step is checked
   against the cache-free model over the accepted sequences.

    python examples/local_global_serve.py             # a few seconds on a 2-core CPU
"""

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import local_global_scan as lg  # noqa: E402  (the model and its cache-free forward)

import fnattn  # noqa: E402
from fnattn import AttentionSpec, masks  # noqa: E402


def serve_step(params, data, cache, tokens, seq_ids, parents, *, q_heads, kv_heads):
    """One serving step over packed tokens (``seq_ids`` names each token's slot):
    allocate once, then every layer in one ``lax.scan`` writes its k/v and attends.
    ``parents`` (packed like the tokens, or None) is the draft tree; returns the
    updated cache and each token's logits."""
    N = tokens.shape[0]
    cache = cache.allocate(seq_ids)
    meta, pos = cache.ragged_metadata(seq_ids, return_positions=True)
    if parents is not None:
        pos = fnattn.draft_positions(parents, **meta)     # context + depth in the tree

    def layer(x, xs):
        p, left, has_sinks, base, kp, vp = xs
        spec = AttentionSpec(mask=masks.causal() & masks.sliding_window(left=left),
                             sinks=jnp.where(has_sinks, p["sinks"], -jnp.inf))
        h = lg.rms(x)
        q = lg.rope((h @ p["wq"]).reshape(N, q_heads, -1), base, pos)
        k = lg.rope((h @ p["wk"]).reshape(N, kv_heads, -1), base, pos)
        v = (h @ p["wv"]).reshape(N, kv_heads, -1)
        res, kp, vp = fnattn.ragged_paged_attention_with_update(
            spec, q, k, v, kp, vp, **meta, draft_parents=parents)
        x = x + res.out.reshape(N, -1) @ p["wo"]
        x = x + jax.nn.gelu(lg.rms(x) @ p["w1"]) @ p["w2"]
        return x, (kp, vp)

    xs = (params["layers"], data["left"], data["has_sinks"], data["rope_base"],
          cache.k_pages, cache.v_pages)
    x, (kp, vp) = jax.lax.scan(layer, params["embed"][tokens], xs)
    return cache.replace(k_pages=kp, v_pages=vp), lg.rms(x) @ params["out"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--window", type=int, default=5, help="HF's sliding_window")
    ap.add_argument("--d-model", type=int, default=32)
    ap.add_argument("--page-size", type=int, default=4)
    args = ap.parse_args(argv)

    heads = dict(q_heads=4, kv_heads=2)
    pat = lg.pattern(args.layers, args.window)
    data = lg.scan_data(pat)
    params = lg.init(jax.random.key(0), layers=args.layers, d_model=args.d_model, **heads)
    params["layers"]["sinks"] = jax.random.normal(jax.random.key(1),
                                                  params["layers"]["sinks"].shape)
    rng = np.random.default_rng(0)

    cache = fnattn.LayeredPagedKVCache.create(
        num_layers=args.layers, num_pages=16, page_size=args.page_size,
        num_kv_heads=heads["kv_heads"], head_dim=args.d_model // heads["q_heads"],
        max_seqs=2, max_pages_per_seq=8)
    step = jax.jit(lambda c, t, i, par: serve_step(params, data, c, t, i, par, **heads))
    reference = jax.jit(lambda t: lg.forward_scanned(params, t[None], data, **heads)[0])

    rel = lg.max_rel
    worst = {}

    # 1. Ragged prefill: two prompts of different lengths in one call.
    prompts = [rng.integers(0, lg.VOCAB, n).astype(np.int32) for n in (11, 7)]
    ids = np.concatenate([np.full(len(p), s, np.int32) for s, p in enumerate(prompts)])
    cache, logits = step(cache, jnp.asarray(np.concatenate(prompts)), jnp.asarray(ids), None)
    starts = np.cumsum([0] + [len(p) for p in prompts])
    worst["prefill"] = max(rel(logits[starts[s]:starts[s + 1]], reference(jnp.asarray(p)))
                           for s, p in enumerate(prompts))

    # 2. Tree verification: request 0 drafts 0 -> 1 -> 3 and 0 -> 2 -> 4; request 1 decodes.
    tree = [-1, 0, 0, 1, 2]
    drafts = rng.integers(0, lg.VOCAB, len(tree) + 1).astype(np.int32)
    parents = jnp.asarray(tree + [-1], jnp.int32)
    ids = jnp.asarray([0] * len(tree) + [1], jnp.int32)
    cache, logits = step(cache, jnp.asarray(drafts), ids, parents)

    def path(node):                      # root-to-node indices among the drafts
        return path(tree[node]) + [node] if node >= 0 else []

    errs = [rel(logits[n], reference(jnp.asarray(np.concatenate(
        [prompts[0], drafts[path(n)]])))[-1]) for n in range(len(tree))]
    errs.append(rel(logits[len(tree)],
                    reference(jnp.asarray(np.append(prompts[1], drafts[-1])))[-1]))
    worst["tree"] = max(errs)

    # 3. Accept path 0 -> 2 -> 4 of request 0 and request 1's token, then decode on.
    accepted = np.array([[0, 2, 4], [0, -1, -1]], np.int32)
    slot_parents = np.array([tree, [-1] * len(tree)], np.int32)
    cache = jax.jit(lambda c: c.accept_drafts(jnp.array([len(tree), 1]), jnp.asarray(accepted),
                                              parents=jnp.asarray(slot_parents)))(cache)
    seqs = [np.concatenate([prompts[0], drafts[[0, 2, 4]]]), np.append(prompts[1], drafts[-1])]
    assert cache.lengths.tolist() == [len(s) for s in seqs], cache.lengths
    nxt = rng.integers(0, lg.VOCAB, 2).astype(np.int32)
    cache, logits = step(cache, jnp.asarray(nxt), jnp.array([0, 1], jnp.int32), None)
    worst["after_accept"] = max(rel(logits[s], reference(jnp.asarray(np.append(seqs[s], nxt[s])))[-1])
                                for s in range(2))

    print(f"{args.layers} layers ({sum(pat['local'])} local, window {args.window}; "
          f"{args.layers - sum(pat['local'])} global) served from one LayeredPagedKVCache "
          "in one lax.scan per step")
    for name, what in (("prefill", "ragged prefill of prompts of 11 and 7 tokens"),
                       ("tree", "tree verification (5 drafts + 1 decode token)"),
                       ("after_accept", "decode after accept_drafts")):
        print(f"{what}: largest logit difference against the model without a cache "
              f"{worst[name]:.1e} (relative to the largest logit)")
    assert max(worst.values()) < 1e-4, worst
    print("every step equals the model without a cache")
    return worst


if __name__ == "__main__":
    main()
