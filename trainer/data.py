"""Data: a byte-level tokenizer, json/jsonl/parquet readers, pretrain packing, SFT masking, batches.

Every sample is a row of `seq_len + 1` token ids plus, in SFT mode, a mask of which targets
count. The order of samples is a pure function of `(seed, position)`: epoch `p // n` uses the
permutation `randperm(n, seed + epoch)`. The only data state a checkpoint needs is therefore the
integer position, and a 2-process run sees the same global batches as a 1-process run.
"""
from __future__ import annotations

import difflib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer._errors import DataError
from trainer.config import DataConfig
from trainer.model import IGNORE_INDEX

BOS, EOS, USER, ASSISTANT, PAD = 256, 257, 258, 259, 260
SPECIALS = {"<bos>": BOS, "<eos>": EOS, "<user>": USER, "<assistant>": ASSISTANT, "<pad>": PAD}


class ByteTokenizer:
    """UTF-8 bytes are ids 0-255; ids 256-260 are <bos> <eos> <user> <assistant> <pad>."""

    vocab_size = 261

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        """Bytes to text; special ids are dropped and broken UTF-8 becomes U+FFFD."""
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


# --- reading files -----------------------------------------------------------------------------

def read_records(path: str | Path) -> list[tuple[str, dict[str, Any]]]:
    """Read a .json (a list of objects), .jsonl or .parquet file.

    Returns `(where, record)` pairs; `where` ("file.jsonl line 3") prefixes later field errors.

    Raises:
        DataError: the file is missing, has an unknown extension, or a line/row is not an object.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file {path} does not exist")
    suffix = path.suffix.lower()
    try:
        return _read_records(path, suffix)
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); save it as "
                        f"UTF-8 {suffix or 'JSON'}") from e


def _read_records(path: Path, suffix: str) -> list[tuple[str, dict[str, Any]]]:
    if suffix == ".jsonl":
        out = []
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path} line {lineno}: not valid JSON ({e.msg} at column {e.colno})") from e
                out.append((f"{path} line {lineno}", _object(obj, f"{path} line {lineno}")))
        return out
    if suffix == ".json":
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise DataError(f"{path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from e
        if not isinstance(data, list):
            raise DataError(f"{path}: a .json data file must hold a list of objects, got {type(data).__name__}")
        return [(f"{path} item {i}", _object(obj, f"{path} item {i}")) for i, obj in enumerate(data)]
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as e:  # pyarrow raises several unrelated types for corrupt files
            raise DataError(f"{path}: cannot read parquet ({e})") from e
        return [(f"{path} row {i}", row) for i, row in enumerate(rows)]
    raise DataError(f"{path}: unknown data format {suffix!r}; use .json, .jsonl or .parquet")


def _object(obj: Any, where: str) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    return obj


def _field(record: dict[str, Any], name: str, where: str, kind: type = str) -> Any:
    if name not in record or record[name] is None:
        present = sorted(k for k, v in record.items() if v is not None)
        close = difflib.get_close_matches(name, present, n=1, cutoff=0.5)
        hint = f"; did you mean '{close[0]}'? (set it with data.*_field)" if close else ""
        null = " (it is null)" if name in record else ""
        raise DataError(f"{where}: missing field '{name}'{null} (fields present: {present}){hint}")
    value = record[name]
    if not isinstance(value, kind):
        raise DataError(f"{where}: field '{name}' must be a {kind.__name__}, got {type(value).__name__}")
    return value


# --- turning records into samples --------------------------------------------------------------

def pack_pretrain(records: Sequence[tuple[str, dict[str, Any]]], config: DataConfig) -> torch.Tensor:
    """Concatenate `text + <eos>` of every record and cut it into rows of seq_len + 1 tokens."""
    tok = ByteTokenizer()
    stream: list[int] = []
    for where, record in records:
        stream += tok.encode(_field(record, config.text_field, where)) + [EOS]
    width = config.seq_len + 1
    n = len(stream) // width
    if n == 0:
        raise DataError(f"only {len(stream)} tokens of text; need at least {width} for one sequence of "
                        f"data.seq_len={config.seq_len}")
    # non-overlapping rows; the tail shorter than a row is dropped
    return torch.tensor(stream[: n * width], dtype=torch.long).view(n, width)


def encode_sft(record: dict[str, Any], where: str, config: DataConfig) -> tuple[list[int], list[bool]]:
    """Token ids and, per token, whether it is a response token the loss should learn."""
    tok = ByteTokenizer()
    if config.messages_field in record and record[config.messages_field] is not None:
        turns = _field(record, config.messages_field, where, list)
    else:
        turns = [{"role": "user", "content": _field(record, config.prompt_field, where)},
                 {"role": "assistant", "content": _field(record, config.response_field, where)}]
    ids, learn = [BOS], [False]
    for i, turn in enumerate(turns):
        at = f"{where} {config.messages_field}[{i}]"
        turn = _object(turn, at)
        role = _field(turn, "role", at)
        text = tok.encode(_field(turn, "content", at))
        if role == "assistant":
            ids += [ASSISTANT] + text + [EOS]
            learn += [False] + [True] * (len(text) + 1)
        elif role in ("user", "system"):
            ids += [USER] + text
            learn += [False] * (len(text) + 1)
        else:
            raise DataError(f"{at}: role {role!r} is not one of 'system', 'user', 'assistant'")
    return ids, learn


def pack_sft(records: Sequence[tuple[str, dict[str, Any]]], config: DataConfig
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """One example per row, truncated or padded to seq_len + 1; returns (ids, learn-mask)."""
    width = config.seq_len + 1
    ids = torch.full((len(records), width), PAD, dtype=torch.long)
    learn = torch.zeros((len(records), width), dtype=torch.bool)
    for row, (where, record) in enumerate(records):
        tokens, mask = encode_sft(record, where, config)
        n = min(len(tokens), width)
        ids[row, :n] = torch.tensor(tokens[:n])
        learn[row, :n] = torch.tensor(mask[:n])
    return ids, learn


@dataclass(frozen=True)
class TokenDataset:
    """Rows of `seq_len + 1` ids; `learn[r, t]` says whether token t of row r is a target."""

    ids: torch.Tensor
    learn: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.ids.shape[0]

    def batch(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """`{"input_ids", "labels"}` for these rows; labels are -100 where no loss is taken."""
        chunk = self.ids[rows]
        labels = chunk[:, 1:].clone()
        if self.learn is not None:
            labels[~self.learn[rows][:, 1:]] = IGNORE_INDEX
        return {"input_ids": chunk[:, :-1].contiguous(), "labels": labels}


def load_dataset(files: Sequence[str | Path], config: DataConfig) -> TokenDataset:
    """Read and tokenize `files` in order into one dataset (DataError names any bad record)."""
    records = [r for path in files for r in read_records(path)]
    if not records:
        raise DataError(f"no records in {[str(f) for f in files]}")
    if config.mode == "sft":
        return TokenDataset(*pack_sft(records, config))
    return TokenDataset(pack_pretrain(records, config))


def split_records(files: Sequence[str | Path], fraction: float
                  ) -> tuple[list[tuple[str, dict]], list[tuple[str, dict]]]:
    """Training and held-out records: the last `fraction` of the records is held out."""
    records = [r for path in files for r in read_records(path)]
    n_val = int(len(records) * fraction)
    return records[: len(records) - n_val], records[len(records) - n_val:]


def build_datasets(config: DataConfig, cache_dir: str | Path) -> tuple[TokenDataset, TokenDataset | None]:
    """Training and validation datasets for `config`; the demo corpus lands in `cache_dir`."""
    from trainer._corpus import write_demo_corpus

    train_files: Sequence[str | Path] = config.train_files
    val_files: Sequence[str | Path] = config.val_files
    if not train_files:
        train_path, val_path = write_demo_corpus(cache_dir, config.mode)
        train_files, val_files = [train_path], [val_path]
    if val_files:
        val = load_dataset(val_files, config)
        return load_dataset(train_files, config), val
    train_records, val_records = split_records(train_files, config.val_fraction)
    pack = (lambda r: TokenDataset(*pack_sft(r, config))) if config.mode == "sft" else \
        (lambda r: TokenDataset(pack_pretrain(r, config)))
    return pack(train_records), (pack(val_records) if val_records else None)


class Sampler:
    """Global sample positions to dataset rows, and a rank's share of each global micro-batch."""

    def __init__(self, size: int, *, seed: int, rank: int = 0, world_size: int = 1) -> None:
        self.size, self.seed, self.rank, self.world_size = size, seed, rank, world_size
        self._epoch, self._perm = -1, torch.empty(0, dtype=torch.long)

    def rows(self, position: int, count: int) -> torch.Tensor:
        """Rows of global positions [position, position + count), crossing epochs as needed."""
        epoch, i = divmod(position, self.size)
        if i + count <= self.size:  # the common case: one slice of one epoch's permutation
            return self._permutation(epoch)[i:i + count]
        head = self._permutation(epoch)[i:]
        return torch.cat([head, self.rows((epoch + 1) * self.size, count - len(head))])

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._epoch, self._perm = epoch, torch.randperm(self.size, generator=g)
        return self._perm

    def local_rows(self, position: int, batch_size: int) -> torch.Tensor:
        """This rank's `batch_size` rows of the global micro-batch starting at `position`."""
        return self.rows(position + self.rank * batch_size, batch_size)
