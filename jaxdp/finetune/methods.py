"""DP fine-tuning of a subset of a model's parameters, with exact factored per-example gradients.

Methods (`METHODS`, `prepare(model, method, ...)`):

  full     every parameter trained.
  lora     LoRA (Hu et al. 2021, arXiv:2106.09685; DP-LoRA: Yu et al. 2022,
           arXiv:2110.06500): chosen projections `W` become `W x + (alpha / r) B A x`
           with `A` (P, r) and `B` (r, D) `jaxdp.core.nn.Linear` layers; only A and B train.
  adapter  Houlsby adapters (Houlsby et al. 2019, arXiv:1902.00751): after the
           chosen projections `h -> h + up(gelu(down(h)))`, bottleneck m; the
           adapters and the layer norms train.
  bitfit   biases only (Zaken et al. 2021, arXiv:2106.10199; DP-BiTFiT: Bu et
           al. 2022, arXiv:2210.00036): every `bias`, of projections and norms.
  prompt   prompt tuning (Lester et al. 2021, arXiv:2104.08691; PromptDPSGD:
           Duan et al. 2023, arXiv:2305.15594): `length` learned embeddings
           before the tokens (`jaxdp.core.nn.SoftPrompt`, GPT-2).
  side     MemDPT-side: a ladder side network of width d / reduction beside the
           frozen GPT-2, which the backward never enters
           (`jaxdp.models.ladder_side.LadderSideGPT2`; `prepare` returns it).
  reversible  MemDPT-rev: the frozen GPT-2 with LoRA made reversible (MEFT's two
           streams: LoRA'd block in F, an adapter in G, scales alpha / beta, output
           averaged), activations recomputed by inversion in the backward
           (`jaxdp.models.reversible.ReversibleGPT2`; `prepare` returns it); LoRA's
           factors and the adapters train.

How it fits the per-example machinery. New trainable weights are `jaxdp.core.nn`
layers (LoRA's A and B, the adapters' down / up projections are `Linear`s, the
prompt a `SoftPrompt`), so they tap their outputs and get `LinearTerm` /
`DenseTerm` rules like any other layer: `per_example_grads` needs no vmap and
no fallback. Everything else is frozen by `freeze`, which re-types each
non-trainable `nnx.Param` as `jaxdp.core.nn.Frozen`: `per_example_grads`,
`jaxdp.core.reference` and `nnx.Optimizer(model, tx, wrt=nnx.Param)` select
`nnx.Param` and never see it (no per-example work, no optimizer state, no
update, no weight decay), and the `jaxdp.core.nn` layers skip the rules of frozen
parameters (a fully frozen layer does not tap; see `jaxdp.core.nn`). Frozen values
enter the backward under `stop_gradient`: no weight-gradient GEMM is formed
for them. The clipping groups are the trainable parameters' (per-layer: one
per LoRA factor, adapter projection, bias-owning layer).

    model = jaxdp.load_hf_gpt2("gpt2/")        # or jaxdp.load_hf_llama("llama-3.2-1b/"): every method but GPT2_METHODS
    jaxdp.finetune.prepare(model, "lora", rngs=nnx.Rngs(0), options=jaxdp.finetune.LoRA(rank=8))
    optimizer = nnx.Optimizer(model, optax.chain(jaxdp.fused_clip(...), optax.adamw(1e-3)), wrt=nnx.Param)

Before `jaxdp.save_hf_gpt2`, fold LoRA into the base kernels with `merge_lora`.
"""

from __future__ import annotations

import math
from typing import Callable

import jax
from flax import nnx

from jaxdp.core import nn
from jaxdp.finetune import targets as family_targets
from jaxdp.finetune.settings import Adapters, LoRA, Prompt, Reversible, Side, accepts_flat_keywords, check_options
from jaxdp.models import layers
from jaxdp.models.gpt2 import GPT2
from jaxdp.models.ladder_side import LadderSideGPT2
from jaxdp.models.llama import Llama
from jaxdp.models.reversible import ReversibleGPT2

METHODS = ("full", "lora", "adapter", "bitfit", "prompt", "side", "reversible")
GPT2_METHODS = ("prompt", "side", "reversible")  # built on GPT-2's modules (soft-prompt slot, blocks, wte)
# The defaults of GPT-2 and the Llama-style families by model class, kept for readers of these names: the
# defaults per family (Mistral, Qwen2, Qwen3, and any family registered later) are
# `jaxdp.finetune.targets.FAMILY_TARGETS`, which `add_lora` / `add_adapters` read.
DEFAULT_LORA_TARGETS = {GPT2: family_targets.GPT2_STYLE.lora, Llama: family_targets.LLAMA_STYLE.lora}
DEFAULT_ADAPTER_TARGETS = {GPT2: family_targets.GPT2_STYLE.adapter, Llama: family_targets.LLAMA_STYLE.adapter}
Path = tuple
Trainable = Callable[[Path, nnx.Module], bool]


