"""One full DP-Adam step per method, and its measurement: compile time, memory, tokens/s, or a roofline.

A configuration is a dict: `model` (a `GPT2Config.preset` name, or "llama-<preset>" for a `LlamaConfig.preset`:
llama-1B, llama-8B, ...), optionally `scan` (True: `scan_layers`, the blocks stacked and run by lax.scan), `B`,
`T`, `method`, `dtype`, `vocab` (GPT-2's vocabulary; a Llama keeps its preset's, the tokens are drawn below `vocab`),
`attention`, `steps` (timed steps per repeat; 0: compile and memory analysis only), `warmup`, optionally
`target` (a GPU kind to compile for without one: predictions only), `profile_dir` and `mechanism` (the noise
mechanism of a fused_clip method, `mechanism_of`: "dpsgd", the default, or "bandmf:<b>" / "blt:<k>", whose
float32 buffers of the parameters' shape are optimizer state the step reads and writes).
The methods (flat clipping unless named; the DP ones clip at C = 1 and add noise sigma = 0.8 unless
`dp_gradients` is asked otherwise):

  non_dp            ordinary step, mean loss, Adam: the baseline
  explicit          jax.vmap(jax.grad) per-example gradients (`jaxdp.core.reference`), then fused_clip
  two_pass          `jaxdp.two_pass_clipped_sums` (norms in the backward, then a clip-weighted backward) + noise
  ghost / store / auto   fused_clip with that NormPlan strategy
  per_layer         fused_clip, strategy "auto", per-layer clipping
  pallas_flat       fused_clip, strategy "pallas"
  pallas_per_layer  fused_clip, strategy "pallas", per-layer clipping (single-pass kernel)
  auto_secure       auto with secure noise (on request)
  auto_merged       auto under `rows_merged()` (the A/B of `jaxdp.core.rows.rows_apart`; on request)

Every DP method's parameter update is Adam of (sum_b clip(g_b) + noise) / B, so at sigma = 0 the
transform `dp_gradients` returns computes the same clipped mean for every method.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable

from jaxdp.analysis.rows_merged import rows_merged
from jaxdp.clipping.settings import ClipSpec, NormPlan

METHODS = ("non_dp", "explicit", "two_pass", "ghost", "store", "auto", "per_layer", "pallas_flat",
           "pallas_per_layer")
SECURE = "auto_secure"  # auto with fused_clip(secure_noise=True): on request, not in the default grid
MERGED = "auto_merged"  # auto without jaxdp.core.rows.rows_apart: its A/B on the same device, on request
ALL_METHODS = METHODS + (SECURE, MERGED)
PROFILED_STEPS = 3
_STRATEGY = {"explicit": "auto", "ghost": "ghost", "store": "store", "auto": "auto", SECURE: "auto",
             MERGED: "auto", "per_layer": "auto", "pallas_flat": "pallas", "pallas_per_layer": "pallas"}


def mechanism_of(name: str | None):
    """The noise mechanism a benchmark row names: None or "dpsgd": DP-SGD; "bandmf:<b>": BandMF with `b` bands
    (`jaxdp.noise.strategies.bandmf(1024, b)`); "blt:<k>": a BLT with `k` buffers (fixed decays, scales and
    sensitivity: its cost does not depend on their values, and no jax_privacy is needed). Raises ValueError otherwise."""
    from jaxdp.noise import mechanisms, strategies
    kind, _, size = (name or "dpsgd").partition(":")
    if kind == "dpsgd" and not size:
        return mechanisms.DPSGD()
    if kind in ("bandmf", "blt") and size.isdigit() and int(size) >= 1:
        k = int(size)
        if kind == "bandmf":
            return strategies.bandmf(max(1024, k), k)
        return mechanisms.BLT(tuple(0.5 ** (i + 1) for i in range(k)), tuple(0.1 for _ in range(k)), 1.0)
    raise ValueError(f"mechanism must be 'dpsgd', 'bandmf:<bands>' or 'blt:<buffers>', got {name!r}")


def dp_gradients(method: str, losses_fn: Callable, *, l2_norm_clip: float = 1.0, noise_multiplier: float = 0.8,
                 expected_batch_size: float, mechanism: str | None = None):
    """(transform, grads_of) of one method: the step's update is `chain(transform, adam)` of
    `grads_of(model, batch, key)`.

    `losses_fn(model, batch)` returns per-example losses (B,). For fused_clip methods `grads_of` returns
    per-example gradients and `transform` clips, sums and noises them; for `non_dp` (the mean loss's
    gradient) and `two_pass` (already clipped and noised by `grads_of`) `transform` is the identity.
    `mechanism` (`mechanism_of`) applies to the fused_clip methods; a correlated one with another method is a
    ValueError.
    """
    import optax
    from flax import nnx

    import jaxdp.core.reference
    from jaxdp.clipping.aggregation import fused_clip
    from jaxdp.clipping.rules import noise_std
    from jaxdp.clipping.two_pass import two_pass_clipped_sums
    from jaxdp.core.per_example import per_example_grads
    from jaxdp.noise.privatizer import GaussianPrivatizer

    if method not in ALL_METHODS:
        raise ValueError(f"unknown method {method!r}; allowed: {', '.join(ALL_METHODS)}")
    noise_mechanism = mechanism_of(mechanism)
    if noise_mechanism.num_buffers and method in ("non_dp", "two_pass"):
        raise ValueError(f"mechanism {mechanism!r} needs a fused_clip method, not {method!r}")
    C, sigma, expected_B = l2_norm_clip, noise_multiplier, expected_batch_size
    if method in ("non_dp", "two_pass"):
        transform = optax.identity()
    else:
        clipping = "per_layer" if method in ("per_layer", "pallas_per_layer") else "flat"
        transform = fused_clip(C, sigma, expected_batch_size=expected_B, secure_noise=method == SECURE,
                               clip=ClipSpec(clipping=clipping), norms=NormPlan(strategy=_STRATEGY[method]),
                               mechanism=noise_mechanism)
    grads_fn = per_example_grads(losses_fn)
    two_pass = two_pass_clipped_sums(losses_fn, C, norms=NormPlan(allow_low_precision=True))  # timing only

    def grads_of(model, batch, key):
        if method == "non_dp":
            return nnx.grad(lambda m: losses_fn(m, batch).mean())(model)
        if method == "explicit":
            _, per_example = jaxdp.core.reference.per_example_grads(losses_fn, model, batch)
            flat = list(nnx.to_flat_state(nnx.state(model, nnx.Param)))
            return nnx.from_flat_state([(p, v.replace(per_example[tuple(p)])) for p, v in flat])
        if method == "two_pass":
            _, sums, _ = two_pass(model, batch)
            return GaussianPrivatizer(noise_std(C, sigma), expected_B).update(sums, key)[0]
        return grads_fn(model, batch)[1]

    return transform, grads_of


def lm_losses(model, batch):
    """Per-example next-token cross-entropy (B,) of `batch["tokens"]` (B, T + 1)."""
    import optax
    logits = model(batch["tokens"][:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tokens"][:, 1:]).mean(-1)


def model_config(cfg: dict):
    """The `GPT2Config` or `LlamaConfig` of a configuration's `model`, `T`, `dtype`, `attention`, `scan`."""
    from jaxdp.models.gpt2 import GPT2Config
    from jaxdp.models.llama import LlamaConfig
    common = dict(dtype=cfg["dtype"], attention=cfg["attention"], scan_layers=bool(cfg.get("scan", False)))
    if cfg["model"].startswith("llama-"):
        return LlamaConfig.preset(cfg["model"][len("llama-"):], seq_len=max(cfg["T"], 64), **common)
    return GPT2Config.preset(cfg["model"], seq_len=cfg["T"], vocab_size=cfg["vocab"], **common)


