"""Token files (``data.name: token_file``): llm.c's shards and headerless ``.bin`` files read the same
tokens, memory-mapped, one stream over the shards of a folder or glob; a bad file is a DataError
naming it; a token id not below the model's vocabulary names the file and its largest id; the
validation split is the last fraction, a separate file or a folder's ``val*.bin``."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

import distlib
from distlib.runner.config import ConfigError, load_config
from distlib.runner.data.errors import DataError
from distlib.runner.data.text import TokenLoader, eval_windows
from distlib.runner.data.token_files import (
    HEADER_BYTES,
    TokenStream,
    llm_c_header,
    load_token_file,
    open_stream,
    read_shard,
    write_token_file,
)
from tests.conftest import ROOT
from tests.runner.test_trainer import built, metrics

DEMO = os.path.join(ROOT, "recipes", "gpt_tokens_demo.yaml")


def _tokens(n: int, vocab: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, n)


@pytest.mark.parametrize("dtype, vocab", [("uint16", 50257), ("uint32", 128256)])
def test_files_with_and_without_llm_c_header_read_the_same_tokens(tmp_path, dtype, vocab):
    tokens = _tokens(1000, vocab)
    write_token_file(str(tmp_path / "h.bin"), tokens, dtype)
    tokens.astype(dtype).tofile(tmp_path / "raw.bin")  # nanoGPT's headerless file
    with open(tmp_path / "h.bin", "rb") as f:  # llm.c's write_datafile: 256 int32, magic, version, count
        header = np.frombuffer(f.read(HEADER_BYTES), dtype="<i4")
    magic, version = (20240520, 1) if dtype == "uint16" else (20240801, 7)
    assert (header[0], header[1], header[2]) == (magic, version, 1000) and not header[3:].any()
    assert os.path.getsize(tmp_path / "h.bin") == HEADER_BYTES + 1000 * np.dtype(dtype).itemsize
    with_header = open_stream(str(tmp_path / "h.bin"))
    raw = open_stream(str(tmp_path / "raw.bin"), dtype)
    assert read_shard(str(tmp_path / "h.bin")).header and not read_shard(str(tmp_path / "raw.bin"), dtype).header
    assert len(with_header) == len(raw) == 1000
    assert np.array_equal(with_header.read(0, 1000), tokens) and np.array_equal(raw.read(0, 1000), tokens)
    assert with_header.read(0, 1000).dtype == np.int64


def test_shards_of_a_folder_or_glob_are_one_stream_in_name_order(tmp_path):
    tokens = _tokens(1000, 500)
    for i, (a, b) in enumerate([(0, 300), (300, 301), (301, 1000)]):  # a shard of one token in the middle
        write_token_file(str(tmp_path / f"train_{i:06d}.bin"), tokens[a:b])
    write_token_file(str(tmp_path / "val_000000.bin"), _tokens(100, 500, seed=1))
    for root in (str(tmp_path), str(tmp_path / "train_*.bin")):
        stream = open_stream(root)
        assert len(stream) == 1000 and np.array_equal(stream.read(0, 1000), tokens)
        starts = np.array([0, 295, 299, 300, 990])  # windows inside one shard and across two or three
        assert np.array_equal(stream.gather(starts, 10), np.stack([tokens[s : s + 10] for s in starts]))
    # a folder with train*.bin trains on those and validates on its val*.bin (what tokenize writes)
    data = load_token_file(str(tmp_path), block_size=16)
    assert len(data.train) == 1000 and np.array_equal(data.val.read(0, 100), _tokens(100, 500, seed=1))


def test_validation_is_the_last_fraction_or_a_separate_file(tmp_path):
    tokens = _tokens(1000, 500)
    write_token_file(str(tmp_path / "a.bin"), tokens)
    write_token_file(str(tmp_path / "v.bin"), tokens[:200])
    default = load_token_file(str(tmp_path / "a.bin"), block_size=8)  # 5%, as byte_text
    assert len(default.train) == 950 and np.array_equal(default.val.read(0, 50), tokens[950:])
    tenth = load_token_file(str(tmp_path / "a.bin"), block_size=8, val_frac=0.1)
    assert np.array_equal(tenth.train.read(0, 900), tokens[:900]) and np.array_equal(
        tenth.val.read(0, 100), tokens[900:]
    )
    with pytest.raises(IndexError):
        tenth.train.read(890, 11)  # the training split ends where validation begins
    separate = load_token_file(str(tmp_path / "a.bin"), block_size=8, val=str(tmp_path / "v.bin"))
    assert len(separate.train) == 1000 and len(separate.val) == 200
    assert load_token_file(str(tmp_path / "a.bin"), block_size=8, val_frac=0.0).val is None
    with pytest.raises(DataError, match="val and data.args.val_frac both set"):
        load_token_file(str(tmp_path / "a.bin"), block_size=8, val=str(tmp_path / "v.bin"), val_frac=0.1)
    with pytest.raises(DataError, match="too few for windows of block_size=600"):
        load_token_file(str(tmp_path / "a.bin"), block_size=600)


def _bad(tmp_path, case: str) -> tuple[str, str, str]:
    """(path, data.args.dtype, the message expected) of a broken token file."""
    p = str(tmp_path / f"{case}.bin")
    header = llm_c_header(100, "uint16")
    body = np.arange(100, dtype="<u2").tobytes()
    if case == "missing":
        return p, "auto", f"no token file at data.root='{p}'"
    data = {
        "bad magic": np.arange(600, dtype="<u2").tobytes(),
        "empty": b"",
        "truncated header": header.tobytes()[:500],
        "truncated tokens": header.tobytes() + body[:-10],
        "half a token": header.tobytes() + body + b"\x01",
        "count mismatch": header.tobytes() + body + body,
        "bad version": np.concatenate([header[:1], [3], header[2:]]).astype("<i4").tobytes() + body,
        "dtype conflict": header.tobytes() + body,
        "raw odd size": body + b"\x01",
    }[case]
    with open(p, "wb") as f:
        f.write(data)
    expected = {
        "bad magic": "no llm.c header (magic 65536, expected 20240520 or 20240801); for a headerless token file",
        "empty": "no llm.c header (magic none (the file is empty)",
        "truncated header": "truncated: 500 bytes, less than llm.c's header of 1024",
        "truncated tokens": "truncated: the header says 100 tokens, the file holds 95",
        "half a token": "truncated or corrupt: 201 bytes after the header are not whole uint16 tokens",
        "count mismatch": "token count mismatch: the header says 100 tokens, the file holds 200",
        "bad version": "llm.c header version 3 with magic 20240520, expected 1",
        "dtype conflict": "llm.c's header says uint16 tokens (magic 20240520), data.args.dtype is uint32",
        "raw odd size": "truncated: 201 bytes are not whole uint32 tokens",
    }[case]
    return p, {"dtype conflict": "uint32", "raw odd size": "uint32"}.get(case, "auto"), expected


BAD = ["missing", "bad magic", "empty", "truncated header", "truncated tokens", "half a token", "count mismatch",
       "bad version", "dtype conflict", "raw odd size"]  # fmt: skip


@pytest.mark.parametrize("case", BAD)
def test_a_bad_token_file_is_a_data_error_naming_it(tmp_path, case):
    path, dtype, expected = _bad(tmp_path, case)
    with pytest.raises(DataError) as e:
        load_token_file(path, block_size=8, dtype=dtype)
    assert expected in str(e.value) and path in str(e.value), str(e.value)


def test_a_token_id_not_below_the_vocabulary_names_the_file_and_its_largest_id(tmp_path):
    tokens = _tokens(200_000, 500)
    tokens[150_000] = 700  # past the first chunk checked at the start: found by the batch that reads it
    write_token_file(str(tmp_path / "t.bin"), tokens)
    stream = open_stream(str(tmp_path / "t.bin"))
    stream.check_vocab_start(500)
    loader = TokenLoader(stream, block_size=1000, batch_size=199, vocab_size=500)  # every window of the file
    with pytest.raises(DataError) as e:
        list(loader)
    msg = str(e.value)
    assert msg.startswith(f"{tmp_path / 't.bin'}: token id 700 (token 150000 of the file)"), msg
    assert "vocabulary size 500" in msg and "largest token id is 700" in msg and "at least 701" in msg, msg
    list(TokenLoader(stream, block_size=1000, batch_size=199, vocab_size=701))  # a large enough vocabulary reads it
    with pytest.raises(DataError, match="token id 700 .token 150000 of the file"):
        list(eval_windows(stream, 1000, 0, 1, 8, torch.device("cpu"), vocab_size=500))
    tokens[10] = 600  # in the first chunk: at the start, before any step
    write_token_file(str(tmp_path / "t.bin"), tokens)
    with pytest.raises(DataError, match="token id 600 .token 10 of the file.*largest token id is 700"):
        open_stream(str(tmp_path / "t.bin")).check_vocab_start(500)


def test_a_stream_reads_only_the_windows_a_batch_needs():
    """Memory-mapped: opening and reading a window does not read the file (numpy memmaps)."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        write_token_file(os.path.join(d, "t.bin"), _tokens(10_000, 500))
        stream = open_stream(os.path.join(d, "t.bin"))
        assert all(isinstance(m, np.memmap) for m in stream._maps)
        assert isinstance(stream, TokenStream) and stream.read(5000, 3).shape == (3,)