class LoRALinear(nnx.Module):
    """`base(x) + (alpha / rank) * lora_b(lora_a(x))`; `lora_b` starts at zero, so the output starts at base's."""

    def __init__(self, base: nn.Linear, *, rank: int, alpha: float, rngs: nnx.Rngs):
        self.base = base
        self.scale = alpha / rank
        a_init = nnx.initializers.normal(1 / math.sqrt(base.in_features))
        self.lora_a = nn.Linear(base.in_features, rank, use_bias=False, dtype=base.dtype,
                                kernel_init=a_init, rngs=rngs)
        self.lora_b = nn.Linear(rank, base.out_features, use_bias=False, dtype=base.dtype,
                                kernel_init=nnx.initializers.zeros, rngs=rngs)

    def __call__(self, x_BTP: jax.Array) -> jax.Array:
        y_BTD = self.base(x_BTP)
        # The barriers give the LoRA branch its own input and output cotangent. Otherwise XLA:GPU's dot
        # merger runs x W and x A as one GEMM over a concatenated [W | A], and the backward's two input
        # gradients over [W; B]: two copies of every LoRA'd frozen weight per step, held from the forward
        # to the backward (WORKSPACE.md, "Fine-tuning memory").
        lora_BTD = self.lora_b(self.lora_a(jax.lax.optimization_barrier(x_BTP)))
        return y_BTD + jax.lax.optimization_barrier(self.scale * lora_BTD).astype(y_BTD.dtype)


class Adapter(nnx.Module):
    """Houlsby's bottleneck `h + up(gelu(down(h)))`, near-identity at initialisation (weights N(0, 0.01^2))."""

    def __init__(self, features: int, bottleneck: int, *, dtype=None, rngs: nnx.Rngs):
        init = nnx.initializers.normal(1e-2)
        self.down = nn.Linear(features, bottleneck, dtype=dtype, kernel_init=init, rngs=rngs)
        self.up = nn.Linear(bottleneck, features, dtype=dtype, kernel_init=init, rngs=rngs)

    def __call__(self, h_BTD: jax.Array) -> jax.Array:
        return h_BTD + self.up(jax.nn.gelu(self.down(h_BTD), approximate=True)).astype(h_BTD.dtype)


class AdaptedLinear(nnx.Module):
    """`adapter(base(x))`: a projection followed by its adapter."""

    def __init__(self, base: nn.Linear, adapter: Adapter):
        self.base = base
        self.adapter = adapter

    def __call__(self, x_BTP: jax.Array) -> jax.Array:
        return self.adapter(self.base(x_BTP))


def _nodes(model: nnx.Module) -> dict[Path, object]:
    return {tuple(path): node for path, node in nnx.iter_graph(model)}


def _set(parent, key, value) -> None:
    if isinstance(parent, nnx.List):
        parent[key] = value
    else:
        setattr(parent, key, value)


def _is_parameter(node) -> bool:
    return isinstance(node, (nnx.Param, nn.Frozen))


def freeze(model: nnx.Module, trainable: Trainable) -> nnx.Module:
    """Makes each parameter an `nnx.Param` if `trainable(path, owner)` else `jaxdp.core.nn.Frozen`, in place.

    `path` is the parameter's path (e.g. `("blocks", 0, "attn", "c_attn", "bias")`),
    `owner` the module holding it. `freeze(model, lambda path, owner: True)`
    unfreezes everything. Returns `model`.
    """
    nodes = _nodes(model)
    for path, node in list(nodes.items()):
        if not _is_parameter(node):
            continue
        owner = nodes[path[:-1]]
        kind = nnx.Param if trainable(path, owner) else nn.Frozen
        if type(node) is not kind:
            _set(owner, path[-1], kind(node.get_value()))
    return model


def trainable_paths(model: nnx.Module) -> list[Path]:
    """Paths of the `nnx.Param`s of `model` (what DP training updates)."""
    return [tuple(p) for p, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))]


