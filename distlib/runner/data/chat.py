"""``data.name: chat``: supervised fine-tuning on conversations, instructions or plain text rows
(runner/data/chat_rows.py), rendered with the tokenizer's chat template (runner/data/chat_template.py),
trained on the assistant's turns, packed into rows of one length (runner/data/packing.py), cached
beside the data, and the loader that shards the rows over the ranks. Design: docs/fine_tuning.md.

A batch is ``({"input_ids", "position_ids"}, labels)``, each (B, T) int64 with T = ``max_length``
whatever the data (one shape: compile sees one), labels ``IGNORED`` where nothing is trained.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import socket
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from distlib.runner.data.chat_rows import check_row, files_of, read_rows, shape_of
from distlib.runner.data.chat_template import TRAIN_ON, ChatEncoder, load_tokenizer, template_text
from distlib.runner.data.errors import DataError
from distlib.runner.data.packing import build_rows, labels_of
from distlib.runner.data.text import IGNORED

# part of every cache key: raise it when what the cache holds changes
CACHE_FORMAT = 1
ARRAYS = ("input_ids", "position_ids", "labels")
Batch = tuple[dict[str, torch.Tensor], torch.Tensor]


@dataclass
class ChatSet:
    """The rows of both splits (``(N, max_length)`` int32 arrays, memory-mapped from the cache)
    and what the run reports of them."""

    train: dict[str, np.ndarray]
    val: dict[str, np.ndarray] | None
    max_length: int
    vocab_size: int
    packing: bool
    tokenizer: str  # the folder, for decoding generated answers
    template: str  # the Jinja file given, or ""
    answers: list[tuple[list[int], str]] = field(default_factory=list)  # held-out (prompt ids, answer)
    stats: dict[str, Any] = field(default_factory=dict)
    cache: str = ""
    reused: bool = False

    @property
    def block_size(self) -> int:
        return self.max_length

    def describe(self) -> str:
        s = self.stats
        layout = f"packed {s['documents']} documents into {s['train_rows']} rows" if self.packing else \
            f"{s['train_rows']} padded rows"  # fmt: skip
        return (f"chat data ({s['shape']}, train_on={s['train_on']}): {s['rows']} rows read ({s['val_documents']} for "
                f"validation), {s['truncated']} truncated to max_length={self.max_length}, {s['dropped']} dropped "
                f"(nothing to train); {layout} of {self.max_length} tokens, {s['fill']:.1%} of positions real, "
                f"{s['trained_fraction']:.1%} trained; cache {'reused' if self.reused else 'written'}: "
                f"{self.cache}")  # fmt: skip


def check_args(args: Mapping[str, Any]) -> list[str]:
    """The mistakes in the values of ``data.args`` of ``chat``, found when the recipe is loaded."""
    problems = []
    if args.get("train_on", "auto") not in TRAIN_ON:
        problems.append(f"data.args.train_on: expected one of {', '.join(TRAIN_ON)}, got {args['train_on']!r}")
    n = args.get("max_length", 2048)
    if isinstance(n, int) and n < 2:
        problems.append(f"data.args.max_length: must be >= 2, got {n}")
    frac = args.get("val_frac", 0.05)
    if isinstance(frac, (int, float)) and not 0.0 <= frac < 1.0:
        problems.append(f"data.args.val_frac: must be in [0, 1), got {frac}")
    for key in ("template", "val", "tokenizer"):
        path = args.get(key)
        if isinstance(path, str) and path and not os.path.exists(path):
            problems.append(f"data.args.{key}={path!r}: no such file or folder")
    return problems


def load_chat(root: str, tokenizer: str = "", max_length: int = 2048, packing: bool = True, train_on: str = "auto",
              template: str = "", val: str = "", val_frac: float = 0.05, eval_answers: int = 0,
              cache_dir: str = "", pretrained: str = "") -> ChatSet:  # fmt: skip
    """The chat rows at ``root`` (a ``.jsonl``/``.parquet`` file, a folder of them, or a dataset
    folder from ``save_to_disk``), tokenized with the tokenizer in the folder ``tokenizer`` (default
    ``pretrained``: the model's folder) and its chat template (or the Jinja file ``template``),
    cut to ``max_length`` tokens (the start kept), packed into rows of ``max_length`` (``packing``)
    or one per row. ``train_on``: ``auto`` (the assistant's turns of messages, the completion of
    prompt/completion rows, all of text), ``assistant``, ``completion`` (the last assistant turn,
    or the completion), ``all``. Validation: the rows of ``val`` (a file or folder like ``root``),
    else a ``val_frac`` share of ``root``'s rows chosen by a hash of their index. ``eval_answers``:
    how many validation conversations keep their prompt for the answer check. The result is cached
    in ``cache_dir`` (default: a ``.distlib-cache`` folder beside ``root``), keyed by the data's
    files, the tokenizer's files, the template and these settings; a run whose key is cached reads it."""
    folder = tokenizer or pretrained
    if not folder:
        raise DataError("data.args.tokenizer: needed (a tokenizer folder) when model.args.pretrained gives none")
    if train_on not in TRAIN_ON:
        raise DataError(f"data.args.train_on={train_on!r}: expected one of {', '.join(TRAIN_ON)}")
    files = files_of(root)
    val_files = files_of(val, "data.args.val") if val else []
    tok = load_tokenizer(folder, template)
    settings = {"format": CACHE_FORMAT, "max_length": max_length, "packing": packing, "train_on": train_on,
                "val_frac": 0.0 if val else val_frac, "eval_answers": eval_answers,
                "data": [_identity(p) for p in files], "val": [_identity(p) for p in val_files],
                "tokenizer": _folder_hash(folder), "template": template_text(tok)}  # fmt: skip
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    path = os.path.join(_cache_root(root, cache_dir), f"{os.path.basename(os.path.normpath(root))}-{key}")
    reused = os.path.isfile(os.path.join(path, "meta.json"))
    if not reused:
        _build(path, tok, files, val_files, max_length, packing, train_on, val_frac, eval_answers)
    return _read(path, tok, folder, template, reused)


def _identity(path: str) -> list:
    """What changes when a data file changes (without reading it): path, size, modification time."""
    paths = [path] if os.path.isfile(path) else sorted(
        os.path.join(d, n) for d, _, names in os.walk(path) for n in names)  # fmt: skip
    return [[os.path.abspath(p), os.path.getsize(p), os.stat(p).st_mtime_ns] for p in paths]


def _folder_hash(folder: str) -> str:
    """A hash of the tokenizer's files (names and bytes)."""
    h = hashlib.sha256()
    for name in sorted(os.listdir(folder)):
        p = os.path.join(folder, name)
        if os.path.isfile(p) and not name.endswith((".safetensors", ".bin", ".pt", ".pth")):  # not the weights
            h.update(name.encode())
            with open(p, "rb") as f:
                h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()


def _cache_root(root: str, cache_dir: str) -> str:
    if cache_dir:
        return os.path.join(cache_dir, "chat")
    beside = os.path.join(os.path.dirname(os.path.abspath(os.path.normpath(root))), ".distlib-cache")
    try:
        os.makedirs(beside, exist_ok=True)
        if os.access(beside, os.W_OK):
            return beside
    except OSError:
        pass
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "distlib", "chat")


