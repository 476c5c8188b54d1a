#!/usr/bin/env bash
# Run benchmark suites on one GPU machine, each next to its baselines, and print a short table last.
#
#   bash bench/run.sh SUITE...          (from the repository root; bash bench/run.sh --help)
#
# Suites (the figure of BENCHMARKS.md each one produces):
#   tests        the GPU test suite, pytest -m gpu, one test at a time (each takes every GPU)
#   step         ResNet18-CIFAR training step, every mode of bench/step.py, with the baselines
#                bench/baselines/rn18_throughput.py on one GPU and with DDP      ("Training step")
#   allreduce    all_reduce bus bandwidth, raw against GradSync's buckets on 1, 2 and 4 communicators,
#                with bench/baselines/allreduce_bw.py                            ("Gradient all_reduce")
#   fallback     one process driving every GPU, against nn.DataParallel, DDP and one GPU
#                (bench/fallback_bench.py, which runs its baselines itself)       ("Fallback mode")
#   gpt          GPT training step at each of GPT_SIZES (default "124M 355M 1.5B"), one command per size:
#                bench/gpt_step.py's single-GPU, DDP and distlib modes, with bench/baselines/gpt_ddp.py
#                on one GPU and with DDP                                         ("GPT training step")
#   sharding     bench/gpt_step.py at each of SHARD_SIZES (default "1.5B 6.7B 10B 13B"): DDP,
#                ZeroRedundancyOptimizer, FSDP2 (eager and compiled blocks) and distlib, unsharded and
#                sharded; OOM where a mode cannot hold the model                 ("Sharded training")
#   buffers      the step with and without GradSync's broadcast_buffers (DDP's default; the step's
#                BatchNorm buffers broadcast from rank 0 before each forward)      ("Training step")
#   compile_startup  the first compiled step and the whole command, compile_for_sync against
#                DDP + torch.compile, cold and warm inductor cache (bench/compile_startup.py)
#   scale        the 1.5B GPT through the runner on one GPU per shard mode (model build, compile warm-up
#                cold and warm, tokens/s, MFU, peak memory, final save; the Shakespeare recipe at that size,
#                the whole command against its steps and evaluation), with the anchors (a build on the
#                GPU, torch.save, an async save's stall, bench.gpt_step single-compile) and the largest
#                6.7B batch (seq 4096) per activation checkpointing mode; one command per part
#                (bench/scale.py; SCALE_ARGS adds arguments)                       ("Large models")
#   plan         the memory plan against the runner's step (torch.cuda.max_memory_allocated) for the 1.5B
#                and 6.7B GPTs and the Llama-1B recipe at 1, 8 and 64 ranks (fake process group on one
#                GPU), eager blocks (bench/plan_accuracy.py)                          ("Memory plan")
#   large        models larger than one GPU on one GPU: the 39.8B GPT (world 8) and a Llama-3-70B-shaped
#                hf_causal_lm (world 64) built sharded under the fake process group and stepped once, and
#                a 7B-class GPT with and without dist.offload (bench/large_models.py)
#                                                                   ("Models larger than one GPU")
#   float8       train.precision=fp8 through the runner next to bf16 and the plain torchao loop: the
#                4096-wide GPT, the Llama-1B recipe's shape and the 1.5B GPT, tensorwise and rowwise;
#                then the Shakespeare loss curves, bf16 (2 seeds) and fp8 (bench/float8.py)
#                                                                              ("Float8 training")
#   checkpoint   how long a sharded checkpoint's save blocks training, synchronous against asynchronous:
#                bench/checkpoint_stall.py on one GPU (4 GB of parameters + AdamW) and FSDP2 over
#                every GPU                                                         ("Sharded checkpoints")
#   flagship     bench/flagship.sh on recipes/cifar.yaml (floor, cold, warm), with
#                bench/baselines/ddp_cifar.py                                     ("Flagship timeline")
#   cifar        bench/recipes.py: recipes/cifar.yaml and cifar_accuracy.yaml over three seeds, with
#                bench/baselines/ddp_cifar.py                                     ("Time to accuracy")
#   shakespeare  bench/recipes.py on recipes/gpt_shakespeare.yaml, with bench/baselines/gpt_ddp.py on
#                the same text, model, batch and schedule                         ("GPT recipe")
#   llama        recipes/llama_1b.yaml on one GPU (LLAMA_STEPS steps, default 60, of 8 x 2048 random tokens
#                of its vocabulary from TOKENS, made once if missing; LLAMA_ARGS adds overrides), with
#                bench/baselines/hf_loop.py (a plain transformers loop, compiled and eager) on the same
#                model and batch                                                  ("Hugging Face Llama")
#   hfio         a Llama-3.2-1B-shaped Hugging Face folder (bf16, save_pretrained) loaded by the runner
#                (Trainer.build_model and launch.py's model stage, from a cold page cache) and a one-step
#                run's checkpoint exported back (python -m distlib.runner.export), replicated and with
#                dist.shard=optimizer, against the disk's cold read and fsynced write of the same bytes;
#                one command per shard mode (bench/hf_io.py; HFIO_ARGS adds arguments) ("Hugging Face Llama")
#   families     every dense Hugging Face family's 0.5-3B shape through the runner against the compiled
#                plain transformers loop (bench/baselines/hf_loop.py), tokens/s and their ratio, four
#                families a command (bench/hf_families.py)                        ("Hugging Face families")
#
# Env: OUT (logs and JSON, default .bench/out), NPROC (processes, default every GPU), CIFAR (default
# .bench/cifar10-jpeg.tar.gz), TEXT (default data/shakespeare.txt.gz, where the recipe reads it),
# LIMIT_S (per command, 540), GPT_ARGS (more arguments of bench/gpt_step.py, e.g. "--batch 8"),
# GPT_BASELINE_ARGS (the shakespeare baseline's, default the recipe's), PYTHON (default python3).
# Each command's log is $OUT/<name>.log; the table at the end gives each command's exit status and time.
set -u
if [ $# -eq 0 ] || [ "$1" = -h ] || [ "$1" = --help ]; then
    sed -n '2,/^set -u/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
    exit 0
fi
OUT=${OUT:-.bench/out}
CIFAR=${CIFAR:-.bench/cifar10-jpeg.tar.gz}
TEXT=${TEXT:-data/shakespeare.txt.gz}
LIMIT_S=${LIMIT_S:-540}
PY=${PYTHON:-python3}
NPROC=${NPROC:-$(nvidia-smi -L 2>/dev/null | grep -c GPU)}
[ "$NPROC" -ge 1 ] 2>/dev/null || NPROC=1
mkdir -p "$OUT"
# measured without NVLink SHARP (multicast); Python's bytecode cached outside site-packages (docs/startup.md)
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-/tmp/pycache}
unset PYTHONDONTWRITEBYTECODE
TORCHRUN="$PY -m torch.distributed.run --standalone --nproc-per-node=$NPROC"
STATUS="$OUT/status.txt"
: >"$STATUS"

