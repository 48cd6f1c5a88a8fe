"""The tables README.md and docs/ show from records are what their JSON under docs/results/ says."""
from pathlib import Path

from expertrail.tools import records

ROOT = Path(__file__).resolve().parents[1]


def test_every_table_shown_from_a_record_is_that_record():
    shown = [(doc.name, record, kind, text == rendered)
             for doc in records.documents(ROOT) for record, kind, text, rendered in records.blocks(doc, ROOT / "docs")]
    assert len(shown) >= 4, shown
    stale = [entry[:3] for entry in shown if not entry[3]]
    assert not stale, f"differ from their records (python -m expertrail.tools.records --write): {stale}"


def test_a_changed_figure_is_caught(tmp_path):
    (tmp_path / "docs" / "results").mkdir(parents=True)
    record = ROOT / "docs" / "results" / "train-default.json"
    (tmp_path / "docs" / "results" / "train-default.json").write_text(record.read_text())
    rendered = records.render("train", record)
    doc = tmp_path / "README.md"
    doc.write_text(f"<!-- record: results/train-default.json train -->\n{rendered.replace('0.983', '0.937')}"
                   "<!-- end record -->\n")
    assert records.main(["--root", str(tmp_path)]) == 1
    assert records.main(["--root", str(tmp_path), "--write"]) == 0 and records.main(["--root", str(tmp_path)]) == 0
    assert "0.983" in doc.read_text()


def test_a_captured_command_is_recorded_with_its_command_machine_date_and_output(tmp_path):
    import json
    import sys
    path = tmp_path / "out.json"
    assert records.main(["--capture", str(path), "--", sys.executable, "-c", "print('a table')"]) == 0
    record = json.loads(path.read_text())
    assert record["command"].endswith("-c 'print('\"'\"'a table'\"'\"')'") and record["output"] == "a table\n"
    assert record["machine"]["cores"] > 0 and record["date"].startswith("20")
    assert records.render("output", path) == "```\na table\n```\n"
    failing = tmp_path / "failed.json"
    assert records.main(["--capture", str(failing), "--", sys.executable, "-c", "raise SystemExit(3)"]) == 3
    assert not failing.exists()
