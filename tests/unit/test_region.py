"""Table-driven tests of region specs: validation (errors name the field), expansion, generation."""
import copy
import json
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml

from processors.resourcebroker.region import (
    MachineSpec, RegionSpecError, generate_region, iter_machines, load_region, machines, parse_region, rack_sizes,
    rack_types, spec_to_dict,
)

EXAMPLE = Path(__file__).resolve().parents[2] / "processors" / "resourcebroker" / "example-region.yaml"

CAP = {"skylake": {"cpu_millicores": 32000, "memory_mib": 131072},
       "broadwell": {"cpu_millicores": 24000, "memory_mib": 65536}}


def spec(**dc_overrides):
    """A valid one-DC spec in file form; ``dc_overrides`` replace (or, set to ..., delete) DC fields."""
    dc = {"name": "dc1", "msbs": 3, "racks_per_msb": 4, "machines_per_rack": 10,
          "machine_types": {"skylake": 0.7, "broadwell": 0.3}, "capacity": copy.deepcopy(CAP)}
    for k, v in dc_overrides.items():
        if v is ...:
            dc.pop(k)
        else:
            dc[k] = v
    return {"region": "r1", "dcs": [dc]}


def with_(data, **top):
    data = copy.deepcopy(data)
    data.update(top)
    return data


# (spec in file form, expected error text: "<field path>: <message start>")
INVALID = {
    "not-a-mapping": (["dc1"], "expected a mapping with region, seed, defaults, dcs, got a list"),
    "region-missing": ({"dcs": spec()["dcs"]}, "region: missing"),
    "region-bad-name": (with_(spec(), region="r 1"), "region: expected a name of letters, digits"),
    "unknown-top-field": (with_(spec(), zones=3), "zones: unknown field; expected one of region, seed"),
    "seed-not-int": (with_(spec(), seed="x"), "seed: expected an integer, got string 'x'"),
    "dcs-missing": ({"region": "r1"}, "dcs: missing"),
    "dcs-empty": (with_(spec(), dcs=[]), "dcs: expected a non-empty list of data centers, got a list"),
    "dcs-not-list": (with_(spec(), dcs={"name": "dc1"}),
                     "dcs: expected a non-empty list of data centers, got a mapping"),
    "dc-not-mapping": (with_(spec(), dcs=["dc1"]), "dcs[0]: expected a mapping with name, msbs"),
    "dc-name-missing": (spec(name=...), "dcs[0].name: missing"),
    "dc-name-with-slash": (spec(name="dc/1"), "dcs[0].name: expected a name of letters, digits, '_', '.'"),
    "dc-name-with-dash": (spec(name="dc-1"), "dcs[0].name: expected a name"),
    "dc-unknown-field": (spec(rack_per_msb=4), "dcs[0].rack_per_msb: unknown field; expected one of name, msbs"),
    "racks-zero": (spec(racks_per_msb=0), "dcs[0].racks_per_msb: expected a positive integer, got number 0"),
    "racks-string": (spec(racks_per_msb="4"), "dcs[0].racks_per_msb: expected a positive integer, got string '4'"),
    "racks-bool": (spec(racks_per_msb=True), "dcs[0].racks_per_msb: expected a positive integer, got boolean True"),
    "racks-float": (spec(racks_per_msb=4.0), "dcs[0].racks_per_msb: expected a positive integer, got number 4.0"),
    "racks-missing": (spec(racks_per_msb=...), "dcs[0].racks_per_msb: missing (set it here or in defaults)"),
    "machines-per-rack-negative": (spec(machines_per_rack=-1), "dcs[0].machines_per_rack: expected a positive integer"),
    "msbs-zero": (spec(msbs=0), "dcs[0].msbs: expected a positive integer or a list of names, got number 0"),
    "msbs-empty-list": (spec(msbs=[]), "dcs[0].msbs: expected a positive integer or a non-empty list of names"),
    "msbs-bad-name": (spec(msbs=["a", "b/c"]), "dcs[0].msbs[1]: expected a name"),
    "msbs-duplicate": (spec(msbs=["a", "b", "a"]), "dcs[0].msbs[2]: duplicate MSB name 'a'"),
    "machines-too-many": (spec(machines=121), "dcs[0].machines: 121 machines do not fit in 3 MSBs × 4 racks × 10 "
                                              "machines = 120"),
    "machines-zero": (spec(machines=0), "dcs[0].machines: expected a positive integer"),
    "types-sum": (spec(machine_types={"skylake": 0.7, "broadwell": 0.2}),
                  "dcs[0].machine_types: fractions sum to 0.9, expected 1"),
    "types-fraction-over-1": (spec(machine_types={"skylake": 1.5}),
                              "dcs[0].machine_types.skylake: expected a fraction in (0, 1], got number 1.5"),
    "types-fraction-zero": (spec(machine_types={"skylake": 0, "broadwell": 1}),
                            "dcs[0].machine_types.skylake: expected a fraction in (0, 1], got number 0"),
    "types-empty": (spec(machine_types={}), "dcs[0].machine_types: expected a type name or a mapping"),
    "capacity-missing-type": (spec(capacity={"skylake": CAP["skylake"]}),
                              "dcs[0].capacity.broadwell: missing: every machine type needs a capacity"),
    "capacity-extra-type": (spec(machine_types="skylake"),
                            "dcs[0].capacity.broadwell: not a machine type of this DC (skylake)"),
    "capacity-cpu-negative": (spec(capacity={**CAP, "skylake": {"cpu_millicores": -1, "memory_mib": 1}}),
                              "dcs[0].capacity.skylake.cpu_millicores: expected a positive integer, got number -1"),
    "capacity-memory-missing": (spec(capacity={**CAP, "skylake": {"cpu_millicores": 1}}),
                                "dcs[0].capacity.skylake.memory_mib: missing"),
    "capacity-unknown-resource": (spec(capacity={**CAP, "skylake": {**CAP["skylake"], "gpus": 8}}),
                                  "dcs[0].capacity.skylake.gpus: unknown field; expected one of cpu_millicores"),
    "capacity-not-mapping": (spec(capacity=[1]), "dcs[0].capacity: expected a mapping of machine type"),
    "second-dc-duplicate-name": (with_(spec(), dcs=spec()["dcs"] * 2), "dcs[1].name: duplicate DC name 'dc1'"),
    "second-dc-wrong-field": (with_(spec(), dcs=spec()["dcs"] + spec(name="dc2", machines_per_rack="ten")["dcs"]),
                              "dcs[1].machines_per_rack: expected a positive integer, got string 'ten'"),
    "defaults-wrong-field": (with_(spec(machines_per_rack=...), defaults={"machines_per_rack": 0}),
                             "defaults.machines_per_rack: expected a positive integer, got number 0"),
    "defaults-unknown-field": (with_(spec(), defaults={"name": "x"}), "defaults.name: unknown field"),
    "defaults-not-mapping": (with_(spec(), defaults=[1]), "defaults: expected a mapping of DC fields"),
}


