"""FLOPs, bytes and kernels of a compiled XLA program, read from its optimized HLO (no device needed).

XLA:GPU can compile for an H100 on a machine without one (`jax.experimental.topologies`,
`experiments/long_context.py --target=h100`), but such a compile has no cost analysis
(`Compiled.cost_analysis()` is None). `step_cost(compiled)` reads the optimized HLO
(`compiled.as_text()`) instead and counts, per run of the program:

  kernels   the instructions that launch device work, at the top level of the
            entry and of loop bodies / branches: fusions, custom calls (cuBLAS,
            cuDNN, Triton), copies and unfused ops; not parameters, tuples,
            bitcasts or the loops themselves;
  flops     per kernel, 2 x prod(result dims) x prod(contracted dims) of every
            dot it runs (inside its fused computation, or as a cuBLAS GEMM call),
            plus cuDNN fused attention: 4 B N T S H forward, 2.5x that backward,
            halved under a causal mask (cuDNN skips the masked blocks), plus the
            GEMM FLOPs of the jaxdp.pallas kernels (opaque Triton calls: counted
            from their names and operand shapes);
  bytes     per kernel, its operands' and result's bytes: what it reads from and
            writes to device memory if nothing stays in cache, except where the kernel
            touches part of a buffer: an operand read only through slices
            (dynamic-slice, slice, gather) costs the slices; an in-place update
            (dynamic-update-slice, scatter, whose output shares the operand's buffer: a
            scan's stacked residuals and gradients, the embedding's scatter-add) costs the
            updated region, written (and for scatter read), not the whole buffer.

`roofline_seconds(cost, rates)` sums max(flops / matmul rate, bytes / bandwidth)
over kernels: a prediction of the device time, to be checked against a profile.
Executions per run follow `while` trip counts (`jaxdp.analysis.collectives`).
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import re

from jaxdp.analysis.collectives import _ARRAY, _COMPUTATION, _array_bytes, _counts, parse_hlo
from jaxdp.clipping.device_rates import DeviceRates

_NOT_KERNELS = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "while", "conditional", "call",
                "after-all", "partition-id", "replica-id", "opt-barrier", "add-dependency", "domain"}
_OPERAND = re.compile(r"%([\w.\-]+)")
_ROOT = re.compile(r"^\s*ROOT\s+%?([\w.\-]+)\s*=")
_SLICING = {"dynamic-slice", "slice", "gather"}      # read part of operand 0
_IN_PLACE = {"dynamic-update-slice": 1, "scatter": 2}  # opcode: position of the update (the rest of operand 0 kept)
_DIMS = re.compile(r"(lhs|rhs)_(contracting|batch)_dims=\{([0-9,]*)\}")


@dataclasses.dataclass(frozen=True)
class Kernel:
    name: str
    opcode: str
    flops: float
    bytes: int
    count: int


@dataclasses.dataclass(frozen=True)
class StepCost:
    kernels: tuple[Kernel, ...]

    @property
    def flops(self) -> float:
        return sum(k.flops * k.count for k in self.kernels)

    @property
    def bytes(self) -> float:
        return sum(k.bytes * k.count for k in self.kernels)

    @property
    def launches(self) -> int:
        return sum(k.count for k in self.kernels)


def _dims(shape_text: str) -> list[int]:
    m = _ARRAY.search(shape_text)
    return [int(d) for d in m.group(2).split(",") if d] if m else []


def _dot_flops(result: str, rest: str, shapes: dict[str, str]) -> float:
    lhs = _OPERAND.findall(rest)[0]
    dims = {f"{side}_{kind}": [int(d) for d in v.split(",") if d] for side, kind, v in _DIMS.findall(rest)}
    lhs_dims = _dims(shapes[lhs])
    return 2.0 * math.prod(_dims(result)) * math.prod(lhs_dims[d] for d in dims.get("lhs_contracting", []))


def _custom_call_flops(result: str, rest: str, shapes: dict[str, str]) -> float:
    target = re.search(r'custom_call_target="([^"]+)"', rest)
    target = target.group(1) if target else ""
    operands = [shapes[o] for o in _OPERAND.findall(rest.split("),")[0]) if o in shapes]
    if "gemm" in target or "matmul" in target:
        config = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', rest)
        contracting = [int(d.strip('"')) for d in config.group(1).split(",") if d] if config else []
        lhs = _dims(operands[0])
        return 2.0 * math.prod(_dims(result)) * math.prod(lhs[d] for d in contracting)
    if target == "__gpu$xla.gpu.triton":  # a jaxdp.pallas kernel: FLOPs from its name and operand shapes
        name = re.search(r'op_name="[^"]*?(\w+)/pallas_call"', rest)
        return _pallas_flops(name.group(1) if name else "", [_dims(o) for o in operands])
    if "fmha" in target and len(operands) >= 2:
        q, k = _dims(operands[0]), _dims(operands[1])  # (B, T, N, H), (B, S, K, H) in the call's logical order
        flops = 4.0 * q[0] * q[1] * q[2] * q[3] * k[1]
        flops *= 2.5 if "Backward" in target else 1.0
        return flops / 2 if '"CAUSAL"' in rest or "PADDING_CAUSAL" in rest else flops
    return 0.0


def _pallas_flops(kernel: str, shapes: list[list[int]]) -> float:
    """GEMM FLOPs of the jaxdp.pallas kernels (Triton calls are opaque to the HLO): x (B, T, P) or (B T, P)
    and g (B, T, D) or (B T, D) are the first two operands."""
    if kernel == "linear_scaled_tile_sum":  # tiles (E, P', D'): c_e-weighted sum
        return 2.0 * math.prod(shapes[0])
    if len(shapes) < 2 or kernel not in ("linear_clipped_sum", "linear_sq_norms", "linear_grad_tiles",
                                         "linear_ghost_sq_norms"):
        return 0.0
    x, g = shapes[0], shapes[1]
    rows, P, D = math.prod(x[:-1]), x[-1], g[-1]
    if kernel == "linear_ghost_sq_norms":  # Gram tiles of x and g per example: 2 B T^2 (P + D)
        return 2.0 * rows * x[-2] * (P + D)
    return 2.0 * rows * P * D


def _operands(rest: str) -> list[str]:
    return _OPERAND.findall(rest.split("),")[0])


def _roots(hlo: str) -> dict[str, str]:
    """{computation: its ROOT instruction's name}."""
    roots, current = {}, None
    for line in hlo.splitlines():
        m = _COMPUTATION.match(line)
        if m:
            current = m.group(2)
        elif current is not None and (m := _ROOT.match(line)):
            roots[current] = m.group(1)
    return roots


def _fusion_bytes(instructions, root: str, operands: list[str]) -> int:
    """Bytes a fusion reads and writes, its fused computation `instructions` seen: operands read through
    slices only cost the slices, and an in-place root (dynamic-update-slice / scatter on a parameter)
    costs its update, not the buffer it shares with that parameter."""
    by_name = {name: (res, op, _operands(rest), rest) for name, res, op, rest in instructions}
    uses: dict[str, list[tuple[str, int]]] = {}
    for name, (_, _, args, _) in by_name.items():
        for pos, o in enumerate(args):
            uses.setdefault(o, []).append((name, pos))

    def through_bitcasts(name):  # the instructions reading `name`, looking through bitcasts
        out = []
        for user, pos in uses.get(name, []):
            out += through_bitcasts(user) if by_name[user][1] == "bitcast" else [(user, pos)]
        return out

    def source(name):  # the instruction behind a chain of bitcasts
        while by_name[name][1] == "bitcast":
            name = by_name[name][2][0]
        return name

    outputs = by_name[root][2] if by_name[root][1] == "tuple" else [root]
    written, aliased = 0, set()
    for out in outputs:
        _, op, args, _ = by_name[source(out)]
        if op in _IN_PLACE and len(args) > _IN_PLACE[op] and by_name[source(args[0])][1] == "parameter":
            update = _array_bytes(by_name[args[_IN_PLACE[op]]][0])
            written += update * (2 if op == "scatter" else 1)  # scatter reads the rows it adds to
            aliased.add(source(out))
        else:
            written += _array_bytes(by_name[out][0])
    read: dict[int, int] = {}
    for name, (res, op, _, rest) in by_name.items():
        if op != "parameter":
            continue
        index = int(rest.split(")")[0])
        users = through_bitcasts(name)
        if users and all(by_name[u][1] in _SLICING and pos == 0 or u in aliased and pos == 0 for u, pos in users):
            read[index] = sum(_array_bytes(by_name[u][0]) for u, pos in users if u not in aliased)
        else:
            read[index] = _array_bytes(res)
    per_operand: dict[str, int] = {}  # one operand passed twice is read once
    for index, nbytes in read.items():
        name = operands[index] if index < len(operands) else index
        per_operand[name] = max(per_operand.get(name, 0), nbytes)
    return written + sum(per_operand.values())


def _kernel_bytes(opcode: str, result: str, operands: list[str], shapes: dict[str, str]) -> int:
    """Bytes of a kernel that is not a fusion: operands and result, or the touched region (see above)."""
    known = [o for o in dict.fromkeys(operands) if o in shapes]
    if opcode in _SLICING:
        return 2 * _array_bytes(result) + sum(_array_bytes(shapes[o]) for o in known[1:])
    if opcode in _IN_PLACE and len(operands) > _IN_PLACE[opcode] and operands[_IN_PLACE[opcode]] in shapes:
        update = _array_bytes(shapes[operands[_IN_PLACE[opcode]]])
        others = sum(_array_bytes(shapes[o]) for o in known if o not in (operands[0], operands[_IN_PLACE[opcode]]))
        return update * (3 if opcode == "scatter" else 2) + others
    return _array_bytes(result) + sum(_array_bytes(shapes[o]) for o in known)


def step_cost(compiled) -> StepCost:
    """The kernels of a compiled program (a `jax.stages.Compiled` or its optimized HLO text)."""
    hlo = compiled if isinstance(compiled, str) else compiled.as_text()
    computations, entry, _ = parse_hlo(hlo)
    roots = _roots(hlo)
    counts = _counts(computations, entry)
    fused = set()  # computations called by a fusion (or a reduce / sort ...): not a schedule level
    for instructions in computations.values():
        for _, _, opcode, rest in instructions:
            if opcode not in ("while", "conditional", "call"):
                fused.update(re.findall(r"\b(?:calls|to_apply)=%?([\w.\-]+)", rest))
    shapes = {c: {name: result for name, result, _, _ in ins} for c, ins in computations.items()}
    flops_of: dict[str, float] = {}
    for comp in computations:  # callees first (post order): nested fusions are already summed
        total = 0.0
        for name, result, opcode, rest in computations[comp]:
            if opcode == "dot":
                total += _dot_flops(result, rest, shapes[comp])
            elif opcode == "custom-call":
                total += _custom_call_flops(result, rest, shapes[comp])
            elif opcode == "fusion":
                total += sum(flops_of.get(c, 0.0) for c in re.findall(r"\bcalls=%?([\w.\-]+)", rest))
        flops_of[comp] = total
    kernels = []
    for comp, instructions in computations.items():
        count = counts.get(comp) or 0
        if comp in fused or not count:
            continue
        for name, result, opcode, rest in instructions:
            if opcode in _NOT_KERNELS or opcode.endswith("-done"):
                continue
            if opcode == "fusion":
                flops = sum(flops_of.get(c, 0.0) for c in re.findall(r"\bcalls=%?([\w.\-]+)", rest))
            elif opcode == "custom-call":
                flops = _custom_call_flops(result, rest, shapes[comp])
            elif opcode == "dot":
                flops = _dot_flops(result, rest, shapes[comp])
            else:
                flops = 0.0
            operands = _operands(rest)
            callee = re.search(r"\bcalls=%?([\w.\-]+)", rest) if opcode == "fusion" else None
            if callee and callee.group(1) in computations and callee.group(1) in roots:
                nbytes = _fusion_bytes(computations[callee.group(1)], roots[callee.group(1)], operands)
            else:
                nbytes = _kernel_bytes(opcode, result, operands, shapes[comp])
            kernels.append(Kernel(name, opcode, flops, nbytes, count))
    return StepCost(tuple(kernels))


GPU_TARGETS = {"h100": "h100_sxm.txtpb"}  # XLA:GPU target descriptions in jaxdp/analysis/gpu_targets/


def target_devices(target: str | None, count: int) -> list:
    """This machine's devices (target None), or `count` devices of a GPU `target` to compile for
    without one (XLA:GPU's deviceless compile: needs JAX's CUDA plugin and a ptxas, no GPU)."""
    import jax
    if target is None:
        return jax.devices()
    if target not in GPU_TARGETS:
        raise ValueError(f"target must be one of {sorted(GPU_TARGETS)} or None, got {target!r}")
    from jax.experimental import topologies
    config = (pathlib.Path(__file__).parent / "gpu_targets" / GPU_TARGETS[target]).read_text()
    try:
        topology = topologies.get_topology_desc(target, "cuda", target_config=config, topology=f"1x1x{count}")
    except Exception as e:  # no CUDA plugin: say what to install
        raise RuntimeError(f"target={target!r} needs JAX's CUDA plugin: pip install "
                           f"jax-cuda12-plugin=={jax.__version__} jax-cuda12-pjrt=={jax.__version__} "
                           "(and a ptxas on PATH, e.g. nvidia-cuda-nvcc-cu12), and on a machine without a "
                           f"CUDA driver JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1; got {type(e).__name__}: {e}") from None
    return list(topology.devices)


_PTXAS_ENTRY = re.compile(r"Compiling entry function '(\S+)'")
_PTXAS_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGISTERS = re.compile(r"Used (\d+) registers")


def register_use(dump_dir: str, arch: str = "sm_90a") -> dict[str, tuple[int, int]]:
    """{kernel: (registers per thread, spill bytes stored + loaded per thread)} of the PTX files XLA:GPU
    wrote under `dump_dir` (`--xla_dump_to`), by `ptxas -v` (PTX kernels only: not cuBLAS, cuDNN or Triton
    GEMM fusions). Names as in the optimized HLO (`fusion_12` -> `fusion.12`, as `step_cost` names them).
    A memory-bound kernel at 255 registers, or spilling, moves its bytes well below the roofline's rate."""
    import subprocess
    use: dict[str, tuple[int, int]] = {}
    for ptx in sorted(pathlib.Path(dump_dir).glob("*.ptx")):
        if ".entry" not in ptx.read_text():  # XLA writes empty PTX files for some partitions
            continue
        out = subprocess.run(["ptxas", f"-arch={arch}", "-v", str(ptx), "-o", "/dev/null"], capture_output=True,
                             text=True, check=True)
        kernel, spill = None, 0
        for line in (out.stdout + out.stderr).splitlines():
            if m := _PTXAS_ENTRY.search(line):
                kernel, spill = re.sub(r"_(\d+)$", r".\1", m.group(1)), 0
            elif kernel and (m := _PTXAS_SPILL.search(line)):
                spill = int(m.group(1)) + int(m.group(2))
            elif kernel and (m := _PTXAS_REGISTERS.search(line)):
                use[kernel] = (int(m.group(1)), spill)
    return use


def roofline_seconds(cost: StepCost, rates: DeviceRates, dtype="bfloat16") -> float:
    """sum over kernels of max(flops / matmul rate, bytes / bandwidth), times their executions."""
    R = rates.matmul_rate(dtype)
    return sum(k.count * max(k.flops / R, k.bytes / rates.bytes_per_s) for k in cost.kernels)


def summary(cost: StepCost, rates: DeviceRates, dtype="bfloat16") -> dict:
    """JSON-ready totals: GFLOP, GB, kernel launches and the roofline milliseconds."""
    return {"gflop": cost.flops / 1e9, "gbytes": cost.bytes / 1e9, "launches": cost.launches,
            "roofline_ms": roofline_seconds(cost, rates, dtype) * 1e3}

