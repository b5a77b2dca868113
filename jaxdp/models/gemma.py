"""Gemma 2 (arXiv:2408.00118) and Gemma 3 text (arXiv:2503.19786) from jaxdp layers.

The math of HF's `modeling_gemma2.py` / `modeling_gemma3.py` (`Gemma2ForCausalLM`, `Gemma3ForCausalLM`),
where it differs from Llama:

  norms      RMSNorm `xhat * (1 + w)` in float32, then cast (`nn.RMSNorm(scale_offset=1.0)`);
             four per block: before and after attention, before and after the MLP
             (`x + post(attn(pre(x)))`, then `x + post_ff(mlp(pre_ff(x)))`);
  embedding  looked up, then times sqrt(d_model) rounded to the compute dtype (HF's
             `embed_scale.to(weight.dtype)`: 55.5 for d = 3072 in bf16);
  MLP        GeGLU: `down(gelu_tanh(gate(x)) * up(x))` with the tanh-approximate GELU;
  attention  grouped-query, scores scaled by `query_pre_attn_scalar ** -0.5` (not head_dim's);
             Gemma 2 soft-caps the scores, `cap * tanh(s / cap)`, before the mask;
             layers are "sliding_attention" (query t sees keys t - w + 1 .. t) or
             "full_attention" (`GemmaConfig.layer_types`: Gemma 2 alternates, sliding first;
             Gemma 3 has five sliding layers to one full);
  Gemma 3    a per-head (1 + w) RMSNorm of q and of k before RoPE; RoPE base
             `rope_local_theta` on sliding layers and `rope_theta` on full ones, whose
             frequencies may be divided by a linear scaling factor (`rope_scaling`);
  head       the embedding, tied (or `lm_head` when untied), its float32 logits soft-capped
             `final_softcap * tanh(logits / final_softcap)` where the config has a cap.

Per-example gradients: every parameter belongs to a `jaxdp.core.nn` layer (Linear, Embed,
RMSNorm with its offset), so `per_example_grads` needs no fallback. The soft-caps are elementwise
functions of the logits without parameters: the backward multiplies the output gradient by
`1 - tanh^2` before it reaches the tied head's tap, whose term (dlogits^T h) therefore sees the
capped logits' gradient.

Attention with a score soft-cap runs here on XLA (the scores are materialised, B x N x T x T, as
HF's eager path does; `jax.nn.dot_product_attention` has no soft-cap); without one it is
`jaxdp.models.attention.causal_attention` (cuDNN on GPU). Context parallelism (`seq_axis`) works
with both: keys and values are all-gathered and the masks are on global positions.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdp.core import nn
from jaxdp.core import sequence_shards as context
from jaxdp.models import attention
from jaxdp.models.llama import apply_rope
from jaxdp.models.remat import block_apply, remat_policy

FAMILIES = ("gemma2", "gemma3_text")  # `GemmaConfig.family`: the HF model_types of this model
LAYER_TYPES = ("sliding_attention", "full_attention")


def default_layer_types(family: str, n_layer: int) -> tuple[str, ...]:
    """HF's layer kinds when a config.json names none: Gemma 2 alternates (sliding first), Gemma 3 has a
    full layer after every five sliding ones (`sliding_window_pattern` 6)."""
    pattern = 2 if family == "gemma2" else 6
    return tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layer))


@dataclasses.dataclass(frozen=True)
class GemmaConfig:
    vocab_size: int = 256000
    seq_len: int = 8192             # maximum sequence length
    n_layer: int = 26
    n_head: int = 8
    n_kv_head: int = 4              # grouped-query attention: n_head % n_kv_head == 0
    d_model: int = 2304
    d_ff: int = 9216                # GeGLU hidden width
    head_dim: int = 256
    query_pre_attn_scalar: float = 256.0  # scores scaled by query_pre_attn_scalar ** -0.5
    rope_theta: float = 10000.0     # RoPE base of the full-attention layers
    rope_local_theta: float = 10000.0  # RoPE base of the sliding layers (Gemma 3: 10000; Gemma 2: = rope_theta)
    rope_scaling: float | None = None  # linear scaling factor of the full layers' frequencies (Gemma 3 4B+)
    rms_norm_eps: float = 1e-6
    sliding_window: int = 4096
    layer_types: tuple[str, ...] | None = None  # per layer, one of LAYER_TYPES; None: the family's default
    attn_softcap: float | None = 50.0   # Gemma 2's score soft-cap; None: none (Gemma 3)
    final_softcap: float | None = 30.0  # Gemma 2's logit soft-cap; None: none (Gemma 3)
    qk_norm: bool = False           # per-head (1 + w) RMSNorm of q and k before RoPE (Gemma 3)
    tie_embeddings: bool = True
    family: str = "gemma2"          # the HF model_type this model is a checkpoint of (`FAMILIES`)
    dtype: str = "float32"          # compute dtype: "float32" | "bfloat16" | "float64"; parameters stay float32
    remat: bool | str = "none"      # per-block activation checkpointing: "none" | "dots" | "full"
    attention: str = "auto"         # layers without a score soft-cap: `jaxdp.models.attention` implementations

    def __post_init__(self):
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "n_kv_head", "d_model", "d_ff", "head_dim",
                     "sliding_window"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GemmaConfig.{name} must be an integer >= 1, got {value!r}")
        if self.head_dim % 2:
            raise ValueError(f"GemmaConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"GemmaConfig.n_head ({self.n_head}) must be divisible by n_kv_head ({self.n_kv_head})")
        if self.family not in FAMILIES:
            raise ValueError(f"GemmaConfig.family must be one of {FAMILIES}, got {self.family!r}")
        if self.layer_types is None:
            object.__setattr__(self, "layer_types", default_layer_types(self.family, self.n_layer))
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if len(self.layer_types) != self.n_layer or any(k not in LAYER_TYPES for k in self.layer_types):
            raise ValueError(f"GemmaConfig.layer_types must be {self.n_layer} of {LAYER_TYPES}, got "
                             f"{self.layer_types!r}")
        for name in ("query_pre_attn_scalar", "rope_theta", "rope_local_theta", "rms_norm_eps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"GemmaConfig.{name} must be > 0, got {getattr(self, name)!r}")
        for name in ("attn_softcap", "final_softcap"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ValueError(f"GemmaConfig.{name} must be None or > 0, got {getattr(self, name)!r}")
        if self.rope_scaling is not None and not self.rope_scaling >= 1:
            raise ValueError(f"GemmaConfig.rope_scaling must be None or >= 1, got {self.rope_scaling!r}")
        for name in ("qk_norm", "tie_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"GemmaConfig.{name} must be True or False, got {getattr(self, name)!r}")
        if self.dtype not in ("float32", "bfloat16", "float64"):
            raise ValueError(f"GemmaConfig.dtype must be 'float32', 'bfloat16' or 'float64', got {self.dtype!r}")
        attention.check_implementation(self.attention)
        remat_policy(self.remat)  # raises on an unknown policy

    @property
    def num_params(self) -> int:
        d, q, kv = self.d_model, self.n_head * self.head_dim, self.n_kv_head * self.head_dim
        block = 4 * d + 2 * d * q + 2 * d * kv + 3 * d * self.d_ff + 2 * self.head_dim * self.qk_norm
        head = 0 if self.tie_embeddings else d * self.vocab_size
        return self.vocab_size * d + self.n_layer * block + d + head


def rope_frequencies(config: GemmaConfig, layer_type: str) -> jax.Array:
    """Inverse frequencies (head_dim / 2,) of a layer kind: the local base on sliding layers, the global
    base (divided by the linear `rope_scaling`) on full ones."""
    H = config.head_dim
    theta = config.rope_local_theta if layer_type == "sliding_attention" else config.rope_theta
    inv_freq = 1.0 / (theta ** (jnp.arange(0, H, 2, dtype=jnp.float32) / H))
    if layer_type == "full_attention" and config.rope_scaling is not None:
        inv_freq = inv_freq / config.rope_scaling
    return inv_freq


def softcap(x: jax.Array, cap: float | None) -> jax.Array:
    """`cap * tanh(x / cap)` (HF's order: divide, tanh, multiply); x itself when `cap` is None."""
    return x if cap is None else jnp.tanh(x / cap) * cap


def softcapped_attention(q_BTNH, k_BSKH, v_BSKH, mask_TS, scale: float, cap: float) -> jax.Array:
    """Grouped-query attention with soft-capped scores (HF's eager path): scores `q k^T * scale` in float32
    (float64 for float64 inputs), `cap * tanh(s / cap)`, masked, softmax, weights back in q's dtype times v.
    Query head n reads key / value head n // (N / K)."""
    B, T, N, H = q_BTNH.shape
    K = k_BSKH.shape[2]
    q_BTKRH = q_BTNH.reshape(B, T, K, N // K, H)
    acc = jnp.promote_types(q_BTNH.dtype, jnp.float32)  # float64 stays float64 (x64 mode)
    s_BKRTS = jnp.einsum("btkrh,bskh->bkrts", q_BTKRH, k_BSKH, preferred_element_type=acc) * scale
    s_BKRTS = jnp.where(mask_TS, softcap(s_BKRTS, cap), jnp.finfo(s_BKRTS.dtype).min)
    w_BKRTS = jax.nn.softmax(s_BKRTS, axis=-1).astype(q_BTNH.dtype)
    y_BTKRH = jnp.einsum("bkrts,bskh->btkrh", w_BKRTS, v_BSKH)
    return y_BTKRH.reshape(B, T, N, H)


class Attention(nnx.Module):
    def __init__(self, config: GemmaConfig, layer_type: str, *, rngs: nnx.Rngs):
        d, dtype, H = config.d_model, jnp.dtype(config.dtype), config.head_dim
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, H
        self.implementation = config.attention
        self.window = config.sliding_window if layer_type == "sliding_attention" else None
        self.scale = float(config.query_pre_attn_scalar) ** -0.5
        self.cap = config.attn_softcap
        linear = lambda i, o: nn.Linear(i, o, use_bias=False, dtype=dtype, rngs=rngs)
        self.q_proj = linear(d, config.n_head * H)
        self.k_proj = linear(d, config.n_kv_head * H)
        self.v_proj = linear(d, config.n_kv_head * H)
        self.o_proj = linear(config.n_head * H, d)
        norm = lambda: nn.RMSNorm(H, epsilon=config.rms_norm_eps, dtype=dtype, scale_offset=1.0)
        self.q_norm, self.k_norm = (norm(), norm()) if config.qk_norm else (None, None)

    def __call__(self, x_BTD, positions_T, inv_freq, seq_axis):
        B, T, _ = x_BTD.shape
        q_BTNH = self.q_proj(x_BTD).reshape(B, T, self.n_head, self.head_dim)
        k_BTKH = self.k_proj(x_BTD).reshape(B, T, self.n_kv_head, self.head_dim)
        v_BTKH = self.v_proj(x_BTD).reshape(B, T, self.n_kv_head, self.head_dim)
        if self.q_norm is not None:  # Gemma 3: over each head's width, before RoPE
            q_BTNH, k_BTKH = self.q_norm(q_BTNH), self.k_norm(k_BTKH)
        q_BTNH, k_BTKH = apply_rope(q_BTNH, positions_T, inv_freq), apply_rope(k_BTKH, positions_T, inv_freq)
        if self.cap is None:  # the shared attention, with its scale 1/sqrt(H) turned into ours
            q_BTNH = (q_BTNH * (self.scale * math.sqrt(self.head_dim))).astype(q_BTNH.dtype)
            y_BTNH = attention.causal_attention(q_BTNH, k_BTKH, v_BTKH, positions_T, implementation=self.implementation,
                                                seq_axis=seq_axis, window=self.window)
        else:
            if seq_axis is not None:
                k_BTKH, v_BTKH = context.gather_sequence(k_BTKH, seq_axis), context.gather_sequence(v_BTKH, seq_axis)
            key_positions_S = jnp.arange(k_BTKH.shape[1])
            mask_TS = positions_T[:, None] >= key_positions_S[None, :]
            if self.window is not None:
                mask_TS &= positions_T[:, None] - key_positions_S[None, :] < self.window
            y_BTNH = softcapped_attention(q_BTNH, k_BTKH, v_BTKH, mask_TS, self.scale, self.cap)
        return self.o_proj(y_BTNH.reshape(B, T, self.n_head * self.head_dim))


class MLP(nnx.Module):
    """GeGLU: down(gelu_tanh(gate(x)) * up(x)) (HF's gelu_pytorch_tanh)."""

    def __init__(self, config: GemmaConfig, *, rngs: nnx.Rngs):
        d, f, dtype = config.d_model, config.d_ff, jnp.dtype(config.dtype)
        self.gate_proj = nn.Linear(d, f, use_bias=False, dtype=dtype, rngs=rngs)
        self.up_proj = nn.Linear(d, f, use_bias=False, dtype=dtype, rngs=rngs)
        self.down_proj = nn.Linear(f, d, use_bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, x_BTD):
        return self.down_proj(jax.nn.gelu(self.gate_proj(x_BTD), approximate=True) * self.up_proj(x_BTD))


class Block(nnx.Module):
    NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")

    def __init__(self, config: GemmaConfig, layer_type: str, *, rngs: nnx.Rngs):
        dtype = jnp.dtype(config.dtype)
        self.layer_type = layer_type
        for name in self.NORMS:
            setattr(self, name, nn.RMSNorm(config.d_model, epsilon=config.rms_norm_eps, dtype=dtype, scale_offset=1.0))
        self.attn = Attention(config, layer_type, rngs=rngs)
        self.mlp = MLP(config, rngs=rngs)

    def __call__(self, x_BTD, positions_T, inv_freq, seq_axis=None):
        a_BTD = self.attn(self.input_layernorm(x_BTD), positions_T, inv_freq, seq_axis)
        x_BTD = x_BTD + self.post_attention_layernorm(a_BTD)
        return x_BTD + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x_BTD)))