@pytest.mark.parametrize("data, expected", INVALID.values(), ids=INVALID.keys())
def test_invalid_specs_name_the_field(data, expected):
    with pytest.raises(RegionSpecError) as err:
        parse_region(data)
    assert str(err.value).startswith(expected), str(err.value)
    assert err.value.path == expected.split(":")[0] or not err.value.path


def test_load_region_names_the_file_and_field(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text(yaml.safe_dump(spec(racks_per_msb=0)))
    with pytest.raises(RegionSpecError, match=r"bad\.yaml: dcs\[0\]\.racks_per_msb: expected a positive integer"):
        load_region(f)
    (tmp_path / "broken.yaml").write_text("region: [")
    with pytest.raises(RegionSpecError, match=r"broken\.yaml: not valid YAML"):
        load_region(tmp_path / "broken.yaml")
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(RegionSpecError, match=r"broken\.json: not valid JSON"):
        load_region(tmp_path / "broken.json")
    with pytest.raises(RegionSpecError, match=r"missing\.yaml: cannot read"):
        load_region(tmp_path / "missing.yaml")


def test_json_and_yaml_specs_load_the_same(tmp_path):
    (tmp_path / "r.json").write_text(json.dumps(spec()))
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(spec()))
    assert load_region(tmp_path / "r.json") == load_region(tmp_path / "r.yaml") == parse_region(spec())


