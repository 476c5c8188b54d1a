"""The rows of a chat data set, read from local files only: JSON lines (``.jsonl``, ``.json``),
Parquet (``.parquet``, through pyarrow), a dataset folder that ``datasets``' ``save_to_disk``
wrote (``load_from_disk``), or a folder of JSON-lines/Parquet files (in name order).

A row is one of three shapes, detected once from the first row: ``messages`` (a list of
``{role, content}``, optional ``tools``), ``prompt``/``completion`` (each a string or a list of
messages), or ``text``. A row that fits no shape, or not the file's, is a DataError naming its
file, line (or row) and field.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from typing import Any

from distlib.runner.data.errors import DataError

ROLES = ("system", "user", "assistant", "tool", "developer", "function", "ipython")
JSON_LINES = (".jsonl", ".json")


def files_of(root: str, what: str = "data.root") -> list[str]:
    """The files (or the dataset folder) ``root`` names; a DataError when there are none."""
    if os.path.isfile(root):
        return [root]
    if os.path.isdir(root):
        if is_dataset_folder(root):
            return [root]
        found = sorted(os.path.join(root, n) for n in os.listdir(root)
                       if n.endswith((*JSON_LINES, ".parquet")))  # fmt: skip
        if found:
            return found
        raise DataError(f"{what}={root!r}: no .jsonl, .json or .parquet files in the folder, and no dataset "
                        "that datasets' save_to_disk wrote")  # fmt: skip
    raise DataError(f"{what}={root!r}: no such file or folder (chat rows: .jsonl, .parquet, or a dataset folder)")


def is_dataset_folder(path: str) -> bool:
    return os.path.isdir(path) and any(
        os.path.isfile(os.path.join(path, n)) for n in ("dataset_info.json", "state.json", "dataset_dict.json")
    )


def read_rows(files: list[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(where, row)`` for each row of ``files`` in order; ``where``: "file line N" or "file row N"."""
    for path in files:
        name = os.path.relpath(path) if not os.path.isabs(path) else path
        if os.path.isdir(path):
            yield from _dataset_rows(path, name)
        elif path.endswith(".parquet"):
            yield from _parquet_rows(path, name)
        else:
            yield from _json_lines(path, name)


def _json_lines(path: str, name: str) -> Iterator[tuple[str, dict[str, Any]]]:
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise DataError(f"{name}: cannot read it: {e}") from e
    with f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{name} line {n}: not JSON: {e.msg} (column {e.colno})") from e
            if not isinstance(row, dict):
                raise DataError(f"{name} line {n}: a row must be a JSON object, got {type(row).__name__}")
            yield f"{name} line {n}", row


def _parquet_rows(path: str, name: str) -> Iterator[tuple[str, dict[str, Any]]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise DataError(f"{name}: reading Parquet needs pyarrow: pip install 'distlib[datasets]'") from e
    try:
        table = pq.ParquetFile(path)
        batches = table.iter_batches(batch_size=4096)
        n = 0
        for batch in batches:
            for row in batch.to_pylist():
                n += 1
                yield f"{name} row {n}", row
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
        raise DataError(f"{name}: cannot read it as Parquet: {e}") from e


def _dataset_rows(path: str, name: str) -> Iterator[tuple[str, dict[str, Any]]]:
    try:
        from datasets import DatasetDict, load_from_disk
    except ImportError as e:
        raise DataError(f"{name}: a dataset folder needs datasets: pip install 'distlib[datasets]'") from e
    try:
        ds = load_from_disk(path)
    except Exception as e:
        raise DataError(f"{name}: cannot load it with datasets.load_from_disk: {type(e).__name__}: {e}") from e
    if isinstance(ds, DatasetDict):
        if "train" not in ds:
            raise DataError(f"{name}: a DatasetDict without a 'train' split (it has: {', '.join(ds)})")
        ds = ds["train"]
    for n, row in enumerate(ds, 1):
        yield f"{name} row {n}", dict(row)


def shape_of(row: Mapping[str, Any], where: str) -> str:
    """The shape of the first row: messages, prompt_completion or text."""
    if "messages" in row:
        return "messages"
    if "prompt" in row and "completion" in row:
        return "prompt_completion"
    if "text" in row:
        return "text"
    fields = ", ".join(map(str, row)) or "none"
    raise DataError(f"{where}: fits no chat row shape: expected a field 'messages' (a conversation), 'prompt' and "
                    f"'completion', or 'text'; the row has: {fields}")  # fmt: skip


def check_row(row: dict[str, Any], shape: str, where: str) -> dict[str, Any]:
    """``row`` checked against ``shape`` (the file's); a DataError naming the field that does not fit.
    A ``tools`` field given as a JSON string (as Parquet files often hold it) is parsed."""
    if shape == "messages":
        _check_messages(row.get("messages"), where, "messages")
    elif shape == "prompt_completion":
        for key in ("prompt", "completion"):
            if key not in row:
                raise DataError(f"{where}: field {key!r} is missing (the first row has prompt and completion)")
            if not isinstance(row[key], str):
                _check_messages(row[key], where, key)
        if isinstance(row["prompt"], str) != isinstance(row["completion"], str) and isinstance(row["prompt"], str):
            raise DataError(f"{where}: field 'completion': a list of messages after a string prompt; give both as "
                            "strings or both as messages")  # fmt: skip
    else:
        if not isinstance(row.get("text"), str):
            got = type(row["text"]).__name__ if "text" in row else "nothing"
            raise DataError(f"{where}: field 'text': expected a string (the first row has text), got {got}")
    tools = row.get("tools")
    if isinstance(tools, str):
        try:
            row = {**row, "tools": json.loads(tools) if tools.strip() else None}
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: field 'tools': a string that is not JSON: {e.msg}") from e
    if row.get("tools") is not None and not isinstance(row["tools"], list):
        raise DataError(f"{where}: field 'tools': expected a list of tool definitions")
    return row


def _check_messages(messages: Any, where: str, field: str) -> None:
    if not isinstance(messages, list) or not messages:
        got = type(messages).__name__ if messages is not None else "nothing"
        raise DataError(f"{where}: field {field!r}: expected a non-empty list of messages, got {got}")
    for i, m in enumerate(messages):
        f = f"{field}[{i}]"
        if not isinstance(m, dict):
            raise DataError(f"{where}: field {f!r}: a message must be an object with role and content")
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise DataError(f"{where}: field '{f}.role': expected one of {', '.join(ROLES)}, got {role!r}")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise DataError(f"{where}: field '{f}.content': expected a string, got {type(content).__name__}")
        if content is None and not m.get("tool_calls"):
            raise DataError(f"{where}: field '{f}.content' is missing")
        if "train" in m and not isinstance(m["train"], bool) and m["train"] is not None:
            raise DataError(f"{where}: field '{f}.train': expected true or false, got {m['train']!r}")


__all__ = ["check_row", "files_of", "read_rows", "shape_of"]