def in_validation(index: int, frac: float) -> bool:
    """Whether row ``index`` goes to validation: a fixed hash of the index (splitmix64) below
    ``frac``, so the split needs no pass over the rows first and never changes with the seed."""
    z = (index + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return ((z ^ (z >> 31)) >> 11) / float(1 << 53) < frac


def _build(path: str, tok: Any, files: list[str], val_files: list[str], max_length: int, packing: bool,
           train_on: str, val_frac: float, eval_answers: int) -> None:  # fmt: skip
    """Tokenize every row, pack, and write the cache folder atomically (a temporary folder renamed)."""
    stats = {"rows": 0, "truncated": 0, "dropped": 0, "val_documents": 0}
    splits: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {"train": [], "val": []}
    answers: list[tuple[list[int], str]] = []
    encoder = None
    sources = [("train", f) for f in files] + [("val", f) for f in val_files]
    index = 0
    for split_of_file, f in sources:
        for where, row in read_rows([f]):
            if encoder is None:
                encoder = ChatEncoder(tok, shape_of(row, where), train_on, max_length)
            row = check_row(row, encoder.shape, where)
            split = split_of_file if val_files or split_of_file == "val" else \
                ("val" if val_frac and in_validation(index, val_frac) else "train")  # fmt: skip
            index += 1
            stats["rows"] += 1
            enc = encoder.encode(row, where)
            stats["truncated"] += enc.truncated
            labels = labels_of(enc.ids, enc.trained)
            if not (labels != IGNORED).any():
                stats["dropped"] += 1
                continue
            splits[split].append((enc.ids, labels))
            if split == "val" and len(answers) < eval_answers and (pa := encoder.prompt_ids(row)) is not None:
                if len(pa[0]) < max_length:
                    answers.append(pa)
    if encoder is None:
        raise DataError(f"data.root: {', '.join(files)}: no rows")
    if not splits["train"]:
        raise DataError(f"data.root: none of the {stats['rows']} rows has anything to train in the training "
                        f"split (train_on={encoder.train_on})")  # fmt: skip
    pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    rows = {s: build_rows(docs, max_length, packing, pad_id=pad) for s, docs in splits.items() if docs}
    real, size = sum(len(d[0]) for d in splits["train"]), rows["train"]["input_ids"].size
    trained = sum(int((d[1] != IGNORED).sum()) for d in splits["train"])
    stats.update(shape=encoder.shape, train_on=encoder.train_on, documents=len(splits["train"]),
                 val_documents=len(splits["val"]), train_rows=len(rows["train"]["input_ids"]),
                 fill=real / size, trained_fraction=trained / size,
                 stop_ids=sorted(encoder.special))  # fmt: skip
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    _remove_abandoned(path)
    tmp = f"{path}.tmp-{socket.gethostname()}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    for split, arrays in rows.items():
        for name in ARRAYS:
            np.save(os.path.join(tmp, f"{split}_{name}.npy"), arrays[name])
    with open(os.path.join(tmp, "meta.json"), "w") as f:
        json.dump({"stats": stats, "answers": answers, "max_length": max_length, "packing": packing}, f)
    try:
        os.rename(tmp, path)  # atomic: a reader sees the whole folder or none
    except OSError:  # another process wrote the same key first: its folder is the same
        shutil.rmtree(tmp, ignore_errors=True)
        if not os.path.isfile(os.path.join(path, "meta.json")):
            raise


def _remove_abandoned(path: str) -> None:
    """Remove the temporary folders that writers of ``path`` on this host left when they were killed
    (kill -9 while tokenizing): their process is gone. A live writer's folder, or another host's on a
    shared file system, is left alone."""
    parent, prefix = os.path.dirname(path), f"{os.path.basename(path)}.tmp-{socket.gethostname()}-"
    for name in os.listdir(parent):
        if not name.startswith(prefix) or not name[len(prefix) :].isdigit():
            continue
        try:
            os.kill(int(name[len(prefix) :]), 0)  # signal 0: does the process exist?
        except ProcessLookupError:
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
        except PermissionError:  # it exists, as another user's
            pass


def _read(path: str, tok: Any, folder: str, template: str, reused: bool) -> ChatSet:
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)

    def split(name: str) -> dict[str, np.ndarray] | None:
        if not os.path.isfile(os.path.join(path, f"{name}_input_ids.npy")):
            return None
        return {a: np.load(os.path.join(path, f"{name}_{a}.npy"), mmap_mode="r") for a in ARRAYS}

    return ChatSet(split("train"), split("val"), meta["max_length"], len(tok), meta["packing"], folder, template,
                   [(list(p), a) for p, a in meta["answers"]], meta["stats"], path, reused)  # fmt: skip


