"""The DP pieces of one linear layer, x (B, T, P) and g (B, T, D), against its non-DP weight-gradient GEMM:
each piece as a function, its FLOPs and compulsory HBM bytes, its time, and its roofline.

`methods()` maps a name to fn(x, g, c) (c: (B,) clip factors): the non-DP wgrad x^T g; the XLA DP paths
(instantiated norms, ghost norms, the clipped GEMM); the Pallas kernels (`jaxdp.pallas`: sq_norms,
ghost_sq_norms, clipped_sum, the fused per-layer single pass). `counts(B, T, P, D, itemsize)` gives each
the same names' (FLOPs, bytes); `seconds_per_call` times one in a single jitted program;
`ceilings` measures the device's R (FLOP/s) and W (bytes/s); `roofline` places a timed row against them.
"""

from __future__ import annotations

import math
import time

NORM_CHUNK = 8  # examples per chunk of the XLA norm paths


def methods() -> dict:
    """name -> fn(x_BTP, g_BTD, c_B), in the order of `counts`."""
    import jax.numpy as jnp

    from jaxdp import pallas as jp
    from jaxdp.clipping import norms

    fn = lambda sq: jnp.minimum(1.0, 1.0 / jnp.sqrt(sq))
    inst = lambda x, g: norms._per_example(lambda a, b: norms._linear_instantiate(a, b, a, b), (x, g), NORM_CHUNK)
    gh = lambda x, g: norms._per_example(lambda a, b: norms._linear_ghost(a, b, a, b), (x, g), NORM_CHUNK)
    return {
        "nondp_wgrad": lambda x, g, c: jnp.einsum("btp,btd->pd", x, g, preferred_element_type=jnp.float32),
        "xla_inst_norms": lambda x, g, c: inst(x, g),
        "xla_ghost_norms": lambda x, g, c: gh(x, g),
        "xla_clipped_sum": jp.linear_clipped_sum_reference,
        "pallas_sq_norms": lambda x, g, c: jp.linear_sq_norms(x, g),
        "pallas_ghost_norms": lambda x, g, c: jp.linear_ghost_sq_norms(x, g),
        "pallas_clipped_sum": lambda x, g, c: jp.linear_clipped_sum(x, g, c),
        "pallas_single_pass": lambda x, g, c: jp.linear_fused_clipped_sum(x, g, fn),
    }


def counts(B: int, T: int, P: int, D: int, itemsize: int) -> dict:
    """name -> (FLOPs, compulsory HBM bytes) of each of `methods()`, at the block sizes they run with.

    Bytes: inputs read once, outputs written once, HBM scratch written and read once (float32); tile
    re-reads of x and g (which L2 mostly absorbs) are not counted, so these are lower bounds. The XLA
    norm paths are `jaxdp.clipping.norm_costs.pair_cost`'s; the kernels' follow their block grids.
    """
    from jaxdp.clipping.norm_costs import LayerShape, pair_cost
    from jaxdp.pallas import _common, ghost_norms, linear_norms, single_pass

    io = B * T * (P + D) * itemsize  # x and g read once
    out = P * D * 4  # a float32 (P, D) sum
    gemm = 2 * B * T * P * D
    shape = LayerShape(B, T, P, D, itemsize)
    inst = pair_cost("linear", "instantiate", shape, chunk_size=NORM_CHUNK)
    ghost = pair_cost("linear", "ghost", shape, chunk_size=NORM_CHUNK)
    n_p, n_d = (math.ceil(n / _common.block(n, blk)) for n, blk in ((P, linear_norms.BLOCK_P),
                                                                    (D, linear_norms.BLOCK_D)))
    bt = _common.block(T, ghost_norms.BLOCK_T)
    chunks = math.ceil(B / single_pass.DEFAULT_CHUNK_SIZE)
    return {
        "nondp_wgrad": (gemm, io + out),
        "xla_inst_norms": (inst.flops, inst.bytes_moved),
        "xla_ghost_norms": (ghost.flops, ghost.bytes_moved),
        "xla_clipped_sum": (gemm + B * T * D, io + out),
        "pallas_sq_norms": (inst.flops, io + B * n_p * n_d * 4),  # = inst. FLOPs, no G in HBM
        "pallas_ghost_norms": (B * T * (T + bt) * (P + D), io + B * math.ceil(T / bt) ** 2 * 4),
        "pallas_clipped_sum": (gemm + B * T * D, io + out),
        # float32 scratch written + read once; the accumulator read + written per chunk.
        "pallas_single_pass": (gemm + 4 * B * P * D, io + 2 * B * P * D * 4 + 2 * chunks * out),
    }


