"""Local readers: JSONL, Parquet, save_to_disk directories; malformed rows and missing paths."""
from __future__ import annotations

import json

import pytest

from megarlhf.config.data import DataConfig
from megarlhf.data import read_records

ROWS = [{"prompt": "What is 2 + 3?", "answer": "5"}, {"prompt": "What is 4 * 4?", "answer": "16", "id": 7}]


def test_jsonl(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n\n")
    assert read_records(str(path)) == ROWS


def test_malformed_jsonl_row_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n\n" + '{"prompt": "x", "answer": }\n')
    with pytest.raises(ValueError, match=rf"{path}:3: malformed JSON line"):
        read_records(str(path))
    path.write_text(json.dumps(ROWS[0]) + "\n[1, 2]\n")
    with pytest.raises(ValueError, match=rf"{path}:2: expected a JSON object, got list"):
        read_records(str(path))


def test_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [dict(r, id=r.get("id")) for r in ROWS]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    assert read_records(str(tmp_path / "d.parquet")) == rows


def test_load_from_disk(tmp_path):
    import datasets

    rows = [dict(r, id=r.get("id")) for r in ROWS]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    assert read_records(str(tmp_path / "ds")) == rows
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "dd"))
    assert read_records(str(tmp_path / "dd"), split="train") == rows
    with pytest.raises(ValueError, match=r"holds splits \['train'\]; set data.split"):
        read_records(str(tmp_path / "dd"))


def test_missing_paths_and_hub_names(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="does not exist$"):
        read_records(str(tmp_path / "nope.jsonl"))
    with pytest.raises(FileNotFoundError, match="looks like a Hugging Face hub name.*no hub access"):
        read_records("openai/gsm8k")
    # a typo in a local path gets no hub hint: a file extension, or a first folder that exists here
    (tmp_path / "data").mkdir()
    monkeypatch.chdir(tmp_path)
    for local in ("data/nope.jsonl", "data/nope", "x/train.parquet"):
        with pytest.raises(FileNotFoundError, match="does not exist$"):
            read_records(local)
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="unsupported extension '.csv'"):
        read_records(str(tmp_path / "d.csv"))
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(ValueError, match="not a datasets save_to_disk directory"):
        read_records(str(tmp_path / "empty_dir"))


def test_data_config_validation():
    with pytest.raises(ValueError, match="max_prompt_length must be a positive int"):
        DataConfig(train_path="x", max_prompt_length=0)


def test_hostile_jsonl_rows_name_file_and_line(tmp_path):
    """Rows that the JSON decoder fails on outside its syntax errors (nesting thousands deep: RecursionError;
    an integer past Python's 4300-digit limit: ValueError) are data errors naming the file and line too."""
    from megarlhf.core.errors import DataError

    path = tmp_path / "hostile.jsonl"
    for row, what in (('{"prompt": ' + "[" * 3000 + "]" * 3000 + "}", "nested too deeply"),
                      ('{"prompt": "x", "answer": ' + "7" * 4301 + "}", "4300 digits")):
        path.write_text(json.dumps(ROWS[0]) + "\n" + row + "\n")
        with pytest.raises(DataError, match=rf"{path}:2: .*{what}"):
            read_records(str(path))
