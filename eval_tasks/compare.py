"""Compare two lm-eval runs item by item: ``python eval_tasks/compare.py RUN_A RUN_B``.

Each RUN is an ``--output_path`` that lm-eval wrote with ``--log_samples``. For every task the
two ran, one line: the items, how many differ (the choice picked, or the text generated), the
largest difference of a loglikelihood (each choice's, or each document's), and the score of each.
"""

import json
import sys
from pathlib import Path


def latest(run: Path, pattern: str) -> dict[str, Path]:
    """Per task, the newest file lm-eval wrote under ``run`` (it names them by task and time)."""
    found = {}
    for path in sorted(run.rglob(pattern)):  # the timestamp sorts: the last one wins
        found[path.stem.split("_", 1)[1].rsplit("_", 1)[0]] = path
    return found


def samples(path: Path) -> dict[int, dict]:
    return {s["doc_id"]: s for s in map(json.loads, path.read_text().splitlines())}


def loglikelihoods(sample: dict) -> list[float]:
    """Each request's loglikelihood: a choice's (multiple choice) or the document's (perplexity)."""
    return [float(r[0]) if isinstance(r, list) else float(r) for r in sample["filtered_resps"]]


SCORES = ("acc,none", "exact_match,strip", "word_perplexity,none")  # nano_mc's, nano_gen's, nano_ppl's


def compare(task: str, a: dict[int, dict], b: dict[int, dict], scores: tuple[dict, dict]) -> str:
    assert a.keys() == b.keys(), f"{task}: the runs scored different items"
    differ = delta = "-"
    if all("exact_match" in a[i] for i in a):  # generation: the same text, or not
        differ = sum(a[i]["filtered_resps"] != b[i]["filtered_resps"] for i in a)
    else:  # a loglikelihood per choice (multiple choice: which is picked), or per document (perplexity)
        lls = {i: (loglikelihoods(a[i]), loglikelihoods(b[i])) for i in a}
        if any(len(x) > 1 for x, _ in lls.values()):
            differ = sum(x.index(max(x)) != y.index(max(y)) for x, y in lls.values())
        delta = f"{max(abs(u - v) for x, y in lls.values() for u, v in zip(x, y)):.1e}"
    key = next(k for k in SCORES if k in scores[0])
    x, y = scores[0][key], scores[1][key]
    relative = abs(x - y) / abs(y) if y else abs(x - y)
    return f"| {task} | {len(a)} | {differ} | {delta} | {key.split(',')[0]} {x:.6g} / {y:.6g} ({relative:.1e}) |"


def main() -> None:
    runs = [Path(p) for p in sys.argv[1:3]]
    sample_files = [latest(run, "samples_*.jsonl") for run in runs]
    results = [json.loads(max(run.rglob("results_*.json")).read_text())["results"] for run in runs]
    print("| task | items | items that differ | largest loglikelihood difference | score: A / B (relative difference) |")
    print("|---|---|---|---|---|")
    for task in sorted(sample_files[0].keys() & sample_files[1].keys()):
        print(compare(task, samples(sample_files[0][task]), samples(sample_files[1][task]),
                      (results[0][task], results[1][task])))


if __name__ == "__main__":
    main()
