"""data.name=chat (docs/fine_tuning.md): the targets and positions of conversations, prompt/completion
and text rows equal a reference rendered here by hand, piece by piece (the assistant's content and
its end-of-turn token trained, role headers and the newline after the end of turn not, ``train:
false`` respected); bad rows and templates are DataErrors naming the row; best-fit decreasing
packing keeps every document whole; packed logits equal each document's alone (the documents are
isolated in attention); the loader's shards at 3 gloo ranks cover every row once; a pass started at
a step continues the order exactly, and a 2-rank run killed with SIGKILL resumes bit for bit;
the cache is reused. Nothing is downloaded: the tokenizers are made here with the ``tokenizers``
library."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from distlib.runner.config import ConfigError, load_config  # noqa: E402
from distlib.runner.data import chat_template  # noqa: E402
from distlib.runner.data.chat import ChatLoader, eval_batches, load_chat  # noqa: E402
from distlib.runner.data.errors import DataError  # noqa: E402
from distlib.runner.data.packing import best_fit_decreasing, build_rows  # noqa: E402
from distlib.runner.data.text import IGNORED  # noqa: E402
from tests.conftest import ROOT, run_ranks  # noqa: E402

SPECIAL = ["<pad>", "<s>", "<|im_start|>", "<|im_end|>"]
# ChatML: a newline after each end of turn (never trained), tools counted in a header
CHATML = (
    "{{ bos_token }}{% if tools %}<|im_start|>tools\n{{ tools | length }} tools<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TINY = dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)  # fmt: skip


def make_tokenizer(path: str, template: str | None = CHATML) -> str:
    """A character-level tokenizer (one token per character, the special tokens whole) saved at ``path``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL + [chr(c) for c in range(32, 127)] + ["\n"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<|im_end|>", pad_token="<pad>",
                                   additional_special_tokens=SPECIAL[2:])  # fmt: skip
    if template:
        fast.chat_template = template
    fast.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return make_tokenizer(str(tmp_path_factory.mktemp("tok") / "tokenizer"))


@pytest.fixture(scope="module")
def tok(tok_dir):
    return chat_template.load_tokenizer(tok_dir)


def ids_of(tok, text: str) -> list[int]:
    """Token ids of ``text`` by hand: the special tokens whole, every other character alone."""
    out, i = [], 0
    while i < len(text):
        special = next((s for s in SPECIAL if text.startswith(s, i)), None)
        piece = special or text[i]
        out.append(tok.convert_tokens_to_ids(piece))
        i += len(piece)
    return out


def reference(tok, messages: list[dict], tools: list | None = None, train_on: str = "assistant") -> tuple:
    """(ids, labels, trained ids) of a conversation rendered piece by piece as CHATML writes it:
    for a trained assistant message its content and ``<|im_end|>`` are trained; headers, the newline
    after the end of turn and every other message are not."""
    pieces = [("<s>", False)]
    if tools:
        pieces.append((f"<|im_start|>tools\n{len(tools)} tools<|im_end|>\n", False))
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    for i, m in enumerate(messages):
        trained = m["role"] == "assistant" and m.get("train", True) and (train_on != "completion" or i == last)
        pieces += [(f"<|im_start|>{m['role']}\n", False), (m["content"] + "<|im_end|>", trained), ("\n", False)]
    ids, mask = [], []
    for text, trained in pieces:
        piece = ids_of(tok, text)
        ids += piece
        mask += [trained] * len(piece)
    labels = [ids[j + 1] if mask[j + 1] else IGNORED for j in range(len(ids) - 1)] + [IGNORED]
    return ids, labels


CONVERSATIONS = [
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 17+25?"},
                  {"role": "assistant", "content": "42"}, {"role": "user", "content": "And 1+1?"},
                  {"role": "assistant", "content": "2"}]},
    {"messages": [{"role": "user", "content": "Capital of France?"},
                  {"role": "assistant", "content": "Paris, I think.", "train": False},
                  {"role": "user", "content": "Sure?"}, {"role": "assistant", "content": "Yes: Paris."}],
     "tools": [{"type": "function", "function": {"name": "lookup"}}, {"type": "function", "function": {"name": "x"}}]},
]  # fmt: skip