run() {  # run NAME COMMAND...: under LIMIT_S, logged to $OUT/NAME.log, its status noted
    local name=$1 t=$SECONDS rc
    shift
    echo "=== $name: $*"
    timeout -k 10 "$LIMIT_S" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    printf '%-26s rc=%-4s %5ss\n' "$name" "$rc" "$((SECONDS - t))" >>"$STATUS"
}

show() {  # show NAME [LINES]: the end of NAME's log, where each command prints its own table
    [ -f "$OUT/$1.log" ] || return 0
    echo "--- $1"
    grep -v '^{"\|^\[rank\|^W[0-9]\|^\[distlib rank\|UserWarning\|^  warnings\.' "$OUT/$1.log" | tail -n "${2:-12}"
}

{
    nvidia-smi -L 2>/dev/null
    $PY -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, "NCCL",
      ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "-")'
    echo "commit $(cat .bench/COMMIT 2>/dev/null || git rev-parse --short HEAD 2>/dev/null)"
} | tee "$OUT/environment.txt"

for suite in "$@"; do
    case $suite in
    tests)
        run tests $PY -m pytest -p no:cacheprovider -q -m gpu
        ;;
    buffers)
        for b in broadcast-buffers no-broadcast-buffers; do
            run "step_$b" $TORCHRUN -m bench.step step --modes distlib-eager,distlib-graph,distlib-compile-graph \
                "--$b" --json "$OUT/step_$b.json"
        done
        ;;
    compile_startup)
        run compile_startup $PY bench/compile_startup.py --nproc "$NPROC" --modes distlib,ddp,plain --compile-times
        ;;
    step)
        run step $TORCHRUN -m bench.step step --json "$OUT/step.json"
        run step_baseline_single env MODE=single BATCH=512 $PY bench/baselines/rn18_throughput.py
        run step_baseline_ddp env MODE=ddp BATCH=512 $TORCHRUN bench/baselines/rn18_throughput.py
        ;;
    allreduce)
        run allreduce $TORCHRUN -m bench.step allreduce --groups 1,2,4 --json "$OUT/allreduce.json"
        run allreduce_baseline $TORCHRUN bench/baselines/allreduce_bw.py
        ;;
    fallback)
        run fallback $PY bench/fallback_bench.py --anchor bench/baselines --json "$OUT/fallback.json"
        ;;
    gpt)
        for size in ${GPT_SIZES:-124M 355M 1.5B}; do
            run "gpt_$size" $TORCHRUN -m bench.gpt_step --sizes "$size" \
                --modes single-compile,ddp-compile,distlib,distlib-compile,distlib-graph \
                --json "$OUT/gpt_$size.json" ${GPT_ARGS:-}
            case $size in  # the same model in the hand-written baseline: layers, heads, width
            124M) shape="--n-layer 12 --n-head 12 --n-embd 768" ;;
            355M) shape="--n-layer 24 --n-head 16 --n-embd 1024" ;;
            1.5B) shape="--n-layer 48 --n-head 25 --n-embd 1600" ;;
            *) continue ;;
            esac
            run "gpt_${size}_baseline_single" $PY bench/baselines/gpt_ddp.py $shape
            run "gpt_${size}_baseline_ddp" $TORCHRUN bench/baselines/gpt_ddp.py $shape
        done
        ;;
    sharding)
        for size in ${SHARD_SIZES:-1.5B 6.7B 10B 13B}; do
            run "sharding_$size" $TORCHRUN -m bench.gpt_step --sizes "$size" \
                --modes ddp,zero-redundancy,fsdp2,fsdp2-compile,distlib,distlib-compile,distlib-zero,distlib-zero-compile,distlib-zero-graph,distlib-fsdp \
                --json "$OUT/sharding_$size.json" ${GPT_ARGS:-}
        done
        ;;
    scale)
        rm -f "$OUT/scale.jsonl"
        run scale_anchors $PY -m bench.scale --parts anchors --json "$OUT/scale.jsonl" ${SCALE_ARGS:-}
        for m in none optimizer full; do
            run "scale_$m" $PY -m bench.scale --parts runner --modes "$m" --json "$OUT/scale.jsonl" ${SCALE_ARGS:-}
            run "scale_recipe_$m" $PY -m bench.scale --parts recipe --modes "$m" --text "$TEXT" --json "$OUT/scale.jsonl" ${SCALE_ARGS:-}
        done
        for m in none full selective; do
            run "scale_ac_$m" $PY -m bench.scale --parts ac --ac-modes "$m" --json "$OUT/scale.jsonl" ${SCALE_ARGS:-}
        done
        run scale_report $PY -m bench.scale --report "$OUT/scale.jsonl"
        ;;
    plan)
        rm -f "$OUT/plan_accuracy.jsonl"
        run plan_accuracy $PY -m bench.plan_accuracy --json "$OUT/plan_accuracy.jsonl"
        ;;
    large)
        run large_build $PY -m bench.large_models --parts build
        run large_offload $PY -m bench.large_models --parts offload
        ;;
    float8)
        rm -f "$OUT/float8.jsonl"
        for model in gpt4096 llama1b gpt1.5b; do
            run "float8_$model" $PY -m bench.float8 --models "$model" --json "$OUT/float8.jsonl"
        done
        run float8_curve $PY -m bench.float8 --curve --curve-jobs 3 --text "$TEXT" --json "$OUT/float8.jsonl" --out "$OUT"
        ;;
    checkpoint)
        run checkpoint_single $PY -m bench.checkpoint_stall --device cuda --mb 4000
        run checkpoint_fsdp $TORCHRUN -m bench.checkpoint_stall --device cuda --fsdp --mb 4000
        ;;
    flagship)
        run flagship env NPROC="$NPROC" PYTHON="$PY" BUDGET_S=$((LIMIT_S - 60)) COLD_AGAIN=1 \
            bash bench/flagship.sh "$CIFAR" "$OUT/flagship"
        run flagship_baseline env TAR="$(realpath "$CIFAR")" EPOCHS=18 BATCH=256 $TORCHRUN bench/baselines/ddp_cifar.py
        ;;
    cifar)
        run cifar $PY bench/recipes.py --nproc "$NPROC" --data "$CIFAR" --out /tmp/distlib-recipes \
            --run "fast:recipes/cifar.yaml" --run "accuracy:recipes/cifar_accuracy.yaml" --seeds 0 1 2 \
            --json "$OUT/cifar.json"
        run cifar_baseline env TAR="$(realpath "$CIFAR")" EPOCHS=18 BATCH=256 $TORCHRUN bench/baselines/ddp_cifar.py
        ;;
    shakespeare)
        # recipes/gpt_shakespeare.yaml's model, batch (64 sequences of 512 bytes in all) and schedule (10 epochs
        # of ~9,400 windows: 1,460 steps, 5% warm-up, cosine to a tenth), the batch per GPU here
        SHAKESPEARE_RECIPE="--vocab 256 --block-size 512 --n-layer 8 --n-head 8 --n-embd 512 --dropout 0.1 \
            --batch $((64 / NPROC)) --steps 1460 --lr 1e-3 --lr-warmup 73 --eval-every 292"
        run shakespeare $PY bench/recipes.py --nproc "$NPROC" --data "$TEXT" --out /tmp/distlib-recipes \
            --run "gpt:recipes/gpt_shakespeare.yaml" --json "$OUT/shakespeare.json"
        # shellcheck disable=SC2086  # the arguments are words
        run shakespeare_baseline $TORCHRUN bench/baselines/gpt_ddp.py --data "$TEXT" \
            ${GPT_BASELINE_ARGS:-$SHAKESPEARE_RECIPE}
        ;;
    llama)
        TOKENS=${TOKENS:-$OUT/llama_tokens.bin}  # headerless uint32 token ids below Llama 3's 128256
        [ -f "$TOKENS" ] || $PY -c "import numpy as np, sys
