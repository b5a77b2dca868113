"""MemDPT-side: a ladder side network (LST) on a frozen GPT-2.

Ladder side-tuning (Sung et al. 2022, arXiv:2206.06522), as MemDPT's side
variant uses it: a narrow transformer of width d / reduction runs beside the
frozen backbone. Its layer i takes a learned gate of the down-projected
backbone state h_i and its own previous output,

    s_0 = down_0(h_0)
    s_i = side_block_i(gate_i(down_i(h_i), s_{i-1}))     gate: s + mu (a - s), mu = sigmoid(alpha / 0.1)

and the head reads `h_L + up(ln(s_L))` through the backbone's (frozen) final
norm and tied embedding. `up` starts at zero, so the model starts as the
backbone.

Memory: every backbone state enters the side network under `stop_gradient`,
so the backward never enters the backbone: none of its internal activations
(attention, 4d MLP) are kept, only the states h_i the down-projections read
(their per-example gradients are LinearTerms of h_i). The side network is
built from `jaxdp.core.nn` layers (`Linear`, `LayerNorm`, `Gate`, GPT-2 `Block`s of
the reduced width), so `per_example_grads` gives exact factored per-example
gradients with no vmap; the backbone must be frozen (`jaxdp.finetune.methods.prepare(model,
"side")` does that), so it costs no per-example work either.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdp.core import nn
from jaxdp.models.gpt2 import GPT2, Block


def side_config(backbone, reduction: int):
    """The side blocks' GPT2Config: width d / reduction, the backbone's head size where it divides."""
    config = backbone.config
    if not isinstance(reduction, int) or reduction < 1 or config.d_model % reduction:
        raise ValueError(f"reduction must be an integer >= 1 dividing d_model={config.d_model}, got {reduction!r}")
    width = config.d_model // reduction
    head_dim = config.d_model // config.n_head
    n_head = width // head_dim if width % head_dim == 0 and width >= head_dim else 1
    return dataclasses.replace(config, d_model=width, n_head=n_head)


class LadderSideGPT2(nnx.Module):
    """`LadderSideGPT2(backbone, reduction=8, rngs=...)(tokens_BT) -> logits_BTV`; `backbone` a GPT2 (kept as is)."""

    def __init__(self, backbone: GPT2, *, reduction: int = 8, rngs: nnx.Rngs):
        if not isinstance(backbone, GPT2):
            raise ValueError(f"backbone must be a jaxdp.models.gpt2.GPT2, got {type(backbone).__name__}")
        config = side_config(backbone, reduction)
        d, width, dtype = backbone.config.d_model, config.d_model, jnp.dtype(config.dtype)
        self.backbone = backbone
        self.reduction = reduction
        self.downs = nnx.List([nn.Linear(d, width, dtype=dtype, rngs=rngs) for _ in range(config.n_layer + 1)])
        self.gates = nnx.List([nn.Gate() for _ in range(config.n_layer)])
        self.blocks = nnx.List([Block(config, rngs=rngs) for _ in range(config.n_layer)])
        self.ln = nn.LayerNorm(width, epsilon=config.layer_norm_epsilon, dtype=dtype)
        self.up = nn.Linear(width, d, dtype=dtype, kernel_init=nnx.initializers.zeros, rngs=rngs)

    def __call__(self, tokens_BT: jax.Array) -> jax.Array:
        return self.backbone.head(self.features(tokens_BT))

    def frozen_head(self):
        return self.backbone.frozen_head()

    def features(self, tokens_BT: jax.Array) -> jax.Array:
        """The head's input: the final norm of the backbone's output plus the side network's up-projection."""
        backbone = self.backbone
        h_BTD, positions_T = backbone.embed(tokens_BT)
        h_BTD = jax.lax.stop_gradient(h_BTD)  # no backward into the backbone
        s_BTW = self.downs[0](h_BTD)
        for down, gate, side_block, block in zip(self.downs[1:], self.gates, self.blocks, backbone.blocks):
            h_BTD = jax.lax.stop_gradient(block(h_BTD, positions_T))
            s_BTW = side_block(gate(down(h_BTD), s_BTW), positions_T)
        return backbone.final_norm(h_BTD + self.up(self.ln(s_BTW)).astype(h_BTD.dtype), tokens_BT.shape[1])
