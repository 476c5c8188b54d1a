"""A plain transformers training loop, as the Hugging Face docs write one: the baseline of the
Llama recipe's figures. The model is built from the recipe's own config (recipes/llama_1b.yaml by
default), so that the architecture is the same by construction; the loop is plain torch and
transformers: ``model(input_ids=x, labels=x).loss`` (transformers shifts the labels itself) under
bf16 autocast, fused AdamW, gradient clipping, ``torch.compile(model)``, on random tokens on the GPU.

    python bench/baselines/hf_loop.py                              # one GPU, 8 x 2048 tokens
    python bench/baselines/hf_loop.py --no-compile                 # eager
    python bench/baselines/hf_loop.py --recipe recipes/llama_demo.yaml --batch 4 --steps 3 --warmup 1   # CPU check

Prints one line starting with RESULT: tokens/s, MFU (training FLOPs per token as the runner counts
them: 6 per weight of the matrix products, the output layer once when tied, an untied input
embedding not; plus 12 * layers * heads * head_dim * sequence for attention; and, for comparison,
mfu_no_embedding with the output layer left out of the 6N as well), peak memory, and the seconds
from the start of the process to the end of the first (compiled) step.
"""
import argparse
import json
import os
import statistics
import time

T0 = time.perf_counter()

import torch  # noqa: E402
import yaml  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--recipe", default=os.path.join(ROOT, "recipes", "llama_1b.yaml"), help="its model.args.config")
p.add_argument("--config-json", default="", help="the config (model_type and its keys) from this file instead")
p.add_argument("--attn", default="auto", help="attn_implementation; auto: sdpa where the family supports it and "
               "does not soft-cap its attention scores, else eager (as the runner's default)")  # fmt: skip
p.add_argument("--batch", type=int, default=8, help="sequences")
p.add_argument("--seq", type=int, default=2048, help="tokens per sequence")
p.add_argument("--steps", type=int, default=30, help="timed steps")
p.add_argument("--warmup", type=int, default=5, help="untimed steps first, at least 1 (the first one compiles)")
p.add_argument("--lr", type=float, default=3e-4)
p.add_argument("--clip", type=float, default=1.0)
p.add_argument("--no-compile", action="store_true")
p.add_argument("--profile-json", default="", help="then profile --profile-steps more steps: key_averages() rows")
p.add_argument("--profile-steps", type=int, default=3)
p.add_argument("--peak-tflops", type=float, default=0.0, help="dense bf16 TFLOP/s of the GPU (default: H100/H200 989)")
args = p.parse_args()
args.warmup = max(1, args.warmup)

cuda = torch.cuda.is_available()
device = torch.device("cuda" if cuda else "cpu")
if cuda:
    torch.backends.cuda.matmul.allow_tf32 = True
torch.manual_seed(0)
if args.config_json:
    with open(args.config_json) as f:
        config = json.load(f)
else:
    with open(args.recipe) as f:
        config = dict(yaml.safe_load(f)["model"]["args"]["config"])
model_type = config.pop("model_type")
cfg = AutoConfig.for_model(model_type, **config)
cfg.use_cache = False
attn = args.attn
if attn == "auto":
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    sdpa = getattr(MODEL_FOR_CAUSAL_LM_MAPPING[type(cfg)], "_supports_sdpa", False)
    attn = "sdpa" if sdpa and not getattr(cfg, "attn_logit_softcapping", None) else "eager"
with torch.device(device):
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation=attn)
model.train()
opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=cuda)
step_model = model if args.no_compile else torch.compile(model)


def train_step(x):
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
        loss = step_model(input_ids=x, labels=x).loss
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
    opt.step()
    return loss


def sync():
    if cuda:
        torch.cuda.synchronize()


x = torch.randint(cfg.vocab_size, (args.batch, args.seq), device=device)
for i in range(args.warmup):
    train_step(x)
    if i == 0:
        sync()
        first_step_s = time.perf_counter() - T0
sync()
times = []
for _ in range(args.steps):
    t = time.perf_counter()
    loss = train_step(x)
    sync()
    times.append(time.perf_counter() - t)
step_s = statistics.median(times)
# the same number of steps back to back, one sync at the end: the host may run ahead of the GPU, as in
# a training run that reads nothing back each step
t = time.perf_counter()
for _ in range(args.steps):
    loss = train_step(x)
sync()
run_s = (time.perf_counter() - t) / args.steps
if args.profile_json:  # after the timed steps: the profiler's own cost stays out of them
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(args.profile_steps):
            train_step(x)
        sync()
    rows = [{"name": e.key, "device": str(e.device_type).rsplit(".", 1)[-1], "self_cpu_us": e.self_cpu_time_total,
             "self_device_us": getattr(e, "self_device_time_total", 0.0) or 0.0, "count": e.count,
             "annotation": bool(getattr(e, "is_user_annotation", False))}
            for e in prof.key_averages()]
    with open(args.profile_json, "w") as f:
        json.dump({"steps": args.profile_steps, "rows": rows}, f)
tokens = args.batch * args.seq

n = sum(p.numel() for p in model.parameters())  # a tied matrix once
emb, out = model.get_input_embeddings().weight, model.get_output_embeddings().weight
matmul = n if out is emb else n - emb.numel()
heads = cfg.num_attention_heads
head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
qk, v = getattr(cfg, "qk_head_dim", None) or head_dim, getattr(cfg, "v_head_dim", None) or head_dim
attention = 6 * cfg.num_hidden_layers * heads * (qk + v) * args.seq
flops = 6 * matmul + attention
flops_no_embedding = 6 * (matmul - out.numel()) + attention
name = torch.cuda.get_device_name() if cuda else "cpu"
peak = args.peak_tflops * 1e12 or (989e12 if ("H100" in name or "H200" in name) else None)
mfu = f"{flops * tokens / step_s / peak:.4f}" if peak else "-"
mfu_ne = f"{flops_no_embedding * tokens / step_s / peak:.4f}" if peak else "-"
mem = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
print(f"RESULT mode=hf-loop{'' if args.no_compile else '-compile'} attn={attn} params={n} step_ms={step_s * 1e3:.2f} "
      f"tokens_per_s={tokens / step_s:.0f} run_tokens_per_s={tokens / run_s:.0f} mfu={mfu} mfu_no_embedding={mfu_ne} "
      f"flops_per_token={flops} peak_mem_gib={mem:.1f} first_step_s={first_step_s:.1f} loss={loss.item():.4f}",
      flush=True)
