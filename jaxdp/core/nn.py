"""Flax NNX layers that take part in DP training.

Each layer computes its ordinary forward pass and taps its output (see
`jaxdp.core._tape`), so that `per_example_grads` receives, in one backward pass,
what it needs for the factored per-example gradients of the layer's
parameters:

  Linear      kernel: LinearTerm(x, g)            bias: sum_t g
  Embed       embedding: EmbedTerm(ids, g); `attend` (tied head):
              LinearTerm(dlogits, h), so dE_b = dlogits_b^T h_b
  LayerNorm   scale: sum_t xhat * g               bias: sum_t g
  RMSNorm     scale: sum_t xhat * g         (also with Gemma's offset: xhat * (1 + scale))

  SoftPrompt  embedding: g[:, :n] (the prompt's output gradient itself)
  Gate        alpha: mu (1 - mu) / temperature * sum_t <g, a - b>

A parameter must be used only through its layer's methods; a direct read of
`layer.kernel` elsewhere in the model would not be seen by the rule.
Outside `per_example_grads` the layers are plain NNX layers.

Frozen parameters. A parameter held as `Frozen` instead of `nnx.Param` is
not trained: `per_example_grads`, `jaxdp.core.reference` and
`nnx.Optimizer(..., wrt=nnx.Param)` see only `nnx.Param`s. A layer taps only
for its trainable parameters: with all of them frozen it does not tap at all
(no per-example work, nothing recorded), with the kernel / scale frozen it
records no input (a zero-width placeholder) and forms only the bias term.
The frozen values enter `per_example_grads`' backward under `stop_gradient`,
so no weight-gradient GEMM is traced for them. `jaxdp.finetune.methods.freeze`
converts between the two.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdp.core import _tape
from jaxdp.core.terms import DenseTerm, EmbedTerm, LinearTerm

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


class Frozen(nnx.Variable):
    """A parameter that is not trained: no per-example gradient, no optimizer update (see the module doc)."""


def is_trainable(variable) -> bool:
    """True for an `nnx.Param` (trained), False for `Frozen`, None or any other variable."""
    return isinstance(variable, nnx.Param)


def _unused_record(a):
    """A zero-width stand-in for a record no trainable parameter needs: nothing is kept for it."""
    return a[..., :0]


def _linear_terms(kernel: bool, bias: bool):
    def terms_fn(x, g):
        terms = {}
        if kernel:
            terms["kernel"] = LinearTerm(_flatten_BTF(x), _flatten_BTF(g))
        if bias:
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
        kernel, bias = is_trainable(self.kernel), self.use_bias and is_trainable(self.bias)
        if not (kernel or bias):
            return y_BTD
        record = x_BTP if kernel else _unused_record(x_BTP)
        return _tape.tap(self, "linear", y_BTD, record, _linear_terms(kernel, bias))


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
        if not is_trainable(self.embedding):
            return y_BTD
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
        if not is_trainable(self.embedding):
            return logits_BTV

        def terms_fn(h, g):
            # logits = h E^T, so dE_b = dlogits_b^T h_b: a LinearTerm with x = dlogits.
            return {"embedding": LinearTerm(_flatten_BTF(g), _flatten_BTF(h))}
        return _tape.tap(self, "attend", logits_BTV, h_BTD, terms_fn)


def _norm_terms(scale: bool, bias: bool):
    def terms_fn(xhat, g):
        g = _flatten_BTF(g).astype(xhat.dtype)
        terms = {}
        if scale:
            terms["scale"] = DenseTerm((_flatten_BTF(xhat) * g).sum(axis=1))
        if bias:
            terms["bias"] = DenseTerm(g.sum(axis=1))
        return terms
    return terms_fn


def _tap_norm(layer, y, xhat, scale: bool, bias: bool):
    if not (scale or bias):
        return y
    return _tape.tap(layer, "norm", y, xhat if scale else _unused_record(xhat), _norm_terms(scale, bias))


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
        return _tap_norm(self, y, xhat, is_trainable(self.scale), self.use_bias and is_trainable(self.bias))


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis (no bias), statistics in float32: `xhat * (scale_offset + scale)`.

    `scale_offset=1.0` is Gemma's norm (`xhat * (1 + w)` in float32, then cast; w starts at 0). The
    per-example gradient of `scale` is `sum_t xhat * g` for any offset (d/dw of xhat (c + w) is xhat).
    """

    def __init__(self, num_features: int, *, epsilon: float = 1e-6, dtype: Dtype | None = None,
                 param_dtype: Dtype = jnp.float32, scale_offset: float = 0.0, rngs: nnx.Rngs | None = None):
        del rngs
        self.epsilon = epsilon
        self.dtype = dtype
        self.scale_offset = float(scale_offset)
        self.scale = nnx.Param(jnp.full((num_features,), 1.0 - self.scale_offset, param_dtype))
        self.dp_path = None

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(_accum_dtype(x.dtype))
        xhat = xf * jax.lax.rsqrt(jnp.square(xf).mean(axis=-1, keepdims=True) + self.epsilon)
        scale = self.scale[...] if self.scale_offset == 0.0 else self.scale_offset + self.scale[...]
        y = (xhat * scale).astype(self.dtype or x.dtype)
        return _tap_norm(self, y, xhat, is_trainable(self.scale), False)


