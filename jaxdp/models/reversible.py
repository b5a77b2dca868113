"""MemDPT-rev: a frozen GPT-2 made reversible, activations recomputed by inversion in the backward.

The reversible design MemDPT's rev variant takes from MEFT (Liao et al. 2023,
arXiv:2306.00477, architecture 1): every pre-trained block becomes one
reversible layer on two streams,

    y1 = alpha x1 + F_n(x2)        F_n: block n of the backbone with LoRA (its weights frozen)
    y2 = beta  x2 + G_n(y1)        G_n: an adapter up(gelu(down(.))), weights N(0, 0.02^2)
    (x1, x2) <- (y2, y1)           the streams are swapped between layers

both streams start as the embedding h_0, and the head reads the average
(x1 + x2) / 2 through the backbone's final norm and tied embedding. MEFT's
initialisation alpha = beta = 0.1 keeps the pre-trained model's starting
point: G_n is near zero at initialisation, so x2 follows the backbone's
hidden states (h_n plus alpha beta = 1% of h_{n-2}), x1 is beta = 0.1 of
the previous one, and the final LayerNorm does not see the average's scale.

Backward by inversion. `__call__` wraps the layers in one `jax.custom_vjp`
whose forward keeps only the last two streams (and the weights); its
backward walks the layers in reverse, each time recomputing
`g = G_n(y1)` -> `x2 = (y2 - g) / beta` -> `f = F_n(x2)` -> `x1 = (y1 - f) / alpha`
under `jax.vjp` and pulling the output cotangents through (MEFT's backward).
Activation memory is therefore that of one layer whatever the depth.

Exact per-example gradients. Inside `jaxdp.per_example_grads` the taps of
the trainable layers (LoRA's A and B, the adapters' projections) run inside
that recomputation: the custom_vjp takes every layer's tape slots as
explicit inputs, and its backward runs F_n and G_n under a sub-tape of the
same mode holding those slots, so their cotangents -- each tap's output
gradient and recorded input ("record"), or its per-example norms ("norms",
`jaxdp.clipping.two_pass`) -- come out of the inverted backward exactly as out of an
ordinary one. The discovery pass runs the layers plainly.

What the gradients are exact to is the inversion itself. In floating point
`x1 = (y1 - f) / alpha` recovers x1 only to the rounding of y1 and f, and
the error grows by about 1 / (alpha beta) per inverted layer (the
difference cancels: with alpha = beta = 0.1, x1 is 1% of f). Against the
stored-activation backward (`backward="stored"`), random tiny GPT-2s,
maximum relative error of the clipped sums: float32, two layers 4e-4, four
layers 1.5 (meaningless); float64, six layers 2e-3; alpha = beta = 1:
float32, six layers 5e-5. So at GPT-2 large's 36 layers pure inversion with
MEFT's scales gives no usable gradient in any dtype: this is MEFT's
reconstruction-error problem, not the DP machinery's. `keep_streams_every=k`
keeps the two streams at the input of every k-th layer (meant to cost 2 B T d
floats per kept layer; XLA:CPU assigns far more, see WORKSPACE.md) and
inverts only between them: k = 2 leaves one
inversion per pair and is exact to float32 rounding at any depth (six
layers: 7e-7; k = 3: 4e-5, k = 4: 4e-3). Default None: every layer is
inverted, activation memory is constant in depth, as MemDPT-rev.

Non-`nnx.Param` state of the layers (the frozen backbone) gets no cotangent
from the inverted backward: it is not differentiated, and no weight-gradient
GEMM of a frozen block is traced.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
from flax import nnx

from jaxdp.core import _tape, nn
from jaxdp.models.gpt2 import GPT2

BACKWARDS = ("reversible", "stored")


class RevAdapter(nnx.Module):
    """G_n: `up(gelu(down(y)))` without a residual (the reversible coupling adds beta x2)."""

    def __init__(self, features: int, bottleneck: int, *, dtype=None, rngs: nnx.Rngs):
        init = nnx.initializers.normal(0.02)
        self.down = nn.Linear(features, bottleneck, dtype=dtype, kernel_init=init, rngs=rngs)
        self.up = nn.Linear(bottleneck, features, dtype=dtype, kernel_init=init, rngs=rngs)

    def __call__(self, y_BTD: jax.Array) -> jax.Array:
        return self.up(jax.nn.gelu(self.down(y_BTD), approximate=True)).astype(y_BTD.dtype)


@contextlib.contextmanager
def _taps_off():
    """No tape: the DP layers' taps are the identity (the inversion itself records nothing)."""
    previous = _tape.current()
    _tape._state.tape = None
    try:
        yield
    finally:
        _tape._state.tape = previous


