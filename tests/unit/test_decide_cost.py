"""bench/decide_cost.py in brief: it decides jobs and journals placements, and prints its figures with conditions."""
import json

from bench import decide_cost


def test_the_decide_cost_bench_prints_positive_figures_and_its_conditions(capsys):
    assert decide_cost.main(["--jobs", "3", "--tasks", "5", "--rounds", "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["scheduler_decide_ms_per_job"] > 0 and doc["allocator_events_and_journal_ms_per_job"] > 0
    assert doc["conditions"]["jobs"] == 3 and doc["conditions"]["tasks_per_job"] == 5
