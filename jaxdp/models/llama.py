"""Llama 3.x (Grattafiori et al. 2024, arXiv:2407.21783) from jaxdp layers.

Pre-RMSNorm blocks, rotary position embeddings (RoPE, rotate-half layout as
the Hugging Face checkpoints, with Llama 3.1 frequency scaling), SwiGLU MLP,
grouped-query attention through `jaxdp.models.attention` (cuDNN's fused
attention on GPU, XLA on CPU; `LlamaConfig.attention`), no biases.
The output head is a separate `jaxdp.core.nn.Linear` (untied) unless
`tie_embeddings=True` (Llama 3.2 1B / 3B tie it), in which case the token
embedding's `attend` is the head. Every parameter has a per-example gradient
rule, so `jaxdp.per_example_grads` needs no fallback.

Three families are this model with a switch (`LlamaConfig.family` names the
one a checkpoint came from; the switches carry the math):

  Mistral   `sliding_window=w`: query t attends to keys t - w + 1 .. t only
            (HF's `kv_idx > q_idx - sliding_window` on top of the causal mask);
  Qwen2     `qkv_bias=True`: q, k and v projections with biases (o has none);
  Qwen3     `qk_norm=True`: a per-head RMSNorm of q and of k (one (head_dim,)
            scale each, shared by the heads) before RoPE; `head_dim` set apart
            from d_model / n_head (Qwen3 0.6B: 1024 / 16 with 128-wide heads).

The biases are `Linear` biases (per-example gradient `sum_t g`) and the q / k
norms are `RMSNorm`s over the last axis of (B, T, heads, head_dim), whose
rule `sum_{t, heads} xhat * g` is the gradient of the shared scale.

Context parallelism: called with `seq_axis=axis` (inside a shard_map; the
sharded train step's loss passes it) the tokens are one shard of the
sequence; positions are offset by the shard index, and attention
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

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")  # `LlamaConfig.family`: the HF model_types of this model
PRESETS = {
    # name: (n_layer, n_head, n_kv_head, d_model, d_ff, tie_embeddings, rope_scaling)
    "tiny": (2, 4, 2, 64, 128, False, None),
    "1B": (16, 32, 8, 2048, 8192, True, 32.0),     # Llama 3.2 1B: 1,235,814,400
    "3B": (28, 24, 8, 3072, 8192, True, 32.0),     # Llama 3.2 3B: 3,212,749,824
    "8B": (32, 32, 8, 4096, 14336, False, 8.0),    # Llama 3.1 8B: 8,030,261,248
}


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 128256
    seq_len: int = 131072          # maximum sequence length
    n_layer: int = 16
    n_head: int = 32
    n_kv_head: int = 8             # grouped-query attention: n_head % n_kv_head == 0
    d_model: int = 2048
    d_ff: int = 8192               # SwiGLU hidden width
    rope_theta: float = 500000.0
    rope_scaling: float | None = 32.0  # Llama 3.1 "llama3" scaling factor; None: plain RoPE
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool = True
    dtype: str = "float32"         # compute dtype: "float32" | "bfloat16"; parameters stay float32
    remat: bool | str = "none"     # per-block activation checkpointing: "none" | "dots" | "full" (True: "full")
    attention: str = "auto"        # "auto" (cuDNN on GPU for bf16, XLA otherwise) | "xla" | "cudnn"
    # width of a head; None: d_model // n_head, resolved to that number (dataclasses.replace of d_model or
    # n_head: pass head_dim=None too)
    head_dim: int | None = None
    qkv_bias: bool = False         # biases on the q, k, v projections (Qwen2)
    qk_norm: bool = False          # per-head RMSNorm of q and k before RoPE (Qwen3)
    sliding_window: int | None = None  # keys t - w + 1 .. t only (Mistral); None: every earlier key
    family: str = "llama"          # the HF model_type this model is a checkpoint of (`FAMILIES`): names, no math
    scan_layers: bool = False      # blocks stacked on a leading layer axis and run by lax.scan (one compiled block)

    def __post_init__(self):
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "n_kv_head", "d_model", "d_ff"):
            if getattr(self, name) < 1:
                raise ValueError(f"LlamaConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.head_dim is None:
            if self.d_model % self.n_head:
                raise ValueError(f"LlamaConfig.d_model ({self.d_model}) must be divisible by n_head ({self.n_head}) "
                                 "unless head_dim is set")
            object.__setattr__(self, "head_dim", self.d_model // self.n_head)
        if not _is_count(self.head_dim) or self.head_dim % 2:
            raise ValueError(f"LlamaConfig.head_dim must be an even integer >= 2 for RoPE, got {self.head_dim!r}")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"LlamaConfig.n_head ({self.n_head}) must be divisible by n_kv_head ({self.n_kv_head})")
        if self.sliding_window is not None and not _is_count(self.sliding_window):
            raise ValueError(f"LlamaConfig.sliding_window must be None or an integer >= 1, got {self.sliding_window!r}")
        for name in ("qkv_bias", "qk_norm"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"LlamaConfig.{name} must be True or False, got {getattr(self, name)!r}")
        if self.family not in FAMILIES:
            raise ValueError(f"LlamaConfig.family must be one of {FAMILIES}, got {self.family!r}")
        if self.rope_theta <= 0:
            raise ValueError(f"LlamaConfig.rope_theta must be > 0, got {self.rope_theta}")
        if self.rope_scaling is not None and self.rope_scaling < 1:
            raise ValueError(f"LlamaConfig.rope_scaling must be None or >= 1, got {self.rope_scaling}")
        attention.check_implementation(self.attention)
        if self.rms_norm_eps <= 0:
            raise ValueError(f"LlamaConfig.rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if self.dtype not in ("float32", "bfloat16", "float64"):
            raise ValueError(f"LlamaConfig.dtype must be 'float32', 'bfloat16' or 'float64', got {self.dtype!r}")
        remat_policy(self.remat)  # raises on an unknown policy
        if not isinstance(self.scan_layers, bool):
            raise ValueError(f"LlamaConfig.scan_layers must be True or False, got {self.scan_layers!r}")

    @classmethod
    def preset(cls, name: str, **overrides) -> LlamaConfig:
        """`LlamaConfig.preset("1B", seq_len=4096)`; names: tiny, 1B, 3B, 8B."""
        if name not in PRESETS:
            raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {name!r}")
        n_layer, n_head, n_kv_head, d_model, d_ff, tie, scaling = PRESETS[name]
        if name == "tiny":
            overrides = dict(dict(vocab_size=256, seq_len=64, rope_theta=10000.0), **overrides)
        return cls(**dict(dict(n_layer=n_layer, n_head=n_head, n_kv_head=n_kv_head, d_model=d_model,
                               d_ff=d_ff, tie_embeddings=tie, rope_scaling=scaling), **overrides))

    @property
    def num_params(self) -> int:
        d, q, kv = self.d_model, self.n_head * self.head_dim, self.n_kv_head * self.head_dim
        block = 2 * d + 2 * d * q + 2 * d * kv + 3 * d * self.d_ff
        block += (q + 2 * kv) * self.qkv_bias + 2 * self.head_dim * self.qk_norm
        head = 0 if self.tie_embeddings else d * self.vocab_size
        return self.vocab_size * d + self.n_layer * block + d + head


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def rope_frequencies(config: LlamaConfig) -> jax.Array:
    """Inverse frequencies (head_dim / 2,), with Llama 3.1 scaling when `rope_scaling` is set."""
    H = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (jnp.arange(0, H, 2, dtype=jnp.float32) / H))
    if config.rope_scaling is None:
        return inv_freq
    factor, low, high, original = config.rope_scaling, 1.0, 4.0, 8192.0
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return jnp.where(medium, smoothed, scaled)


def apply_rope(x_BTNH: jax.Array, positions_T: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotate-half RoPE in float32, returned in x's dtype."""
    angles_TF = positions_T.astype(jnp.float32)[:, None] * inv_freq[None, :]
    cos = jnp.concatenate([jnp.cos(angles_TF)] * 2, axis=-1)[None, :, None, :]
    sin = jnp.concatenate([jnp.sin(angles_TF)] * 2, axis=-1)[None, :, None, :]
    xf = x_BTNH.astype(jnp.promote_types(x_BTNH.dtype, jnp.float32))
    x1, x2 = jnp.split(xf, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (xf * cos + rotated * sin).astype(x_BTNH.dtype)


class Attention(nnx.Module):
    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        d, dtype, H = config.d_model, jnp.dtype(config.dtype), config.head_dim
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, H
        self.implementation, self.window = config.attention, config.sliding_window
        linear = lambda i, o: nn.Linear(i, o, use_bias=config.qkv_bias, dtype=dtype, rngs=rngs)
        self.q_proj = linear(d, config.n_head * H)
        self.k_proj = linear(d, config.n_kv_head * H)
        self.v_proj = linear(d, config.n_kv_head * H)
        self.o_proj = nn.Linear(config.n_head * H, d, use_bias=False, dtype=dtype, rngs=rngs,
                                kernel_init=nnx.initializers.normal(0.02 / math.sqrt(2 * config.n_layer)))
        norm = lambda: nn.RMSNorm(H, epsilon=config.rms_norm_eps, dtype=dtype) if config.qk_norm else None
        self.q_norm, self.k_norm = norm(), norm()

    def __call__(self, x_BTD, positions_T, inv_freq, seq_axis):
        B, T, _ = x_BTD.shape
        q_BTNH = self.q_proj(x_BTD).reshape(B, T, self.n_head, self.head_dim)
        k_BTKH = self.k_proj(x_BTD).reshape(B, T, self.n_kv_head, self.head_dim)
        v_BTKH = self.v_proj(x_BTD).reshape(B, T, self.n_kv_head, self.head_dim)
        if self.q_norm is not None:  # Qwen3: over each head's width, before RoPE
            q_BTNH = self.q_norm(q_BTNH)
        if self.k_norm is not None:
            k_BTKH = self.k_norm(k_BTKH)
        q_BTNH, k_BTKH = apply_rope(q_BTNH, positions_T, inv_freq), apply_rope(k_BTKH, positions_T, inv_freq)
        y_BTNH = attention.causal_attention(q_BTNH, k_BTKH, v_BTKH, positions_T, implementation=self.implementation,
                                            seq_axis=seq_axis, window=self.window)
        return self.o_proj(y_BTNH.reshape(B, T, self.n_head * self.head_dim))


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        d, f, dtype = config.d_model, config.d_ff, jnp.dtype(config.dtype)
        self.gate_proj = nn.Linear(d, f, use_bias=False, dtype=dtype, rngs=rngs)
        self.up_proj = nn.Linear(d, f, use_bias=False, dtype=dtype, rngs=rngs)
        self.down_proj = nn.Linear(f, d, use_bias=False, dtype=dtype, rngs=rngs,
                                   kernel_init=nnx.initializers.normal(0.02 / math.sqrt(2 * config.n_layer)))

    def __call__(self, x_BTD):
        return self.down_proj(jax.nn.silu(self.gate_proj(x_BTD)) * self.up_proj(x_BTD))


class Block(nnx.Module):
    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        dtype = jnp.dtype(config.dtype)
        self.input_layernorm = nn.RMSNorm(config.d_model, epsilon=config.rms_norm_eps, dtype=dtype)
        self.attn = Attention(config, rngs=rngs)
        self.post_attention_layernorm = nn.RMSNorm(config.d_model, epsilon=config.rms_norm_eps, dtype=dtype)
        self.mlp = MLP(config, rngs=rngs)

    def __call__(self, x_BTD, positions_T, inv_freq, seq_axis=None):
        x_BTD = x_BTD + self.attn(self.input_layernorm(x_BTD), positions_T, inv_freq, seq_axis)
        return x_BTD + self.mlp(self.post_attention_layernorm(x_BTD))



class Llama(nnx.Module):
    """`Llama(config, rngs=nnx.Rngs(seed))(tokens_BT) -> logits_BTV` (float32 logits).

    `model(tokens_BT, seq_axis=axis)` inside a shard_map: `tokens_BT` is one shard of the sequence over the
    mesh axis `axis` (context parallelism); None (the default) is the plain model."""

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        dtype = jnp.dtype(config.dtype)
        self.config = config
        self.embed_tokens = nn.Embed(config.vocab_size, config.d_model, dtype=dtype, rngs=rngs)
        blocks = [Block(config, rngs=rngs) for _ in range(config.n_layer)]
        # scan_layers: one Block whose variables lead with the layer axis (the same values as unrolled's)
        self.blocks = layer_scan.stack(blocks) if config.scan_layers else nnx.List(blocks)
        self.norm = nn.RMSNorm(config.d_model, epsilon=config.rms_norm_eps, dtype=dtype)
        self.lm_head = None if config.tie_embeddings else nn.Linear(
            config.d_model, config.vocab_size, use_bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, tokens_BT: jax.Array, *, seq_axis: str | None = None) -> jax.Array:
        return self.head(self.features(tokens_BT, seq_axis=seq_axis))

    def features(self, tokens_BT: jax.Array, *, seq_axis: str | None = None) -> jax.Array:
        """The head's input (B, T, D): the blocks, then the final norm."""
        _, T = tokens_BT.shape
        if context.global_seq_len(T, seq_axis) > self.config.seq_len:
            raise ValueError(f"sequence length {context.global_seq_len(T, seq_axis)} exceeds "
                             f"LlamaConfig.seq_len={self.config.seq_len}")
        positions_T = context.seq_offset(T, seq_axis) + jnp.arange(T)
        inv_freq = rope_frequencies(self.config)
        x_BTD = self.embed_tokens(tokens_BT)
        apply = block_apply(self.config.remat, seq_axis)
        if self.config.scan_layers:
            x_BTD = layer_scan.scan_layers(apply, self.blocks, x_BTD, positions_T, inv_freq)
        else:
            for block in self.blocks:
                x_BTD = apply(block, x_BTD, positions_T, inv_freq)
        return self.norm(x_BTD)

    def head(self, h_BTD: jax.Array) -> jax.Array:
        """The head (tied embedding or lm_head): float32 logits (B, T, V) of the features."""
        logits_BTV = self.embed_tokens.attend(h_BTD) if self.lm_head is None else self.lm_head(h_BTD)
        return logits_BTV.astype(jnp.promote_types(logits_BTV.dtype, jnp.float32))

    def frozen_head(self) -> Callable[[jax.Array], jax.Array] | None:
        """`head` when its weights are frozen (fine-tuning), else None (`jaxdp.core.losses.token_nll`)."""
        head = self.embed_tokens if self.lm_head is None else self.lm_head  # maybe LoRA'd or adapted: any Param
        return None if jax.tree.leaves(nnx.state(head, nnx.Param)) else self.head
