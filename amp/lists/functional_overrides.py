"""Casting policy for functions in `torch.nn.functional`. Data only: read by amp/lists/__init__.py.

F.instance_norm and F.batch_norm are not listed: they accept low-precision inputs with FP32
weights and statistics, which is what O2 keeps. F.embedding runs in its weight's dtype.
"""

__all__ = [
    "MODULE",
    "FP16_FUNCS",
    "FP32_FUNCS",
    "INPUT_DTYPE_FUNCS",
    "FLOAT8_FUNCS",
    "CASTS",
    "SEQUENCE_CASTS",
    "PROMOTED_BY_TORCH",
    "DELEGATES",
    "C_MODULE",
    "C_BINDINGS",
    "BANNED_FUNCS",
]

MODULE = "torch.nn.functional"

FP16_FUNCS = (
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_tbc",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
    "linear",
    "prelu",
    "scaled_dot_product_attention",
)

FP32_FUNCS = (
    # Interpolation and sampling
    "interpolate",
    "grid_sample",
    # Pointwise
    "softplus",
    "softmin",
    "log_softmax",
    "softmax",
    # Normalisation
    "layer_norm",
    "rms_norm",
    "group_norm",
    "local_response_norm",
    "normalize",
    "cosine_similarity",
    "pdist",
    # Losses
    "poisson_nll_loss",
    "cosine_embedding_loss",
    "cross_entropy",
    "hinge_embedding_loss",
    "kl_div",
    "l1_loss",
    "mse_loss",
    "margin_ranking_loss",
    "multilabel_margin_loss",
    "multilabel_soft_margin_loss",
    "multi_margin_loss",
    "nll_loss",
    "binary_cross_entropy_with_logits",
    "smooth_l1_loss",
    "huber_loss",
    "soft_margin_loss",
    "triplet_margin_loss",
    "ctc_loss",
    # Pooling that torch's CPU autocast runs in FP32
    "avg_pool3d",
    "max_pool3d",
    "max_unpool2d",
    "max_unpool3d",
    "adaptive_avg_pool3d",
    "adaptive_max_pool3d",
    "fractional_max_pool2d",
    "fractional_max_pool3d",
)

# apex ran these in FP32. torch's kernels compute them in FP32 internally for float16 and bfloat16
# inputs and round once into the input's dtype, as torch.autocast leaves them: FP32 would only
# add casts and traffic (GPT-2's gelu: two casts each way and twice the bytes, per layer). Listed,
# checked, never patched; `amp.register_float_function(torch.nn.functional, "gelu")` gives apex's
# choice back.
# F.pad needs no FP32 either (it copies values); torch's CPU autocast runs its reflection and
# replication kernels in FP32 for speed only.
INPUT_DTYPE_FUNCS = ("gelu", "pad")

# Where float8 is on (amp.initialize / amp.autocast(float8=...)), these run their three matmuls
# in FP8 when in features, out features and tokens are multiples of 16 (amp/casting/float8.py);
# otherwise, and where float8 is off, they keep their FP16_FUNCS policy.
FLOAT8_FUNCS = ("linear",)

CASTS = ("bilinear",)

SEQUENCE_CASTS = ()

PROMOTED_BY_TORCH = ()

