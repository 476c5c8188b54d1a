"""Text files to token shards in llm.c's format, with a local tokenizer:

    python -m distlib.runner.tokenize INPUT... OUT_DIR --tokenizer PATH [--shard-tokens N] [--val-frac F]

``INPUT``: text files (``.txt`` or any other name, ``.gz`` unpacked), each one document, or
``.jsonl`` files (``.jsonl.gz``), one document a line in its ``"text"`` field. ``--tokenizer``: a
``tokenizer.json`` (read by the ``tokenizers`` package) or a Hugging Face tokenizer folder (its
``tokenizer.json``, else transformers' ``AutoTokenizer`` when installed). Every document is
preceded by one delimiter token, as llm.c's ``fineweb.py`` does (``<|endoftext|>`` for GPT-2,
``<|begin_of_text|>`` for Llama 3): the tokenizer's BOS token when it has one, else its EOS token,
or ``--doc-token``. ``--max-tokens N`` keeps the first N tokens only.

Files are tokenized in parallel (one process per core, ``--workers``) and written in the order
given: ``OUT_DIR/train_000000.bin``, ... of ``--shard-tokens`` tokens each (uint16 when the
vocabulary fits, else uint32), and with ``--val-frac F`` the last fraction F of the tokens as
``OUT_DIR/val_000000.bin``, .... ``data: {name: token_file, root: OUT_DIR}`` trains on them
(docs/token_files.md).
"""

from __future__ import annotations

import argparse
import gzip
import json
import multiprocessing as mp
import os
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np

from distlib.runner.data.token_files import DTYPES, HEADER_BYTES, llm_c_header

# special tokens that delimit documents, by preference: a BOS kind first (llm.c's Llama 3 data), then an EOS kind
DOC_TOKENS = ("<|begin_of_text|>", "<|endoftext|>", "<s>", "<bos>", "<|bos|>", "</s>", "<eos>", "<|eos|>")


class TokenizeError(Exception):
    """A bad argument or input of the command: one ``error:`` line, exit 2."""


class TextTokenizer:
    """A local tokenizer: ``encode(texts)``, its vocabulary size and its document delimiter."""

    def __init__(self, path: str, doc_token: str | None = None):
        self.path = path
        self._fast: Any = None
        self._auto: Any = None
        config: dict[str, Any] = {}
        folder = path if os.path.isdir(path) else os.path.dirname(path)
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if os.path.isfile(os.path.join(folder, "tokenizer_config.json")):
            with open(os.path.join(folder, "tokenizer_config.json")) as f:
                config = json.load(f)
        if os.path.isfile(file):
            try:
                from tokenizers import Tokenizer
            except ImportError as e:
                raise TokenizeError("reading a tokenizer.json needs the tokenizers package: "
                                    "pip install 'distlib[hf]' (or tokenizers)") from e  # fmt: skip
            try:
                self._fast = Tokenizer.from_file(file)
            except Exception as e:  # the Rust side's errors are plain Exceptions
                raise TokenizeError(
                    f"--tokenizer {file}: not a tokenizer.json the tokenizers package reads: {e}"
                ) from e
            self.vocab_size = self._fast.get_vocab_size(with_added_tokens=True)
            vocab = self._fast.get_vocab(with_added_tokens=True)
        elif os.path.isdir(path):
            try:
                from transformers import AutoTokenizer
            except ImportError as e:
                raise TokenizeError(f"--tokenizer {path}: a folder without tokenizer.json needs transformers' "
                                    "AutoTokenizer: pip install transformers") from e  # fmt: skip
            self._auto = AutoTokenizer.from_pretrained(path, local_files_only=True)
            self.vocab_size = len(self._auto)
            vocab = self._auto.get_vocab()
        else:
            raise TokenizeError(f"--tokenizer {path}: no such file or folder (a tokenizer.json or a folder with one)")
        self.doc_token_id = self._doc_token(doc_token, config, vocab)

    def _doc_token(self, name: str | None, config: dict[str, Any], vocab: dict[str, int]) -> int | None:
        def content(v: Any) -> str | None:  # tokenizer_config.json writes a token as a string or {content: ...}
            return v.get("content") if isinstance(v, dict) else v

        if name == "none":
            return None
        if name is None:
            candidates = [content(config.get("bos_token")), content(config.get("eos_token")), *DOC_TOKENS]
            if self._auto is not None:
                candidates[:0] = [self._auto.bos_token, self._auto.eos_token]
            name = next((c for c in candidates if c and c in vocab), None)
            if name is None:
                raise TokenizeError(f"--tokenizer {self.path}: no BOS or EOS token found to put between documents; "
                                    "name one with --doc-token TOKEN (or --doc-token none)")  # fmt: skip
        if name not in vocab:
            raise TokenizeError(f"--doc-token {name!r}: not a token of {self.path}")
        return vocab[name]

    @property
    def dtype(self) -> str:
        return "uint16" if self.vocab_size <= 1 << 16 else "uint32"

    def encode(self, texts: list[str]) -> list[list[int]]:
        if self._fast is not None:
            return [e.ids for e in self._fast.encode_batch(texts, add_special_tokens=False)]
        return self._auto(texts, add_special_tokens=False)["input_ids"]

    def tokens(self, docs: list[str]) -> np.ndarray:
        """The documents' tokens end to end, each preceded by the delimiter."""
        ids = self.encode(docs)
        head = [] if self.doc_token_id is None else [self.doc_token_id]
        flat = [t for doc in ids for t in (*head, *doc)]
        return np.asarray(flat, dtype=DTYPES[self.dtype])


