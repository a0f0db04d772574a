"""Read facts out of a compiled XLA program's text (`jax.jit(...).lower(...).compile().as_text()`):
the GEMM FLOPs it executes and the collectives it runs. Used to check the analytic accounting
against what the compiler really produced.

`dot_flops` counts the program *text*: a `while` body (`lax.scan`) appears once whatever its trip
count, so measure with one layer (and one microbatch) when comparing totals with it.
`executed_dot_flops` multiplies each loop body by its trip count, as the program runs.
"""

from __future__ import annotations

import math
import re
from collections import Counter

import numpy as np

_SHAPE = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\w+)\[([\d,]*)\]")
_DOT = re.compile(r"^\s*(?:ROOT )?%\S+ = \w+\[([\d,]*)\]\S* dot\(%([^,\s]+), %([^,\s)]+)\)(.*)$")
_COLLECTIVE = re.compile(
    r"= (\(.*?\)|\S+) (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\("
)
_GROUPS = re.compile(r"replica_groups=\{(.*?)\}\}?,")


def _dims(text: str) -> list[int]:
    return [int(d) for d in text.split(",") if d]


def dot_flops(hlo_text: str) -> int:
    """2 x MACs of every `dot` in the program (inside fusions included), per device.

    Compiled HLO names operands without shapes, so shapes are looked up per computation."""
    total = 0
    shapes: dict[str, list[int]] = {}
    for line in hlo_text.splitlines():
        if line.rstrip().endswith("{") and "=" not in line.split("(")[0]:
            shapes = {}  # a new computation: names are scoped to it
            continue
        if m := _SHAPE.match(line):
            shapes[m.group(1)] = _dims(m.group(3))
        if m := _DOT.match(line):
            out, lhs_name, attrs = _dims(m.group(1)), m.group(2), m.group(4)
            contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", attrs)
            lhs = shapes.get(lhs_name)
            if lhs is None or contracting is None:
                raise ValueError(f"cannot size dot: {line.strip()[:200]}")
            total += 2 * math.prod(out) * math.prod(lhs[c] for c in _dims(contracting.group(1)))
    return total


def collectives(hlo_text: str, batch_rows: int | None = None) -> Counter:
    """Tensors moved by collectives that really communicate (replica groups of more than one
    device), by kind. With `batch_rows`, only activations: rank >= 3 with that leading dim. XLA's
    combiner may merge several collectives into one tuple-shaped op; each tensor is counted."""
    found: Counter = Counter()
    for line in hlo_text.splitlines():
        m = _COLLECTIVE.search(line)
        if not m:
            continue
        groups = _GROUPS.search(line)
        if groups and re.fullmatch(r"(\{\d+\},?)*\{\d+", groups.group(1)):
            continue  # singleton groups: a no-op (e.g. shard_map's transpose over a size-1 axis)
        for shape in re.findall(r"\w+\[([\d,]*)\]", m.group(1)):
            dims = _dims(shape)
            if batch_rows is None or (len(dims) >= 3 and dims[0] == batch_rows):
                found[m.group(2)] += 1
    return found


_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1, "f64": 8, "s64": 8}
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}")


def group_size(line: str) -> int | None:
    """Devices in each group of one collective's HLO line: `replica_groups` listed or iota, or over
    named mesh axes (`mesh['axis_0'=2,...] {'axis_0'}`, as GSPMD writes them); None when it names none."""
    if m := _MESH_GROUPS.search(line):
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", m.group(1)))
        return math.prod(int(sizes[a]) for a in re.findall(r"'(\w+)'", m.group(2)))
    groups = replica_groups(line)
    return len(groups[0]) if groups else None


def all_to_all_bytes(hlo_text: str) -> float:
    """Bytes one device sends by synchronous all_to_all (XLA:CPU's) in the program text, each op once (as
    `collectives`): of each result, (g - 1)/g for groups of g devices (its own share stays)."""
    total = 0.0
    for line in hlo_text.splitlines():
        m = _COLLECTIVE.search(line)
        if not m or m.group(2) != "all-to-all":
            continue
        if "all-to-all-start(" in line:
            raise NotImplementedError("asynchronous all-to-all: its shape lists operands and results")
        g = group_size(line)
        if g is None:
            raise ValueError(f"an all-to-all without replica groups: {line.strip()[:200]}")
        for dtype, shape in re.findall(r"(\w+)\[([\d,]*)\]", m.group(1)):
            total += _BYTES[dtype] * math.prod(_dims(shape)) * (g - 1) / g
    return total


