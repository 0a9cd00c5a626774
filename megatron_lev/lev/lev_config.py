"""The LEV generator's configuration (LEVConfig) and its parameters' names: torch-free, and
exported beside lev/generator.py (as lev_config.py, which lev.py imports) in Hugging Face folders.
The math is in generator.py; the fields' meaning in its docstring and docs/lev.md.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

DIGIT_ORDERS = ("msb_first", "lsb_first")
HEAD_SHARDED_PARAMETERS = ("w_seed", "ln_gamma", "ln_beta", "delta", "w_out", "knot_scale",  # knot_scale: optional
                           "mode_offset")  # mode_offset: with `center_modes` only
REPLICATED_PARAMETERS = ("codebooks", "out_norm_weight")  # out_norm_weight: with `output_norm` only
MODE_PRODUCTS = ("product", "geometric_mean")  # LEVConfig.mode_product
MATMUL_DTYPES = ("float32", "bfloat16")  # LEVConfig.matmul_dtype


def smallest_base(vocab_size: int, num_coordinates: int) -> int:
    """The smallest integer b with b**k >= V, in exact integer arithmetic."""
    b = max(1, int(round(vocab_size ** (1.0 / num_coordinates))))
    while b ** num_coordinates < vocab_size:
        b += 1
    while b > 1 and (b - 1) ** num_coordinates >= vocab_size:
        b -= 1
    return b


@dataclass
class LEVConfig:
    """Every hyper-parameter of the generator; defaults are the spec's. `digit_base` pins the
    base instead of deriving it from `vocab_size` (for instance to keep a checkpoint's codebook
    shape when the vocabulary grows); it must still satisfy `digit_base ** k >= vocab_size`."""

    vocab_size: int
    hidden_size: int
    num_coordinates: int = 3  # k
    seed_dim: int = 128  # d_s
    num_heads: int = 8  # h
    num_knots: int = 16  # kappa
    num_modes: int = 64  # r
    init_std: float = 0.02
    delta_init_std: float = 0.1
    layernorm_eps: float = 1e-5
    log_eps: float = 1e-9
    digit_order: str = "msb_first"
    unique_ids: bool = True
    digit_base: Optional[int] = None
    # Initialisation options (docs/lev.md, "Initialisation"); off by default, the spec's init.
    init_embedding_rms: Optional[float] = None  # scale W_out: embedding RMS at init (0.02 = an N(0, 0.02) table)
    init_remove_shared: bool = False  # project W_out off the mean mode: tokens share no direction at init
    # The generator's own knobs (docs/lev.md, "Knobs"); the defaults are the spec's generator.
    ln_gain_init: float = 1.0  # LayerNorm gain gamma at init; 3.63 spreads x = sigmoid(u / 2) over every knot
    output_norm: bool = False  # RMSNorm of the embedding (after the sum over all heads), learned gain
    output_norm_init: float = 0.02  # that gain at init: an N(0, 0.02) table's RMS
    # The basis as the author's KHRONOS layer builds it (docs/lev.md, "The author's training").
    knot_scale_learnable: bool = False  # t = |x - g_j| * s[l, d], s a parameter initialised to kappa - 1
    basis_normalize: bool = True  # divide the weights by their sum (the spec); KHRONOS does not
    # Remedies for the modes' shared direction (docs/lev.md, "The modes' shared direction"; issue 49).
    mode_product: str = "product"  # "geometric_mean": sign * exp(mean_d log|phi'|), the log-sum over d_s
    mode_groups: int = 1  # G: each mode the mean over G groups of d_s / G coordinates of their product
    center_modes: bool = False  # subtract a learned per-mode offset, initialised to the modes' mean over
    #                              a fixed sample of ids (calibration_ids): no shared direction at init
    # The two dense products (W_seed, W_out) in float32 (the spec), or with both operands rounded to
    # bfloat16 (tensor cores, float32 accumulation inside the GEMM; issue 50). Not a size field.
    matmul_dtype: str = "float32"

    spec_basis = property(lambda self: self.basis_normalize and not self.knot_scale_learnable,
                          doc="The spec's basis (fixed scale, normalised): the 3-knot form, the fused kernels.")
    spec_product = property(lambda self: self.mode_product == "product" and self.mode_groups == 1,
                            doc="The spec's mode: one product over all d_s coordinates.")
    fused_modes = property(lambda self: self.spec_basis and self.spec_product,
                           doc="The spec's basis and product: the compiled CPU path and the fused kernels.")

    def __post_init__(self):
        self.validate()

    @property
    def base(self) -> int:
        if self.digit_base is not None:
            return self.digit_base
        return smallest_base(self.vocab_size, self.num_coordinates)

    def validate(self, tp_size: int = 1) -> "LEVConfig":
        """Raise ValueError naming the offending field for an impossible config."""
        for name in ("vocab_size", "hidden_size", "num_coordinates", "seed_dim", "num_heads", "num_modes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"LEVConfig.{name}={value!r} must be a positive integer")
        if isinstance(self.num_knots, bool) or not isinstance(self.num_knots, int) or self.num_knots < 2:
            raise ValueError(f"LEVConfig.num_knots={self.num_knots!r} must be an integer >= 2")
        for name, minimum in (("init_std", 0), ("delta_init_std", 0), ("layernorm_eps", None), ("log_eps", None),
                              ("ln_gain_init", None), ("output_norm_init", None), ("init_embedding_rms", None)):
            value = getattr(self, name)
            if (value is not None or name != "init_embedding_rms") and (isinstance(value, bool) or not (
                    isinstance(value, (int, float)) and math.isfinite(value)
                    and (value > 0 if minimum is None else value >= minimum))):
                raise ValueError(f"LEVConfig.{name}={value!r} must be a finite number "
                                 f"{'> 0' if minimum is None else '>= 0'}{' or None' * (name == 'init_embedding_rms')}")
        for name in ("init_remove_shared", "output_norm", "knot_scale_learnable", "basis_normalize", "center_modes"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"LEVConfig.{name}={getattr(self, name)!r} must be true or false")
        if self.digit_order not in DIGIT_ORDERS:
            raise ValueError(f"LEVConfig.digit_order={self.digit_order!r} must be one of {DIGIT_ORDERS}")
        if self.matmul_dtype not in MATMUL_DTYPES:
            raise ValueError(f"LEVConfig.matmul_dtype={self.matmul_dtype!r} must be one of {MATMUL_DTYPES}")
        if self.mode_product not in MODE_PRODUCTS:
            raise ValueError(f"LEVConfig.mode_product={self.mode_product!r} must be one of {MODE_PRODUCTS}")
        g = self.mode_groups
        if isinstance(g, bool) or not isinstance(g, int) or g < 1 or self.seed_dim % g:
            raise ValueError(f"LEVConfig.mode_groups={g!r} must be a positive integer dividing seed_dim "
                             f"{self.seed_dim} (each group holds seed_dim / mode_groups coordinates)")
        b, k = self.digit_base, self.num_coordinates
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 1):
            raise ValueError(f"LEVConfig.digit_base={b!r} must be a positive integer or None")
        if b is not None and b ** k < self.vocab_size:
            raise ValueError(f"LEVConfig.digit_base={b}: {b}**{k} = {b ** k} < vocab_size {self.vocab_size}, "
                             "so some ids have no digits")
        if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
            raise ValueError(f"tensor-parallel size {tp_size!r} must be a positive integer")
        if self.num_heads % tp_size != 0:
            raise ValueError(f"LEVConfig.num_heads={self.num_heads} must be divisible by the tensor-parallel size "
                             f"{tp_size} (--tensor-model-parallel-size): heads are split over TP ranks")
        return self

    def num_parameters(self) -> int:
        """Spec formula: k*b*d_s + h*(d_s^2 + 2*d_s) + h*d_s*kappa*r + h*r*D (+ D with `output_norm`,
        + h*d_s with `knot_scale_learnable`, + h*r with `center_modes`)."""
        k, b, ds, h = self.num_coordinates, self.base, self.seed_dim, self.num_heads
        kappa, r, d = self.num_knots, self.num_modes, self.hidden_size
        return (k * b * ds + h * (ds * ds + 2 * ds) + h * ds * kappa * r + h * r * d + d * self.output_norm
                + h * ds * self.knot_scale_learnable + h * r * self.center_modes)

    def parameter_names(self) -> tuple[str, ...]:
        """The generator's parameters, replicated ones first (what a full state dict holds)."""
        optional = {"out_norm_weight": self.output_norm, "knot_scale": self.knot_scale_learnable,
                    "mode_offset": self.center_modes}
        return tuple(n for n in (*REPLICATED_PARAMETERS, *HEAD_SHARDED_PARAMETERS) if optional.get(n, True))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "LEVConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"LEVConfig: unknown field(s) {unknown} (known: {sorted(known)})")
        return cls(**data)
