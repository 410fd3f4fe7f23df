"""Data: loaders for json/jsonl/parquet, errors naming file/line/field, packing, SFT masks."""
from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from trainer import DataConfig, DataError
from trainer.data import (ASSISTANT, EOS, ByteTokenizer, Sampler, TokenDataset, build_datasets,
                          load_dataset, read_records)
from trainer.model import IGNORE_INDEX


def _write(tmp_path, name, rows):
    path = tmp_path / name
    if name.endswith(".parquet"):
        keys = sorted({k for r in rows for k in r})  # from_pylist would keep the first row's keys only
        pq.write_table(pa.Table.from_pydict({k: [r.get(k) for r in rows] for k in keys}), path)
    elif name.endswith(".jsonl"):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        path.write_text(json.dumps(rows))
    return path


@pytest.mark.parametrize("name", ["d.json", "d.jsonl", "d.parquet"])
def test_three_formats_read_the_same(tmp_path, name):
    rows = [{"text": "hello world " * 5}, {"text": "second document " * 4}]
    ds = load_dataset([_write(tmp_path, name, rows)], DataConfig(seq_len=16))
    stream = ByteTokenizer().encode(rows[0]["text"]) + [EOS]
    assert ds.ids[0].tolist() == stream[:17]
    assert ds.learn is None and ds.ids.shape[1] == 17


@pytest.mark.parametrize("name, where", [("d.json", "item 1"), ("d.jsonl", "line 2"), ("d.parquet", "row 1")])
def test_missing_field_names_file_place_and_field(tmp_path, name, where):
    path = _write(tmp_path, name, [{"text": "fine text here"}, {"txt": "typo"}])
    with pytest.raises(DataError) as info:
        load_dataset([path], DataConfig(seq_len=4))
    msg = str(info.value)
    assert str(path) in msg and where in msg and "missing field 'text'" in msg and "did you mean 'txt'" in msg


def test_malformed_files(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": oops}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl line 2: not valid JSON"):
        read_records(bad)
    wrong = _write(tmp_path, "w.jsonl", [{"text": 3}])
    with pytest.raises(DataError, match=r"w\.jsonl line 1: field 'text' must be a str, got int"):
        load_dataset([wrong], DataConfig(seq_len=4))
    notlist = tmp_path / "n.json"
    notlist.write_text('{"text": "a"}')
    with pytest.raises(DataError, match="must hold a list of objects"):
        read_records(notlist)
    broken = tmp_path / "b.parquet"
    broken.write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match=r"b\.parquet: cannot read parquet"):
        read_records(broken)
    with pytest.raises(DataError, match="unknown data format"):
        read_records(_write(tmp_path, "x.csv", []))
    with pytest.raises(DataError, match="does not exist"):
        read_records(tmp_path / "missing.jsonl")


def test_sft_loss_only_on_response_tokens(tmp_path):
    rows = [{"prompt": "Q?", "response": "Yes."}]
    ds = load_dataset([_write(tmp_path, "s.jsonl", rows)], DataConfig(mode="sft", seq_len=16))
    batch = ds.batch(torch.tensor([0]))
    ids, labels = batch["input_ids"][0].tolist(), batch["labels"][0].tolist()
    learned = [t for t in labels if t != IGNORE_INDEX]
    assert learned == list(b"Yes.") + [EOS]  # response bytes and the end token only
    # every learned label is the next token of the input, and follows the <assistant> marker
    first = labels.index(ord("Y"))
    assert ids[first] == ASSISTANT


def test_sft_multi_turn_messages_and_role_errors(tmp_path):
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "A"},
                          {"role": "user", "content": "again"}, {"role": "assistant", "content": "B"}]}]
    ds = load_dataset([_write(tmp_path, "m.jsonl", rows)], DataConfig(mode="sft", seq_len=32))
    labels = ds.batch(torch.tensor([0]))["labels"][0].tolist()
    assert [t for t in labels if t != IGNORE_INDEX] == [ord("A"), EOS, ord("B"), EOS]
    bad = _write(tmp_path, "r.jsonl", [{"messages": [{"role": "bot", "content": "x"}]}])
    with pytest.raises(DataError, match=r"r\.jsonl line 1 messages\[0\]: role 'bot'"):
        load_dataset([bad], DataConfig(mode="sft", seq_len=8))
    missing = _write(tmp_path, "p.parquet", [{"prompt": "x", "answer": "y"}])
    with pytest.raises(DataError, match=r"p\.parquet row 0: missing field 'response'"):
        load_dataset([missing], DataConfig(mode="sft", seq_len=8))


def test_demo_corpus_is_deterministic_and_uses_both_formats(tmp_path):
    cfg = DataConfig(seq_len=32)
    a_train, a_val = build_datasets(cfg, tmp_path / "a")
    b_train, b_val = build_datasets(cfg, tmp_path / "b")
    assert torch.equal(a_train.ids, b_train.ids) and torch.equal(a_val.ids, b_val.ids)
    assert (tmp_path / "a" / "demo_pretrain_train.jsonl").is_file()
    assert (tmp_path / "a" / "demo_pretrain_val.parquet").is_file()
    assert len(a_train) > 1000 and len(a_val) > 50
    sft_train, _ = build_datasets(DataConfig(mode="sft", seq_len=32), tmp_path / "s")
    assert sft_train.learn is not None and sft_train.learn.any()


def test_sampler_shards_the_global_batch():
    one = Sampler(10, seed=3)
    r0, r1 = Sampler(10, seed=3, rank=0, world_size=2), Sampler(10, seed=3, rank=1, world_size=2)
    glob = one.rows(0, 4)
    assert torch.equal(torch.cat([r0.local_rows(0, 2), r1.local_rows(0, 2)]), glob)
    # crossing an epoch boundary draws a new permutation but visits every row once per epoch
    assert sorted(one.rows(0, 10).tolist()) == list(range(10))
    assert sorted(one.rows(10, 10).tolist()) == list(range(10))
    assert not torch.equal(one.rows(0, 10), one.rows(10, 10))


def test_dataset_batch_shifts_labels():
    ds = TokenDataset(torch.arange(10).view(2, 5))
    b = ds.batch(torch.tensor([1]))
    assert b["input_ids"].tolist() == [[5, 6, 7, 8]] and b["labels"].tolist() == [[6, 7, 8, 9]]


@pytest.mark.parametrize("name", ["latin1.jsonl", "latin1.json"])
def test_data_file_that_is_not_utf8_names_the_file(tmp_path, name):
    from trainer.data import read_records

    path = tmp_path / name
    path.write_bytes(b'[{"text": "caf\xe9"}]' if name.endswith(".json") else b'{"text": "caf\xe9"}\n')
    with pytest.raises(DataError, match=rf"{name}: not UTF-8 text"):
        read_records(path)