def in_one_program(f, iters: int):
    """A jitted fn(*args) running f(*args) `iters` times in one `fori_loop`, so one dispatch times many calls.

    The arguments ride in the loop state through an optimization barrier (XLA cannot hoist f out of the
    loop as invariant), and each call's result is reduced into a carried scalar (it is not dead code):
    that reduction reads the output once more (P x D floats for a sum, B for norms).
    """
    import jax
    import jax.numpy as jnp

    def many(*args):
        def body(_, state):
            args, acc = state
            out = f(*args)
            acc = acc + sum(jnp.sum(o, dtype=jnp.float32) for o in jax.tree.leaves(out))
            return jax.lax.optimization_barrier(args), acc
        return jax.lax.fori_loop(0, iters, body, (args, jnp.zeros((), jnp.float32)))[1]

    return jax.jit(many)


def seconds_per_call(f, args, repeats: int, stat=None, iters: int = 1) -> float:
    """Seconds per call of f: the median (or `stat`) over `repeats` timings of `iters` calls in one program,
    after two untimed runs (compile and warm-up)."""
    import jax
    import numpy as np
    run = in_one_program(f, iters)
    jax.block_until_ready(run(*args))
    jax.block_until_ready(run(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(run(*args))
        times.append((time.perf_counter() - t0) / iters)
    return float((stat or np.median)(times))


def ceilings(dtype, probes, repeats: int, iters: int) -> dict:
    """Measured R (FLOP/s, best square matmul in `dtype`) and W (bytes/s, best of copy and sum).

    `probes` is (matmul sizes n, each 2 n^3 FLOPs; the element count of the copy and the sum)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    sizes, n_elems = probes
    key = jax.random.key(1)
    matmul = {}
    for n in sizes:
        a = jax.random.normal(key, (n, n), jnp.float32).astype(dtype)
        matmul[str(n)] = 2 * n ** 3 / seconds_per_call(jnp.matmul, (a, a), repeats, np.min, iters)
        del a
    v = jax.random.normal(key, (n_elems,), jnp.float32).astype(dtype)
    nbytes = n_elems * v.dtype.itemsize
    copy = 2 * nbytes / seconds_per_call(lambda v: v * 2, (v,), repeats, np.min, iters)
    total = nbytes / seconds_per_call(lambda v: jnp.sum(v, dtype=jnp.float32), (v,), repeats, np.min, iters)
    return dict(R=max(matmul.values()), W=max(copy, total), matmul_flops_per_s=matmul,
                copy_bytes_per_s=copy, sum_bytes_per_s=total, copy_elements=n_elems, dtype=str(dtype))


def roofline(row: dict, R: float, W: float) -> dict:
    """A row's (flops, bytes, status, seconds) against R FLOP/s and W bytes/s: its intensity, the floor
    max(flops / R, bytes / W), the resource that sets it, and floor / measured time (None unless ok)."""
    t_flops, t_bytes = row["flops"] / R, row["bytes"] / W
    floor = max(t_flops, t_bytes)
    achieved = floor / row["seconds"] if row["status"] == "ok" else None
    return dict(intensity=row["flops"] / row["bytes"], floor_s=floor,
                bound="compute" if t_flops >= t_bytes else "memory", of_floor=achieved)


def measured_row(name: str, fn, args, counted: tuple[int, int], *, repeats: int, iters: int) -> dict:
    """{method, flops, bytes, status} of timing `fn(*args)`: status "ok" with seconds and tflops, or the
    exception's name with its first line as error (an OOM or a lowering failure is a result)."""
    flops, nbytes = counted
    row = dict(method=name, flops=flops, bytes=nbytes)
    try:
        s = seconds_per_call(fn, args, repeats, iters=iters)
        row.update(status="ok", seconds=s, tflops=flops / s / 1e12)
    except Exception as e:  # noqa: BLE001
        row.update(status=type(e).__name__, error=str(e).splitlines()[0][:200])
    return row