@pytest.mark.parametrize("train_on", ["assistant", "completion"])
def test_conversation_targets_equal_a_reference_rendered_by_hand(tok, train_on):
    from distlib.runner.data.packing import labels_of

    enc = chat_template.ChatEncoder(tok, "messages", train_on)
    for n, row in enumerate(CONVERSATIONS):
        got = enc.encode(row, f"row {n}")
        ids, labels = reference(tok, row["messages"], row.get("tools"), train_on)
        assert got.ids.tolist() == ids
        assert labels_of(got.ids, got.trained).tolist() == labels
    # the end of turn is trained after each trained answer, and the newline after it is not
    got = enc.encode(CONVERSATIONS[1], "row")
    labels = labels_of(got.ids, got.trained).tolist()
    end, newline = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("\n")
    trained = [t for t in labels if t != IGNORED]
    assert tok.decode(trained) == "Yes: Paris.<|im_end|>"  # "Paris, I think." has train: false
    assert newline not in trained and trained[-1] == end


def test_prompt_completion_and_text_rows(tok):
    from distlib.runner.data.packing import labels_of

    enc = chat_template.ChatEncoder(tok, "prompt_completion")
    got = enc.encode({"prompt": "2+2=", "completion": "4"}, "row")
    assert got.ids.tolist() == ids_of(tok, "2+2=4<|im_end|>")  # eos appended, trained: the model learns to stop
    assert [t for t in labels_of(got.ids, got.trained).tolist() if t != IGNORED] == ids_of(tok, "4<|im_end|>")
    row = {"prompt": [{"role": "user", "content": "Hi"}], "completion": [{"role": "assistant", "content": "Hello"}]}
    got = enc.encode(row, "row")
    ids, labels = reference(tok, row["prompt"] + row["completion"])
    assert got.ids.tolist() == ids and labels_of(got.ids, got.trained).tolist() == labels
    text = chat_template.ChatEncoder(tok, "text").encode({"text": "abc"}, "row")
    assert text.ids.tolist() == ids_of(tok, "abc<|im_end|>") and text.trained[1:].all()


def test_a_template_that_closes_a_turn_with_nothing_and_a_tokenizer_without_one(tmp_path, tok):
    bare = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}" \
           "{% if add_generation_prompt %}assistant: {% endif %}"  # fmt: skip
    path = make_tokenizer(str(tmp_path / "bare"), template=bare)
    enc = chat_template.ChatEncoder(chat_template.load_tokenizer(path), "messages")
    with pytest.raises(DataError, match=r"row 7: messages\[1\]: .*nothing after the assistant's content"):
        enc.encode({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}, "row 7")
    none = make_tokenizer(str(tmp_path / "none"), template=None)
    enc = chat_template.ChatEncoder(chat_template.load_tokenizer(none), "messages")
    with pytest.raises(DataError, match="no chat template.*data.args.template="):
        enc.encode(CONVERSATIONS[0], "f line 1")
    jinja = tmp_path / "chatml.jinja"
    jinja.write_text(CHATML)
    enc = chat_template.ChatEncoder(chat_template.load_tokenizer(none, str(jinja)), "messages")
    assert enc.encode(CONVERSATIONS[0], "row").ids.tolist() == reference(tok, CONVERSATIONS[0]["messages"])[0]


def write_jsonl(path, rows) -> str:
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return str(path)


@pytest.mark.parametrize("bad, message", [
    ({"question": "?"}, r"line 3: fits no chat row shape.*the row has: question"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}]},
     r"line 3: field 'messages\[1\].role'"),
    ({"messages": [{"role": "user", "content": 5}]}, r"line 3: field 'messages\[0\].content'"),
])  # fmt: skip
def test_a_row_that_fits_no_shape_names_its_file_line_and_field(tmp_path, tok_dir, bad, message):
    rows = CONVERSATIONS[:1] * 2 + [bad]
    if "question" in bad:
        rows = [bad]
        message = message.replace("line 3", "line 1")
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    with pytest.raises(DataError, match=r"rows\.jsonl " + message):
        load_chat(path, tokenizer=tok_dir, max_length=64, cache_dir=str(tmp_path / "c"))


