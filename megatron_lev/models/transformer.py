"""One decoder layer: pre-RMSNorm, RoPE self-attention (grouped-query optional) through
`F.scaled_dot_product_attention(is_causal=True)`, and a SwiGLU MLP; no biases anywhere.
`compile_decoder_layers` compiles each layer with torch.compile (torchtitan's per-block way);
`set_attention_backend` picks SDPA's backends (Megatron-LM's --attention-backend)."""
from __future__ import annotations

import contextlib
import subprocess
import warnings

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatron_lev.distributed.rng import get_rng_tracker
from megatron_lev.models.config import LeviathanConfig
from megatron_lev.models.layers import ColumnLinear, RMSNorm, RowLinear, apply_rotary, checkpoint, init_rng
from megatron_lev.models.settings import ATTENTION_BACKENDS


# Megatron-LM's --attention-backend values (ATTENTION_BACKENDS) as torch SDPA's backends, in
# priority order. Megatron's "fused" is Transformer Engine's cuDNN attention; "unfused" and
# "local" compute softmax(QK^T)V plainly (SDPA's math backend); "flash" is flash attention.
_NAMED_BACKENDS = {"flash": (SDPBackend.FLASH_ATTENTION,), "fused": (SDPBackend.CUDNN_ATTENTION,),
                   "unfused": (SDPBackend.MATH,), "local": (SDPBackend.MATH,)}
# "auto" on Hopper and later: cuDNN's attention first (reported 1.7-2.3x faster than flash for
# training shapes there; not yet timed by this project), then torch's own order. Where cuDNN
# cannot take the inputs, SDPA goes down the list.
HOPPER_PRIORITY = (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                   SDPBackend.MATH)


def sdpa_backends(name: str, device: torch.device) -> tuple | None:
    """The SDPA backends `--attention-backend name` allows on `device`, in priority order, or None
    (torch's own choice: "auto" before Hopper and off CUDA)."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"--attention-backend {name!r}: must be one of {', '.join(ATTENTION_BACKENDS)}")
    device = torch.device(device)
    if name == "fused" and device.type != "cuda":
        raise ValueError(f"--attention-backend fused: cuDNN attention needs CUDA (this run is on {device.type})")
    if name != "auto":
        return _NAMED_BACKENDS[name]
    if device.type == "cuda" and torch.backends.cudnn.is_available() and torch.cuda.get_device_capability(device)[0] >= 9:
        return HOPPER_PRIORITY
    return None


class SelfAttention(torch.nn.Module):
    """Causal self-attention with RoPE and grouped-query attention; this rank's heads only."""

    def __init__(self, config: LeviathanConfig):
        super().__init__()
        self.config = config
        tp = parallel_state.get_tensor_model_parallel_world_size()
        self.head_dim = config.kv_channels
        self.num_heads = config.num_attention_heads // tp
        self.num_groups = config.num_query_groups // tp
        self.heads_per_group = config.num_attention_heads // config.num_query_groups
        self.qkv = ColumnLinear(
            config.hidden_size, (config.num_attention_heads + 2 * config.num_query_groups) * self.head_dim,
            config=config, init_method=config.init_method, bias=False, gather_output=False)
        self.out_proj = RowLinear(
            config.num_attention_heads * self.head_dim, config.hidden_size, config=config,
            init_method=config.output_layer_init_method, bias=False, input_is_parallel=True,
            skip_bias_add=True)
        self.sdpa_backends = None  # torch's own order until set_attention_backend
        self.recompute_core_attention = (config.recompute_granularity == "selective"
                                         and "core_attn" in (config.recompute_modules or []))
        if config.qk_layernorm:  # RMSNorm of each query and key head (megatron-core's q/k_layernorm)
            self.q_norm = RMSNorm(self.head_dim, config.layernorm_epsilon, config.params_dtype)
            self.k_norm = RMSNorm(self.head_dim, config.layernorm_epsilon, config.params_dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        s, b, _ = x.shape
        qkv, _ = self.qkv(x)
        qkv = qkv.view(s, b, self.num_groups, self.heads_per_group + 2, self.head_dim)
        # Views, no copies: RoPE runs once on the q and k heads together; `split`'s backward
        # is one concatenation where slicing q, k and v apart costs three zero-fills + copies.
        qk, v = qkv.split((self.heads_per_group + 1, 1), dim=3)
        if self.config.qk_layernorm:
            qk = self._qk_norm(qk)
        qk = apply_rotary(qk, cos.unsqueeze(2), sin.unsqueeze(2))  # [s, b, groups, hpg + 1, dh]
        q = qk[:, :, :, :self.heads_per_group].reshape(s, b, self.num_heads, self.head_dim)  # a view at MHA
        k, v = qk[:, :, :, -1], v.squeeze(3)  # [s, b, groups, dh]
        if self.recompute_core_attention:
            out = checkpoint(self.core_attention, q, k, v)
        else:
            out = self.core_attention(q, k, v)
        out, _ = self.out_proj(out)
        return out

    def _qk_norm(self, qk: torch.Tensor) -> torch.Tensor:
        """[s, b, groups, hpg + 1, dh]: the query heads normed with q_norm's scale, the key head with
        k_norm's. Each TP rank holds other heads, so the scales' gradients are summed over TP (as
        megatron-core's finalize_model_grads does for GPTModel's q/k_layernorm)."""
        q_scale, k_scale = self.q_norm.weight, self.k_norm.weight
        if parallel_state.get_tensor_model_parallel_world_size() > 1:
            group = parallel_state.get_tensor_model_parallel_group()
            q_scale = copy_to_tensor_model_parallel_region(q_scale, group=group)
            k_scale = copy_to_tensor_model_parallel_region(k_scale, group=group)
        scale = torch.cat((q_scale.expand(self.heads_per_group, -1), k_scale.unsqueeze(0)))
        return F.rms_norm(qk, (self.head_dim,), None, self.config.layernorm_epsilon) * scale

    def backend_context(self):
        """SDPA restricted to (and ordered by) this layer's backends, or torch's own choice."""
        if self.sdpa_backends is None:
            return contextlib.nullcontext()
        return sdpa_kernel(list(self.sdpa_backends), set_priority=True)

    def core_attention(self, q, k, v):
        """[s, b, n, dh] q and [s, b, g, dh] k/v -> [s, b, n * dh]."""
        s, b = q.shape[:2]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, dh]
        p = self.config.attention_dropout if self.training else 0.0
        # Dropout draws from the model-parallel stream: each TP rank holds different heads.
        rng = get_rng_tracker().fork() if p > 0 else contextlib.nullcontext()
        with rng, self.backend_context():
            # GQA inside the kernel (query head i uses kv head i // heads_per_group, our
            # grouping): no repeat_interleave copies of k and v.
            out = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True,
                                                 enable_gqa=self.heads_per_group > 1)
        return out.permute(2, 0, 1, 3).reshape(s, b, self.num_heads * self.head_dim)