# (spec in file form, machines, first id, last id, machines per type)
COUNTS = {
    "full-layout": (spec(), 120, "dc1-msb1-r01-m001", "dc1-msb3-r04-m010", {"skylake": 80, "broadwell": 40}),
    "one-type-shorthand": (spec(machine_types="skylake", capacity={"skylake": CAP["skylake"]}), 120,
                           "dc1-msb1-r01-m001", "dc1-msb3-r04-m010", {"skylake": 120}),
    "named-msbs": (spec(msbs=["north", "south"]), 80, "dc1-north-r01-m001", "dc1-south-r04-m010",
                   {"skylake": 60, "broadwell": 20}),
    "machines-below-room": (spec(machines=100), 100, "dc1-msb1-r01-m001", "dc1-msb3-r04-m008", None),
    "wide-numbers": (spec(msbs=1, racks_per_msb=120, machines_per_rack=1500, machine_types="skylake",
                          capacity={"skylake": CAP["skylake"]}), 180000,
                     "dc1-msb1-r001-m0001", "dc1-msb1-r120-m1500", {"skylake": 180000}),
    "defaults-inherited": ({"region": "us-east.1", "defaults": {"racks_per_msb": 2, "machines_per_rack": 5,
                                                                "machine_types": "skylake",
                                                                "capacity": {"skylake": CAP["skylake"]}},
                            "dcs": [{"name": "a", "msbs": 1}, {"name": "b", "msbs": 2, "machines_per_rack": 3}]},
                           22, "a-msb1-r01-m001", "b-msb2-r02-m003", {"skylake": 22}),
}