def step_fn(cfg: dict):
    """(jitted step(state, batch, key) -> state, its abstract arguments, a function building the real ones).

    The step is one DP-Adam (lr 1e-4) update of the configuration's model with its method. Compiling
    from shapes keeps a held process's device memory free for the process being timed; with
    `cfg["target"]` the arguments are placed on that GPU's deviceless devices.
    """
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from jaxdp.models import registry

    method, B, T = cfg["method"], cfg["B"], cfg["T"]
    config = model_config(cfg)
    dp_tx, grads_of = dp_gradients(method, lm_losses, expected_batch_size=float(B), mechanism=cfg.get("mechanism"))
    tx = optax.chain(dp_tx, optax.adam(1e-4)) if method not in ("non_dp", "two_pass") else optax.adam(1e-4)

    def build():
        model = registry.build(config, nnx.Rngs(0))
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

    graphdef, abstract_state = nnx.split(nnx.eval_shape(build))

    @jax.jit
    def step(state, batch, key):
        with rows_merged() if method == MERGED else contextlib.nullcontext():
            model, optimizer = nnx.merge(graphdef, state)
            optimizer.update(model, grads_of(model, batch, key))
            return nnx.state((model, optimizer))

    def inputs():
        """The step's real arguments, built after compiling (a held process keeps no state on the device)."""
        _, state = nnx.split(build())
        return state, {"tokens": jax.random.randint(jax.random.key(1), (B, T + 1), 0, cfg["vocab"])}, jax.random.key(2)

    sharding = None
    if cfg.get("target"):
        from jax.sharding import Mesh, NamedSharding, PartitionSpec

        from jaxdp.analysis.hlo_cost import target_devices
        sharding = NamedSharding(Mesh(target_devices(cfg["target"], 1), ("x",)), PartitionSpec())
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
                            (abstract_state, jax.ShapeDtypeStruct((B, T + 1), jnp.int32), jax.random.key(2)))
    state_spec, tokens_spec, key_spec = abstract
    return step, (state_spec, {"tokens": tokens_spec}, key_spec), inputs


