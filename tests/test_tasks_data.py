"""Math data loaders: the formats people have, configurable field names, errors that name the row."""

import json

import pytest

from pipelinerl.config import TaskConfig
from pipelinerl.tasks.data import load_rows

ROWS = [{"q": "1+1?", "gold": "2", "source": "made up"}, {"q": "2*3?", "gold": 6, "source": "made up"}]
EXPECTED = [("1+1?", "2"), ("2*3?", "6")]


def write(tmp_path, suffix):
    path = tmp_path / f"rows{suffix}"
    if suffix == ".jsonl":
        path.write_text("\n".join(json.dumps(row) for row in ROWS) + "\n\n")
    elif suffix == ".json":
        path.write_text(json.dumps(ROWS))
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist([{**row, "gold": str(row["gold"])} for row in ROWS]), path)
    return path


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
def test_formats_with_configured_fields(tmp_path, suffix):
    path = write(tmp_path, suffix)
    assert load_rows(path, question_field="q", answer_field="GOLD") == EXPECTED  # any key case


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
def test_missing_fields_name_the_file_the_row_and_the_fields_found(tmp_path, suffix):
    path = write(tmp_path, suffix)
    with pytest.raises(ValueError, match=rf"rows{suffix} row 0: .*\['gold', 'q', 'source'\].*task.question_field"):
        load_rows(path)  # the defaults (question/problem, answer) are absent


def test_a_bad_row_further_down_is_found_at_start_up(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [{"problem": "a", "answer": "1"}, {"problem": "b"}]))
    with pytest.raises(ValueError, match=r"train.jsonl row 1: .*\['problem'\]"):
        from pipelinerl.tasks import get_task

        get_task(TaskConfig(name="math", dataset_path=str(path)))


def test_default_fields_and_open_reasoner_zero_pairs(tmp_path):
    orz = [[{"from": "human", "value": "1+1?"}, {"from": "assistant", "ground_truth": {"value": "2"}}]]
    (tmp_path / "orz.json").write_text(json.dumps(orz))
    (tmp_path / "plain.jsonl").write_text(json.dumps({"Problem": "p", "Answer": 3}))
    assert load_rows(tmp_path / "orz.json") == [("1+1?", "2")]
    assert load_rows(tmp_path / "plain.jsonl") == [("p", "3")]


def test_unknown_suffix_missing_file_and_datasets_folder(tmp_path):
    (tmp_path / "rows.csv").write_text("q,a\n")
    with pytest.raises(ValueError, match="use a .jsonl, .json or .parquet"):
        load_rows(tmp_path / "rows.csv")
    with pytest.raises(ValueError, match="does not exist"):
        load_rows(tmp_path / "absent.jsonl")
    from datasets import Dataset, DatasetDict

    Dataset.from_list(ROWS[:1]).save_to_disk(str(tmp_path / "hf"))
    assert load_rows(tmp_path / "hf", "q", "gold") == EXPECTED[:1]
    with pytest.raises(ValueError, match=r"hf row 0: .*\['gold', 'q', 'source'\]"):
        load_rows(tmp_path / "hf")
    rows = [{**row, "gold": str(row["gold"])} for row in ROWS]  # one Arrow type per column
    DatasetDict({"test": Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "splits"))
    with pytest.raises(ValueError, match=r"holds the splits \['test'\]: give one split's folder"):
        load_rows(tmp_path / "splits")
    assert load_rows(tmp_path / "splits" / "test", "q", "gold") == EXPECTED
