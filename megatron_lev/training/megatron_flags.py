"""Megatron-LM's `pretrain_gpt.py` flags (core_v0.16.1) as `python -m megatron_lev.train` sees
them: accepted with a warning (no work to do here; a third element lists the only values
accepted, the decoder's), refused (cannot apply here, with the reason), supported with a note
worth knowing, and the flags that are ours alone. The model's own settings (--num-layers,
--rotary-percent, --qk-layernorm, ...) are models/settings.py's table.

Every flag our parser defines under a Megatron-LM name has Megatron's meaning.
"""
from __future__ import annotations

TRAIN_IGNORED = {
    "--use-mcore-models": (0, "the model is always built from megatron-core layers"),
    "--deepspeed": (0, "training always runs under DeepSpeed"),
    "--swiglu": (0, "the MLP is always SwiGLU"),
    "--disable-bias-linear": (0, "linear layers never have biases"),
    "--normalization": (1, "always RMSNorm", ("RMSNorm",)),
    "--position-embedding-type": (1, "always RoPE (--rotary-base sets its base)", ("rope",)),
    "--no-position-embedding": (0, "RoPE needs no position table"),
    "--max-position-embeddings": (1, "RoPE has no position table; --seq-length sets the length"),
    "--untie-embeddings-and-output-weights": (0, "the config's model.embedding (lev / tied / untied / factorized) decides"),
    "--group-query-attention": (0, "--num-query-groups decides"),
    "--use-flash-attn": (0, "attention runs through torch SDPA, which picks flash attention on GPUs"),
    "--transformer-impl": (1, "the model uses its own megatron-core layers (no Transformer Engine)"),
    "--no-masked-softmax-fusion": (0, "no fused softmax kernel is used"),
    "--no-bias-gelu-fusion": (0, "no fused bias-GeLU kernel is used"),
    "--no-bias-swiglu-fusion": (0, "no fused bias-SwiGLU kernel is used"),
    "--no-bias-dropout-fusion": (0, "no fused bias-dropout kernel is used"),
    "--no-rope-fusion": (0, "no fused RoPE kernel is used"),
    "--no-gradient-accumulation-fusion": (0, "gradients accumulate in DeepSpeed's fp32 buffers"),
    "--use-distributed-optimizer": (0, "optimizer state is sharded by DeepSpeed ZeRO (--zero-stage, default 1)"),
    "--overlap-grad-reduce": (0, "DeepSpeed's JSON (overlap_comm) decides"),
    "--overlap-param-gather": (0, "DeepSpeed's JSON (overlap_comm) decides"),
    "--log-validation-ppl-to-tensorboard": (0, "validation perplexity is always logged"),
    "--log-timers-to-tensorboard": (0, "iteration-time is always logged"),
    "--log-memory-to-tensorboard": (0, "memory is always logged"),
    "--log-straggler": (0, "the slowest rank is always in the log line (rank time min/max)"),
    "--num-dataset-builder-threads": (1, "rank 0 builds the dataset indices once, cached"),
    "--no-create-attention-mask-in-dataloader": (0, "no mask is built (the model is causal)"),
    "--dataloader-type": (1, "the sampler is always Megatron's 'single' pretraining sampler"),
}