np.random.default_rng(0).integers(0, 128256, 4_000_000, dtype=np.uint32).tofile(sys.argv[1])" "$TOKENS"
        # shellcheck disable=SC2086  # LLAMA_ARGS are words
        run llama_recipe $PY launch.py recipes/llama_1b.yaml data.root="$TOKENS" data.args.dtype=uint32 \
            data.args.val_frac=0.005 train.max_steps="${LLAMA_STEPS:-60}" run.out_dir="$OUT/llama_1b" \
            run.resume=false run.progress=plain ${LLAMA_ARGS:-}
        run llama_baseline $PY bench/baselines/hf_loop.py
        run llama_baseline_eager $PY bench/baselines/hf_loop.py --no-compile
        ;;
    hfio)
        rm -f "$OUT/hf_io.jsonl"
        # shellcheck disable=SC2086  # HFIO_ARGS are words
        run hfio $PY -m bench.hf_io --json "$OUT/hf_io.jsonl" ${HFIO_ARGS:-}
        # shellcheck disable=SC2086
        run hfio_optimizer $PY -m bench.hf_io --shard optimizer --reuse --json "$OUT/hf_io.jsonl" ${HFIO_ARGS:-}
        run hfio_report $PY -m bench.hf_io --report "$OUT/hf_io.jsonl"
        ;;
    families)
        rm -f "$OUT/hf_families.jsonl"
        # the torchtitan anchor in the llama row where torchtitan is installed (bench/baselines/README.md)
        titan=""
        if $PY -c "import torchtitan" 2>/dev/null; then titan="--titan"; fi
        for group in llama,mistral,qwen2,qwen3 gemma,gemma2,gemma3_text,phi3 olmo2,gpt2,gpt_neox,granite; do
            extra=""
            if [ "${group%%,*}" = llama ]; then extra="$titan"; fi
            # shellcheck disable=SC2086  # extra: no word or one
            run "families_${group%%,*}" $PY -m bench.hf_families --families "$group" --json "$OUT/hf_families.jsonl" $extra
        done
        ;;
    *)
        echo "unknown suite $suite (bash bench/run.sh --help)" | tee -a "$STATUS"
        ;;
    esac
done

# each command's own table, then the status of every command
for name in tests step step_broadcast-buffers step_no-broadcast-buffers compile_startup allreduce fallback cifar \
    shakespeare llama_recipe checkpoint_single checkpoint_fsdp scale_report hfio_report large_build large_offload \
    float8_gpt4096 float8_llama1b float8_gpt1.5b float8_curve plan_accuracy; do show "$name" 30; done
for log in "$OUT"/gpt_*.log "$OUT"/sharding_*.log; do
    case $log in *baseline*) ;; *) [ -f "$log" ] && show "$(basename "$log" .log)" 14 ;; esac
done
for log in "$OUT"/*baseline*.log; do [ -f "$log" ] && show "$(basename "$log" .log)" 2; done
show flagship 20
echo "=== commands"
cat "$STATUS"
