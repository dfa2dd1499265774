"""Region specs: a region's data centers, MSBs, racks and machines, read from a compact file or generated.

Pure apart from ``load_region`` (which reads one file). The hierarchy is Twine's (§2.1, Figure 5):
region → data center (DC) → main switchboard (MSB, the largest fault domain in a DC) → rack → machine.
A spec describes each DC compactly; ``machines()`` expands it::

    region: r1
    seed: 7                        # optional: shuffles which racks get which machine type
    defaults:                      # optional: any DC field, inherited by every DC that does not set it
      machines_per_rack: 10
    dcs:
      - name: dc1
        msbs: 3                    # a count (named msb1, msb2, ...) or a list of names
        racks_per_msb: 4
        machines_per_rack: 10      # a rack's size
        machines: 110              # optional total; default msbs × racks_per_msb × machines_per_rack
        machine_types: {skylake: 0.7, broadwell: 0.3}   # fractions summing to 1 (or one type name)
        capacity: {skylake: {cpu_millicores: 32000, memory_mib: 131072},
                   broadwell: {cpu_millicores: 24000, memory_mib: 65536}}

Expansion rules (deterministic; the same spec always gives the same machines in the same order):

* racks are numbered per MSB (``r01`` …) and machines per rack (``m001`` …); a machine id is
  ``<dc>-<msb>-<rack>-<m>``, e.g. ``dc1-msb2-r03-m007`` (wider numbers when a DC needs them);
* a rack holds one machine type (Twine §2.7: a rack holds either 92 small or 30 big machines). The DC's
  racks, MSB by MSB, get types in proportion to the fractions, interleaved so every MSB gets its share
  (largest deficit first, ties by type name); with a ``seed`` that sequence is shuffled (same counts,
  other racks);
* with ``machines`` below the layout's room, machines are spread evenly: every rack gets the same count
  or one less, and the racks with one more are spread over the MSBs first.

``generate_region(n, dcs=..., seed=...)`` picks a layout for any size (simulated regions; 1,000,000 machines
expand in a few seconds). ``spec_to_dict`` writes a spec back in the file form (``parse_region`` inverts it).
"""
from __future__ import annotations

import json
import math
import random
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from streams.validate import describe_value

DC_FIELDS = ("name", "msbs", "racks_per_msb", "machines_per_rack", "machines", "machine_types", "capacity")
REGION_FIELDS = ("region", "seed", "defaults", "dcs")
RESOURCE_FIELDS = ("cpu_millicores", "memory_mib")
FRACTION_TOLERANCE = 1e-6

# Names end up in machine ids (joined by "-"), fault-domain paths (joined by "/") and free-pool keys
# (free/<dc>), so DC, MSB and machine type names are plain words; a region name may also hold "-".
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.]*\Z")
_REGION_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*\Z")

# generate_region's layout: a Twine rack holds 30 big or 92 small machines (§2.7); a DC has tens of MSBs (§2.1).
DEFAULT_MACHINES_PER_RACK = 30
MAX_GENERATED_MSBS = 36
MIN_GENERATED_RACKS = 4  # a small generated DC uses smaller racks rather than fewer than this
DEFAULT_MACHINE_TYPES = (("skylake", 0.7), ("broadwell", 0.3))
DEFAULT_CAPACITY = (("skylake", (32000, 131072)), ("broadwell", (24000, 65536)))


class RegionSpecError(ValueError):
    """A region spec is wrong; ``path`` names the field (``dcs[0].racks_per_msb``)."""

    def __init__(self, path: str, message: str, source: str | None = None):
        self.path, self.message, self.source = path, message, source
        where = ": ".join(p for p in (source, path) if p)
        super().__init__(f"{where}: {message}" if where else message)


