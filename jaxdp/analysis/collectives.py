"""The collectives of a compiled SPMD program and the bytes each device sends for them.

`collectives(compiled)` reads the optimized HLO of a compiled `jax.jit`
program (`compiled.as_text()`: the SPMD-partitioned module, so every shape
is already the shape ONE device holds) and returns one `Collective` per
collective instruction, with the number of times one execution of the
program runs it (an op in a `while` body counts its `known_trip_count`
times; any other called computation inherits its caller's count).

Bytes per device are what one device SENDS under the bandwidth-optimal ring
algorithm over a group of n devices, from the HLO result shape (the sum of
its arrays for a combined, tuple-shaped op) with `size` its bytes:

  all-reduce          2 (n - 1) / n x size     (reduce-scatter then all-gather)
  all-gather          (n - 1) / n x size       (size: the gathered result)
  reduce-scatter      (n - 1) x size           (= (n - 1) / n x the operand, n x size)
  all-to-all          (n - 1) / n x size
  collective-permute  size                     (each device sends its buffer once)

n is the size of the op's first replica group (groups of one op have equal
sizes; `{}` means every partition). Async pairs (`*-start` / `*-done`) are
counted once, at the `-done` (whose result is the op's output) with the
`-start`'s groups. These are cost-model volumes, not a measurement of the
wire: XLA may pick another algorithm, and on fake CPU devices nothing moves.
"""

from __future__ import annotations

import collections
import dataclasses
import re
import statistics

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "s16": 2, "u16": 2, "f16": 2,
             "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b(" + "|".join(_ITEMSIZE) + r")\[([0-9,]*)\]")