# Functions that only pass their tensors on to a patched entry of the same policy ("namespace",
# "name"). They stay in the tables above (their policy is tested through them) but are not
# wrapped while that entry is: one policy check per call instead of two.
DELEGATES = {
    "layer_norm": ("torch", "layer_norm"),
    "rms_norm": ("torch", "rms_norm"),
    "group_norm": ("torch", "group_norm"),
    "softmax": ("torch.Tensor", "softmax"),
    "softmin": ("torch.Tensor", "softmax"),
    "log_softmax": ("torch.Tensor", "log_softmax"),
    "kl_div": ("torch", "kl_div"),
    "poisson_nll_loss": ("torch", "poisson_nll_loss"),
    "cosine_embedding_loss": ("torch", "cosine_embedding_loss"),
    "hinge_embedding_loss": ("torch", "hinge_embedding_loss"),
    "margin_ranking_loss": ("torch", "margin_ranking_loss"),
    "binary_cross_entropy_with_logits": ("torch", "binary_cross_entropy_with_logits"),
    "triplet_margin_loss": ("torch", "triplet_margin_loss"),
    "ctc_loss": ("torch", "ctc_loss"),
    # The losses below pass their tensors to their torch._C._nn binding (C_BINDINGS).
    "cross_entropy": ("torch._C._nn", "cross_entropy_loss"),
    "nll_loss": ("torch._C._nn", "nll_loss_nd"),
    "l1_loss": ("torch._C._nn", "l1_loss"),
    "mse_loss": ("torch._C._nn", "mse_loss"),
    "huber_loss": ("torch._C._nn", "huber_loss"),
    "soft_margin_loss": ("torch._C._nn", "soft_margin_loss"),
    "multilabel_margin_loss": ("torch._C._nn", "multilabel_margin_loss"),
    "multi_margin_loss": ("torch._C._nn", "multi_margin_loss"),
}

# The C bindings in torch._C._nn behind these functions, which libraries (and torch's own
# autocast tests) call directly. Each is patched with its function's policy (from the lists above
# or a registration), under its own name; a name the installed torch lacks is skipped.
C_MODULE = "torch._C._nn"
C_BINDINGS = {
    "linear": ("linear",),
    "scaled_dot_product_attention": ("scaled_dot_product_attention",),
    "interpolate": (
        "upsample_nearest1d",
        "upsample_nearest2d",
        "upsample_nearest3d",
        "_upsample_nearest_exact1d",
        "_upsample_nearest_exact2d",
        "_upsample_nearest_exact3d",
        "upsample_linear1d",
        "upsample_bilinear2d",
        "_upsample_bilinear2d_aa",
        "upsample_trilinear3d",
        "upsample_bicubic2d",
        "_upsample_bicubic2d_aa",
        "_upsample_lanczos2d_aa",
    ),
    "softplus": ("softplus",),
    "gelu": ("gelu",),
    "cross_entropy": ("cross_entropy_loss",),
    "l1_loss": ("l1_loss",),
    "mse_loss": ("mse_loss",),
    "multilabel_margin_loss": ("multilabel_margin_loss",),
    "multi_margin_loss": ("multi_margin_loss",),
    "nll_loss": ("nll_loss", "nll_loss2d", "nll_loss_nd"),
    "smooth_l1_loss": ("smooth_l1_loss",),
    "huber_loss": ("huber_loss",),
    "soft_margin_loss": ("soft_margin_loss",),
    "avg_pool3d": ("avg_pool3d",),
    "max_pool3d": ("max_pool3d_with_indices",),
    "max_unpool2d": ("max_unpool2d",),
    "max_unpool3d": ("max_unpool3d",),
    "adaptive_avg_pool3d": ("adaptive_avg_pool3d",),
    "adaptive_max_pool3d": ("adaptive_max_pool3d",),
    "fractional_max_pool2d": ("fractional_max_pool2d",),
    "fractional_max_pool3d": ("fractional_max_pool3d",),
    "binary_cross_entropy": ("binary_cross_entropy",),
    "pad": (
        "pad",
        "reflection_pad1d",
        "reflection_pad2d",
        "replication_pad1d",
        "replication_pad2d",
        "replication_pad3d",
    ),
}

BANNED_FUNCS = (
    (
        "binary_cross_entropy",
        "\namp does not work out-of-the-box with `F.binary_cross_entropy` or `torch.nn.BCELoss.` "
        "It requires that the output of the previous function be already a FloatTensor. \n\n"
        "Most models have a Sigmoid right before BCELoss. In that case, you can use\n"
        "    torch.nn.BCEWithLogitsLoss\n"
        "to combine Sigmoid+BCELoss into a single layer that is compatible with amp.\n"
        "Another option is to add\n"
        "    amp.register_float_function(torch, 'sigmoid')\n"
        "before calling `amp.initialize()`, or to compute the loss inside "
        "`with amp.disable_casts():` on FP32 inputs.",
    ),
)