class Gemma(nnx.Module):
    """`Gemma(config, rngs=nnx.Rngs(seed))(tokens_BT) -> logits_BTV` (float32, soft-capped where the config says).

    `model(tokens_BT, seq_axis=axis)` inside a shard_map: `tokens_BT` is one shard of the sequence over the
    mesh axis `axis` (context parallelism); None (the default) is the plain model."""

    def __init__(self, config: GemmaConfig, *, rngs: nnx.Rngs):
        dtype = jnp.dtype(config.dtype)
        self.config = config
        self.embed_tokens = nn.Embed(config.vocab_size, config.d_model, dtype=dtype, rngs=rngs)
        self.blocks = nnx.List([Block(config, kind, rngs=rngs) for kind in config.layer_types])
        self.norm = nn.RMSNorm(config.d_model, epsilon=config.rms_norm_eps, dtype=dtype, scale_offset=1.0)
        self.lm_head = None if config.tie_embeddings else nn.Linear(
            config.d_model, config.vocab_size, use_bias=False, dtype=dtype, rngs=rngs)

    def __call__(self, tokens_BT: jax.Array, *, seq_axis: str | None = None) -> jax.Array:
        return self.head(self.features(tokens_BT, seq_axis=seq_axis))

    def features(self, tokens_BT: jax.Array, *, seq_axis: str | None = None) -> jax.Array:
        """The head's input (B, T, D): scaled embeddings, the blocks, the final norm."""
        _, T = tokens_BT.shape
        if context.global_seq_len(T, seq_axis) > self.config.seq_len:
            raise ValueError(f"sequence length {context.global_seq_len(T, seq_axis)} exceeds "
                             f"GemmaConfig.seq_len={self.config.seq_len}")
        positions_T = context.seq_offset(T, seq_axis) + jnp.arange(T)
        inv_freq = {kind: rope_frequencies(self.config, kind) for kind in LAYER_TYPES}
        x_BTD = self.embed_tokens(tokens_BT)
        x_BTD = x_BTD * jnp.asarray(math.sqrt(self.config.d_model), x_BTD.dtype)  # sqrt(d) in the compute dtype
        apply = block_apply(self.config.remat, seq_axis)
        for block in self.blocks:
            x_BTD = apply(block, x_BTD, positions_T, inv_freq[block.layer_type])
        return self.norm(x_BTD)

    def head(self, h_BTD: jax.Array) -> jax.Array:
        """The head (tied embedding or lm_head): float32 logits (B, T, V), soft-capped by `final_softcap`."""
        logits_BTV = self.embed_tokens.attend(h_BTD) if self.lm_head is None else self.lm_head(h_BTD)
        return softcap(logits_BTV.astype(jnp.promote_types(logits_BTV.dtype, jnp.float32)), self.config.final_softcap)

    def frozen_head(self) -> Callable[[jax.Array], jax.Array] | None:
        """`head` when its weights are frozen (fine-tuning), else None (`jaxdp.core.losses.token_nll`)."""
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return None if jax.tree.leaves(nnx.state(head, nnx.Param)) else self.head