class ChatLoader:
    """This rank's batches of the rows: each epoch, an order of the rows drawn from ``seed + epoch``
    (the same on every rank) cut into global batches of ``batch_size * world_size`` rows, of which
    each rank takes its slice; the rows left over by the last full global batch wait for another
    epoch's order. Every rank has the same steps, each of one shape (batch_size, max_length); the
    global batch of a step is the same at any world size. ``iter_from(step)`` starts a pass at a
    step without reading the steps before it: a resume continues the order exactly."""

    def __init__(self, rows: Mapping[str, np.ndarray], *, batch_size: int, rank: int = 0, world_size: int = 1,
                 seed: int = 0, device: torch.device | str = "cpu", max_rows: int = 0):  # fmt: skip
        self.rows, self.batch_size, self.rank, self.world_size = rows, batch_size, rank, world_size
        self.seed, self.epoch, self.device = seed, 0, torch.device(device)
        self.n = len(rows["input_ids"]) if not max_rows else min(max_rows, len(rows["input_ids"]))
        self.steps_per_epoch = self.n // (batch_size * world_size)
        if self.steps_per_epoch == 0:
            raise ValueError(f"{self.n} rows cannot fill one global batch of {batch_size} x {world_size} ranks")
        self.trained = None  # per row: its trained tokens (counted when first asked)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        self.epoch = int(state["epoch"])

    def __len__(self) -> int:
        return self.steps_per_epoch

    def order(self, epoch: int) -> np.ndarray:
        """(steps, world_size, batch_size): the rows of every batch of ``epoch``, by step and rank."""
        g = torch.Generator().manual_seed(self.seed + epoch)
        perm = torch.randperm(self.n, generator=g).numpy()
        s, w, b = self.steps_per_epoch, self.world_size, self.batch_size
        return perm[: s * w * b].reshape(s, w, b)

    def __iter__(self) -> Iterator[Batch]:
        return self.iter_from(0)

    def iter_from(self, step: int) -> Iterator[Batch]:
        """This epoch's batches from ``step`` on (the pass counts as the epoch's)."""
        order = self.order(self.epoch)[:, self.rank]
        self.epoch += 1
        for s in range(step, len(order)):
            yield batch_of(self.rows, np.sort(order[s]), self.device)

    def trained_tokens(self, samples: int) -> int:
        """The trained tokens (targets not IGNORED) in the first ``samples`` rows of the run's
        global order (``samples`` = steps x global batch), over every epoch so far."""
        if self.trained is None:
            self.trained = (np.asarray(self.rows["labels"][: self.n]) != IGNORED).sum(1)
        per_epoch = self.steps_per_epoch * self.batch_size * self.world_size
        total, epoch = 0, 0
        while samples > 0:
            take = min(samples, per_epoch)
            flat = self.order(epoch).reshape(-1)[:take]
            total += int(self.trained[flat].sum())
            samples -= take
            epoch += 1
        return total


