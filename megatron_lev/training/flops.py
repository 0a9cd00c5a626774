"""Model FLOPs of a training step, and MFU.

One formula, used for every log line (`training_flops`). It counts the matrix
multiplications of the model (what MFU conventionally measures, PaLM appendix B),
forward + backward = 3 x forward, and nothing that recomputation repeats:

    transformer, per token:   6 * N_matmul + 12 * L * D * s
        N_matmul = L * (D * (D + 2 * kv) + D * D + 3 * D * F) + D * V_padded [+ r * D]
          attention q, k, v (kv = kv_channels * num_query_groups, the GQA width) and out
          projections, the SwiGLU MLP (3 matrices), and the output head over the padded
          vocabulary; an input embedding *table* is a lookup (0 FLOPs), the factorised input
          side's r -> D projection a matrix (r = embedding_rank);
        12 * L * D * s: attention scores and the weighted sum of values, full s x s as in
          PaLM (no causal halving), s = sequence length;
    LEV generator, per DISTINCT token id of each micro-batch (it evaluates each once):
        3 * h * (2 * d_s * d_s + 2 * d_s * kappa * r + 2 * r * D)
          seed projection, the mode factors phi = basis @ S (lev/generator.py evaluates the
          basis densely over the kappa knots), and the aggregation to D; elementwise
          work (LayerNorm, spline weights, the log-sum product) is not counted.

MFU = achieved model FLOP/s per device / peak FLOP/s per device. Peaks are dense bf16
tensor-core numbers; pass --peak-tflops for anything else (fp32 runs, other parts).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

# Dense bf16 peak TFLOP/s per device (SXM parts).
PEAK_TFLOPS = {"a100": 312.0, "h100": 989.0, "h200": 989.0}


@dataclass(frozen=True)
class FlopsModel:
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    kv_width: int  # kv_channels * num_query_groups
    padded_vocab_size: int
    seq_length: int
    # LEV generator dims (None for table embeddings).
    lev_heads: Optional[int] = None
    lev_seed_dim: Optional[int] = None
    lev_knots: Optional[int] = None
    lev_modes: Optional[int] = None
    input_projection_params: int = 0  # the factorised input side's r x D projection (0 otherwise)

    @property
    def matmul_params(self) -> int:
        d, f, kv = self.hidden_size, self.ffn_hidden_size, self.kv_width
        per_layer = d * (d + 2 * kv) + d * d + 3 * d * f
        return self.num_layers * per_layer + d * self.padded_vocab_size + self.input_projection_params

    def transformer_flops_per_token(self) -> int:
        return 6 * self.matmul_params + 12 * self.num_layers * self.hidden_size * self.seq_length

    def lev_flops_per_distinct_token(self) -> int:
        if self.lev_heads is None:
            return 0
        ds, kappa, r = self.lev_seed_dim, self.lev_knots, self.lev_modes
        forward = self.lev_heads * (2 * ds * ds + 2 * ds * kappa * r + 2 * r * self.hidden_size)
        return 3 * forward


def training_flops(model: FlopsModel, tokens: int, distinct_tokens: int = 0) -> float:
    """Model FLOPs of training on `tokens` tokens whose micro-batches held
    `distinct_tokens` distinct ids in total (summed over micro-batches)."""
    return float(model.transformer_flops_per_token()) * tokens + float(model.lev_flops_per_distinct_token()) * distinct_tokens


def peak_flops_per_device(gpu_type: Optional[str], peak_tflops: Optional[float]) -> Optional[float]:
    """--peak-tflops wins over --gpu-type; None when neither is known (MFU not reported)."""
    if peak_tflops is not None:
        return peak_tflops * 1e12
    if gpu_type is not None:
        return PEAK_TFLOPS[gpu_type] * 1e12
    return None


def flops_model(model_config, seq_length: int) -> FlopsModel:
    lev = model_config.lev_config() if model_config.embedding == "lev" else None
    return FlopsModel(
        num_layers=model_config.num_layers, hidden_size=model_config.hidden_size,
        ffn_hidden_size=model_config.ffn_hidden_size,
        kv_width=model_config.kv_channels * (model_config.num_query_groups or model_config.num_attention_heads),
        padded_vocab_size=model_config.padded_vocab_size, seq_length=seq_length,
        lev_heads=lev.num_heads if lev else None, lev_seed_dim=lev.seed_dim if lev else None,
        lev_knots=lev.num_knots if lev else None, lev_modes=lev.num_modes if lev else None,
        input_projection_params=(model_config.embedding_rank * model_config.hidden_size
                                 if model_config.embedding == "factorized" else 0))
