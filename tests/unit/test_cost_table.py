"""docs/models.md's cost table lists every paper config with the hours the estimator gives
(reproduce/cost_table.py makes it), so that it cannot go stale."""

from __future__ import annotations

import re
from pathlib import Path

from reproduce import cost_table

PAGE = Path(__file__).resolve().parents[2] / "docs/models.md"


def page_rows() -> dict[str, list[str]]:
    text = PAGE.read_text()
    block = re.search(r"<!-- cost-table: .*? -->\n(.*?)<!-- /cost-table -->", text, re.S)
    assert block, "docs/models.md has no cost table between its cost-table markers"
    rows = {}
    for line in block.group(1).splitlines()[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows[cells[0].strip("`")] = cells[1:]
    return rows


def test_the_table_lists_every_paper_config_and_no_other():
    configs = cost_table.paper_configs()
    assert len(configs) > 30  # every folder's configs were found
    assert sorted(page_rows()) == configs


def test_the_tables_hours_are_the_estimators():
    rows = page_rows()
    stale = {
        config: (rows[config][-1], cost_table.hours_cell(config))
        for config in cost_table.paper_configs()
        if rows.get(config, [""])[-1] != cost_table.hours_cell(config)
    }
    assert not stale, f"rerun python -m reproduce.cost_table: (page, estimator) {stale}"


def test_the_tables_runs_are_the_recorded_ones():
    rows = page_rows()
    for config in cost_table.paper_configs():
        assert rows[config][:-1] == list(cost_table.run_cells(config)), config
