"""GPT-2 (Radford et al. 2019) from jaxdp layers.

Tied token embedding / output head, learned positions, pre-LayerNorm blocks,
GELU MLP, causal attention through `jaxdp.models.attention` (cuDNN's fused
attention on GPU, XLA on CPU; `GPT2Config.attention`). Parameters
are float32; `dtype="bfloat16"` computes in bf16. Every parameter has a
per-example gradient rule, so `jaxdp.per_example_grads` needs no fallback.

Context parallelism (as `jaxdp.models.llama`): called with `seq_axis=axis`
(inside a shard_map) the tokens are one shard of the sequence; learned
positions are offset by the shard's first global position, and attention
all-gathers keys and values over `axis` with a causal mask on global
positions. With `seq_axis=None` (the default) the model is the plain one.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdp.core import layer_scan, nn
from jaxdp.core import sequence_shards as context
from jaxdp.models import attention
from jaxdp.models.remat import block_apply, remat_policy

PRESETS = {
    # name: (n_layer, n_head, d_model)
    "tiny": (2, 2, 64),
    "small": (12, 12, 768),     # 124M
    "medium": (24, 16, 1024),   # 350M
    "large": (36, 20, 1280),    # 774M
    "xl": (48, 25, 1600),       # 1.5B
}


@dataclasses.dataclass(frozen=True)
class GPT2Config:
    vocab_size: int = 50257
    seq_len: int = 1024          # maximum sequence length (learned positions)
    n_layer: int = 12
    n_head: int = 12
    d_model: int = 768
    mlp_ratio: int = 4
    layer_norm_epsilon: float = 1e-5
    dtype: str = "float32"       # compute dtype: "float32" | "bfloat16"; parameters stay float32
    remat: bool | str = "none"   # per-block activation checkpointing: "none" | "dots" | "full" (True: "full")
    attention: str = "auto"      # "auto" (cuDNN on GPU for bf16, XLA otherwise) | "xla" | "cudnn"
    scan_layers: bool = False    # blocks stacked on a leading layer axis and run by lax.scan (one compiled block)

    def __post_init__(self):
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model", "mlp_ratio"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPT2Config.{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.n_head:
            raise ValueError(f"GPT2Config.d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")
        if self.dtype not in ("float32", "bfloat16", "float64"):
            raise ValueError(f"GPT2Config.dtype must be 'float32', 'bfloat16' or 'float64', got {self.dtype!r}")
        remat_policy(self.remat)  # raises on an unknown policy
        if not isinstance(self.scan_layers, bool):
            raise ValueError(f"GPT2Config.scan_layers must be True or False, got {self.scan_layers!r}")
        attention.check_implementation(self.attention)

    @classmethod
    def preset(cls, name: str, **overrides) -> "GPT2Config":
        """`GPT2Config.preset("small", seq_len=512)`; names: tiny, small, medium, large, xl. `overrides` may
        change any field, the preset's shape included (`preset("tiny", n_layer=8)`)."""
        if name not in PRESETS:
            raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {name!r}")
        n_layer, n_head, d_model = PRESETS[name]
        if name == "tiny":
            overrides = dict(dict(vocab_size=256, seq_len=64), **overrides)
        return cls(**dict(dict(n_layer=n_layer, n_head=n_head, d_model=d_model), **overrides))

    @property
    def num_params(self) -> int:
        d, L = self.d_model, self.n_layer
        block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + 2 * (d * self.mlp_ratio * d) + self.mlp_ratio * d + d
        return self.vocab_size * d + self.seq_len * d + L * block + 2 * d


class Attention(nnx.Module):
    def __init__(self, config: GPT2Config, *, rngs: nnx.Rngs):
        d, dtype = config.d_model, jnp.dtype(config.dtype)
        proj_init = nnx.initializers.normal(0.02 / math.sqrt(2 * config.n_layer))
        self.n_head = config.n_head
        self.implementation = config.attention
        self.c_attn = nn.Linear(d, 3 * d, dtype=dtype, rngs=rngs)
        self.c_proj = nn.Linear(d, d, dtype=dtype, kernel_init=proj_init, rngs=rngs)

    def __call__(self, x_BTD, positions_T, seq_axis):
        B, T, D = x_BTD.shape
        H = D // self.n_head
        q, k, v = jnp.split(self.c_attn(x_BTD), 3, axis=-1)
        q_BTNH, k_BTNH, v_BTNH = (a.reshape(B, T, self.n_head, H) for a in (q, k, v))
        y_BTNH = attention.causal_attention(q_BTNH, k_BTNH, v_BTNH, positions_T, implementation=self.implementation,
                                            seq_axis=seq_axis)
        return self.c_proj(y_BTNH.reshape(B, T, D))


class MLP(nnx.Module):
    def __init__(self, config: GPT2Config, *, rngs: nnx.Rngs):
        d, dtype = config.d_model, jnp.dtype(config.dtype)
        proj_init = nnx.initializers.normal(0.02 / math.sqrt(2 * config.n_layer))
        self.c_fc = nn.Linear(d, config.mlp_ratio * d, dtype=dtype, rngs=rngs)
        self.c_proj = nn.Linear(config.mlp_ratio * d, d, dtype=dtype, kernel_init=proj_init, rngs=rngs)

    def __call__(self, x_BTD):
        return self.c_proj(jax.nn.gelu(self.c_fc(x_BTD), approximate=True))


