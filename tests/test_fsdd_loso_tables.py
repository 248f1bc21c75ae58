"""The recipe README's leave-one-speaker-out table and the README's summary say what the committed
fold results (``examples/fsdd/results/loso/<run>/<family>-loso.json``) say: every mean and worst
fold, for every family, system and run."""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "examples" / "fsdd" / "results" / "loso"
RUNS = ("before", "after", "after-synth")  # the table's column groups, in order
# the table's (family, system) rows -> (results file, system key in its summary)
ROWS = {
    ("CTC", "greedy"): ("ctc", "greedy"),
    ("CTC", "prefix beam 8"): ("ctc", "beam"),
    ("CTC", "beam 8 + LSTM LM"): ("ctc", "beam+LM"),
    ("transducer", "greedy"): ("transducer", "greedy"),
    ("transducer", "beam 8"): ("transducer", "beam"),
    ("transducer", "beam 8 + LSTM LM"): ("transducer", "beam+LM"),
    ("AED", "greedy"): ("aed", "greedy"),
    ("AED", "beam 8"): ("aed", "beam"),
    ("AED", "beam 8 + LSTM LM"): ("aed", "beam+LM"),
    ("AED", "joint CTC/attention"): ("aed", "beam+CTC"),
    ("AED", "joint CTC/attention + LSTM LM (`example.yaml`)"): ("aed", "beam+CTC+LM"),
}


def _summary(run: str, family: str) -> dict:
    return json.loads((RESULTS / run / f"{family}-loso.json").read_text())["summary"]


def _table_rows() -> dict[tuple[str, str], list[str]]:
    text = (ROOT / "examples" / "fsdd" / "README.md").read_text()
    start = text.index("| family | system | before: mean | after: mean | after + synthetic: mean |")
    rows = {}
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("| "):
            break
        cells = [cell.replace("**", "").strip() for cell in line.strip("|").split(" | ")]
        family = cells[0].split(" (")[0]  # "transducer (before, after: reduced)" -> "transducer"
        rows[(family, cells[1])] = cells[2:]
    return rows


def test_the_table_has_every_row():
    assert set(_table_rows()) == set(ROWS)


@pytest.mark.parametrize("row", list(ROWS), ids=[" / ".join(row) for row in ROWS])
def test_every_cell_is_the_results_figure(row):
    cells = _table_rows()[row]
    family, system = ROWS[row]
    for i, run in enumerate(RUNS):
        s = _summary(run, family)[system]
        mean = (f"{100 * s['mean_wer']:.2f} % · {s['mean_errors']:.1f} "
                f"({s['mean_sub']:.1f} / {s['mean_del']:.1f} / {s['mean_ins']:.1f})")
        worst = f"{100 * s['worst_wer']:.2f} % ({s['worst_speaker']})"
        assert cells[i] == mean, (run, "mean")
        assert cells[len(RUNS) + i] == worst, (run, "worst")


def test_the_readme_summary_is_the_best_systems_results():
    text = (ROOT / "README.md").read_text()
    for run, label in (("before", "the plain recipe per fold"), ("after", "the recipe's speaker-robust options"),
                       ("after-synth", "16 synthetic espeak-ng speakers")):
        s = _summary(run, "aed")["beam+CTC+LM"]
        line = next(line for line in text.splitlines() if line.startswith("| leave-one-speaker-out") and label in line)
        figures = re.findall(r"([0-9.]+) %", line)
        assert figures == [f"{100 * s['mean_wer']:.2f}", f"{100 * s['worst_wer']:.2f}"], run
