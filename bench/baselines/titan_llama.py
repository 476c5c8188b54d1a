"""torchtitan on the Llama-3.2-1B shape, one GPU: the anchor of the Llama recipe's speed.

torchtitan 0.3.0's own trainer, run as its ``torchtitan.train`` runs it (``--module``/``--config``
through its ConfigManager), on its llama3 ``1B`` flavor (= recipes/llama_1b.yaml's model: 16 x 2048,
32 heads, 8 key/value heads, 8192 hidden, vocabulary 128256, tied): FSDP2 on the one rank (bf16
parameters, fp32 reduction), each block compiled, its AdamW, gradient clipping at 1.0, no activation
checkpointing, 8 x 2048 random tokens a step (one document a row). Two settings differ from
torchtitan's own llama3 configs, because torchtitan 0.3.0 fails with them on torch 2.11: its chunked
loss (a plain compiled cross-entropy instead) and its CUDA-graph capture (off). It calls three APIs
newer than torch 2.11: shimmed below (with a torch that has them, nothing is shimmed). Its flex
attention has no backward on the CPU: a GPU only.

    python3 bench/baselines/titan_llama.py                   # flex attention (the flavor's default)
    python3 bench/baselines/titan_llama.py --attn varlen     # torch's varlen_attn (flash)
    python3 bench/baselines/titan_llama.py --flavor debugmodel --batch 2 --seq 256 --steps 2 --warmup 1   # quick

Needs torchtitan 0.3.0 and what it imports (bench/baselines/README.md says which wheels). Prints
one line starting with RESULT: tokens/s from the median step, peak memory
(``torch.cuda.max_memory_allocated``), seconds from the start of the process to the end of the
first step.
"""
import argparse
import os
import statistics
import sys
import time

T0 = time.perf_counter()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def shim_torch() -> list[str]:
    """What torchtitan 0.3.0 calls that an older torch (2.11) lacks: stand-ins that change nothing
    on one GPU. Returns the names shimmed."""
    shimmed = []
    import torch.distributed.fsdp as fsdp

    if not hasattr(fsdp, "DataParallelMeshDims"):  # only named in type hints of the models not run here
        from dataclasses import dataclass

        @dataclass
        class DataParallelMeshDims:
            shard: object = None
            replicate: object = None

        fsdp.DataParallelMeshDims = DataParallelMeshDims
        shimmed.append("fsdp.DataParallelMeshDims")
    if not hasattr(dist, "set_timeout"):  # lowers the process group's timeout after step 1: not needed
        dist.set_timeout = lambda *a, **k: None
        shimmed.append("dist.set_timeout")
    import inspect

    import torch.nn.attention.flex_attention as flex

    if "separate_full_blocks" not in inspect.signature(flex.create_block_mask).parameters:
        create_block_mask = flex.create_block_mask

        def create_block_mask_shim(*args, separate_full_blocks=True, **kwargs):
            # the older create_block_mask always separates the full blocks
            return create_block_mask(*args, **kwargs)

        flex.create_block_mask = create_block_mask_shim
        shimmed.append("create_block_mask(separate_full_blocks=)")
    return shimmed


SHIMMED = shim_torch()  # before torchtitan's modules take these names

from dataclasses import dataclass  # noqa: E402

from torchtitan.components.dataloader import BaseDataLoader  # noqa: E402
from torchtitan.components.tokenizer import BaseTokenizer  # noqa: E402

ARGS = {"flavor": "1B", "attn": "flex", "batch": 8, "seq": 2048, "steps": 30}


