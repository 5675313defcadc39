"""docs/methods.md: every row's overrides load and validate against the one-node recipe (the doc cannot name a key
or a value the config does not take)."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ROWS = [line for line in (ROOT / "docs" / "methods.md").read_text().splitlines()
        if line.startswith("| ") and "`" in line.split("|")[2]]


def test_the_table_has_its_rows():
    assert len(ROWS) >= 20


@pytest.mark.parametrize("row", ROWS, ids=lambda r: r.split("|")[1].strip()[:40])
def test_each_methods_overrides_load(row):
    from rl.config import load_config
    overrides = re.search(r"`([^`]+)`", row.split("|")[2]).group(1).split()
    # the rows name placeholder paths (the teacher's): the path checks are the config's, tested elsewhere
    cfg = load_config(str(ROOT / "configs" / "recipes" / "m3-1node-h200.yaml"), overrides, check_paths=False)
    for item in overrides:  # and each took effect
        key, value = item.split("=", 1)
        section, field = key.split(".")
        got = getattr(getattr(cfg, section), field)
        assert str(got).lower() == value.lower() or got == (None if value == "null" else type(got)(value)), item