@dataclass(frozen=True, slots=True)
class DCSpec:
    name: str
    msbs: tuple[str, ...]
    racks_per_msb: int
    machines_per_rack: int  # a rack's room
    machines: int  # total machines in the DC, at most len(msbs) × racks_per_msb × machines_per_rack
    machine_types: tuple[tuple[str, float], ...]  # (type, fraction of the DC's racks) by type name; sum 1
    capacity: tuple[tuple[str, int, int], ...]  # (type, cpu_millicores, memory_mib), same types in the same order

    @property
    def racks(self) -> int:
        return len(self.msbs) * self.racks_per_msb

    @property
    def room(self) -> int:
        return self.racks * self.machines_per_rack

    def capacity_of(self, machine_type: str) -> tuple[int, int]:
        """(cpu_millicores, memory_mib) of one machine of ``machine_type``."""
        for t, cpu, mem in self.capacity:
            if t == machine_type:
                return cpu, mem
        raise KeyError(f"DC {self.name} has no machine type {machine_type!r}")


@dataclass(frozen=True, slots=True)
class RegionSpec:
    name: str
    dcs: tuple[DCSpec, ...]
    seed: int | None = None  # None: racks get types in the interleaved order; an int shuffles that order

    @property
    def n_machines(self) -> int:
        return sum(dc.machines for dc in self.dcs)


class MachineSpec(NamedTuple):
    """One machine of a region (a plain tuple: a million of them stay small)."""

    id: str
    region: str
    dc: str
    msb: str
    rack: str
    machine_type: str
    cpu_millicores: int
    memory_mib: int

    def topology(self) -> dict[str, str]:
        """The ``Topology`` record of MachineRegistered."""
        return {"region": self.region, "dc": self.dc, "msb": self.msb, "rack": self.rack}

    def capacity(self) -> dict[str, int]:
        """The ``Resources`` record of MachineRegistered."""
        return {"cpu_millicores": self.cpu_millicores, "memory_mib": self.memory_mib}


# -- reading a spec --------------------------------------------------------------------------------------------