def _sub_tape(tape, slots):
    """A fresh tape of `tape`'s mode holding `slots` (or no tape when `tape` is None)."""
    if tape is None:
        return _taps_off()
    return _tape.recording(tape.mode, slots, tape.axes, tape.norms_fns)


def _slots_of(tape, module) -> dict:
    """The entries of `tape.slots` whose taps belong to DP layers inside `module`."""
    if tape is None:
        return {}
    names = {"/".join(map(str, node.dp_path)) for _, node in nnx.iter_graph(module)
             if isinstance(node, nn.DP_LAYERS) and node.dp_path is not None}
    return {k: v for k, v in tape.slots.items() if k.rsplit(":", 2)[0] in names}


class ReversibleGPT2(nnx.Module):
    """`ReversibleGPT2(backbone, alpha=0.1, beta=0.1, bottleneck=64, rngs=...)(tokens_BT) -> logits_BTV`.

    `backbone`: a GPT2 (LoRA already added where wanted: `jaxdp.finetune.methods.prepare(model, "reversible")`).
    `backward`: "reversible" (recompute by inversion) or "stored" (ordinary autodiff of the same
    forward: the ground truth the tests compare with; activation memory grows with depth).
    """

    def __init__(self, backbone: GPT2, *, alpha: float = 0.1, beta: float = 0.1, bottleneck: int = 64,
                 backward: str = "reversible", keep_streams_every: int | None = None, rngs: nnx.Rngs):
        if not isinstance(backbone, GPT2):
            raise ValueError(f"backbone must be a jaxdp.models.gpt2.GPT2, got {type(backbone).__name__}")
        if not (alpha > 0 and beta > 0):
            raise ValueError(f"alpha and beta must be > 0 (the layers are inverted by dividing by them), "
                             f"got alpha={alpha!r}, beta={beta!r}")
        if keep_streams_every is not None and (not isinstance(keep_streams_every, int) or keep_streams_every < 1):
            raise ValueError(f"keep_streams_every must be None or an integer >= 1, got {keep_streams_every!r}")
        if not isinstance(bottleneck, int) or bottleneck < 1:
            raise ValueError(f"bottleneck must be an integer >= 1, got {bottleneck!r}")
        config = backbone.config
        self.backbone = backbone
        self.alpha, self.beta = float(alpha), float(beta)
        self.backward = check_backward(backward)
        self.keep_streams_every = keep_streams_every
        self.adapters = nnx.List([RevAdapter(config.d_model, bottleneck, dtype=jnp.dtype(config.dtype), rngs=rngs)
                                  for _ in range(config.n_layer)])

    def __call__(self, tokens_BT: jax.Array) -> jax.Array:
        return self.backbone.head(self.features(tokens_BT))

    def frozen_head(self):
        return self.backbone.frozen_head()

    def features(self, tokens_BT: jax.Array) -> jax.Array:
        """The head's input: the final norm of the averaged streams."""
        backbone = self.backbone
        h_BTD, positions_T = backbone.embed(tokens_BT)
        h_BTD = h_BTD.astype(jnp.promote_types(h_BTD.dtype, jnp.float32))  # streams in float32 at least
        tape = _tape.current()
        if self.backward == "stored" or (tape is not None and tape.mode == "discover"):
            x1, x2 = h_BTD, h_BTD
            for F, G in zip(backbone.blocks, self.adapters):
                x1, x2 = _layer(F, G, self.alpha, self.beta, x1, x2, positions_T)
        else:
            x1, x2 = self._reversible(tape, h_BTD, positions_T)
        return backbone.final_norm((x1 + x2) / 2, tokens_BT.shape[1])

    def _reversible(self, tape, h_BTD, positions_T):
        alpha, beta, every = self.alpha, self.beta, self.keep_streams_every
        kept = set(range(0, len(self.adapters), every)) if every else set()  # layers whose inputs are kept
        Fs = [nnx.split(F, nnx.Param, ...) for F in self.backbone.blocks]
        Gs = [nnx.split(G, nnx.Param, ...) for G in self.adapters]
        graphdefs = [(F[0], G[0]) for F, G in zip(Fs, Gs)]
        rests = [(F[2], G[2]) for F, G in zip(Fs, Gs)]  # frozen: closed over, never differentiated here
        params = [(F[1], G[1]) for F, G in zip(Fs, Gs)]
        slots = [(_slots_of(tape, F), _slots_of(tape, G)) for F, G in zip(self.backbone.blocks, self.adapters)]
        slot_shapes = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), slots)

        def F_fn(n, x2, p, s):  # s None: no taps (the forward); else this layer's slots
            with _sub_tape(None if s is None else tape, s):
                return nnx.merge(graphdefs[n][0], p, rests[n][0])(x2, positions_T).astype(x2.dtype)

        def G_fn(n, y1, p, s):
            with _sub_tape(None if s is None else tape, s):
                return nnx.merge(graphdefs[n][1], p, rests[n][1])(y1).astype(y1.dtype)

        def forward(x1, x2, params):
            inputs = {}
            for n, (pF, pG) in enumerate(params):
                if n in kept:
                    inputs[n] = (x1, x2)
                y1 = alpha * x1 + F_fn(n, x2, pF, None)
                x1, x2 = beta * x2 + G_fn(n, y1, pG, None), y1
            return (x1, x2), inputs

        @jax.custom_vjp
        def stack(x1, x2, params, slots):
            del slots
            return forward(x1, x2, params)[0]

        def stack_fwd(x1, x2, params, slots):
            del slots
            (x1, x2), inputs = forward(x1, x2, params)
            return (x1, x2), (x1, x2, params, inputs)

        def stack_bwd(residuals, cotangents):
            x1, x2, params, inputs = residuals  # the last layer's (y2, y1); the kept layers' inputs
            dx1, dx2 = cotangents
            zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), slot_shapes)
            dparams, dslots = [None] * len(params), [None] * len(params)
            for n in reversed(range(len(params))):
                (pF, pG), (sF, sG) = params[n], zeros[n]
                # The barrier ties this layer's recomputation to the cotangents of the layer above, so that
                # the scheduler cannot run the inversion chain (which needs no cotangent) ahead, nor CSE a
                # kept layer's recomputation with its forward. With keep_streams_every XLA:GPU keeps
                # only the streams over pure inversion; XLA:CPU's buffer assignment holds about the
                # stored-activation memory (WORKSPACE.md, "Fine-tuning memory").
                y1, y2, dy1, dy2, kept_inputs = jax.lax.optimization_barrier((x2, x1, dx2, dx1, inputs.get(n)))
                g, G_vjp = jax.vjp(lambda y, p, s: G_fn(n, y, p, s), y1, pG, sG)
                x2 = kept_inputs[1] if n in kept else (y2 - g) / beta
                f, F_vjp = jax.vjp(lambda x, p, s: F_fn(n, x, p, s), x2, pF, sF)
                x1 = kept_inputs[0] if n in kept else (y1 - f) / alpha
                dy1_G, dpG, dsG = G_vjp(dy2)
                dy1 = dy1 + dy1_G
                dx2_F, dpF, dsF = F_vjp(dy1)
                dx1, dx2 = alpha * dy1, beta * dy2 + dx2_F
                dparams[n], dslots[n] = (dpF, dpG), (dsF, dsG)
            return dx1, dx2, dparams, dslots

        stack.defvjp(stack_fwd, stack_bwd)
        return stack(h_BTD, h_BTD, params, slots)


def _layer(F, G, alpha, beta, x1, x2, positions_T):
    """One reversible layer, streams swapped: (x1, x2) -> (y2, y1)."""
    y1 = alpha * x1 + F(x2, positions_T).astype(x2.dtype)
    return beta * x2 + G(y1).astype(y1.dtype), y1


def check_backward(backward: str) -> str:
    if backward not in BACKWARDS:
        raise ValueError(f"backward must be one of {BACKWARDS}, got {backward!r}")
    return backward
