"""Prints the per-example norm / clipped-sum cost model for GPT-2 layer shapes (markdown).

    python -m experiments.cost_model [--batch_size=8] [--chunk_size=8] [--itemsize=2]

For every linear shape of GPT-2 small / medium / large at T = 128, 1024, 4096:
FLOPs of the ghost and instantiate norms, the non-DP weight-gradient FLOPs for
scale, and, per layer (norm + clipped sum), the time each method takes by the
H100 row of `jaxdp.clipping.device_rates` (FLOPs at the matmul rate + bytes at the
bandwidth): ghost / instantiate norms followed by the clipped-sum GEMM, or
`store` (per-example gradients kept; bytes held shown). `auto` is the norm
method `strategy="auto"` picks; `store?` whether a layer alone would be stored
within the 1 GiB budget (`plan_stored` also caps the total over layers).
"""

from absl import app, flags

from jaxdp.clipping import device_rates
from jaxdp.clipping.norm_costs import (
    DEFAULT_MEMORY_BUDGET_BYTES,
    LayerShape,
    choose_method,
    linear_layer_cost,
    pair_cost,
    plan_stored,
)
from jaxdp.models.gpt2 import GPT2Config

FLAGS = flags.DEFINE_integer("batch_size", 8, "examples per micro-batch (B)")
CHUNK = flags.DEFINE_integer("chunk_size", 8, "examples per norm chunk")
ITEMSIZE = flags.DEFINE_integer("itemsize", 2, "bytes per input element (2: bf16, 4: float32)")


def layer_shapes(config: GPT2Config):
    d, V = config.d_model, config.vocab_size
    return [("attn.c_attn", "linear", d, 3 * d), ("attn.c_proj", "linear", d, d),
            ("mlp.c_fc", "linear", d, 4 * d), ("mlp.c_proj", "linear", 4 * d, d),
            ("wte (head use)", "linear", V, d), ("wte (lookup)", "embed", V, d),
            ("wte (head x lookup)", "linear_embed", V, d)]


def main(argv):
    del argv
    B, k, s = FLAGS.value, CHUNK.value, ITEMSIZE.value
    rates = device_rates.H100
    print(f"B = {B}, chunk = {k}, {s}-byte inputs, memory budget {DEFAULT_MEMORY_BUDGET_BYTES / 2**30:.0f} GiB, "
          f"rates: {rates.device_kind}\n")
    print("| model | T | layer | P x D | non-DP wgrad GFLOP | ghost GFLOP | inst. GFLOP | "
          "layer us ghost / inst. / store | store held MB | auto | store? |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in ("small", "medium", "large"):
        config = GPT2Config.preset(name)
        for T in (128, 1024, 4096):
            for layer, kind, P, D in layer_shapes(config):
                shape = LayerShape(B, T, P, D, itemsize=s)
                ghost, inst = (pair_cost(kind, m, shape, chunk_size=k) for m in ("ghost", "instantiate"))
                pick = choose_method(kind, shape, chunk_size=k, rates=rates if kind == "linear" else None)
                row = f"| {name} | {T} | {layer} | {P} x {D} | "
                if kind == "linear":
                    costs = {m: linear_layer_cost(m, shape, chunk_size=k)
                             for m in ("ghost", "instantiate", "store")}
                    us = " / ".join(f"{rates.seconds(c.flops, c.bytes_moved, 'bfloat16' if s == 2 else 'float32') * 1e6:.0f}"
                                    for c in costs.values())
                    stored = "yes" if plan_stored({0: shape}, rates, chunk_size=k) else "no"
                    row += (f"{2 * B * T * P * D / 1e9:.1f} | {ghost.flops / 1e9:.1f} | {inst.flops / 1e9:.1f} | "
                            f"{us} | {costs['store'].scratch_bytes / 1e6:.0f} | {pick} | {stored} |")
                else:
                    row += f"- | {ghost.flops / 1e9:.1f} | {inst.flops / 1e9:.1f} | - | - | {pick} | - |"
                print(row)


if __name__ == "__main__":
    app.run(main)