def _matching_linears(model: nnx.Module, targets, argument: str) -> list[tuple[Path, nn.Linear]]:
    if isinstance(targets, str) or not targets:
        raise ValueError(f"{argument} must be a non-empty sequence of module path suffixes like 'attn/c_attn', "
                         f"got {targets!r}")
    linears = [(p, n) for p, n in _nodes(model).items() if isinstance(n, nn.Linear)]

    def name(path):
        return "/".join(map(str, path))
    found = []
    for target in targets:
        hits = [(p, n) for p, n in linears if ("/" + name(p)).endswith("/" + target.strip("/"))]
        if not hits:
            kinds = sorted({"/".join("*" if isinstance(k, int) else str(k) for k in p) for p, _ in linears})
            raise ValueError(f"{argument}: {target!r} matches no jaxdp.core.nn.Linear of the model; its linears are "
                             f"{kinds}")
        found += hits
    return found


def resolve_targets(model: nnx.Module, method: str, targets) -> tuple[str, ...]:
    """`targets` checked against `model`'s family (`jaxdp.finetune.targets.check_targets`: an unknown name is
    one line listing the family's names), or the family's default for `method` ("lora" / "adapter") when
    None."""
    family = family_targets.family_of(model)
    if targets is None:
        return family_targets.default_targets(family, method)
    return family_targets.check_targets(family, targets)


def add_lora(model: nnx.Module, *, rank: int, alpha: float | None = None,
             targets=None, rngs: nnx.Rngs) -> nnx.Module:
    """Wraps every `jaxdp.core.nn.Linear` whose path ends with one of `targets` (default: the model family's,
    `jaxdp.finetune.targets.FAMILY_TARGETS`) in a `LoRALinear`, in place. `alpha` defaults to `rank` (scale 1). Freezes
    nothing (see `prepare`).
    """
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"rank must be an integer >= 1, got {rank!r}")
    alpha = float(rank if alpha is None else alpha)
    targets = resolve_targets(model, "lora", targets)
    nodes = _nodes(model)
    for path, linear in _matching_linears(model, targets, "targets"):
        _set(nodes[path[:-1]], path[-1], LoRALinear(linear, rank=rank, alpha=alpha, rngs=rngs))
    return model


def add_adapters(model: nnx.Module, *, bottleneck: int, targets=None, rngs: nnx.Rngs) -> nnx.Module:
    """Puts a Houlsby `Adapter` after every `jaxdp.core.nn.Linear` whose path ends with one of `targets`
    (default: the model family's, `jaxdp.finetune.targets.FAMILY_TARGETS`), in place."""
    if not isinstance(bottleneck, int) or bottleneck < 1:
        raise ValueError(f"bottleneck must be an integer >= 1, got {bottleneck!r}")
    targets = resolve_targets(model, "adapter", targets)
    nodes = _nodes(model)
    for path, linear in _matching_linears(model, targets, "targets"):
        adapter = Adapter(linear.out_features, bottleneck, dtype=linear.dtype, rngs=rngs)
        _set(nodes[path[:-1]], path[-1], AdaptedLinear(linear, adapter))
    return model


def add_soft_prompt(model: nnx.Module, *, length: int, rngs: nnx.Rngs) -> nnx.Module:
    """Gives a GPT-2 a `SoftPrompt` of `length` embeddings, initialised from randomly drawn token embeddings."""
    if not hasattr(model, "soft_prompt") or not hasattr(model, "wte"):
        raise ValueError(f"model must be a jaxdp.models.gpt2.GPT2 (it has the soft_prompt slot), "
                         f"got {type(model).__name__}")
    if not isinstance(length, int) or length < 1:
        raise ValueError(f"length must be an integer >= 1, got {length!r}")
    table = model.wte.embedding[...]
    ids = jax.random.choice(rngs.params(), table.shape[0], (length,), replace=length > table.shape[0])
    prompt = nn.SoftPrompt(length, table.shape[1], dtype=model.wte.dtype,
                           embedding_init=lambda *_: table[ids], rngs=rngs)
    model.soft_prompt = nnx.data(prompt)
    return model


def merge_lora(model: nnx.Module) -> nnx.Module:
    """Folds every `LoRALinear` into its base kernel (`W + scale A B`) and puts the base back, in place."""
    nodes = _nodes(model)
    for path, node in nodes.items():
        if isinstance(node, LoRALinear):
            base = node.base
            delta = node.scale * (node.lora_a.kernel[...] @ node.lora_b.kernel[...])
            base.kernel.set_value((base.kernel[...] + delta).astype(base.kernel[...].dtype))
            _set(nodes[path[:-1]], path[-1], base)
    return model


