"""``python -m distlib.runner.tokenize``: text and .jsonl files to llm.c shards with a local tokenizer
(built here: nothing downloads), one delimiter token before every document, shards of
``--shard-tokens``, the last ``--val-frac`` of the tokens as val shards, uint32 when the
vocabulary does not fit uint16, the same files from any number of processes; bad input is one
``error:`` line and exit 2; tokenize then train end to end."""

from __future__ import annotations

import gzip
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

tokenizers = pytest.importorskip("tokenizers")  # the hf extra; CI installs it through the test extra

from distlib.runner.data.token_files import HEADER_BYTES, load_token_file, open_stream  # noqa: E402
from distlib.runner.data.tokenize import TokenizeError, main, tokenize  # noqa: E402
from tests.conftest import ROOT  # noqa: E402
from tests.runner.test_trainer import metrics  # noqa: E402

WORDS = "the quick brown fox jumps over lazy dog a cat sat on mat".split()


def word_tokenizer(path, extra_words: int = 0, specials=("<|endoftext|>",)) -> str:
    """A WordLevel tokenizer.json: the special tokens first, then WORDS (and ``extra_words`` more)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate([*specials, "[UNK]", *WORDS, *(f"w{i}" for i in range(extra_words))])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if specials:
        tok.add_special_tokens(list(specials))
    tok.save(str(path))
    return str(path)


def _ids(tokenizer: str, text: str) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(tokenizer).encode(text, add_special_tokens=False).ids


def _inputs(tmp_path) -> tuple[list[str], list[str]]:
    """Four input files (text, gzipped text, .jsonl of two documents) and the five documents in order."""
    docs = ["the quick brown fox", "jumps over the lazy dog", "a cat sat", "on the mat", "the dog sat on a cat"]
    (tmp_path / "a.txt").write_text(docs[0])
    with gzip.open(tmp_path / "b.txt.gz", "wt") as f:
        f.write(docs[1])
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps({"text": d, "id": i}) for i, d in enumerate(docs[2:4])))
    (tmp_path / "d.txt").write_text(docs[4])
    return [str(tmp_path / n) for n in ("a.txt", "b.txt.gz", "c.jsonl", "d.txt")], docs


def test_tokenize_writes_llm_c_shards_with_a_delimiter_before_every_document(tmp_path):
    tok = word_tokenizer(tmp_path / "tokenizer.json")
    inputs, docs = _inputs(tmp_path)
    out = tmp_path / "out"
    done = tokenize(inputs, str(out), tok, shard_tokens=7, val_frac=0.3, workers=1, progress=False)
    expected = [t for d in docs for t in (0, *_ids(tok, d))]  # <|endoftext|> is id 0, before every document
    assert len(expected) == 26 and done["dtype"] == "uint16" and done["doc_token_id"] == 0
    n_val = int(26 * 0.3)  # the last 7 tokens
    assert done["tokens"] == {"train": 26 - n_val, "val": n_val}
    names = sorted(os.listdir(out))
    assert names == ["train_000000.bin", "train_000001.bin", "train_000002.bin", "val_000000.bin"], names
    counts = []
    for name in names:
        with open(out / name, "rb") as f:
            header = np.frombuffer(f.read(HEADER_BYTES), dtype="<i4")
        assert header[0] == 20240520 and header[1] == 1
        assert os.path.getsize(out / name) == HEADER_BYTES + 2 * header[2]
        counts.append(int(header[2]))
    assert counts == [7, 7, 5, 7]  # the last train shard cut short where validation begins
    data = load_token_file(str(out), block_size=2)
    assert data.train.read(0, 19).tolist() == expected[:19] and data.val.read(0, 7).tolist() == expected[19:]
    # shards move with the val tail: a tail that spans several shards and empties one of them
    done = tokenize(inputs, str(tmp_path / "out2"), tok, shard_tokens=5, val_frac=0.5, workers=1, progress=False)
    assert [os.path.basename(p) for p in done["train"]] == [f"train_00000{i}.bin" for i in range(3)]
    assert done["tokens"] == {"train": 13, "val": 13} and len(done["val"]) == 3
    train, val = open_stream(str(tmp_path / "out2" / "train_*.bin")), open_stream(str(tmp_path / "out2" / "val_*.bin"))
    assert train.read(0, 13).tolist() + val.read(0, 13).tolist() == expected
    assert not os.path.exists(tmp_path / "out2" / "train_000005.bin")


def test_the_same_files_from_any_number_of_processes(tmp_path):
    tok = word_tokenizer(tmp_path / "tokenizer.json")
    inputs, _ = _inputs(tmp_path)
    (tmp_path / "a.txt").write_text("the quick brown fox " * 50_000)  # the last to finish of two processes
    tokenize(inputs, str(tmp_path / "one"), tok, shard_tokens=60_000, val_frac=0.2, workers=1, progress=False)
    tokenize(inputs, str(tmp_path / "two"), tok, shard_tokens=60_000, val_frac=0.2, workers=2, progress=False)
    names = sorted(os.listdir(tmp_path / "one"))
    assert names == sorted(os.listdir(tmp_path / "two")) and len(names) == 4, names
    for n in names:
        assert (tmp_path / "one" / n).read_bytes() == (tmp_path / "two" / n).read_bytes(), n


def test_a_vocabulary_beyond_uint16_writes_uint32_tokens(tmp_path):
    tok = word_tokenizer(tmp_path / "tokenizer.json", extra_words=70_000)
    (tmp_path / "a.txt").write_text("the w69999 fox w0")
    done = tokenize([str(tmp_path / "a.txt")], str(tmp_path / "out"), tok, workers=1, progress=False)
    assert done["dtype"] == "uint32" and done["vocab_size"] > 1 << 16
    with open(done["train"][0], "rb") as f:
        assert np.frombuffer(f.read(12), dtype="<i4").tolist() == [20240801, 7, 5]
    assert open_stream(done["train"][0]).read(0, 5).tolist() == [0, *_ids(tok, "the w69999 fox w0")]


def test_the_delimiter_is_the_tokenizers_bos_else_eos_or_the_one_named(tmp_path):
    """A Hugging Face tokenizer folder: tokenizer.json and tokenizer_config.json's bos_token / eos_token."""
    folder = tmp_path / "hf"
    folder.mkdir()
    word_tokenizer(folder / "tokenizer.json", specials=("<s>", "</s>"))
    (tmp_path / "a.txt").write_text("the fox")
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))

    def first(out: str, **kw) -> int:
        done = tokenize([str(tmp_path / "a.txt")], str(tmp_path / out), str(folder), workers=1, progress=False, **kw)
        return open_stream(done["train"][0]).read(0, 1).item()

    assert first("bos") == 0
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>"}}))
    assert first("eos") == 1
    assert first("named", doc_token="<s>") == 0
    done = tokenize([str(tmp_path / "a.txt")], str(tmp_path / "none"), str(folder), doc_token="none", workers=1,
                    progress=False)  # fmt: skip
    assert open_stream(done["train"][0]).read(0, 2).tolist() == _ids(str(folder / "tokenizer.json"), "the fox")


