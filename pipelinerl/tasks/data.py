"""(question, answer) rows from the files people have: JSONL, JSON, Parquet, a `datasets` folder.

Every row is checked when the task is built (the actor's start-up), so a file without the expected
fields fails at once, naming the file, the row and the fields it does have, not hours into a run.
"""

from __future__ import annotations

import json
from pathlib import Path

# Looked for (any key case) when task.question_field / task.answer_field are null.
DEFAULT_QUESTION_FIELDS = ("question", "problem")
DEFAULT_ANSWER_FIELDS = ("answer",)
DEFAULT_PROMPT_FIELDS = ("prompt", "instruction", "question")  # instruction prompts (no answer)


def _read(path: Path) -> list:
    """The raw rows of one file or `datasets` folder."""
    if path.is_dir():
        from datasets import load_from_disk  # imported here: seconds of imports, for folders only

        data = load_from_disk(str(path))
        if not hasattr(data, "to_list"):  # a DatasetDict: one sub-folder per split
            raise ValueError(f"{str(path)!r} holds the splits {sorted(data)}: give one split's folder, e.g. "
                             f"{str(path / sorted(data)[0])!r}")
        return data.to_list()
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if path.suffix == ".json":
        rows = json.loads(path.read_text())
        if not isinstance(rows, list):
            raise ValueError(f"{str(path)!r}: a .json data file holds a list of rows, got {type(rows).__name__}")
        return rows
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    raise ValueError(f"{str(path)!r}: use a .jsonl, .json or .parquet file or a `datasets` folder")


def _field(lower: dict, wanted: tuple[str, ...]):
    return next((lower[name.lower()] for name in wanted if lower.get(name.lower()) is not None), None)


def _question_answer(row, where: str, question_fields: tuple[str, ...],
                     answer_fields: tuple[str, ...]) -> tuple[str, str]:
    """One row as (question, answer); an Open-Reasoner-Zero [human, assistant] pair is also understood."""
    if isinstance(row, list) and len(row) == 2 and isinstance(row[1], dict) \
            and isinstance(row[1].get("ground_truth"), dict):
        return str(row[0]["value"]), str(row[1]["ground_truth"]["value"])
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a row with fields {'/'.join(question_fields)} and "
                         f"{'/'.join(answer_fields)}, got {str(row)[:200]!r}")
    lower = {str(k).lower(): v for k, v in row.items()}
    question, answer = _field(lower, question_fields), _field(lower, answer_fields)
    if question is None or answer is None:
        raise ValueError(f"{where}: no question field ({'/'.join(question_fields)}) or no answer field "
                         f"({'/'.join(answer_fields)}); the row's fields are {sorted(map(str, row))}. "
                         "Set task.question_field / task.answer_field to the names this file uses")
    return str(question), str(answer)


def load_rows(path: str | Path, question_field: str | None = None, answer_field: str | None = None,
              setting: str = "task.dataset_path") -> list[tuple[str, str]]:
    """(question, answer) rows of `path`; a field name of None means the defaults above. `setting` is the config
    key that named the file, for the error when it is missing."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"data file {str(path)!r} does not exist (set {setting})")
    question_fields = (question_field,) if question_field else DEFAULT_QUESTION_FIELDS
    answer_fields = (answer_field,) if answer_field else DEFAULT_ANSWER_FIELDS
    return [_question_answer(row, f"{path.name} row {i}", question_fields, answer_fields)
            for i, row in enumerate(_read(path))]


def load_prompts(path: str | Path, prompt_field: str | None = None, setting: str = "task.dataset_path") -> list[str]:
    """The prompt text of every row of `path` (rows without an answer: instruction data); `prompt_field` None
    means DEFAULT_PROMPT_FIELDS."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"data file {str(path)!r} does not exist (set {setting})")
    fields = (prompt_field,) if prompt_field else DEFAULT_PROMPT_FIELDS
    prompts = []
    for i, row in enumerate(_read(path)):
        text = _field({str(k).lower(): v for k, v in row.items()}, fields) if isinstance(row, dict) else None
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{path.name} row {i}: no prompt text in a field {'/'.join(fields)}; the row is "
                             f"{str(row)[:200]!r}. Set task.question_field to the name this file uses")
        prompts.append(text)
    return prompts