class SwiGLUMLP(torch.nn.Module):
    """down(silu(gate(x)) * up(x)); gate and up fused in one column-parallel matmul."""

    def __init__(self, config: LeviathanConfig):
        super().__init__()
        # stride=2: rank r's shard is [gate_r; up_r], so chunk(2) below works for any TP.
        self.gate_up = ColumnLinear(
            config.hidden_size, 2 * config.ffn_hidden_size, config=config, init_method=config.init_method,
            bias=False, gather_output=False, stride=2)
        self.down = RowLinear(
            config.ffn_hidden_size, config.hidden_size, config=config,
            init_method=config.output_layer_init_method, bias=False, input_is_parallel=True,
            skip_bias_add=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up, _ = self.gate_up(x)
        gate, up = gate_up.chunk(2, dim=-1)
        out, _ = self.down(F.silu(gate) * up)
        return out


class DecoderLayer(torch.nn.Module):
    """x + attention(norm(x)), then + mlp(norm(x)). `layer_number` is 0-based."""

    def __init__(self, config: LeviathanConfig, layer_number: int):
        super().__init__()
        self.config, self.layer_number = config, layer_number
        with init_rng(config.init_seed, f"layers.{layer_number}"):
            self.input_norm = RMSNorm(config.hidden_size, config.layernorm_epsilon, config.params_dtype)
            self.attention = SelfAttention(config)
            self.mlp_norm = RMSNorm(config.hidden_size, config.layernorm_epsilon, config.params_dtype)
            self.mlp = SwiGLUMLP(config)
        self.compiled_forward = None

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.compiled_forward is not None:
            try:
                return self.compiled_forward(hidden, cos, sin)
            except Exception as exc:
                if not is_compiler_failure(exc):
                    raise
                self.compiled_forward = None  # this layer runs eagerly from now on
                _warn_compile_failure(self.layer_number, exc)
        return self.layer_forward(hidden, cos, sin)

    def layer_forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The layer's math (what `compile` compiles)."""
        hidden = hidden + self._dropout(self.attention(self.input_norm(hidden), cos, sin))
        return hidden + self._dropout(self.mlp(self.mlp_norm(hidden)))

    def compile(self, **kwargs) -> None:
        """Compile `layer_forward` with torch.compile (`forward` then runs it; it falls back to
        `layer_forward`, with one warning per process, when Inductor or Triton cannot compile).

        At TP > 1 without SP the column-parallel layers all-reduce their input gradient with
        megatron-core's synchronous copy-to-TP mapping instead of its `async_op=True` all-reduce,
        which dynamo cannot trace (a graph break on every rank): the compiled layer is then one
        graph on every rank, the same graph. The eager path keeps the async all-reduce, which
        overlaps the weight-gradient matmul."""
        for module in self.modules():
            if isinstance(module, ColumnLinear) and module.allreduce_dgrad:
                module.allreduce_dgrad = False
        self.compiled_forward = torch.compile(self.layer_forward, **kwargs)

    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        p = self.config.hidden_dropout
        # The residual stream is replicated over TP: the default stream (same seed on all TP
        # ranks) gives every rank the same mask.
        return F.dropout(x, p, training=True) if p > 0 and self.training else x


def compile_decoder_layers(module: torch.nn.Module) -> int:
    """torch.compile every DecoderLayer of `module` in place (torchtitan's per-block
    compilation: one graph per layer, reused by all layers of the same shape; parameter
    names unchanged). Inductor fuses RoPE, SwiGLU, RMSNorm and the residual adds into a
    few kernels around the matmuls and attention. Returns how many layers it compiled."""
    layers = [m for m in module.modules() if isinstance(m, DecoderLayer)]
    for layer in layers:
        layer.compile(dynamic=False)
    return len(layers)


def set_attention_backend(module: torch.nn.Module, name: str, device: torch.device) -> tuple | None:
    """Every attention of `module` uses SDPA's backends for `--attention-backend name` on `device`
    (`sdpa_backends`); returns them (None: torch's own order)."""
    backends = sdpa_backends(name, device)
    for attention in (m for m in module.modules() if isinstance(m, SelfAttention)):
        attention.sdpa_backends = backends
    return backends


def sdpa_backend_used(module: torch.nn.Module, batch: int, seq: int, dtype: torch.dtype, device) -> str:
    """The SDPA backend that `module`'s first attention runs for a [batch, seq] micro-batch of
    `dtype` on `device` (what torch's dispatcher picks under the layer's backends), by name."""
    attention = next(m for m in module.modules() if isinstance(m, SelfAttention))
    shape = (batch, attention.num_heads, seq, attention.head_dim)
    q = torch.zeros(shape, dtype=dtype, device=device)
    kv = torch.zeros((batch, attention.num_groups, seq, attention.head_dim), dtype=dtype, device=device)
    with attention.backend_context():
        choice = torch._fused_sdp_choice(q, kv, kv, dropout_p=attention.config.attention_dropout, is_causal=True,
                                         enable_gqa=attention.heads_per_group > 1)
    return SDPBackend(choice).name


def is_compiler_failure(exc: BaseException) -> bool:
    """Whether `exc` says the compiler toolchain failed (Inductor's backend, Triton's build of a
    kernel or its launcher: no C compiler, no Python.h), rather than the model."""
    from torch._dynamo.exc import BackendCompilerFailed  # Inductor's InductorError is one

    if isinstance(exc, (BackendCompilerFailed, subprocess.CalledProcessError)):
        return True
    return type(exc).__module__.startswith("triton") or any(
        text in str(exc) for text in ("C compiler", "C++ compiler", "Python.h"))


_compile_failures = []


def _warn_compile_failure(layer_number: int, exc: BaseException) -> None:
    _compile_failures.append(layer_number)
    if len(_compile_failures) == 1:
        first_line = (str(exc).strip().splitlines() or [""])[0][:200]
        warnings.warn(f"--compile-layers: torch.compile failed for decoder layer {layer_number}, running the "
                      f"layers that fail eagerly (same math, slower): {type(exc).__name__}: {first_line}")