def trainable_filter(method: str, *, train_layer_norms: bool = True) -> Trainable:
    """`trainable(path, owner)` of a method (see the module doc); `train_layer_norms` for "adapter"."""
    check_method(method)
    if method == "full":
        return lambda path, owner: True
    if method == "lora":
        return lambda path, owner: "lora_a" in path or "lora_b" in path
    if method == "adapter":
        norms = (nn.LayerNorm, nn.RMSNorm) if train_layer_norms else ()
        return lambda path, owner: "adapter" in path or isinstance(owner, norms)
    if method == "bitfit":
        return lambda path, owner: path[-1] == "bias"
    if method == "side":
        return lambda path, owner: path[0] != "backbone"
    if method == "reversible":
        return lambda path, owner: "lora_a" in path or "lora_b" in path or path[0] == "adapters"
    return lambda path, owner: isinstance(owner, nn.SoftPrompt)


def check_method(method: str, family: str = "gpt2") -> None:
    """ValueError unless `method` is one of `METHODS` and applies to a model of `family` ("gpt2", "llama")."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if method in GPT2_METHODS and family != "gpt2":
        raise ValueError(f"method {method!r} is built on GPT-2's modules; a {family} model takes one of "
                         f"{tuple(m for m in METHODS if m not in GPT2_METHODS)}")


def _add_lora(model: nnx.Module, lora: LoRA, rngs: nnx.Rngs) -> nnx.Module:
    return add_lora(model, rank=lora.rank, alpha=lora.alpha, targets=lora.targets, rngs=rngs)


@accepts_flat_keywords
def prepare(model: nnx.Module, method: str, *, rngs: nnx.Rngs,
            options: LoRA | Adapters | Prompt | Side | Reversible | None = None) -> nnx.Module:
    """Adds `method`'s modules to `model` and freezes all but its trainable parameters, in place.

    "side" wraps `model` (a GPT-2) in a `LadderSideGPT2`, "reversible" adds LoRA
    and wraps it in a `ReversibleGPT2`, and returns that: use the returned model.

    Args:
      model: a model built from `jaxdp.core.nn` layers (a GPT-2 for `GPT2_METHODS`).
      method: one of `METHODS`: "full" | "lora" | "adapter" | "bitfit" | "prompt" | "side" | "reversible".
      rngs: initialises the new parameters.
      options: the method's settings (`jaxdp.finetune.settings`): `LoRA(rank, alpha, targets)` for "lora",
        `Adapters(bottleneck, targets, train_layer_norms)` for "adapter", `Prompt(length)`, `Side(reduction)`,
        `Reversible(lora, bottleneck, alpha, beta, keep_streams_every)`; None: the method's defaults. "full"
        and "bitfit" take none. The flat keywords these replaced (`rank=`, `lora_targets=`, `bottleneck=`,
        `prompt_length=`, `side_reduction=`, `rev_alpha=`, ...) are still accepted for one release, with a
        DeprecationWarning.

    Returns:
      `model` (for "side" and "reversible", the network holding it as `backbone`), whose
      `nnx.Param`s are exactly the method's trainable parameters. A scanned model (`scan_layers=True`)
      comes back as a new scanned model holding the method's modules in every block: use the returned model.
    """
    check_method(method, "gpt2" if isinstance(model, GPT2) else type(model).__name__)
    options = check_options(method, options)
    if layers.is_scanned(model):  # the method's modules are added block by block, then the blocks restacked
        if method in ("side", "reversible"):
            raise ValueError(f"method {method!r} wraps the blocks of an unrolled GPT-2: build the model with "
                             "scan_layers=False")
        return layers.scanned(prepare(layers.unrolled(model), method, rngs=rngs, options=options))
    if method == "lora":
        _add_lora(model, options, rngs)
    elif method == "adapter":
        add_adapters(model, bottleneck=options.bottleneck, targets=options.targets, rngs=rngs)
    elif method == "prompt":
        add_soft_prompt(model, length=options.length, rngs=rngs)
    elif method == "side":
        model = LadderSideGPT2(model, reduction=options.reduction, rngs=rngs)
    elif method == "reversible":
        _add_lora(model, options.lora, rngs)
        model = ReversibleGPT2(model, alpha=options.alpha, beta=options.beta, bottleneck=options.bottleneck,
                               keep_streams_every=options.keep_streams_every, rngs=rngs)
    if method in ("side", "reversible"):
        model.config = model.backbone.config  # the wrapper reads like its GPT-2 (e.g. config.seq_len when sampling)
    train_layer_norms = options.train_layer_norms if method == "adapter" else True
    model = freeze(model, trainable_filter(method, train_layer_norms=train_layer_norms))
    if not trainable_paths(model):
        why = " (bitfit trains biases, and it has none)" if method == "bitfit" else ""
        raise ValueError(f"method {method!r} leaves no trainable parameter in this {type(model).__name__}{why}")
    return model