TRAIN_REFUSED = {
    "--fp16": (0, "fp16 needs loss scaling, which is not wired here; use --bf16 (or fp32)"),
    "--fp8-format": (1, "fp8 needs Transformer Engine, which the model does not use"),
    "--checkpoint-activations": (0, "gone from Megatron-LM too; use --recompute-activations or "
                                    "--recompute-granularity"),
    "--recompute-modules": (None, "selective recompute covers core attention only (--recompute-granularity "
                                  "selective)"),
    "--distribute-saved-activations": (0, "recomputed activations are not sharded over TP here"),
    "--reset-attention-mask": (0, "the model's attention is causal over the whole sequence (SDPA without a "
                                  "per-document mask); --reset-position-ids and --eod-mask-loss apply"),
    "--rampup-batch-size": (3, "batch-size ramp-up is not implemented (the global batch is fixed)"),
    "--context-parallel-size": (1, "context parallelism is not implemented"),
    "--virtual-pipeline-model-parallel-size": (1, "DeepSpeed's pipeline engine has no interleaved schedule"),
    "--num-layers-per-virtual-pipeline-stage": (1, "DeepSpeed's pipeline engine has no interleaved schedule"),
    "--num-experts": (1, "mixture-of-experts models are not implemented"),
    "--expert-model-parallel-size": (1, "mixture-of-experts models are not implemented"),
    "--finetune": (0, "a weights-only start at iteration 0 is not implemented; --no-load-optim loads the weights "
                      "without the optimizer state"),
    "--use-checkpoint-args": (0, "--config defines the model; a checkpoint of another model is refused"),
    "--ckpt-format": (1, "checkpoints are DeepSpeed's (tools/convert_to_hf.py / convert_from_hf.py convert)"),
}

# Supported, with Megatron's meaning; what is worth knowing about a few of them here.
SUPPORTED_NOTES = {
    "--sequence-parallel": "parsed; the decoder refuses it for now (only the LEV embedding implements it)",
    "--deepspeed-config": "Megatron-DeepSpeed's flag; a path or a packaged name (zero1/2/3, zero3_offload)",
    "--recompute-activations": "selective recompute (core attention), as in Megatron",
    "--lr-decay-style": "default cosine here (Megatron: linear); the packaged configs set it",
    "--exit-signal-handler": "on by default here (SIGTERM and SIGUSR1)",
    "--log-throughput": "adds TFLOP/s per GPU (and MFU with --gpu-type) to the log line",
    "--timing-log-level": "1: Megatron's timer block after each log line (forward-backward, all-grads-sync, "
                          "optimizer); 2: also batch-generator, forward-compute, backward-compute; timed by CUDA "
                          "events, no synchronisation added to the step",
    "--logging-level": "10 (debug) also shows what a run's log leaves out: DeepSpeed's memory dumps, "
                       "megatron-core warnings that do not apply here",
    "--local-rank": "the deepspeed launcher's; the rank is read from the environment",
    "--tokenizer-type": "GPT2BPETokenizer (--vocab-file, --merge-file; Megatron-LM's ids), SentencePieceTokenizer, "
                        "GPTSentencePieceTokenizer, HuggingFaceTokenizer; preprocessing also Llama2Tokenizer "
                        "(BOS first)",
    "--make-vocab-size-divisible-by": "pads the tokenizer's vocabulary to a multiple of this x TP (default 128), "
                                      "as Megatron",
    "--rotary-percent": "RoPE on the first int(kv_channels x it) dims of each head, as megatron-core (exported as "
                        "rope_parameters' partial_rotary_factor)",
    "--qk-layernorm": "an RMSNorm of each query and key head before RoPE, as megatron-core",
    "--use-rope-scaling": "LLaMA 3's RoPE scaling, as megatron-core (exported as rope_type llama3)",
    "--kv-channels": "the head size (default hidden size / heads)",
    "--attention-backend": "torch SDPA's backends: auto (default) prefers cuDNN's attention on Hopper and later, "
                           "flash, fused (cuDNN's; CUDA only), unfused and local (the math backend)",
}

# Flags of megatron_lev.train that Megatron-LM does not have.
TRAIN_OWN_FLAGS = ("--config", "--zero-stage", "--train-tokens", "--keep-last-checkpoints", "--metrics-file",
                   "--keep-checkpoints-every",
                   "--gpu-type", "--peak-tflops", "--max-skipped-steps", "--embedding",
                   "--freeze-input-embedding", "--embedding-rank", "--lev-init-from", "--compile-layers",
                   "--override-checkpoint-args", "--trust-remote-code", "--lev-lr-mult", "--lev-clip-grad",
                   "--lev-no-weight-decay", "--lev-union-ids")
