"""Fine-tuning throughput on conversations: trained tokens per second over one set of synthetic
documents, three ways, in one process on one device (the same model, weights and documents):

- ``packed``: the chat data's rows (runner/data/packing.py: best-fit decreasing into rows of
  ``--seq`` tokens, positions per document), ``HFCausalLM(input_ids, position_ids)``: documents
  isolated by transformers' packed-sequence mask;
- ``padded``: one document per row, padded to ``--seq`` (the chat data with ``packing: false``);
- ``hf-loop``: a plain transformers loop as its docs write one: ``--batch`` documents a step, padded
  to the longest of the batch with an attention mask, ``model(..., labels=...).loss``
  (bench/baselines/hf_loop.py's loop otherwise), compiled with dynamic shapes after one untimed pass
  over every batch (each batch's length is a shape); ``hf-loop-eager``: the same loop not compiled.

The documents: lengths drawn from a lognormal (mean about ``--mean`` tokens, cut to ``--seq``), the
first ``--prompt-frac`` of each untrained (a prompt), the rest trained. Each mode runs ``--warmup``
untimed steps, then one timed pass over every document; trained tokens/s = the documents' trained
tokens / the pass's seconds. The Llama-3.2-1B shape (recipes/llama_1b.yaml's config), random weights.

    python bench/sft.py                                                      # a GPU, bf16, compiled
    python bench/sft.py --recipe recipes/sft_demo.yaml --docs 48 --seq 128 --mean 40 --batch 4 --no-compile
                                                                             # CPU check

Prints one RESULT line per mode.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # this checkout's distlib, run as a script
IGNORED = -100


def documents(n: int, mean: float, seq: int, vocab: int, prompt_frac: float, seed: int) -> list[tuple]:
    """``n`` documents (ids, labels): lognormal lengths of mean about ``mean``, at most ``seq``."""
    rng = np.random.default_rng(seed)
    sigma = 0.8
    lengths = np.clip(rng.lognormal(np.log(mean) - sigma**2 / 2, sigma, n).astype(int), 8, seq)
    docs = []
    for n_tok in lengths:
        ids = rng.integers(0, vocab, n_tok)
        trained = np.arange(n_tok) >= int(n_tok * prompt_frac)
        labels = np.full(n_tok, IGNORED)
        labels[:-1] = np.where(trained[1:], ids[1:], IGNORED)
        docs.append((ids, labels))
    return docs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default=os.path.join(ROOT, "recipes", "llama_1b.yaml"), help="its model.args.config")
    p.add_argument("--docs", type=int, default=512)
    p.add_argument("--mean", type=float, default=600.0, help="mean document length, tokens")
    p.add_argument("--seq", type=int, default=2048, help="row length (packed, padded); the longest document")
    p.add_argument("--batch", type=int, default=8, help="rows a step (hf-loop: documents a step)")
    p.add_argument("--prompt-frac", type=float, default=0.3)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--attn", default="sdpa")
    p.add_argument("--modes", default="packed,padded,hf-loop",
                   help="packed, padded, hf-loop (compiled, dynamic shapes), hf-loop-eager")  # fmt: skip
    p.add_argument("--no-compile", action="store_true")
    args = p.parse_args()

    from distlib.runner.data.packing import build_rows
    from distlib.runner.models.hf_causal_lm import hf_causal_lm

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    with open(args.recipe) as f:
        config = dict(yaml.safe_load(f)["model"]["args"]["config"])
    config.setdefault("vocab_size", 512)
    config["max_position_embeddings"] = max(config.get("max_position_embeddings", 0), args.seq)
    docs = documents(args.docs, args.mean, args.seq, config["vocab_size"], args.prompt_frac, seed=0)
    trained_total = sum(int((d[1] != IGNORED).sum()) for d in docs)
    real_total = sum(len(d[0]) for d in docs)
    torch.manual_seed(0)
    with torch.device(device):
        wrapper = hf_causal_lm(config=config, attn_implementation=args.attn)
    initial = {k: v.clone() for k, v in wrapper.state_dict().items()}

    def batches(mode: str) -> list[tuple]:
        """(inputs, labels) of each step, on the device (copies outside the clock)."""
        out = []
        if mode.startswith("hf-loop"):
            for i in range(0, len(docs), args.batch):
                group = docs[i : i + args.batch]
                longest = max(len(d[0]) for d in group)
                ids = torch.zeros(len(group), longest, dtype=torch.long)
                mask = torch.zeros(len(group), longest, dtype=torch.long)
                labels = torch.full((len(group), longest), IGNORED, dtype=torch.long)
                for r, (d_ids, d_labels) in enumerate(group):
                    n = len(d_ids)
                    ids[r, :n], mask[r, :n] = torch.from_numpy(d_ids), 1
                    # transformers shifts the labels itself: label j is token j where token j is trained
                    labels[r, 1:n] = torch.from_numpy(np.where(d_labels[:-1] != IGNORED, d_ids[1:], IGNORED))
                out.append(({"input_ids": ids.to(device), "attention_mask": mask.to(device)}, labels.to(device)))
            return out
        rows = build_rows(docs, args.seq, packing=mode == "packed")
        n = len(rows["input_ids"])
        for i in range(0, n, args.batch):
            take = {k: torch.from_numpy(v[i : i + args.batch].astype(np.int64)).to(device) for k, v in rows.items()}
            if len(take["input_ids"]) < args.batch:  # one shape: the last step filled with untrained rows
                short = args.batch - len(take["input_ids"])
                take = {k: torch.cat([v, v[:1].expand(short, -1)]) for k, v in take.items()}
                take["labels"][-short:] = IGNORED
            out.append(({"input_ids": take["input_ids"], "position_ids": take["position_ids"]}, take["labels"]))
        return out

    def run(mode: str) -> None:
        """One mode's timed pass; its gradients, optimizer, graphs and batches die with it."""
        wrapper.load_state_dict(initial)
        hf = wrapper.hf
        opt = torch.optim.AdamW(hf.parameters(), lr=1e-5, betas=(0.9, 0.95), weight_decay=0.1, fused=cuda)
        if mode.startswith("hf-loop"):
            # hf-loop-eager: the loop as transformers' docs write it, not compiled
            net = hf if args.no_compile or mode == "hf-loop-eager" else torch.compile(hf, dynamic=True)

            def loss_of(x, y, net=net):
                return net(**x, labels=y).loss
        else:
            net = wrapper if args.no_compile else torch.compile(wrapper)

            def loss_of(x, y, net=net):
                logits = net(**x)
                return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten(), ignore_index=IGNORED)

        def step(x, y, loss_of=loss_of, opt=opt, hf=hf):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
                loss = loss_of(x, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(hf.parameters(), 1.0)
            opt.step()
            return loss

        steps = batches(mode)
        # a batch padded to its longest has a shape of its own: the loop's warm-up is a whole untimed pass,
        # so that its timed pass holds no compilation (the packed and padded rows have one shape)
        for x, y in steps if mode.startswith("hf-loop") else steps[: args.warmup]:
            step(x, y)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        for x, y in steps:
            loss = step(x, y)
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t
        positions = sum(x["input_ids"].numel() for x, _ in steps)
        mem = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
        print(f"RESULT mode={mode} docs={len(docs)} steps={len(steps)} positions={positions} "
              f"real_tokens={real_total} trained_tokens={trained_total} seconds={seconds:.3f} "
              f"trained_tokens_per_s={trained_total / seconds:.0f} positions_per_s={positions / seconds:.0f} "
              f"peak_mem_gib={mem:.1f} loss={loss.item():.4f} compile={not args.no_compile}", flush=True)  # fmt: skip

    for mode in args.modes.split(","):
        run(mode)
        # the previous mode's gradients and compiled graphs go before the next allocates: each peak is its own
        wrapper.zero_grad(set_to_none=True)
        gc.collect()
        torch._dynamo.reset()
        if cuda:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