def batch_of(rows: Mapping[str, np.ndarray], index: np.ndarray, device: torch.device) -> Batch:
    """The rows ``index`` as a batch; pinned for a copy to a GPU. Index sorted: memory-map reads in order."""
    pin = device.type == "cuda"

    def take(name: str) -> torch.Tensor:
        t = torch.from_numpy(np.asarray(rows[name][index], dtype=np.int64))
        return t.pin_memory() if pin else t

    return {"input_ids": take("input_ids"), "position_ids": take("position_ids")}, take("labels")


def eval_batches(rows: Mapping[str, np.ndarray] | None, rank: int, world_size: int, batch_size: int,
                 device: torch.device, ends_only: bool = False) -> Iterator[Batch]:  # fmt: skip
    """This rank's share (rows rank, rank + W, ...) of the validation rows, each row once over all
    ranks, in batches of ``batch_size`` rows: every rank yields as many batches as the largest share
    needs, each of the same shape (a short batch is filled with rows whose targets are all
    ``IGNORED``). ``ends_only``: the first batch and the last (a warm-up)."""
    if rows is None:
        return
    n, length = len(rows["input_ids"]), rows["input_ids"].shape[1]
    largest = math.ceil(math.ceil(n / world_size) / batch_size)
    idx = np.arange(rank, n, world_size)
    chosen = list(range(largest))
    if ends_only:
        chosen = chosen[:1] + chosen[1:][-1:]
    for k in chosen:
        index = idx[k * batch_size : (k + 1) * batch_size]
        x, y = batch_of(rows, index, device)
        short = batch_size - len(index)
        if short:  # filler rows: token 0 at positions 0..T-1, nothing trained
            filler = {"input_ids": torch.zeros(short, length, dtype=torch.int64),
                      "position_ids": torch.arange(length).expand(short, length)}  # fmt: skip
            x = {name: torch.cat([v, filler[name]]) for name, v in x.items()}
            y = torch.cat([y, torch.full((short, length), IGNORED, dtype=torch.int64)])
        yield x, y


load_chat.check_args = check_args  # components.check calls it when the recipe is loaded

__all__ = ["ChatLoader", "ChatSet", "batch_of", "eval_batches", "in_validation", "load_chat"]
