"""Flax NNX layers that take part in DP training.

Each layer computes its ordinary forward pass and taps its output (see
`jaxdp._tape`), so that `per_example_grads` receives, in one backward pass,
what it needs for the factored per-example gradients of the layer's
parameters:

  Linear      kernel: LinearTerm(x, g)            bias: sum_t g
  Embed       embedding: EmbedTerm(ids, g); `attend` (tied head):
              LinearTerm(dlogits, h), so dE_b = dlogits_b^T h_b
  LayerNorm   scale: sum_t xhat * g               bias: sum_t g
  RMSNorm     scale: sum_t xhat * g

A parameter must be used only through its layer's methods; a direct read of
`layer.kernel` elsewhere in the model would not be seen by the rule.
Outside `per_example_grads` the layers are plain NNX layers.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdp import _tape
from jaxdp.terms import DenseTerm, EmbedTerm, LinearTerm

Dtype = Any
default_kernel_init = nnx.initializers.normal(stddev=0.02)


def _accum_dtype(dtype):
    """float32, or float64 where the inputs are float64."""
    return jnp.promote_types(dtype, jnp.float32)


def _flatten_BTF(a):
    """(B, ..., F) -> (B, T, F) with T the product of the middle axes."""
    return a.reshape(a.shape[0], -1, a.shape[-1])


def _sum_over_tokens(a):
    a = _flatten_BTF(a)
    return a.astype(_accum_dtype(a.dtype)).sum(axis=1)


def _linear_terms(use_bias):
    def terms_fn(x, g):
        terms = {"kernel": LinearTerm(_flatten_BTF(x), _flatten_BTF(g))}
        if use_bias:
            terms["bias"] = DenseTerm(_sum_over_tokens(g))
        return terms
    return terms_fn


class Linear(nnx.Module):
    """`y = x @ kernel + bias` over the last axis; `x` is (B, ..., in_features)."""

    def __init__(self, in_features: int, out_features: int, *, use_bias: bool = True,
                 dtype: Dtype | None = None, param_dtype: Dtype = jnp.float32,
                 kernel_init=default_kernel_init, bias_init=nnx.initializers.zeros,
                 rngs: nnx.Rngs):
        self.in_features = in_features
        self.out_features = out_features
        self.use_bias = use_bias
        self.dtype = dtype
        self.kernel = nnx.Param(kernel_init(rngs.params(), (in_features, out_features), param_dtype))
        self.bias = nnx.Param(bias_init(rngs.params(), (out_features,), param_dtype)) if use_bias else None
        self.dp_path = None

    def __call__(self, x_BTP: jax.Array) -> jax.Array:
        kernel = self.kernel[...]
        dtype = self.dtype or jnp.result_type(x_BTP, kernel)
        x_BTP = x_BTP.astype(dtype)
        y_BTD = jnp.dot(x_BTP, kernel.astype(dtype))
        if self.use_bias:
            y_BTD = y_BTD + self.bias[...].astype(dtype)
        return _tape.tap(self, "linear", y_BTD, x_BTP, _linear_terms(self.use_bias))


class Embed(nnx.Module):
    """Embedding table (V, D): `__call__(ids)` looks up rows, `attend(h)` is the tied head `h @ E^T`."""

    def __init__(self, num_embeddings: int, features: int, *, dtype: Dtype | None = None,
                 param_dtype: Dtype = jnp.float32, embedding_init=default_kernel_init,
                 rngs: nnx.Rngs):
        if num_embeddings >= 2 ** 24:
            raise ValueError(f"num_embeddings must be < 2**24 (ids travel as float32), got {num_embeddings}")
        self.num_embeddings = num_embeddings
        self.features = features
        self.dtype = dtype
        self.embedding = nnx.Param(embedding_init(rngs.params(), (num_embeddings, features), param_dtype))
        self.dp_path = None

    def __call__(self, ids_BT: jax.Array) -> jax.Array:
        table = self.embedding[...]
        if self.dtype is not None:
            table = table.astype(self.dtype)
        y_BTD = jnp.take(table, ids_BT, axis=0)
        num_embeddings = self.num_embeddings

        def terms_fn(ids, g):
            return {"embedding": EmbedTerm(ids.astype(jnp.int32).reshape(ids.shape[0], -1),
                                           _flatten_BTF(g), num_embeddings)}
        return _tape.tap(self, "lookup", y_BTD, ids_BT, terms_fn)

    def attend(self, h_BTD: jax.Array) -> jax.Array:
        table = self.embedding[...]
        dtype = self.dtype or jnp.result_type(h_BTD, table)
        h_BTD = h_BTD.astype(dtype)
        logits_BTV = jnp.dot(h_BTD, table.astype(dtype).T)

        def terms_fn(h, g):
            # logits = h E^T, so dE_b = dlogits_b^T h_b: a LinearTerm with x = dlogits.
            return {"embedding": LinearTerm(_flatten_BTF(g), _flatten_BTF(h))}
        return _tape.tap(self, "attend", logits_BTV, h_BTD, terms_fn)


def _norm_terms(use_bias):
    def terms_fn(xhat, g):
        xhat = _flatten_BTF(xhat)
        g = _flatten_BTF(g).astype(xhat.dtype)
        terms = {"scale": DenseTerm((xhat * g).sum(axis=1))}
        if use_bias:
            terms["bias"] = DenseTerm(g.sum(axis=1))
        return terms
    return terms_fn


class LayerNorm(nnx.Module):
    """LayerNorm over the last axis, statistics in float32 (float64 for float64 inputs)."""

    def __init__(self, num_features: int, *, epsilon: float = 1e-5, use_bias: bool = True,
                 dtype: Dtype | None = None, param_dtype: Dtype = jnp.float32, rngs: nnx.Rngs | None = None):
        del rngs
        self.epsilon = epsilon
        self.use_bias = use_bias
        self.dtype = dtype
        self.scale = nnx.Param(jnp.ones((num_features,), param_dtype))
        self.bias = nnx.Param(jnp.zeros((num_features,), param_dtype)) if use_bias else None
        self.dp_path = None

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(_accum_dtype(x.dtype))
        mean = xf.mean(axis=-1, keepdims=True)
        var = jnp.square(xf - mean).mean(axis=-1, keepdims=True)
        xhat = (xf - mean) * jax.lax.rsqrt(var + self.epsilon)
        y = xhat * self.scale[...]
        if self.use_bias:
            y = y + self.bias[...]
        y = y.astype(self.dtype or x.dtype)
        return _tape.tap(self, "norm", y, xhat, _norm_terms(self.use_bias))


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis (no bias), statistics in float32."""

    def __init__(self, num_features: int, *, epsilon: float = 1e-6, dtype: Dtype | None = None,
                 param_dtype: Dtype = jnp.float32, rngs: nnx.Rngs | None = None):
        del rngs
        self.epsilon = epsilon
        self.dtype = dtype
        self.scale = nnx.Param(jnp.ones((num_features,), param_dtype))
        self.dp_path = None

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(_accum_dtype(x.dtype))
        xhat = xf * jax.lax.rsqrt(jnp.square(xf).mean(axis=-1, keepdims=True) + self.epsilon)
        y = (xhat * self.scale[...]).astype(self.dtype or x.dtype)
        return _tape.tap(self, "norm", y, xhat, _norm_terms(False))


DP_LAYERS = (Linear, Embed, LayerNorm, RMSNorm)