@pytest.mark.parametrize(
    "case, expected",
    [
        ("missing input", "no such input file: "),
        ("no delimiter", "no BOS or EOS token found to put between documents; name one with --doc-token"),
        ("unknown delimiter", "--doc-token '<bos>': not a token of"),
        ("not a tokenizer", "not a tokenizer.json the tokenizers package reads"),
        ("no tokenizer", "no such file or folder"),
        ("bad jsonl", 'c.jsonl:2: expected a JSON object with a string field "text"'),
        ("shards already there", "already holds token shards (train_000000.bin, ...)"),
    ],
)
def test_bad_input_is_one_error_line_and_exit_2(tmp_path, capsys, case, expected):
    tok = word_tokenizer(tmp_path / "tokenizer.json")
    (tmp_path / "a.txt").write_text("the fox")
    args = [str(tmp_path / "a.txt"), str(tmp_path / "out"), "--tokenizer", tok, "--workers", "1", "--no-progress"]
    if case == "missing input":
        args[0] = str(tmp_path / "nope.txt")
    elif case == "no delimiter":
        args[3] = word_tokenizer(tmp_path / "plain.json", specials=())
    elif case == "unknown delimiter":
        args += ["--doc-token", "<bos>"]
    elif case == "not a tokenizer":
        (tmp_path / "bad.json").write_text("{}")
        args[3] = str(tmp_path / "bad.json")
    elif case == "no tokenizer":
        args[3] = str(tmp_path / "nope.json")
    elif case == "bad jsonl":
        (tmp_path / "c.jsonl").write_text('{"text": "the"}\n{"body": "fox"}\n')
        args[0] = str(tmp_path / "c.jsonl")
    elif case == "shards already there":
        assert main(args) == 0
        capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and expected in err and err.count("\n") == 1, err


def test_options_out_of_range_are_refused(tmp_path):
    tok = word_tokenizer(tmp_path / "tokenizer.json")
    (tmp_path / "a.txt").write_text("the fox")
    for kw, msg in [({"shard_tokens": 0}, "--shard-tokens 0"), ({"val_frac": 1.0}, "--val-frac 1.0"),
                    ({"max_tokens": -1}, "--max-tokens -1")]:  # fmt: skip
        with pytest.raises(TokenizeError, match=msg):
            tokenize([str(tmp_path / "a.txt")], str(tmp_path / "out"), tok, progress=False, **kw)


@pytest.mark.slow
def test_tokenize_then_train_end_to_end(tmp_path):
    """A BPE trained here on the first 100 KB of the Shakespeare slice, the command line over two
    files with its progress bar, then the runner's GPT on the shards it wrote:
    the validation loss falls below a uniform guess over the vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    with gzip.open(os.path.join(ROOT, "data", "shakespeare-demo", "shakespeare.txt.gz"), "rt") as f:
        text = f.read(100_000)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))  # fmt: skip
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "a.txt").write_text(text[:50_000])
    (tmp_path / "b.txt").write_text(text[50_000:])
    out = tmp_path / "tokens"
    proc = subprocess.run(
        [sys.executable, "-m", "distlib.runner.tokenize", str(tmp_path / "a.txt"), str(tmp_path / "b.txt"), str(out),
         "--tokenizer", str(tmp_path / "tokenizer.json"), "--val-frac", "0.1", "--workers", "1"],
        capture_output=True, text=True, cwd=ROOT, timeout=120, env={**os.environ, "PYTHONPATH": ROOT},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "tokenizing" in proc.stdout and "train: " in proc.stdout and "val: " in proc.stdout, proc.stdout
    import launch

    run = tmp_path / "run"
    assert launch.main([os.path.join(ROOT, "recipes", "gpt_tokens_demo.yaml"), f"data.root={out}",
                        "model.args.vocab_size=300", "train.epochs=2", "data.train_subset=256", "model.args.n_layer=1",
                        "model.args.n_embd=32", f"run.out_dir={run}", "run.progress=plain"]) == 0  # fmt: skip
    rows = metrics(run)
    assert rows[-1]["val_loss"] < math.log(300) - 0.5, rows
