"""Pre-tokenized language-model data: ``.bin`` token files, memory-mapped, never read whole.

A file is llm.c's shard format (``dev/data/data_common.py``: ``write_datafile``) or nanoGPT's
headerless one:

- llm.c: a header of 256 little-endian int32 (``header[0]`` the magic, 20240520 for uint16 tokens
  or 20240801 for uint32; ``header[1]`` the version, 1 or 7; ``header[2]`` the token count), then
  the tokens;
- headerless: nothing but the tokens, of ``data.args.dtype`` (``uint16`` or ``uint32``).

``data.root`` names one file, a folder, or a glob of shards; the shards, in name order, are one
token stream (a window may cross from one shard into the next, as a document does in llm.c's
shards). ``python -m distlib.runner.tokenize`` writes such shards. Design: docs/token_files.md.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass

import numpy as np

from distlib.runner.data.errors import DataError

HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
# llm.c's magics: the token dtype, and the version its writer puts next to the magic
MAGICS = {20240520: (np.dtype("<u2"), 1), 20240801: (np.dtype("<u4"), 7)}
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
VOCAB_CHECK_TOKENS = 1 << 16  # of each shard, checked against the vocabulary at the start (every batch later)


@dataclass(frozen=True)
class Shard:
    """One token file: where its tokens start (bytes), how many, of which dtype."""

    path: str
    offset: int
    count: int
    dtype: np.dtype
    header: bool

    def tokens(self) -> np.memmap:
        return np.memmap(self.path, dtype=self.dtype, mode="r", offset=self.offset, shape=(self.count,))


def read_shard(path: str, dtype: str = "auto") -> Shard:
    """The layout of the token file ``path``: llm.c's header when it has one, else headerless
    tokens of ``dtype``. Raises DataError naming the file for a missing or unreadable file, an
    unknown magic or version, a truncated file, or a token count that does not match its size."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(HEADER_BYTES)
    except FileNotFoundError as e:
        raise DataError(f"no token file at {path!r}") from e
    except OSError as e:
        raise DataError(f"{path}: could not read the token file: {e}") from e
    magic = int(np.frombuffer(head[:4], dtype="<i4")[0]) if len(head) >= 4 else None
    if magic in MAGICS:
        tok, version = MAGICS[magic]
        if dtype != "auto" and DTYPES[dtype] != tok:
            raise DataError(f"{path}: llm.c's header says {tok.name} tokens (magic {magic}), data.args.dtype is "
                            f"{dtype}; leave data.args.dtype unset (auto) for files with a header")  # fmt: skip
        if len(head) < HEADER_BYTES:
            raise DataError(f"{path}: truncated: {size} bytes, less than llm.c's header of {HEADER_BYTES}")
        header = np.frombuffer(head, dtype="<i4")
        if int(header[1]) != version:
            raise DataError(f"{path}: llm.c header version {int(header[1])} with magic {magic}, expected {version}")
        count = int(header[2])
        have = (size - HEADER_BYTES) // tok.itemsize
        if count < 0 or (size - HEADER_BYTES) % tok.itemsize:
            raise DataError(f"{path}: truncated or corrupt: {size - HEADER_BYTES} bytes after the header are not "
                            f"whole {tok.name} tokens (the header says {count})")  # fmt: skip
        if have < count:
            raise DataError(f"{path}: truncated: the header says {count} tokens, the file holds {have}")
        if have > count:
            raise DataError(f"{path}: token count mismatch: the header says {count} tokens, the file holds {have}")
        return Shard(path, HEADER_BYTES, count, tok, header=True)
    if dtype == "auto":
        shown = "none (the file is empty)" if magic is None else str(magic)
        raise DataError(
            f"{path}: no llm.c header (magic {shown}, expected {' or '.join(map(str, MAGICS))}); for a headerless "
            "token file (nanoGPT's .bin) set data.args.dtype to uint16 or uint32"
        )
    tok = DTYPES[dtype]
    if size % tok.itemsize:
        raise DataError(f"{path}: truncated: {size} bytes are not whole {dtype} tokens")
    return Shard(path, 0, size // tok.itemsize, tok, header=False)


def find_shards(root: str, what: str = "data.root") -> list[str]:
    """The token files ``root`` names, in name order: the file itself, a folder's ``*.bin`` files
    (its ``train*.bin`` ones when it has any), or the files a glob matches."""
    if os.path.isdir(root):
        train = sorted(glob.glob(os.path.join(glob.escape(root), "train*.bin")))
        paths = train or sorted(glob.glob(os.path.join(glob.escape(root), "*.bin")))
        if not paths:
            raise DataError(f"{what}={root!r}: a folder without .bin token files")
        return paths
    if glob.has_magic(root):
        paths = sorted(p for p in glob.glob(root) if os.path.isfile(p))
        if not paths:
            raise DataError(f"{what}={root!r}: the pattern matches no file")
        return paths
    if not os.path.exists(root):
        raise DataError(f"no token file at {what}={root!r}: point it at a .bin file, a folder or a glob of shards")
    return [root]


class TokenStream:
    """The tokens ``[lo, hi)`` of the shards, end to end, as one stream, memory-mapped: only what a
    batch reads is read. ``gather`` cuts windows from it; ``split`` makes sub-streams."""

    def __init__(self, shards: list[Shard], lo: int = 0, hi: int | None = None):
        self.shards = shards
        self.bounds = np.cumsum([0] + [s.count for s in shards])  # each shard's first global position
        self.lo, self.hi = lo, int(self.bounds[-1]) if hi is None else hi
        self._maps = [s.tokens() if s.count else None for s in shards]

    def __len__(self) -> int:
        return self.hi - self.lo

    def split(self, at: int) -> tuple[TokenStream, TokenStream]:
        """The first ``at`` tokens and the rest."""
        return TokenStream(self.shards, self.lo, self.lo + at), TokenStream(self.shards, self.lo + at, self.hi)

    def locate(self, pos: int) -> tuple[Shard, int]:
        """The shard that holds position ``pos`` of this stream, and the index in it."""
        g = self.lo + pos
        i = int(np.searchsorted(self.bounds, g, side="right")) - 1
        return self.shards[i], g - int(self.bounds[i])

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens ``[start, start + length)`` of this stream (a copy, int64)."""
        g, end = self.lo + start, self.lo + start + length
        if start < 0 or end > self.hi:
            raise IndexError(f"tokens [{start}, {start + length}) outside a stream of {len(self)}")
        out = np.empty(length, dtype=np.int64)
        i = int(np.searchsorted(self.bounds, g, side="right")) - 1
        k = 0
        while k < length:  # most windows lie in one shard; one that crosses into the next takes two pieces
            first, last = int(self.bounds[i]), int(self.bounds[i + 1])
            n = min(end, last) - g
            if n > 0:
                out[k : k + n] = self._maps[i][g - first : g - first + n]
                k, g = k + n, g + n
            i += 1
        return out

    def gather(self, starts: np.ndarray, length: int) -> np.ndarray:
        """One (len(starts), length) int64 array: the windows that begin at ``starts``."""
        out = np.empty((len(starts), length), dtype=np.int64)
        for row, s in enumerate(starts.tolist()):
            out[row] = self.read(s, length)
        return out

    def check_vocab(self, windows: np.ndarray, starts: np.ndarray, vocab_size: int | None) -> None:
        """A DataError naming the file when a token of ``windows`` (cut at ``starts``) is not below
        ``vocab_size``; it gives that file's largest token id."""
        if vocab_size is None or windows.size == 0 or int(windows.max()) < vocab_size:
            return
        row, col = np.argwhere(windows >= vocab_size)[0]
        shard, index = self.locate(int(starts[row]) + int(col))
        raise vocab_error(shard, index, int(windows[row, col]), vocab_size)

    def check_vocab_start(self, vocab_size: int | None) -> None:
        """The first tokens of every shard in this stream against ``vocab_size`` (the rest is checked
        batch by batch as it is read): a wrong vocabulary fails at the start, not hours in."""
        if vocab_size is None:
            return
        for i, (shard, mm) in enumerate(zip(self.shards, self._maps)):
            first, last = max(self.lo, int(self.bounds[i])), min(self.hi, int(self.bounds[i + 1]))
            if mm is None or first >= last:
                continue
            a = first - int(self.bounds[i])
            chunk = mm[a : a + min(last - first, VOCAB_CHECK_TOKENS)]
            if int(chunk.max()) >= vocab_size:
                index = a + int(np.argmax(chunk >= vocab_size))
                raise vocab_error(shard, index, int(chunk[index - a]), vocab_size)

    @property
    def source(self) -> str:
        names = sorted({os.path.basename(s.path) for s in self.shards})
        return names[0] if len(names) == 1 else f"{len(names)} shards ({names[0]}, ...)"


def vocab_error(shard: Shard, index: int, token: int, vocab_size: int) -> DataError:
    top = int(shard.tokens().max())  # once, on the way out: the figure the fix needs
    return DataError(
        f"{shard.path}: token id {token} (token {index} of the file) is not below the model's vocabulary size "
        f"{vocab_size}; the file's largest token id is {top}: set the vocabulary size (model.args.vocab_size) to "
        f"at least {top + 1}, or tokenize with the model's tokenizer"
    )


def open_stream(root: str, dtype: str = "auto", what: str = "data.root") -> TokenStream:
    """The token files ``root`` names (``find_shards``) as one stream; every file is checked."""
    if dtype not in ("auto", *DTYPES):
        raise DataError(f"data.args.dtype={dtype!r}: expected auto (llm.c's header), uint16 or uint32")
    return TokenStream([read_shard(p, dtype) for p in find_shards(root, what)])


@dataclass
class TokenFileSet:
    """Both splits of a token file data set, as streams (``val`` None: no validation), and the
    window length. ``vocab_size`` is the model's business: the recipe gives it."""

    train: TokenStream
    val: TokenStream | None
    block_size: int
    vocab_size: int | None = None
    source: str = ""


def load_token_file(
    root: str,
    block_size: int = 256,
    dtype: str = "auto",
    val: str = "",
    val_frac: float | None = None,
) -> TokenFileSet:
    """The token files at ``root`` (a file, a folder, a glob) for training; validation is ``val``
    (files as ``root``), else a folder's ``val*.bin`` files, else the last ``val_frac`` (default
    0.05) of the tokens; ``val_frac=0`` without ``val``: no validation. ``dtype``: ``auto`` (llm.c's
    header) or the tokens of headerless files. ``block_size``: tokens a sample holds."""
    if block_size <= 0:
        raise DataError(f"token_file: data.args.block_size must be > 0, got {block_size}")
    if val_frac is not None and not 0.0 <= val_frac < 1.0:
        raise DataError(f"token_file: data.args.val_frac must be in [0, 1), got {val_frac}")
    if val and val_frac:
        raise DataError("token_file: data.args.val and data.args.val_frac both set: validation is either a "
                        "separate file or the last fraction of data.root's tokens; drop one")  # fmt: skip
    stream = open_stream(root, dtype)
    if not val and val_frac is None and os.path.isdir(root) and glob.glob(os.path.join(glob.escape(root), "val*.bin")):
        val = os.path.join(root, "val*.bin")  # the folder python -m distlib.runner.tokenize writes
    if val:
        train, valid = stream, open_stream(val, dtype, what="data.args.val")
    else:
        frac = 0.05 if val_frac is None else val_frac
        n_val = int(len(stream) * frac)
        train, valid = stream.split(len(stream) - n_val)
        if frac == 0.0:
            valid = None
    if len(train) < 2 * block_size + 1:
        raise DataError(f"data.root={root!r}: {len(train)} training tokens are too few for windows of "
                        f"block_size={block_size}; use more tokens or a smaller block_size")  # fmt: skip
    if valid is not None and len(valid) < block_size + 1:
        raise DataError(f"token_file: {len(valid)} validation tokens are too few for one window of block_size="
                        f"{block_size}; use a larger val_frac or val file, or a smaller block_size")  # fmt: skip
    return TokenFileSet(train, valid, block_size, source=stream.source)


def write_token_file(path: str, tokens: np.ndarray, dtype: str | None = None, header: bool = True) -> None:
    """Write ``tokens`` as one file in llm.c's format (``header``), else headerless. ``dtype``:
    uint16 or uint32; None: uint16 when every token fits, else uint32."""
    tokens = np.asarray(tokens)
    if dtype is None:
        dtype = "uint16" if tokens.size == 0 or int(tokens.max()) < 1 << 16 else "uint32"
    tok = DTYPES[dtype]
    with open(path, "wb") as f:
        if header:
            f.write(llm_c_header(len(tokens), dtype).tobytes())
        f.write(tokens.astype(tok).tobytes())


def llm_c_header(count: int, dtype: str) -> np.ndarray:
    """llm.c's 256-int32 header of a file of ``count`` tokens of ``dtype``."""
    if count >= 1 << 31:
        raise ValueError(f"{count} tokens do not fit llm.c's int32 count: write more, smaller shards")
    magic = next(m for m, (tok, _) in MAGICS.items() if tok == DTYPES[dtype])
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[0], header[1], header[2] = magic, MAGICS[magic][1], count
    return header
