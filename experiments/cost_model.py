"""Prints the per-example norm cost model for GPT-2 layer shapes (markdown).

    python -m experiments.cost_model [--batch_size=8] [--chunk_size=8]

For every linear shape of GPT-2 small / medium / large at T = 128, 1024, 4096:
FLOPs, HBM bytes and scratch bytes of the ghost and instantiate norms, the
non-DP weight-gradient FLOPs for scale, and what `strategy="auto"` picks.
"""

from absl import app, flags

from jaxdp.models.gpt2 import GPT2Config
from jaxdp.norms import DEFAULT_MEMORY_BUDGET_BYTES, choose_method, pair_cost

FLAGS = flags.DEFINE_integer("batch_size", 8, "examples per micro-batch (B)")
CHUNK = flags.DEFINE_integer("chunk_size", 8, "examples per norm chunk")


def layer_shapes(config: GPT2Config):
    d, V = config.d_model, config.vocab_size
    return [("attn.c_attn", "linear", d, 3 * d), ("attn.c_proj", "linear", d, d),
            ("mlp.c_fc", "linear", d, 4 * d), ("mlp.c_proj", "linear", 4 * d, d),
            ("wte (head use)", "linear", V, d), ("wte (lookup)", "embed", V, d),
            ("wte (head x lookup)", "linear_embed", V, d)]


def main(argv):
    del argv
    B, k = FLAGS.value, CHUNK.value
    print(f"B = {B}, chunk = {k}, float32 inputs, memory budget {DEFAULT_MEMORY_BUDGET_BYTES / 2**30:.0f} GiB\n")
    print("| model | T | layer | P x D | non-DP wgrad GFLOP | ghost GFLOP | ghost HBM MB | ghost scratch MB | "
          "inst. GFLOP | inst. HBM MB | inst. scratch MB | auto |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in ("small", "medium", "large"):
        config = GPT2Config.preset(name)
        for T in (128, 1024, 4096):
            for layer, kind, P, D in layer_shapes(config):
                ghost = pair_cost(kind, "ghost", B=B, T=T, P=P, D=D, chunk_size=k)
                inst = pair_cost(kind, "instantiate", B=B, T=T, P=P, D=D, chunk_size=k)
                pick = choose_method(kind, B=B, T=T, P=P, D=D, chunk_size=k)
                wgrad = f"{2 * B * T * P * D / 1e9:.1f}" if kind == "linear" else "-"
                print(f"| {name} | {T} | {layer} | {P} x {D} | {wgrad} | "
                      f"{ghost.flops / 1e9:.1f} | {ghost.bytes_moved / 1e6:.0f} | {ghost.scratch_bytes / 1e6:.0f} | "
                      f"{inst.flops / 1e9:.1f} | {inst.bytes_moved / 1e6:.0f} | {inst.scratch_bytes / 1e6:.0f} | "
                      f"{pick} |")


if __name__ == "__main__":
    app.run(main)