@pytest.mark.parametrize("data, n, first, last, per_type", COUNTS.values(), ids=COUNTS.keys())
def test_machine_counts_and_ids(data, n, first, last, per_type):
    region = parse_region(data)
    ms = machines(region)
    assert region.n_machines == len(ms) == n
    assert (ms[0].id, ms[-1].id) == (first, last)
    assert len({m.id for m in ms}) == n
    if per_type is not None:
        assert Counter(m.machine_type for m in ms) == per_type
    for m in ms[:: max(1, n // 50)]:  # the id spells the topology, and capacity follows the type
        assert m.id.startswith(f"{m.dc}-{m.msb}-{m.rack}-m")
        assert m.region == region.name
        dc = next(d for d in region.dcs if d.name == m.dc)
        assert (m.cpu_millicores, m.memory_mib) == dc.capacity_of(m.machine_type)


def test_machine_spec_records_match_the_schema():
    m = machines(parse_region(spec()))[0]
    assert m == MachineSpec("dc1-msb1-r01-m001", "r1", "dc1", "msb1", "r01", "skylake", 32000, 131072)
    assert m.topology() == {"region": "r1", "dc": "dc1", "msb": "msb1", "rack": "r01"}
    assert m.capacity() == {"cpu_millicores": 32000, "memory_mib": 131072}


# (DC overrides, machines per rack MSB by MSB)
SPREADS = {
    "even": (dict(machines=12, msbs=3, racks_per_msb=2), [2, 2, 2, 2, 2, 2]),
    "extras-over-msbs-first": (dict(machines=8, msbs=3, racks_per_msb=2), [2, 1, 2, 1, 1, 1]),
    "fewer-machines-than-racks": (dict(machines=2, msbs=3, racks_per_msb=2), [1, 0, 1, 0, 0, 0]),
    "full": (dict(machines_per_rack=3, msbs=2, racks_per_msb=2), [3, 3, 3, 3]),
}


@pytest.mark.parametrize("overrides, sizes", SPREADS.values(), ids=SPREADS.keys())
def test_machines_spread_evenly_over_racks(overrides, sizes):
    region = parse_region(spec(**overrides))
    assert rack_sizes(region.dcs[0]) == sizes
    per_rack = Counter((m.msb, m.rack) for m in machines(region))
    assert sorted(per_rack.values(), reverse=True) == sorted((s for s in sizes if s), reverse=True)


def test_rack_types_interleave_over_msbs():
    region = parse_region(spec(msbs=3, racks_per_msb=4, machine_types={"skylake": 0.75, "broadwell": 0.25}))
    types = rack_types(region, region.dcs[0])
    assert Counter(types) == {"skylake": 9, "broadwell": 3}
    for msb in range(3):  # every MSB gets its share: one broadwell rack in four
        assert types[msb * 4:(msb + 1) * 4].count("broadwell") == 1
    racks = {(m.msb, m.rack): m.machine_type for m in machines(region)}
    assert len(set(racks.values())) == 2 and len(racks) == 12  # one type per rack


def test_example_region_file():
    region = load_region(EXAMPLE)
    ms = machines(region)
    assert (region.name, [d.name for d in region.dcs], len(ms)) == ("r1", ["dc1", "dc2"], 350)
    assert Counter((m.dc, m.machine_type) for m in ms) == {("dc1", "skylake"): 180, ("dc1", "broadwell"): 60,
                                                         ("dc2", "skylake"): 110}
    assert {m.msb for m in ms if m.dc == "dc2"} == {"north", "south"}
    assert {(m.cpu_millicores, m.memory_mib) for m in ms if m.dc == "dc2"} == {(48000, 196608)}
    assert ms[0].id == "dc1-msb1-r01-m001" and ms[-1].id == "dc2-south-r03-m018"
    assert parse_region(spec_to_dict(region)) == region


# (n_machines, dcs, machines per DC)
GENERATED = {
    "two": (2, 2, [1, 1]),
    "odd-split": (101, 2, [51, 50]),
    "three-named": (1000, ["east", "west", "north"], [334, 333, 333]),
    "one-dc": (20, 1, [20]),
    "ten-thousand": (10_000, 3, [3334, 3333, 3333]),
}


@pytest.mark.parametrize("n, dcs, per_dc", GENERATED.values(), ids=GENERATED.keys())
def test_generate_region_sizes(n, dcs, per_dc):
    region = generate_region(n, dcs=dcs, seed=3)
    ms = machines(region)
    assert len(ms) == region.n_machines == n
    assert [sum(1 for m in ms if m.dc == dc.name) for dc in region.dcs] == per_dc
    assert len({m.id for m in ms}) == n
    assert parse_region(spec_to_dict(region)) == region


def test_small_generated_regions_still_have_racks_msbs_and_types():
    ms = machines(generate_region(20, dcs=2, seed=None))
    assert len({(m.dc, m.msb) for m in ms}) == 4
    assert len({(m.dc, m.msb, m.rack) for m in ms}) == 8
    assert {m.machine_type for m in ms} == {"skylake", "broadwell"}


def test_generate_region_is_deterministic_by_seed():
    a, b, c = (machines(generate_region(5000, dcs=2, seed=s)) for s in (7, 7, 8))
    assert a == b
    assert [m.id for m in a] == [m.id for m in c]  # the seed moves types between racks, not machines
    assert [m.machine_type for m in a] != [m.machine_type for m in c]
    rack_mix = [Counter({(m.dc, m.msb, m.rack): m.machine_type for m in ms}.values()) for ms in (a, c)]
    assert rack_mix[0] == rack_mix[1]  # same number of racks per type


@pytest.mark.parametrize("n, dcs, message", [
    (0, 2, "n_machines: expected a positive integer"),
    (1, 2, "n_machines: 1 machine(s) for 2 DCs"),
    (10, 0, "dcs: expected a positive integer"),
    (10, [], "dcs: expected at least one DC"),
    (10, ["dc/1"], "dcs[0].name: expected a name"),
])
def test_generate_region_rejects(n, dcs, message):
    with pytest.raises(RegionSpecError) as err:
        generate_region(n, dcs=dcs)
    assert str(err.value).startswith(message)


def test_one_million_machines():
    start = time.perf_counter()
    region = generate_region(1_000_000, dcs=5, seed=1)
    n = sum(1 for _ in iter_machines(region))
    streamed = time.perf_counter() - start
    start = time.perf_counter()
    ms = machines(region)
    listed = time.perf_counter() - start
    print(f"\n1,000,000 machines: streamed in {streamed:.2f}s, listed in {listed:.2f}s")
    assert n == len(ms) == region.n_machines == 1_000_000
    assert len({m.id for m in ms}) == 1_000_000
    assert Counter(m.dc for m in ms) == {f"dc{i}": 200_000 for i in range(1, 6)}