def read_documents(path: str) -> list[str]:
    """The documents of one input file: the whole text, or a .jsonl file's "text" fields."""
    opener: Any = gzip.open if path.endswith(".gz") else open
    name = path[:-3] if path.endswith(".gz") else path
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            if not name.endswith(".jsonl"):
                return [f.read()]
            docs = []
            for i, line in enumerate(f, start=1):
                if line.strip():
                    row = json.loads(line)
                    if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                        raise TokenizeError(f'{path}:{i}: expected a JSON object with a string field "text"')
                    docs.append(row["text"])
            return docs
    except FileNotFoundError as e:
        raise TokenizeError(f"{path}: no such input file") from e
    except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizeError(f"{path}: could not read it as UTF-8 text: {e}") from e


_worker_tokenizer: TextTokenizer | None = None


def _init_worker(path: str, doc_token: str | None) -> None:
    global _worker_tokenizer
    _worker_tokenizer = TextTokenizer(path, doc_token)


def _tokenize_file(path: str) -> tuple[np.ndarray | None, str]:
    try:
        return _worker_tokenizer.tokens(read_documents(path)), ""
    except TokenizeError as e:  # reported by the parent, which stops the others
        return None, str(e)


class ShardWriter:
    """Tokens written into ``<prefix>_000000.bin``, ... of ``shard_tokens`` each, with llm.c's header."""

    def __init__(self, out_dir: str, prefix: str, shard_tokens: int, dtype: str):
        self.out_dir, self.prefix, self.shard_tokens, self.dtype = out_dir, prefix, shard_tokens, dtype
        self.paths: list[str] = []
        self.counts: list[int] = []
        self._file: Any = None

    def write(self, tokens: np.ndarray) -> None:
        k = 0
        while k < len(tokens):
            if self._file is None or self.counts[-1] == self.shard_tokens:
                self._open()
            n = min(len(tokens) - k, self.shard_tokens - self.counts[-1])
            self._file.write(tokens[k : k + n].astype(DTYPES[self.dtype]).tobytes())
            self.counts[-1] += n
            k += n

    def _open(self) -> None:
        self._close_file()
        path = os.path.join(self.out_dir, f"{self.prefix}_{len(self.paths):06d}.bin")
        self._file = open(path, "wb")
        self._file.write(llm_c_header(0, self.dtype).tobytes())  # the count is set when the shard is full
        self.paths.append(path)
        self.counts.append(0)

    def _close_file(self) -> None:
        if self._file is not None:
            self._file.seek(0)
            self._file.write(llm_c_header(self.counts[-1], self.dtype).tobytes())
            self._file.close()
            self._file = None

    def close(self) -> None:
        self._close_file()


def _move_tail(train: ShardWriter, val: ShardWriter, n_val: int) -> None:
    """The last ``n_val`` tokens of the train shards into the val shards (in order), the train
    shards cut short (an emptied one deleted)."""
    itemsize = DTYPES[train.dtype].itemsize
    left, first = n_val, len(train.counts)
    while left > 0:  # the shards the tail spans
        first -= 1
        left -= min(left, train.counts[first])
    take = [0] * len(train.counts)
    left = n_val
    for i in range(len(train.counts) - 1, first - 1, -1):
        take[i] = min(left, train.counts[i])
        left -= take[i]
    for i in range(first, len(train.counts)):
        mm = np.memmap(train.paths[i], dtype=DTYPES[train.dtype], mode="r", offset=HEADER_BYTES,
                       shape=(train.counts[i],))  # fmt: skip
        val.write(np.asarray(mm[train.counts[i] - take[i] :]))
        del mm
    val.close()
    for i in range(len(train.counts) - 1, first - 1, -1):
        keep = train.counts[i] - take[i]
        if keep == 0:
            os.unlink(train.paths[i])
            del train.paths[i], train.counts[i]
            continue
        with open(train.paths[i], "r+b") as f:
            f.write(llm_c_header(keep, train.dtype).tobytes())
            f.truncate(HEADER_BYTES + keep * itemsize)
        train.counts[i] = keep