def run_one(cfg: dict, *, repeats: int = 3, on_compiled: Callable[[], None] | None = None) -> dict:
    """`cfg` plus its measurement: status, compile_s, compiled_bytes, peak_bytes and peak_source, and

    - with `cfg["target"]`: the compiled step's roofline (`jaxdp.analysis.hlo_cost.summary` with H100 rates)
      and its heavy kernels (255 registers or spills, from the dumped PTX); nothing runs;
    - with `cfg["steps"]` = 0: nothing more (memory analysis only);
    - else step_s (the median over `repeats` of `steps` steps dispatched back to back, one sync each,
      after `warmup` steps), tokens_per_s and, with `cfg["profile_dir"]`, a traced profile summary.

    `on_compiled()` runs after compiling, before any step (a held child waits there for its turn).
    Peak memory is the device's peak_bytes_in_use where reported, else the compiled memory analysis.
    """
    import jax
    import numpy as np
    if cfg.get("target"):  # the step's PTX, for its kernels' registers (XLA reads the flag at its first compile)
        ptx_dir = tempfile.mkdtemp(prefix="bench_ptx_")
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_dump_to={ptx_dir} --xla_dump_hlo_module_re=jit_step")
    step, abstract_args, inputs = step_fn(cfg)
    t0 = time.perf_counter()
    compiled = step.trace(*abstract_args).lower().compile()
    compile_s = time.perf_counter() - t0
    analysis = compiled.memory_analysis()
    compiled_bytes = (analysis.temp_size_in_bytes + analysis.argument_size_in_bytes
                      + analysis.output_size_in_bytes - analysis.alias_size_in_bytes) if analysis else None
    row = dict(cfg, status="ok", compile_s=compile_s, compiled_bytes=compiled_bytes)
    if on_compiled is not None:
        on_compiled()
    if cfg.get("target"):
        from jaxdp.analysis import hlo_cost
        from jaxdp.clipping import device_rates
        cost = hlo_cost.step_cost(compiled)
        try:
            registers = hlo_cost.register_use(ptx_dir)
        finally:
            shutil.rmtree(ptx_dir, ignore_errors=True)
        heavy = {name for name, (regs, spill) in registers.items() if regs >= 255 or spill}
        return dict(row, **hlo_cost.summary(cost, device_rates.H100, cfg["dtype"]), peak_bytes=compiled_bytes,
                    peak_source="memory_analysis", heavy_kernels=len(heavy),
                    heavy_gbytes=sum(k.bytes * k.count for k in cost.kernels if k.name in heavy) / 1e9)
    if not cfg["steps"]:
        return dict(row, peak_bytes=compiled_bytes, peak_source="memory_analysis")
    state, batch, key = inputs()
    for _ in range(cfg["warmup"]):
        state = compiled(state, batch, key)
    jax.block_until_ready(state)
    # Steps dispatched back to back, as a training loop runs them: host dispatch overlaps the device's
    # work (a sync per step would add the same host time to every method and pull ratios toward 1).
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(cfg["steps"]):
            state = compiled(state, batch, key)
        jax.block_until_ready(state)
        times.append((time.perf_counter() - t0) / cfg["steps"])
    stats = jax.devices()[0].memory_stats() or {}
    peak, source = stats.get("peak_bytes_in_use"), "peak_bytes_in_use"
    if peak is None:
        peak, source = compiled_bytes, "memory_analysis"
    if cfg.get("profile_dir"):
        from jaxdp.analysis import profile
        log_dir = os.path.join(cfg["profile_dir"], f"{cfg['model']}_{cfg['B']}_{cfg['T']}_{cfg['method']}")
        with jax.profiler.trace(log_dir, create_perfetto_trace=True):
            for _ in range(PROFILED_STEPS):
                state = compiled(state, batch, key)
            jax.block_until_ready(state)
        row["profile"] = profile.summarize(log_dir, PROFILED_STEPS)
    median = float(np.median(times))
    return dict(row, step_s=median, tokens_per_s=cfg["B"] * cfg["T"] / median, peak_bytes=peak, peak_source=source,
                timing=f"median of {repeats} x {cfg['steps']} steps, one sync each")


def child_env(cfg: dict) -> dict | None:
    """The environment of a child process compiling `cfg` (None: inherit). For a deviceless GPU compile
    (`cfg["target"]`): no CUDA driver to check, Pallas kernels compiled (not interpreted), and
    strategy "auto" planning with the target's rates."""
    if not cfg.get("target"):
        return None
    return dict(os.environ, JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1", JAXDP_PALLAS_INTERPRET="0",
                JAXDP_DEVICE_KIND=cfg["target"])


def spawned_row(cfg: dict, command: list[str], timeout: float) -> dict:
    """Runs one configuration's child `command` (it prints its row as its last stdout line) and returns
    that row, or `cfg` with status "timeout", "OOM" or the child's error (`jaxdp.analysis.held.row_of`)."""
    import subprocess

    from jaxdp.analysis.held import row_of
    try:
        proc = subprocess.run(command, check=False, capture_output=True, text=True, timeout=timeout, env=child_env(cfg))
    except subprocess.TimeoutExpired:
        return dict(cfg, status="timeout")
    return row_of(cfg, proc.returncode, proc.stdout, proc.stderr)
