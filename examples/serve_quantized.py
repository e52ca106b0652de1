"""Serving from a quantized KV cache (int8 and float8), checked against the float model.

The model, the requests and the serving loop of ``examples/serve_paged.py``,
run with a ``LayeredPagedKVCache`` whose pools are quantized
(``quant_format=...``: int8 codes with one scale per token and kv head, or
float8_e4m3fn), so that the cache holds half the bytes of a bfloat16 one (a
quarter of float32's). ``ragged_paged_attention_with_update`` quantizes each
new token's K/V as it writes it (``fnattn.quant.quantize``, saturating) and
dequantizes the pages as it reads them.

Each generated sequence is checked against the float model run without a
cache (``fnattn.attention`` over the whole sequence): the logits differ only by
the quantization of the cache (printed, and asserted below a bound), and the
greedy tokens are the same wherever the float model's two best logits are
further apart than that difference.

    python examples/serve_quantized.py          # ~30 s on a 2-core CPU
"""

import argparse
import os
import sys

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import serve_paged  # noqa: E402  (the model and the serving loop)
from fnattn.cache import LayeredPagedKVCache  # noqa: E402
from fnattn.quant import QuantFormat  # noqa: E402

FORMATS = {"int8": QuantFormat("int8"), "fp8": QuantFormat("float8_e4m3fn")}
BOUND = {"int8": 0.05, "fp8": 0.25}   # max |logit difference| (logits are O(1)-O(10))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=5)
    ap.add_argument("--max-new", type=int, default=6)
    ap.add_argument("--formats", default="int8,fp8")
    args = ap.parse_args(argv)

    import jax
    params = serve_paged.init(jax.random.key(0))
    rng = np.random.default_rng(0)
    requests = [(int(rng.integers(0, 6)),
                 rng.integers(0, serve_paged.VOCAB, int(rng.integers(3, 12))).tolist())
                for _ in range(args.requests)]
    worst = {}
    for name in args.formats.split(","):
        cache = LayeredPagedKVCache.create(
            num_layers=serve_paged.LAYERS, num_pages=32, page_size=8,
            num_kv_heads=serve_paged.KV_HEADS, head_dim=serve_paged.HEAD, max_seqs=4,
            max_pages_per_seq=serve_paged.MAX_LEN // 8, quant_format=FORMATS[name])
        out, steps, cache = serve_paged.serve(params, requests, max_new=args.max_new,
                                              batch_tokens=48, cache=cache)
        diff, agree, decided = 0.0, 0, 0
        for i, (_, prompt) in enumerate(requests):
            gen, logits = out[i]
            seq = jnp.array(prompt + gen, jnp.int32)
            ref = np.asarray(serve_paged.full_forward(params, seq))[len(prompt) - 1:-1]
            d = np.abs(ref - np.stack(logits)).max(-1)                  # per step
            diff = max(diff, float(d.max()))
            top2 = np.sort(ref, -1)[:, -2:]
            clear = (top2[:, 1] - top2[:, 0]) > 2 * d                   # a clear winner
            same = np.argmax(ref, -1) == np.asarray(gen)
            assert same[clear].all(), f"{name}, request {i}: a clear greedy token differs"
            agree += int(same.sum())
            decided += len(gen)
        print(f"{name} cache ({FORMATS[name].name}, per-{FORMATS[name].granularity} scales, "
              f"{cache.k_pages.nbytes + cache.v_pages.nbytes} bytes of pools): "
              f"{len(requests)} requests in {steps} steps; max |logit difference| against "
              f"the float model without a cache {diff:.1e}; greedy tokens equal "
              f"{agree}/{decided}")
        assert diff < BOUND[name], (name, diff)
        assert int(cache.num_free) == cache.num_pages, "pages were not all given back"
        worst[name] = diff
    return worst


if __name__ == "__main__":
    main()