@pytest.mark.slow
def test_a_bad_row_stops_the_run_with_exit_2_and_one_error_line(tmp_path, tok_dir):
    path = write_jsonl(tmp_path / "rows.jsonl", CONVERSATIONS + [{"messages": [{"role": "user"}]}])
    r = subprocess.run([sys.executable, "launch.py", "recipes/sft_demo.yaml", f"data.root={path}",
                        f"data.args.tokenizer={tok_dir}", f"run.out_dir={tmp_path / 'run'}", "run.progress=plain"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 2, r.stderr[-2000:]
    errors = [line for line in r.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "rows.jsonl line 3: field 'messages[0].content' is missing" in errors[0], r.stderr
    assert "Traceback" not in r.stderr


def bfd_reference(lengths: list[int], capacity: int) -> list[list[int]]:
    """Best-fit decreasing by exhaustive search of the bins for each document."""
    bins: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        rooms = [(capacity - sum(lengths[j] for j in b), k) for k, b in enumerate(bins)]
        fits = [(r, k) for r, k in rooms if r >= lengths[i]]
        if fits:
            bins[min(fits)[1]].append(i)
        else:
            bins.append([i])
    return bins


def test_best_fit_decreasing_keeps_every_document_whole():
    rng = random.Random(3)
    lengths = [rng.randint(1, 64) for _ in range(137)] + [64, 64, 1]
    bins = best_fit_decreasing(lengths, 64)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))  # none lost, none twice
    assert all(sum(lengths[i] for i in b) <= 64 for b in bins)
    assert [sorted(b) for b in bins] == [sorted(b) for b in bfd_reference(lengths, 64)]
    assert len(bins) <= -(-sum(lengths) // 64) * 11 // 9 + 1  # BFD's bound: 11/9 OPT + 1
    docs = [(np.arange(n) + 5, np.where(np.arange(n) % 2, np.arange(n) + 6, IGNORED)) for n in lengths]
    rows = build_rows(docs, 64, packing=True, pad_id=0)
    for r, b in enumerate(bins):  # each document contiguous, positions from 0, its own targets
        at = 0
        for i in b:
            n = lengths[i]
            assert rows["position_ids"][r, at : at + n].tolist() == list(range(n))
            assert rows["input_ids"][r, at : at + n].tolist() == docs[i][0].tolist()
            assert rows["labels"][r, at : at + n].tolist() == docs[i][1].tolist()
            at += n
        assert (rows["labels"][r, at:] == IGNORED).all()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_logits_equal_each_documents_alone(attn):
    from distlib.runner.models.hf_causal_lm import hf_causal_lm

    torch.manual_seed(0)
    model = hf_causal_lm(config={**TINY, "vocab_size": 101}, attn_implementation=attn).eval()
    g = torch.Generator().manual_seed(1)
    lengths = [[23, 41, 7, 1, 24], [96], [50, 46]]  # three rows of 96 positions
    docs = [[torch.randint(0, 101, (n,), generator=g) for n in row] for row in lengths]
    x = torch.stack([torch.cat(row) for row in docs])
    pos = torch.stack([torch.cat([torch.arange(len(d)) for d in row]) for row in docs])
    with torch.no_grad():
        packed = model(input_ids=x, position_ids=pos)
        for r, row in enumerate(docs):
            at = 0
            for d in row:
                alone = model(d.unsqueeze(0))[0]
                torch.testing.assert_close(packed[r, at : at + len(d)], alone, atol=1e-5, rtol=0)
                at += len(d)
        assert not torch.allclose(model(x)[0, 30:64], packed[0, 30:64], atol=1e-3)  # unmasked: documents mix


def _chat_rows(path: str, n: int, seed: int, longest: int = 30) -> str:
    rng = random.Random(seed)
    rows = [{"messages": [{"role": "user", "content": f"q{i} " + "x" * rng.randint(0, longest)},
                          {"role": "assistant", "content": f"a{i} " + "y" * rng.randint(0, longest)}]}
            for i in range(n)]  # fmt: skip
    return write_jsonl(path, rows)


def _shards(ctx, data: str, tok_dir: str, cache: str) -> dict:
    from types import SimpleNamespace

    from distlib.runner.tasks.chat import open_chat

    cfg = SimpleNamespace(
        data=SimpleNamespace(root=data, cache_dir=cache, args={"tokenizer": tok_dir, "max_length": 48,
                                                                "val_frac": 0.2}),
        model=SimpleNamespace(args={}),
    )  # fmt: skip
    chat = open_chat(cfg, ctx)
    loader = ChatLoader(chat.train, batch_size=2, rank=ctx.rank, world_size=ctx.world_size, seed=5)
    epochs = []
    for epoch in range(2):
        loader.set_epoch(epoch)
        epochs.append([(x["input_ids"].tolist(), x["position_ids"].tolist(), y.tolist()) for x, y in loader])
    vals = [(x["input_ids"].tolist(), y.tolist()) for x, y in eval_batches(chat.val, ctx.rank, ctx.world_size, 2,
                                                                          torch.device("cpu"))]  # fmt: skip
    return {"epochs": epochs, "val": vals, "rows": len(chat.train["input_ids"]), "reused": chat.reused,
            "all_train": chat.train["input_ids"].tolist(), "all_val": chat.val["input_ids"].tolist()}  # fmt: skip


def test_the_loaders_shards_at_3_ranks_cover_each_row_once(tmp_path, tok_dir):
    data = _chat_rows(tmp_path / "rows.jsonl", 150, 0)
    ranks = run_ranks(_shards, 3, data, tok_dir, str(tmp_path / "cache"), timeout=240)
    rows, everything = ranks[0]["rows"], ranks[0]["all_train"]
    steps = rows // 6
    assert steps >= 3
    for epoch in range(2):
        lens = {len(r["epochs"][epoch]) for r in ranks}
        assert lens == {steps}  # every rank the same steps, each batch (2, 48)
        seen = [tuple(row) for r in ranks for ids, pos, y in r["epochs"][epoch] for row in ids]
        assert all(len(ids) == 2 and len(ids[0]) == 48 for r in ranks for ids, _, _ in r["epochs"][epoch])
        assert len(seen) == steps * 6 and len(set(seen)) == len(seen)  # disjoint
        assert set(seen) <= {tuple(r) for r in everything}
    assert ranks[0]["epochs"][0] != ranks[0]["epochs"][1]  # a new order each epoch
    # validation: every row once over the ranks, the same batches on each, short ones filled with IGNORED
    val = [tuple(row) for r in ranks for ids, y in r["val"] for row, t in zip(ids, y) if any(v != IGNORED for v in t)]
    assert sorted(val) == sorted(tuple(r) for r in ranks[0]["all_val"])
    assert len({len(r["val"]) for r in ranks}) == 1
    assert [r["reused"] for r in ranks] == [False, True, True]  # built by rank 0, read by the others


def test_a_pass_started_at_a_step_continues_the_order_exactly(tmp_path, tok_dir):
    data = _chat_rows(tmp_path / "rows.jsonl", 120, 1)
    chat = load_chat(data, tokenizer=tok_dir, max_length=48, cache_dir=str(tmp_path / "c"))
    full = ChatLoader(chat.train, batch_size=3, rank=1, world_size=2, seed=9)
    full.set_epoch(1)
    whole = [y for _, y in full]
    resumed = ChatLoader(chat.train, batch_size=3, rank=1, world_size=2, seed=9)
    resumed.load_state_dict({"epoch": 1})
    tail = [y for _, y in resumed.iter_from(4)]
    assert len(whole) > 5 and all(torch.equal(a, b) for a, b in zip(whole[4:], tail, strict=True))
    other = ChatLoader(chat.train, batch_size=3, rank=1, world_size=2, seed=10)
    other.set_epoch(1)
    assert not all(torch.equal(a, b) for (_, a), b in zip(other, whole))  # train.seed changes the order


def test_the_cache_is_reused_and_keyed_by_the_settings(tmp_path, tok_dir, monkeypatch):
    data = _chat_rows(tmp_path / "rows.jsonl", 40, 2)
    first = load_chat(data, tokenizer=tok_dir, max_length=48)
    assert not first.reused and os.path.dirname(first.cache) == str(tmp_path / ".distlib-cache")
    monkeypatch.setattr(chat_template.ChatEncoder, "encode", lambda *a: pytest.fail("tokenized again"))
    again = load_chat(data, tokenizer=tok_dir, max_length=48)
    assert again.reused and again.cache == first.cache
    assert all(np.array_equal(first.train[k], again.train[k]) for k in first.train)
    monkeypatch.undo()
    other = load_chat(data, tokenizer=tok_dir, max_length=64)  # another setting: another key
    assert not other.reused and other.cache != first.cache
    assert not [n for n in os.listdir(tmp_path / ".distlib-cache") if ".tmp" in n]  # written atomically


def test_a_writer_killed_while_tokenizing_leaves_no_folder_behind_for_long(tmp_path, tok_dir):
    """A temporary cache folder of a writer on this host whose process is gone (kill -9 mid-write) is
    removed by the next writer; a live writer's, and another host's, are left alone."""
    data = _chat_rows(tmp_path / "rows.jsonl", 30, 2)
    first = load_chat(data, tokenizer=tok_dir, max_length=48)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that no process holds now
    host = socket.gethostname()
    key = os.path.basename(first.cache)
    cache = tmp_path / ".distlib-cache"
    other_key = load_chat(data, tokenizer=tok_dir, max_length=64).cache  # written after the folders below
    shutil.rmtree(other_key)
    abandoned = cache / f"{os.path.basename(other_key)}.tmp-{host}-{dead.pid}"
    live = cache / f"{os.path.basename(other_key)}.tmp-{host}-{os.getppid()}"  # a process that runs
    elsewhere = cache / f"{os.path.basename(other_key)}.tmp-another-host-{dead.pid}"
    for folder in (abandoned, live, elsewhere):
        folder.mkdir()
        (folder / "train_input_ids.npy").write_bytes(b"torn")
    again = load_chat(data, tokenizer=tok_dir, max_length=64)
    assert not again.reused and os.path.isfile(os.path.join(again.cache, "meta.json"))
    assert not abandoned.exists() and live.exists() and elsewhere.exists()
    assert key in os.listdir(cache)  # the committed caches untouched


def _problems(recipe: str, overrides: list[str]) -> list[str]:
    try:
        load_config(recipe, overrides)
    except ConfigError as e:
        return e.problems
    return []


def test_recipe_checks_refuse_what_cannot_isolate_documents():
    demo = os.path.join(ROOT, "recipes", "sft_demo.yaml")
    packed = "attn_implementation=flash_attention_2 with data.args.packing=true"
    assert any(packed in p for p in _problems(demo, ["model.args.attn_implementation=flash_attention_2"]))
    padded = _problems(demo, ["model.args.attn_implementation=flash_attention_2", "data.args.packing=false"])
    assert not any(packed in p for p in padded)
    gpt = _problems(demo, ["model.name=gpt", "model.args=null"])
    assert any("data.name=chat with model.name=gpt" in p for p in gpt)
    assert any("data.args.train_on: expected one of" in p for p in _problems(demo, ["data.args.train_on=prompts"]))
    assert _problems(demo, []) == []


@pytest.mark.slow
def test_the_sft_demo_learns_to_answer(tmp_path):
    """recipes/sft_demo.yaml at 2 torchrun ranks: the greedy answers to 100 held-out prompts are
    mostly right after training, where the same model untrained gets none right."""
    from types import SimpleNamespace

    from distlib.runner.models.hf_causal_lm import hf_causal_lm
    from distlib.runner.tasks.chat import answer_accuracy
    from tests.runner.test_e2e import launch, read_run

    out = tmp_path / "run"
    launch([os.path.join(ROOT, "recipes", "sft_demo.yaml"), f"run.out_dir={out}", f"data.cache_dir={tmp_path}",
            "run.progress=plain"], nproc=2, timeout=900)  # fmt: skip
    config, rows = read_run(out)
    trained = rows[-1]["answer_accuracy"]
    with open(out / "summary.json") as f:
        assert json.load(f)["final_answer_accuracy"] == trained
    args = config["data"]["args"]
    data = load_chat(os.path.join(ROOT, config["data"]["root"]), cache_dir=str(tmp_path), **args)
    assert data.reused and len(data.answers) == args["eval_answers"]
    torch.manual_seed(config["train"]["seed"])
    untrained = hf_causal_lm(config={**config["model"]["args"]["config"], "vocab_size": data.vocab_size})
    ctx = SimpleNamespace(rank=0, world_size=1, device=torch.device("cpu"))
    before = answer_accuracy(untrained, data, ctx, torch.autocast("cpu", enabled=False))
    print(f"sft demo: answer_accuracy {before} untrained, {trained} trained, {rows[-1]['train_s']} s of training")
    assert before <= 0.05 and trained >= 0.5, (before, trained)


def _train_chat(ctx, overrides: list[str], out_dir: str, stop_after: int) -> dict:
    """One rank of a chat run that records the targets it trains on (``stop_after`` > 0: rank 0 gets
    a SIGTERM after that many steps of this process)."""
    import signal

    from distlib.runner.training.trainer import Trainer
    from tests.runner.test_trainer import built

    seen, step = [], Trainer.train_step

    def recording_step(self, x, y):
        seen.append((self.state.epoch * len(self.loader) + self.state.step, x["input_ids"].tolist(), y.tolist()))
        step(self, x, y)
        if stop_after and ctx.rank == 0 and len(seen) == stop_after:
            os.kill(os.getpid(), signal.SIGTERM)

    Trainer.train_step = recording_step
    cfg = load_config(os.path.join(ROOT, "recipes", "sft_demo.yaml"), [*overrides, f"run.out_dir={out_dir}"])
    with built(cfg, ctx) as trainer:
        code = trainer.fit()
        weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return {"code": code, "seen": seen, "weights": weights, "steps": len(trainer.loader)}


@pytest.mark.slow
def test_a_chat_run_stopped_mid_epoch_resumes_to_the_uninterrupted_batches_and_weights(tmp_path, tok_dir):
    import signal

    data = _chat_rows(tmp_path / "rows.jsonl", 90, 4)
    o = [f"data.root={data}", f"data.args.tokenizer={tok_dir}", "data.args.max_length=48", "data.args.eval_answers=0",
         f"data.cache_dir={tmp_path}", "model.args.config.max_position_embeddings=48", "train.epochs=2",
         "train.batch_size=4", "run.checkpoint_every=1", "run.progress=plain"]  # fmt: skip
    ref = run_ranks(_train_chat, 2, o, str(tmp_path / "ref"), 0, timeout=400)
    steps = ref[0]["steps"]
    stopped = run_ranks(_train_chat, 2, o, str(tmp_path / "run"), steps + 2, timeout=400)
    resumed = run_ranks(_train_chat, 2, o, str(tmp_path / "run"), 0, timeout=400)
    assert all(r["code"] == 128 + signal.SIGTERM for r in stopped)
    done = len(stopped[0]["seen"])
    assert steps < done < 2 * steps  # mid-epoch, in epoch 2
    for a, b, c in zip(stopped, resumed, ref):  # every rank: its batches before the stop and after, as uninterrupted
        assert a["seen"] + b["seen"] == c["seen"]
        assert all(torch.equal(b["weights"][k], c["weights"][k]) for k in c["weights"])


# launch.py with every chat batch slowed by CHAT_PACE_S seconds (nothing else changed): a run long
# enough to be killed between two checkpoints whatever the machine's speed
PACED_LAUNCH = """import os, runpy, sys, time
sys.path.insert(0, {root!r})
import distlib.runner.data.chat as chat
pace, batch_of = float(os.environ["CHAT_PACE_S"]), chat.batch_of
def paced(*args, **kwargs):
    time.sleep(pace)
    return batch_of(*args, **kwargs)
chat.batch_of = paced
sys.argv = [os.path.join({root!r}, "launch.py"), *sys.argv[1:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.slow
def test_a_chat_run_killed_with_sigkill_resumes_bit_for_bit_and_reuses_its_cache(tmp_path, tok_dir):
    """recipes/sft_demo.yaml on 2 gloo torchrun ranks (packed rows, train.grad_accum=2, a metrics row
    every step, a background checkpoint every 4 steps), the whole job SIGKILLed in its second epoch
    once a checkpoint there is committed and a later step's row is written, then the same command
    again: it resumes from that checkpoint without tokenizing again (the cache's files untouched), and
    its per-step rows and final weights and optimizer state equal an uninterrupted run's bit for bit."""
    from tests.runner.conftest import checkpoints, saved, step_name
    from tests.runner.test_reliability import ENV, TORCHRUN, Job

    data = _chat_rows(tmp_path / "rows.jsonl", 160, 4, longest=12)  # documents of 28 to 54 tokens: 2 or 3 a row
    every = 4

    def command(out: str, cache: str, script: str = "launch.py") -> list[str]:
        return TORCHRUN + ["--standalone", "--nproc-per-node=2", script, "recipes/sft_demo.yaml", "dist.backend=gloo",
                           f"data.root={data}", f"data.args.tokenizer={tok_dir}", "data.args.max_length=96",
                           "data.args.eval_answers=0", f"data.cache_dir={cache}",
                           "model.args.config.max_position_embeddings=96", "train.epochs=3", "train.batch_size=4",
                           "train.grad_accum=2", "train.eval_every=0", "train.eval_every_steps=1",
                           f"run.checkpoint_every_steps={every}", "run.keep_checkpoints=20", "run.progress=plain",
                           f"run.out_dir={out}"]  # fmt: skip

    def finished(job: Job) -> str:
        code = job.wait(timeout=400)
        assert code == 0, job.output[-4000:]
        return job.output

    ref, out = str(tmp_path / "ref"), str(tmp_path / "run")
    finished(Job(command(ref, str(tmp_path / "ref-cache")), str(tmp_path / "ref.log")))
    rows = _metrics(ref)
    steps = next(r["step"] for r in rows if "epoch_step" not in r)  # epoch 1's end: the steps of an epoch
    assert [r["step"] for r in rows] == list(range(1, 3 * steps + 1)) and steps > 2 * every
    target = (steps // every + 1) * every  # the first checkpoint of epoch 2, mid-epoch

    script = tmp_path / "paced_launch.py"
    script.write_text(PACED_LAUNCH.format(root=ROOT))
    cache = str(tmp_path / "cache")
    job = Job(command(out, cache, str(script)), str(tmp_path / "killed.log"), env={**ENV, "CHAT_PACE_S": "0.1"})
    try:
        end = time.monotonic() + 300
        while not (step_name(target) in checkpoints(out) and any(r["step"] > target + 1 for r in _metrics(out))):
            assert job.proc.poll() is None, f"the run ended before it could be killed:\n{job.output[-3000:]}"
            assert time.monotonic() < end, job.output[-3000:]
            job.workers()  # remember pids while they live
            time.sleep(0.02)
    finally:
        job.kill()  # SIGKILL: torchrun and its ranks, nothing said, nothing saved
        job.log.close()
        Job.running.remove(job)
    killed = job.output
    written = re.search(r"cache written: (\S+)", killed)
    assert written and "stopped by" not in killed, killed[-3000:]
    packed = re.search(r"packed (\d+) documents into (\d+) rows", killed)
    assert 2 * int(packed.group(1)) > 3 * int(packed.group(2)), packed.group(0)  # rows of several documents
    folder = written.group(1)
    assert os.path.dirname(folder) == os.path.join(cache, "chat")
    files = {n: os.stat(os.path.join(folder, n)).st_mtime_ns for n in os.listdir(folder)}
    left = [r["step"] for r in _metrics(out)]
    newest = checkpoints(out)[-1]
    assert target + 1 < left[-1] < 3 * steps and newest < step_name(3 * steps), (left, newest)

    again = finished(Job(command(out, cache), str(tmp_path / "resumed.log")))
    assert f"cache reused: {folder}" in again and "cache written" not in again, again[-3000:]
    assert os.listdir(os.path.join(cache, "chat")) == [os.path.basename(folder)]  # no other folder, no temporary
    assert {n: os.stat(os.path.join(folder, n)).st_mtime_ns for n in os.listdir(folder)} == files
    resumed = re.search(r"resuming from (\S+): epoch (\d+), step (\d+)", again)
    assert resumed and resumed.group(1) == os.path.join(out, "checkpoints", newest), again[-3000:]
    assert int(resumed.group(2)) * steps + int(resumed.group(3)) == int(newest[4:]) > steps

    keys = ("epoch", "epoch_step", "step", "train_loss", "val_loss", "lr", "tokens", "trained_tokens")
    assert [{k: r.get(k) for k in keys} for r in _metrics(out)] == [{k: r.get(k) for k in keys} for r in rows]
    a, b = saved(out), saved(ref)
    for name in ("model", "optimizer"):
        flat_a = dict(torch.utils._pytree.tree_flatten_with_path(a[name])[0])
        flat_b = dict(torch.utils._pytree.tree_flatten_with_path(b[name])[0])
        assert flat_a.keys() == flat_b.keys()
        for k in flat_a:
            va, vb = flat_a[k], flat_b[k]
            assert torch.equal(va, vb) if isinstance(va, torch.Tensor) else va == vb, (name, k)


def _metrics(out_dir: str) -> list[dict]:
    path = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip().endswith("}")]


@pytest.mark.slow
def test_the_sft_benchmark_runs_its_three_modes_on_the_cpu():
    cmd = [sys.executable, "bench/sft.py", "--recipe", "recipes/sft_demo.yaml", "--docs", "12", "--seq", "64",
           "--mean", "20", "--batch", "2", "--warmup", "1", "--no-compile"]  # fmt: skip
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    results = [line for line in r.stdout.splitlines() if line.startswith("RESULT")]
    rows = [dict(kv.split("=") for kv in line.split()[1:]) for line in results]
    assert [row["mode"] for row in rows] == ["packed", "padded", "hf-loop"]
    assert len({row["trained_tokens"] for row in rows}) == 1  # the same documents each way
    assert int(rows[0]["steps"]) < int(rows[1]["steps"])  # packed: fewer rows


def test_parquet_and_a_dataset_folder_read_as_the_json_lines(tmp_path, tok_dir):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    datasets = pytest.importorskip("datasets")
    rows = [{"messages": c["messages"], "tools": json.dumps(c["tools"]) if "tools" in c else ""}
            for c in CONVERSATIONS * 6]  # fmt: skip
    rows = [{**r, "messages": [{"role": m["role"], "content": m["content"], "train": m.get("train", True)}
                               for m in r["messages"]]} for r in rows]  # fmt: skip
    jsonl = write_jsonl(tmp_path / "rows.jsonl", rows)
    pq.write_table(pa.Table.from_pylist(rows), str(tmp_path / "rows.parquet"))
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "folder"))
    kw = dict(tokenizer=tok_dir, max_length=96, val_frac=0.0, cache_dir=str(tmp_path / "c"))
    ref = load_chat(jsonl, **kw)
    assert ref.stats["documents"] == 12 and ref.stats["rows"] == 12
    for root in (tmp_path / "rows.parquet", tmp_path / "folder"):
        got = load_chat(str(root), **kw)
        assert all(np.array_equal(got.train[k], ref.train[k]) for k in ref.train), root