class Block(nnx.Module):
    def __init__(self, config: GPT2Config, *, rngs: nnx.Rngs):
        dtype = jnp.dtype(config.dtype)
        self.ln_1 = nn.LayerNorm(config.d_model, epsilon=config.layer_norm_epsilon, dtype=dtype)
        self.attn = Attention(config, rngs=rngs)
        self.ln_2 = nn.LayerNorm(config.d_model, epsilon=config.layer_norm_epsilon, dtype=dtype)
        self.mlp = MLP(config, rngs=rngs)

    def __call__(self, x_BTD, positions_T, seq_axis=None):
        x_BTD = x_BTD + self.attn(self.ln_1(x_BTD), positions_T, seq_axis)
        return x_BTD + self.mlp(self.ln_2(x_BTD))



class GPT2(nnx.Module):
    """`GPT2(config, rngs=nnx.Rngs(seed))(tokens_BT) -> logits_BTV` (float32 logits).

    `model(tokens_BT, seq_axis=axis)` inside a shard_map: `tokens_BT` is one shard of the sequence over the
    mesh axis `axis` (context parallelism); None (the default) is the plain model."""

    def __init__(self, config: GPT2Config, *, rngs: nnx.Rngs):
        dtype = jnp.dtype(config.dtype)
        self.config = config
        self.wte = nn.Embed(config.vocab_size, config.d_model, dtype=dtype, rngs=rngs)
        self.wpe = nn.Embed(config.seq_len, config.d_model, dtype=dtype,
                            embedding_init=nnx.initializers.normal(0.01), rngs=rngs)
        blocks = [Block(config, rngs=rngs) for _ in range(config.n_layer)]
        # scan_layers: one Block whose variables lead with the layer axis (the same values as unrolled's)
        self.blocks = layer_scan.stack(blocks) if config.scan_layers else nnx.List(blocks)
        self.ln_f = nn.LayerNorm(config.d_model, epsilon=config.layer_norm_epsilon, dtype=dtype)
        self.soft_prompt = nnx.data(None)  # prompt tuning: a jaxdp.core.nn.SoftPrompt (jaxdp.finetune.methods.add_soft_prompt)

    def __call__(self, tokens_BT: jax.Array, *, seq_axis: str | None = None) -> jax.Array:
        return self.head(self.features(tokens_BT, seq_axis=seq_axis))

    def features(self, tokens_BT: jax.Array, *, seq_axis: str | None = None) -> jax.Array:
        """The head's input (B, T, D): the blocks, then the final norm at the tokens' positions."""
        x_BTD, positions_T = self.embed(tokens_BT, seq_axis=seq_axis)
        apply = block_apply(self.config.remat, seq_axis)
        if self.config.scan_layers:
            x_BTD = layer_scan.scan_layers(apply, self.blocks, x_BTD, positions_T)
        else:
            for block in self.blocks:
                x_BTD = apply(block, x_BTD, positions_T)
        return self.final_norm(x_BTD, tokens_BT.shape[1])

    def embed(self, tokens_BT: jax.Array, *, seq_axis: str | None = None) -> tuple[jax.Array, jax.Array]:
        """(the first block's input x_BTD, positions_T): token (after a soft prompt, if any) + position embeddings."""
        B = tokens_BT.shape[0]
        x_BTD = self.wte(tokens_BT)
        if self.soft_prompt is not None:  # learned embeddings before the tokens; their logits are dropped
            if seq_axis is not None:
                raise ValueError("a soft prompt cannot be used with a sequence-sharded (context-parallel) model")
            x_BTD = self.soft_prompt(x_BTD)
        T = x_BTD.shape[1]
        if context.global_seq_len(T, seq_axis) > self.config.seq_len:
            raise ValueError(f"sequence length {context.global_seq_len(T, seq_axis)} exceeds "
                             f"GPT2Config.seq_len={self.config.seq_len}")
        positions_T = context.seq_offset(T, seq_axis) + jnp.arange(T)
        return x_BTD + self.wpe(jnp.broadcast_to(positions_T, (B, T))), positions_T

    def final_norm(self, x_BTD: jax.Array, num_tokens: int) -> jax.Array:
        """The final norm on the last `num_tokens` positions (a soft prompt's are dropped)."""
        return self.ln_f(x_BTD[:, x_BTD.shape[1] - num_tokens:])

    def head(self, h_BTD: jax.Array) -> jax.Array:
        """The tied head: float32 logits (B, T, V) of the features."""
        logits_BTV = self.wte.attend(h_BTD)
        return logits_BTV.astype(jnp.promote_types(logits_BTV.dtype, jnp.float32))

    def frozen_head(self) -> Callable[[jax.Array], jax.Array] | None:
        """`head` when its weights are frozen (fine-tuning), else None: a loss may then run the head over
        chunks of tokens (`jaxdp.core.losses.token_nll`)."""
        return None if jax.tree.leaves(nnx.state(self.wte, nnx.Param)) else self.head