_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s+\(.*\{\s*$")  # unindented header
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([a-z][\w\-]*)\((.*)$")
_CALLED = re.compile(r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of a compiled program."""
    kind: str          # one of KINDS
    name: str          # the HLO instruction name
    result_bytes: int  # bytes of its per-device result (all arrays of a tuple)
    group_size: int    # n: devices per replica group
    count: int = 1     # executions per run of the program (while-loop trip counts)

    @property
    def bytes_per_device(self) -> float:
        """Bytes one device sends per execution (ring formulas of the module docstring)."""
        n, size = self.group_size, self.result_bytes
        if n <= 1:
            return 0.0
        if self.kind == "all-reduce":
            return 2 * (n - 1) / n * size
        if self.kind == "reduce-scatter":
            return (n - 1) * size
        if self.kind == "collective-permute":
            return float(size)
        return (n - 1) / n * size  # all-gather, all-to-all


def _array_bytes(shape_text: str) -> int:
    total = 0
    for dtype, dims in _ARRAY.findall(shape_text):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * _ITEMSIZE[dtype]
    return total


def _group_size(attrs: str, num_partitions: int) -> int:
    iota = re.search(r"replica_groups=\[([0-9,]+)\]<=", attrs)
    if iota:  # [num_groups, group_size]<=[...]: iota device list
        return int(iota.group(1).split(",")[-1])
    explicit = re.search(r"replica_groups=\{(\{[^}]*\}|)", attrs)
    if explicit is None or not explicit.group(1).strip("{}"):
        return num_partitions  # no groups, or {}: all devices in one group
    return len(explicit.group(1).strip("{}").split(","))


def parse_hlo(hlo: str):
    """{computation: [(name, result_text, opcode, rest)] in schedule order}, the entry's name, num_partitions."""
    computations, entry, current = {}, None, None
    for line in hlo.splitlines():
        m = _COMPUTATION.match(line)
        if m:
            current = m.group(2)
            computations[current] = []
            if m.group(1):
                entry = current
            continue
        m = _INSTRUCTION.match(line)
        if m and current is not None:
            computations[current].append(m.groups())
    partitions = re.search(r"\bnum_partitions=(\d+)", hlo)
    return computations, entry, int(partitions.group(1)) if partitions else 1


def _counts(computations, entry) -> dict[str, int | None]:
    """Executions of each computation per run of the entry; None where a `while` has no known trip count.

    HLO text lists computations in post order (callees before callers), so walking it backwards
    visits every caller of a computation before the computation itself.
    """
    counts: dict[str, int | None] = {entry: 1}
    for comp in reversed(list(computations)):
        if comp not in counts:
            continue
        for _, _, opcode, rest in computations[comp]:
            callees = _CALLED.findall(rest)
            for branches in _BRANCHES.findall(rest):
                callees += [b.strip().lstrip("%") for b in branches.split(",") if b.strip()]
            times = counts[comp]
            if opcode == "while" and times is not None:
                trip = _TRIP_COUNT.search(rest)
                times = times * int(trip.group(1)) if trip else None
            for callee in callees:
                if callee in computations:
                    known = counts.get(callee, 0)
                    counts[callee] = None if known is None or times is None else known + times
    return counts


def collectives(compiled) -> list[Collective]:
    """Every collective of a compiled program (a `jax.stages.Compiled` or its HLO text).

    Raises ValueError if a collective sits in a `while` loop without a known
    trip count (its executions per step would be unknown).
    """
    hlo = compiled if isinstance(compiled, str) else compiled.as_text()
    computations, entry, num_partitions = parse_hlo(hlo)
    counts = _counts(computations, entry)
    starts = {}
    found = []
    for comp, instructions in computations.items():
        for name, result, opcode, rest in instructions:
            kind = opcode.removesuffix("-start").removesuffix("-done")
            if kind not in KINDS:
                continue
            if opcode.endswith("-start"):
                starts[name] = rest
                continue
            if opcode.endswith("-done"):
                operand = re.match(r"\s*%?([\w.\-]+)", rest).group(1)
                rest = starts[operand]
            count = counts.get(comp, 0)
            if count is None:
                raise ValueError(f"{opcode} {name} runs in a while loop without a known trip count")
            found.append(Collective(kind, name, _array_bytes(result), _group_size(rest, num_partitions), count))
    return found


def bytes_by_kind(compiled) -> dict[str, float]:
    """{kind: bytes one device sends per run of the program}, every kind of KINDS present (0 if none)."""
    totals = dict.fromkeys(KINDS, 0.0)
    for c in collectives(compiled):
        totals[c.kind] += c.count * c.bytes_per_device
    return totals


# ------------------------------------------------------------------ the schedule of the collectives

_COMPUTE = ("fusion", "custom-call", "dot", "convolution")  # opcodes that do the step's work


def collective_pairs(hlo_text: str) -> list[dict]:
    """One dict per collective of the ENTRY computation, in schedule order: kind, operands, the compute
    instructions scheduled between its start and done (None if synchronous), where it starts (a fraction
    of the schedule)."""
    computations, entry, _ = parse_hlo(hlo_text)
    instructions = computations[entry]
    starts, pairs = {}, []
    for i, (name, _, opcode, rest) in enumerate(instructions):
        kind = opcode.removesuffix("-start").removesuffix("-done")
        if kind not in KINDS:
            continue
        if opcode.endswith("-start"):
            starts[name] = (i, rest.split(")")[0].count("%") or 1)
        elif opcode.endswith("-done"):
            j, operands = starts.pop(rest.split(")")[0].strip().lstrip("%"))
            between = sum(1 for _, _, op, _ in instructions[j + 1:i] if op in _COMPUTE)
            pairs.append(dict(kind=kind, operands=operands, between=between, at=j / len(instructions)))
        else:
            pairs.append(dict(kind=kind, operands=1, between=None, at=i / len(instructions)))
    return pairs


def schedule_table(rows: dict[str, list[dict]]) -> str:
    """A Markdown table of `collective_pairs` per program: counts, async pairs, operands, compute between."""
    lines = ["| program | collective | count | async pairs | most operands in one | compute ops between start "
             "and done (min / median / max) | pairs with none | starts at (fraction of the schedule) |",
             "|---|---|---|---|---|---|---|---|"]
    for program, pairs in rows.items():
        by_kind = collections.defaultdict(list)
        for p in pairs:
            by_kind[p["kind"]].append(p)
        for kind, ps in sorted(by_kind.items()):
            between = [p["between"] for p in ps if p["between"] is not None]
            spread = (f"{min(between)} / {statistics.median(between):g} / {max(between)}" if between else "n/a")
            lines.append(f"| {program} | {kind} | {len(ps)} | {len(between)} | {max(p['operands'] for p in ps)} | "
                         f"{spread} | {sum(b == 0 for b in between)} | "
                         f"{min(p['at'] for p in ps):.2f}-{max(p['at'] for p in ps):.2f} |")
    return "\n".join(lines)