def load_region(path: str | Path) -> RegionSpec:
    """Read and validate a region spec file (YAML, or JSON for ``.json``); errors name the file and the field."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise RegionSpecError("", f"cannot read: {exc.strerror or exc}", str(path)) from None
    try:
        if path.suffix.lower() == ".json":
            data = json.loads(text)
        else:
            import yaml  # noqa: PLC0415 - start-up: yaml (~12 ms), YAML specs only; CLI path

            data = yaml.safe_load(text)
    except ValueError as exc:  # json.JSONDecodeError
        raise RegionSpecError("", f"not valid JSON: {exc}", str(path)) from None
    except yaml.YAMLError as exc:
        raise RegionSpecError("", f"not valid YAML: {exc}", str(path)) from None
    try:
        return parse_region(data)
    except RegionSpecError as exc:
        raise RegionSpecError(exc.path, exc.message, str(path)) from None


def parse_region(data: Any) -> RegionSpec:
    """Validate a spec already read into dicts and lists (the file form); raises RegionSpecError(path, message)."""
    if not isinstance(data, Mapping):
        raise RegionSpecError("", f"expected a mapping with {', '.join(REGION_FIELDS)}, got {_describe(data)}")
    _no_unknown(data, REGION_FIELDS, "")
    name = _name(_required(data, "region", ""), "region", _REGION_NAME)
    seed = data.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise RegionSpecError("seed", f"expected an integer, got {_describe(seed)}")
    defaults = data.get("defaults") or {}
    if not isinstance(defaults, Mapping):
        raise RegionSpecError("defaults", f"expected a mapping of DC fields, got {_describe(defaults)}")
    _no_unknown(defaults, DC_FIELDS[1:], "defaults")
    dcs = _required(data, "dcs", "")
    if not isinstance(dcs, list) or not dcs:
        raise RegionSpecError("dcs", f"expected a non-empty list of data centers, got {_describe(dcs)}")
    out: list[DCSpec] = []
    for i, raw in enumerate(dcs):
        dc = _parse_dc(raw, f"dcs[{i}]", defaults)
        if any(d.name == dc.name for d in out):
            raise RegionSpecError(f"dcs[{i}].name", f"duplicate DC name {dc.name!r}")
        out.append(dc)
    return RegionSpec(name=name, dcs=tuple(out), seed=seed)


def _parse_dc(raw: Any, path: str, defaults: Mapping[str, Any]) -> DCSpec:  # noqa: C901
    if not isinstance(raw, Mapping):
        raise RegionSpecError(path, f"expected a mapping with {', '.join(DC_FIELDS)}, got {_describe(raw)}")
    _no_unknown(raw, DC_FIELDS, path)

    def field(key: str, required: bool = True) -> tuple[Any, str]:
        """The value of ``key`` and the path it came from: the DC's own, else the defaults'."""
        if key in raw:
            return raw[key], f"{path}.{key}"
        if key in defaults:
            return defaults[key], f"defaults.{key}"
        if required:
            hint = " (set it here or in defaults)" if key != "name" else ""
            raise RegionSpecError(f"{path}.{key}", "missing" + hint)
        return None, f"{path}.{key}"

    name = _name(*field("name"), _NAME)
    msbs_raw, msbs_path = field("msbs")
    if isinstance(msbs_raw, list):
        if not msbs_raw:
            raise RegionSpecError(msbs_path, "expected a positive integer or a non-empty list of names")
        msbs = tuple(_name(m, f"{msbs_path}[{j}]", _NAME) for j, m in enumerate(msbs_raw))
        for j, m in enumerate(msbs):
            if m in msbs[:j]:
                raise RegionSpecError(f"{msbs_path}[{j}]", f"duplicate MSB name {m!r}")
    else:
        msbs = tuple(f"msb{j}" for j in range(1, _positive(msbs_raw, msbs_path, "or a list of names") + 1))
    racks_per_msb = _positive(*field("racks_per_msb"))
    machines_per_rack = _positive(*field("machines_per_rack"))
    room = len(msbs) * racks_per_msb * machines_per_rack
    machines_raw, machines_path = field("machines", required=False)
    machines = room if machines_raw is None else _positive(machines_raw, machines_path)
    if machines > room:
        raise RegionSpecError(machines_path, f"{machines} machines do not fit in {len(msbs)} MSBs × {racks_per_msb} "
                                             f"racks × {machines_per_rack} machines = {room}")
    types = _machine_types(*field("machine_types"))
    capacity = _capacity(*field("capacity"), types)
    return DCSpec(name=name, msbs=msbs, racks_per_msb=racks_per_msb, machines_per_rack=machines_per_rack,
                  machines=machines, machine_types=types, capacity=capacity)


def _machine_types(raw: Any, path: str) -> tuple[tuple[str, float], ...]:
    if isinstance(raw, str):
        return ((_name(raw, path, _NAME), 1.0),)
    if not isinstance(raw, Mapping) or not raw:
        raise RegionSpecError(path, f"expected a type name or a mapping of type to fraction, got {_describe(raw)}")
    out = []
    for t, frac in raw.items():
        _name(t, f"{path}.{t}", _NAME)
        if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0 < frac <= 1:
            raise RegionSpecError(f"{path}.{t}", f"expected a fraction in (0, 1], got {_describe(frac)}")
        out.append((t, float(frac)))
    total = sum(f for _, f in out)
    if abs(total - 1) > FRACTION_TOLERANCE:
        raise RegionSpecError(path, f"fractions sum to {total:g}, expected 1")
    return tuple(sorted(out))  # by name: the order keys come in (YAML vs JSON tools) changes nothing


def _capacity(raw: Any, path: str, types: tuple[tuple[str, float], ...]) -> tuple[tuple[str, int, int], ...]:
    if not isinstance(raw, Mapping):
        raise RegionSpecError(path, f"expected a mapping of machine type to {{cpu_millicores, memory_mib}}, "
                                    f"got {_describe(raw)}")
    names = [t for t, _ in types]
    for t in raw:
        if t not in names:
            raise RegionSpecError(f"{path}.{t}", f"not a machine type of this DC ({', '.join(names)})")
    out = []
    for t in names:
        if t not in raw:
            raise RegionSpecError(f"{path}.{t}", "missing: every machine type needs a capacity")
        res = raw[t]
        if not isinstance(res, Mapping):
            raise RegionSpecError(f"{path}.{t}", f"expected a mapping with cpu_millicores, memory_mib, "
                                                 f"got {_describe(res)}")
        _no_unknown(res, RESOURCE_FIELDS, f"{path}.{t}")
        cpu = _positive(_required(res, "cpu_millicores", f"{path}.{t}"), f"{path}.{t}.cpu_millicores")
        mem = _positive(_required(res, "memory_mib", f"{path}.{t}"), f"{path}.{t}.memory_mib")
        out.append((t, cpu, mem))
    return tuple(out)


def _required(data: Mapping, key: str, path: str) -> Any:
    if key not in data:
        raise RegionSpecError(f"{path}.{key}" if path else key, "missing")
    return data[key]


def _no_unknown(data: Mapping, known: Sequence[str], path: str) -> None:
    for key in data:
        if key not in known:
            where = f"{path}.{key}" if path else str(key)
            raise RegionSpecError(where, f"unknown field; expected one of {', '.join(known)}")


def _positive(value: Any, path: str, alternative: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RegionSpecError(path, f"expected a positive integer{' ' + alternative if alternative else ''}, "
                                    f"got {_describe(value)}")
    return value


def _name(value: Any, path: str, pattern: re.Pattern) -> str:
    if not isinstance(value, str) or not pattern.match(value):
        allowed = "letters, digits, '_', '.'" + (", '-'" if pattern is _REGION_NAME else "")
        raise RegionSpecError(path, f"expected a name of {allowed} (starting with a letter or digit), "
                                    f"got {_describe(value)}")
    return value


def _describe(value: Any) -> str:
    return describe_value(value, none="nothing", mapping="a mapping", sequence="a list")


def spec_to_dict(spec: RegionSpec) -> dict[str, Any]:
    """The file form of ``spec`` (YAML/JSON-ready); ``parse_region(spec_to_dict(s)) == s``."""
    out: dict[str, Any] = {"region": spec.name}
    if spec.seed is not None:
        out["seed"] = spec.seed
    dcs = []
    for dc in spec.dcs:
        auto = dc.msbs == tuple(f"msb{j}" for j in range(1, len(dc.msbs) + 1))
        d: dict[str, Any] = {"name": dc.name, "msbs": len(dc.msbs) if auto else list(dc.msbs),
                             "racks_per_msb": dc.racks_per_msb, "machines_per_rack": dc.machines_per_rack}
        if dc.machines != dc.room:
            d["machines"] = dc.machines
        d["machine_types"] = dict(dc.machine_types)
        d["capacity"] = {t: {"cpu_millicores": cpu, "memory_mib": mem} for t, cpu, mem in dc.capacity}
        dcs.append(d)
    out["dcs"] = dcs
    return out


# -- generating a spec -----------------------------------------------------------------------------------------

def generate_region(n_machines: int, dcs: int | Sequence[str] = 2, seed: int | None = 0, *, name: str = "sim",
                    machines_per_rack: int = DEFAULT_MACHINES_PER_RACK,
                    machine_types: Mapping[str, float] | Sequence[tuple[str, float]] = DEFAULT_MACHINE_TYPES,
                    capacity: Mapping[str, tuple[int, int]] | Sequence[tuple[str, tuple[int, int]]]
                    = DEFAULT_CAPACITY) -> RegionSpec:
    """A simulated region of exactly ``n_machines`` over ``dcs`` (a count, named dc1…, or names).

    Machines are split evenly over the DCs (the first DCs take the remainder). Per DC: racks of
    ``machines_per_rack`` (smaller when the DC would otherwise have fewer than ``MIN_GENERATED_RACKS``, so
    even a tiny region has several racks, MSBs and machine types), about √racks MSBs (at most
    ``MAX_GENERATED_MSBS``), racks spread evenly over them.
    ``capacity`` maps each machine type to (cpu_millicores, memory_mib). Deterministic in all arguments;
    ``seed`` picks which racks get which type (None: the plain interleaved order).
    """
    names = [f"dc{i}" for i in range(1, _positive(dcs, "dcs") + 1)] if isinstance(dcs, int) else list(dcs)
    if not names:
        raise RegionSpecError("dcs", "expected at least one DC")
    n_machines = _positive(n_machines, "n_machines")
    if n_machines < len(names):
        raise RegionSpecError("n_machines",
                              f"{n_machines} machine(s) for {len(names)} DCs: every DC needs at least one")
    types = dict(machine_types)
    caps = dict(capacity)
    machines_per_rack = _positive(machines_per_rack, "machines_per_rack")
    file_form: dict[str, Any] = {
        "region": name,
        "defaults": {"machine_types": types,
                     "capacity": {t: {"cpu_millicores": c[0], "memory_mib": c[1]} for t, c in caps.items()}},
        "dcs": [],
    }
    if seed is not None:
        file_form["seed"] = seed
    base, extra = divmod(n_machines, len(names))
    for i, dc in enumerate(names):
        n_dc = base + (i < extra)
        per_rack = min(machines_per_rack, -(-n_dc // MIN_GENERATED_RACKS))
        racks = -(-n_dc // per_rack)
        msbs = max(1, min(MAX_GENERATED_MSBS, math.isqrt(racks)))
        file_form["dcs"].append({"name": dc, "msbs": msbs, "racks_per_msb": -(-racks // msbs),
                                 "machines_per_rack": per_rack, "machines": n_dc})
    return parse_region(file_form)


# -- expanding a spec into machines ----------------------------------------------------------------------------

def rack_types(spec: RegionSpec, dc: DCSpec) -> list[str]:
    """The machine type of each rack of ``dc``, MSB by MSB (``racks_per_msb`` racks each).

    Largest deficit first: rack i takes the type whose share of racks 0..i falls furthest behind its fraction
    (ties: type name), so every stretch of racks is close to the fractions; a seed shuffles the sequence.
    """
    counts = [0] * len(dc.machine_types)
    out = []
    for i in range(1, dc.racks + 1):
        k = max(range(len(counts)), key=lambda j: (dc.machine_types[j][1] * i - counts[j], -j))
        counts[k] += 1
        out.append(dc.machine_types[k][0])
    if spec.seed is not None:
        random.Random(f"{spec.name}/{dc.name}/{spec.seed}").shuffle(out)
    return out


def rack_sizes(dc: DCSpec) -> list[int]:
    """Machines in each rack of ``dc``, MSB by MSB: ``machines`` spread evenly, extras over the MSBs first."""
    base, extra = divmod(dc.machines, dc.racks)
    n_msbs = len(dc.msbs)
    return [base + (r * n_msbs + m < extra) for m in range(n_msbs) for r in range(dc.racks_per_msb)]


def iter_machines(spec: RegionSpec) -> Iterator[MachineSpec]:
    """Every machine of ``spec`` in order: DC by DC, MSB by MSB, rack by rack. Deterministic."""
    make = tuple.__new__
    region = spec.name
    for dc in spec.dcs:
        rack_w = max(2, len(str(dc.racks_per_msb)))
        numbers = [f"m{k:0{max(3, len(str(dc.machines_per_rack)))}d}" for k in range(1, dc.machines_per_rack + 1)]
        types, sizes = rack_types(spec, dc), rack_sizes(dc)
        caps = {t: (cpu, mem) for t, cpu, mem in dc.capacity}
        i = 0
        for msb in dc.msbs:
            for r in range(1, dc.racks_per_msb + 1):
                rack = f"r{r:0{rack_w}d}"
                prefix = f"{dc.name}-{msb}-{rack}-"
                mtype = types[i]
                cpu, mem = caps[mtype]
                for number in numbers[:sizes[i]]:
                    yield make(MachineSpec, (prefix + number, region, dc.name, msb, rack, mtype, cpu, mem))
                i += 1


def machines(spec: RegionSpec) -> list[MachineSpec]:
    """``iter_machines`` as a list (about 200 bytes a machine; stream ``iter_machines`` for huge regions)."""
    return list(iter_machines(spec))