def tokenize(inputs: list[str], out_dir: str, tokenizer: str, *, shard_tokens: int = 100_000_000,
             val_frac: float = 0.0, doc_token: str | None = None, workers: int = 0, max_tokens: int = 0,
             progress: bool = True) -> dict[str, Any]:  # fmt: skip
    """Tokenize ``inputs`` into shards in ``out_dir`` (see the module's docstring); returns what it
    wrote: ``{"train": [paths], "val": [paths], "tokens": {"train": n, "val": n}, "dtype": ...}``."""
    if shard_tokens <= 0 or shard_tokens >= 1 << 31:
        raise TokenizeError(f"--shard-tokens {shard_tokens}: must be in [1, 2**31) (llm.c's int32 count)")
    if max_tokens < 0:
        raise TokenizeError(f"--max-tokens {max_tokens}: must be >= 0 (0: all)")
    if not 0.0 <= val_frac < 1.0:
        raise TokenizeError(f"--val-frac {val_frac}: must be in [0, 1)")
    missing = [p for p in inputs if not os.path.isfile(p)]
    if missing:
        raise TokenizeError(f"no such input file: {', '.join(missing)}")
    tok = TextTokenizer(tokenizer, doc_token)  # its errors here, before any worker starts
    os.makedirs(out_dir, exist_ok=True)
    stale = [n for n in os.listdir(out_dir) if n.endswith(".bin") and n.startswith(("train_", "val_"))]
    if stale:
        raise TokenizeError(f"{out_dir} already holds token shards ({sorted(stale)[0]}, ...): "
                            "use an empty folder, or delete them")  # fmt: skip
    train = ShardWriter(out_dir, "train", shard_tokens, tok.dtype)
    workers = workers or min(len(inputs), os.cpu_count() or 1)
    sizes = [os.path.getsize(p) for p in inputs]
    with _progress(progress, sum(sizes)) as advance:
        try:
            for (tokens, error), size in zip(_map(inputs, tokenizer, doc_token, workers), sizes):
                if error:
                    raise TokenizeError(error)
                if max_tokens and sum(train.counts) + len(tokens) >= max_tokens:
                    train.write(tokens[: max_tokens - sum(train.counts)])
                    advance(size)
                    break  # the later inputs are not read
                train.write(tokens)
                advance(size)
        finally:
            train.close()
    total = sum(train.counts)
    if total == 0:
        for p in train.paths:
            os.unlink(p)
        raise TokenizeError("the inputs hold no tokens")
    val = ShardWriter(out_dir, "val", shard_tokens, tok.dtype)
    n_val = int(total * val_frac)
    if n_val:
        _move_tail(train, val, n_val)
    return {"train": train.paths, "val": val.paths, "tokens": {"train": sum(train.counts), "val": sum(val.counts)},
            "dtype": tok.dtype, "vocab_size": tok.vocab_size, "doc_token_id": tok.doc_token_id}  # fmt: skip


def _map(inputs: list[str], tokenizer: str, doc_token: str | None, workers: int) -> Iterator[tuple]:
    """Each input's tokens, in the order given; over ``workers`` processes when more than one."""
    if workers <= 1:
        _init_worker(tokenizer, doc_token)
        yield from map(_tokenize_file, inputs)
        return
    # spawn: a fresh interpreter per worker (the Rust tokenizer's threads do not survive a fork)
    with mp.get_context("spawn").Pool(workers, initializer=_init_worker, initargs=(tokenizer, doc_token)) as pool:
        yield from pool.imap(_tokenize_file, inputs)


class _progress:
    """A rich progress bar over the input bytes (nothing when ``enabled`` is False)."""

    def __init__(self, enabled: bool, total: int):
        self.enabled, self.total = enabled, total

    def __enter__(self):
        if not self.enabled:
            return lambda n: None
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

        self.bar = Progress(TextColumn("tokenizing"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                            transient=False)  # fmt: skip
        self.bar.start()
        task = self.bar.add_task("tokenize", total=self.total)
        return lambda n: self.bar.advance(task, n)

    def __exit__(self, *exc: Any) -> None:
        if self.enabled:
            self.bar.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m distlib.runner.tokenize", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("paths", nargs="+", metavar="INPUT... OUT_DIR", help="text or .jsonl files, then the output folder")
    p.add_argument("--tokenizer", required=True, help="a tokenizer.json, or a Hugging Face tokenizer folder")
    p.add_argument("--shard-tokens", type=int, default=100_000_000, help="tokens per shard (default 100M, as llm.c)")
    p.add_argument("--val-frac", type=float, default=0.0, help="the last fraction of the tokens as val_*.bin")
    p.add_argument("--doc-token", default=None, help="the token before each document (default: BOS, else EOS; none)")
    p.add_argument("--max-tokens", type=int, default=0, help="stop after this many tokens (default 0: all)")
    p.add_argument("--workers", type=int, default=0, help="processes (default: one per core, at most one per file)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    if len(args.paths) < 2:
        p.error("give at least one INPUT and the OUT_DIR")
    *inputs, out_dir = args.paths
    try:
        done = tokenize(inputs, out_dir, args.tokenizer, shard_tokens=args.shard_tokens, val_frac=args.val_frac,
                        doc_token=args.doc_token, workers=args.workers, max_tokens=args.max_tokens,
                        progress=not args.no_progress)  # fmt: skip
    except TokenizeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for split in ("train", "val"):
        if done[split]:
            print(f"{split}: {done['tokens'][split]:,} tokens in {len(done[split])} file(s) "
                  f"({os.path.basename(done[split][0])}, ...), {done['dtype']}")  # fmt: skip
    print(f"vocabulary {done['vocab_size']:,}; document delimiter token id {done['doc_token_id']}")
    return 0