class RandomTokens(BaseDataLoader):
    """The same ``local_batch_size`` x ``seq_len`` random token ids every step, one document a row."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        vocab: int = 32000  # ids below every vocabulary of the comparison (as bench.hf_families draws them)

    def __init__(self, config: Config, *, dp_rank: int, seq_len: int, local_batch_size: int, **_) -> None:
        g = torch.Generator().manual_seed(dp_rank)
        tokens = torch.randint(0, config.vocab, (local_batch_size, seq_len + 1), generator=g)
        positions = torch.arange(seq_len).expand(local_batch_size, seq_len)
        self.batch = ({"input": tokens[:, :-1], "positions": positions}, tokens[:, 1:])

    def __iter__(self):
        while True:
            yield self.batch

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None:
        pass


class NoTokenizer(BaseTokenizer):
    """Random token ids need no tokenizer (and no tokenizer files)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        pass

    def __init__(self, config: Config | None = None, **_) -> None:
        super().__init__()

    def encode(self, *args, **kwargs) -> list[int]:
        raise NotImplementedError

    def decode(self, *args, **kwargs) -> str:
        raise NotImplementedError

    def get_vocab_size(self) -> int:
        return 32000


def llama3_bench():  # noqa: ANN201  (a torchtitan Trainer.Config)
    """The config this script trains: ``--config llama3_bench`` of ``--module titan_llama``."""
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import default_adamw
    from torchtitan.components.validate import Validator
    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.models.common.config_utils import decoder_vocab_size
    from torchtitan.models.llama3 import model_registry
    from torchtitan.trainer import Trainer

    spec = model_registry(ARGS["flavor"], attn_backend=ARGS["attn"])
    return Trainer.Config(
        model_spec=spec,
        loss=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(spec)),
        tokenizer=NoTokenizer.Config(),
        dataloader=RandomTokens.Config(vocab=min(32000, decoder_vocab_size(spec))),
        optimizer=default_adamw(lr=3e-4),
        training=TrainingConfig(local_batch_size=ARGS["batch"], seq_len=ARGS["seq"], steps=ARGS["steps"],
                                max_norm=1.0, disable_cuda_graphs=True),  # fmt: skip
        compile=CompileConfig(enable=True, components=["model", "loss"]),
        activation_checkpoint=None,
        checkpoint=CheckpointManager.Config(enable=False),
        validator=Validator.Config(enable=False),
        metrics=MetricsProcessor.Config(log_freq=10),
        dump_folder=os.environ.get("TITAN_DUMP", "/tmp/titan_llama"),
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavor", default="1B", help="torchtitan llama3 flavor")
    p.add_argument("--attn", default="flex", choices=["flex", "varlen", "flex_flash"], help="torchtitan's attention backend")
    p.add_argument("--batch", type=int, default=8, help="sequences a step")
    p.add_argument("--seq", type=int, default=2048, help="tokens a sequence")
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (the first one compiles)")
    args = p.parse_args()
    # the config function runs in the module torchtitan imports by name: the settings reach it there
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import titan_llama

    titan_llama.ARGS.update(flavor=args.flavor, attn=args.attn, batch=args.batch, seq=args.seq,
                            steps=args.warmup + args.steps)  # fmt: skip
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29517"}.items():  # fmt: skip
        os.environ.setdefault(k, v)  # one process without torchrun

    from torchtitan.config import ConfigManager
    from torchtitan.tools.logging import init_logger
    from torchtitan.trainer import Trainer

    init_logger()
    config = ConfigManager().parse_args(["--module", "titan_llama", "--config", "llama3_bench"])
    cuda = torch.cuda.is_available()
    times: list[float] = []
    first: list[float] = []
    train_step = Trainer.train_step

    def timed_step(self, data_iterator):  # noqa: ANN001, ANN202
        t = time.perf_counter()
        out = train_step(self, data_iterator)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        if not first:
            first.append(time.perf_counter() - T0)
        return out

    Trainer.train_step = timed_step
    trainer = config.build()
    try:
        trainer.train()
    finally:
        trainer.close()
    step_s = statistics.median(times[args.warmup :])
    tokens = args.batch * args.seq
    n = sum(p.numel() for m in trainer.model_parts for p in m.parameters())
    mem = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
    print(f"RESULT mode=torchtitan-{args.attn} flavor={args.flavor} params={n} step_ms={step_s * 1e3:.2f} "
          f"tokens_per_s={tokens / step_s:.0f} peak_mem_gib={mem:.1f} first_step_s={first[0]:.1f} "
          f"shimmed={','.join(SHIMMED) or 'none'}", flush=True)  # fmt: skip
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