class SoftPrompt(nnx.Module):
    """Prompt tuning (Lester et al. 2021, arXiv:2104.08691): `length` learned embeddings put before the tokens'.

    `__call__(x_BTD) -> (B, length + T, D)`. The per-example gradient of the
    prompt is its output gradient `g[b]` (length, D): a DenseTerm, no input
    recorded.
    """

    def __init__(self, length: int, features: int, *, dtype: Dtype | None = None,
                 param_dtype: Dtype = jnp.float32, embedding_init=default_kernel_init, rngs: nnx.Rngs):
        if length < 1:
            raise ValueError(f"SoftPrompt length must be >= 1, got {length}")
        self.length = length
        self.dtype = dtype
        self.embedding = nnx.Param(embedding_init(rngs.params(), (length, features), param_dtype))
        self.dp_path = None

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        dtype = self.dtype or jnp.result_type(x_BTD, self.embedding[...])
        prompt_BND = jnp.broadcast_to(self.embedding[...].astype(dtype), (x_BTD.shape[0], *self.embedding.shape))
        if is_trainable(self.embedding):
            prompt_BND = _tape.tap(self, "prompt", prompt_BND, _unused_record(prompt_BND),
                                   lambda _, g: {"embedding": DenseTerm(g.astype(_accum_dtype(g.dtype)))})
        return jnp.concatenate([prompt_BND, x_BTD.astype(dtype)], axis=1)


class Gate(nnx.Module):
    """A learned scalar mix `b + mu (a - b)`, `mu = sigmoid(alpha / temperature)` (LST's ladder gate, arXiv:2206.06522).

    Per-example gradient of `alpha`: `sum_t <g_t, mu (1 - mu) / temperature (a_t - b_t)>`,
    a DenseTerm of shape (B,), from the recorded `dz/dalpha` (z = mu (a - b)).
    """

    def __init__(self, *, init: float = 0.0, temperature: float = 0.1, rngs: nnx.Rngs | None = None):
        del rngs
        if temperature <= 0:
            raise ValueError(f"Gate temperature must be > 0, got {temperature}")
        self.temperature = temperature
        self.alpha = nnx.Param(jnp.asarray(init, jnp.float32))
        self.dp_path = None

    def __call__(self, a: jax.Array, b: jax.Array) -> jax.Array:
        mu = jax.nn.sigmoid(self.alpha[...] / self.temperature)
        diff = a - b
        z = (mu * diff).astype(diff.dtype)
        if is_trainable(self.alpha):
            # dz/dalpha = mu (1 - mu) / temperature * (a - b): recorded whole, so that terms_fn is a pure
            # function of (record, g) (it runs after the traced forward has returned).
            dz_dalpha = (mu * (1 - mu) / self.temperature * diff).astype(_accum_dtype(diff.dtype))

            def terms_fn(r, g):
                r, g = _flatten_BTF(r), _flatten_BTF(g)
                return {"alpha": DenseTerm(jnp.sum(r * g.astype(r.dtype), axis=(1, 2)))}
            z = _tape.tap(self, "gate", z, dz_dalpha, terms_fn)
        return b + z


DP_LAYERS = (Linear, Embed, LayerNorm, RMSNorm, SoftPrompt, Gate)