def test_the_gpt_needs_its_vocabulary_size_from_the_recipe_with_token_files(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("data: {name: token_file, root: data/shakespeare-demo/tokens}\nmodel: {name: gpt}\n")
    with pytest.raises(ConfigError, match="model.args.vocab_size: needed with data.name=token_file"):
        load_config(recipe)
    with pytest.raises(ConfigError, match="train.task=classification with data.name=token_file"):
        load_config(DEMO, ["train.task=classification"])


def test_the_gpt_trains_on_the_committed_demo_tokens(tmp_path, world_size_1):
    """recipes/gpt_tokens_demo.yaml: the built-in GPT on data/shakespeare-demo/tokens (vocabulary 512),
    shortened; the loss falls below a uniform guess and validation covers every val window once."""
    small = ["train.epochs=2", "data.train_subset=256", "model.args.n_layer=1", "model.args.n_embd=32",
             "model.args.n_head=2", "train.batch_size=16", "run.progress=plain", f"run.out_dir={tmp_path}"]  # fmt: skip
    cfg = load_config(DEMO, small)
    with built(cfg, distlib.init("gloo")) as trainer:
        assert trainer.model.cfg.vocab_size == 512 and trainer.task.eval_size == (12_500 - 1) // 64
        assert trainer.fit() == 0
    rows = metrics(tmp_path)
    assert [r["epoch"] for r in rows] == [1, 2] and rows[-1]["val_loss"] < math.log(512), rows


@pytest.mark.gpus(1)
@pytest.mark.slow
@pytest.mark.parametrize("overrides", [[], ["train.cuda_graph=true"]], ids=["eager", "cuda_graph"])
def test_the_gpt_trains_on_the_demo_tokens_on_a_gpu(tmp_path, overrides):
    """On a GPU: each step's windows read from the memory map into pinned memory and copied
    asynchronously, in bf16; also into a captured step's static inputs. The loss falls as on the CPU."""
    from tests.runner.test_e2e import launch

    out = tmp_path / "gpu"
    launch([DEMO, f"run.out_dir={out}", "run.progress=plain", "train.precision=bf16", *overrides], nproc=1,
           timeout=400)  # fmt: skip
    rows = metrics(out)
    assert rows[-1]["val_loss"] < rows[0]["val_loss"] and rows[-1]["val_loss"] < math.log(512) - 1.0, rows