_IOTA = re.compile(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_LISTED = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")


def replica_groups(line: str) -> list[tuple[int, ...]] | None:
    """The device groups of one collective's HLO line, in either of XLA's spellings: listed
    (`{{0,2},{1,3}}`) or iota (`[2,2]<=[2,2]T(1,0)`: arange over the dims, transposed, reshaped);
    None when the line names none."""
    if m := _IOTA.search(line):
        shape = _dims(m.group(1))
        ids = np.arange(math.prod(_dims(m.group(2)))).reshape(_dims(m.group(2)))
        if m.group(3):
            ids = ids.transpose(_dims(m.group(3)))
        return [tuple(int(i) for i in g) for g in ids.reshape(shape)]
    if m := _LISTED.search(line):
        return [tuple(_dims(g)) for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
    return None


def collective_groups(hlo_text: str, kind: str) -> list[list[tuple[int, ...]]]:
    """The replica groups of every `kind` collective (e.g. "all-gather") in the program text."""
    found = []
    for line in hlo_text.splitlines():
        m = _COLLECTIVE.search(line)
        if m and m.group(2) == kind and (groups := replica_groups(line)) is not None:
            found.append(groups)
    return found


_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_CALLED = re.compile(
    r"(?:body|condition|to_apply|calls|true_computation|false_computation)=%?([\w.\-]+)|branch_computations=\{([^}]*)\}"
)


def _computations(hlo_text: str) -> dict[str, list[str]]:
    """Each computation's lines, by name."""
    found: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in hlo_text.splitlines():
        if current is None:
            if (m := _COMPUTATION.match(line)) and "=" not in line.split("(")[0]:
                current = found.setdefault(m.group(1), [])
            continue
        if line.strip() == "}":
            current = None
        else:
            current.append(line)
    return found


def _called(lines: list[str]) -> set[str]:
    names = set()
    for line in lines:
        for single, branches in _CALLED.findall(line):
            names |= {single} if single else {b.strip().lstrip("%") for b in branches.split(",")}
    return names


def loop_bodies(hlo_text: str) -> list[str]:
    """The text of every `while` loop's body together with every computation it calls (branches,
    fusions, nested loops), one string per loop: what runs on each iteration."""
    comps = _computations(hlo_text)
    bodies = [m for lines in comps.values() for line in lines for m in re.findall(r"body=%?([\w.\-]+)", line)]
    out = []
    for body in bodies:
        seen, todo = set(), [body]
        while todo:
            name = todo.pop()
            if name in seen or name not in comps:
                continue
            seen.add(name)
            todo.extend(_called(comps[name]))
        out.append("\n".join(line for name in sorted(seen) for line in comps[name]))
    return out


_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_ENTRY = re.compile(r"^ENTRY %?([\w.\-]+) ")


def executed_dot_flops(hlo_text: str) -> int:
    """`dot_flops` as the program executes them: from the entry computation, each called computation
    once per call, a `while` loop's body and condition times its known trip count, and a
    conditional's costliest branch (an upper bound where a branch is skipped at run time). A loop
    whose trip count XLA did not infer is an error, not a guess."""
    comps = _computations(hlo_text)
    entry = next(m.group(1) for line in hlo_text.splitlines() if (m := _ENTRY.match(line)))
    memo: dict[str, int] = {}

    def cost(name: str) -> int:
        if name not in memo:
            lines = comps[name]
            total = dot_flops("\n".join(lines))
            for line in lines:
                called = _called([line]) & comps.keys()
                if not called:
                    continue
                if " while(" in line:
                    trips = _TRIP_COUNT.search(line)
                    if trips is None:
                        raise ValueError(f"a loop without a known trip count: {line.strip()[:200]}")
                    total += int(trips.group(1)) * sum(cost(c) for c in called)
                elif " conditional(" in line:
                    total += max(cost(c) for c in called)
                else:
                    total += sum(cost(c) for c in called)
            memo[name] = total
        return memo[name]

    return cost(entry)
