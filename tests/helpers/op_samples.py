"""Sample arguments for every entry of amp's op tables, by name (and namespace where they differ).

`sample(entry, make)` returns (args, kwargs). `make(*shape, kind=...)` builds a floating tensor
in the dtype the test wants for that position ("any" random, "positive", "unit" in (-0.9, 0.9),
"prob" in (0, 1), "sign" in {-1, 1}); integer tensors are built directly.
"""

import torch

L, H, C = 5, 3, 4  # small sizes: sequence length, hidden, channels


def _spd(make, n=3):
    base = torch.randn(n, n)
    return make(tensor=base @ base.T + n * torch.eye(n))


def _well_conditioned(make, n=3):
    return make(tensor=torch.randn(n, n) + n * torch.eye(n))


def _lower(make, n=3):
    return make(
        tensor=torch.linalg.cholesky(torch.randn(n, n) @ torch.randn(n, n).T + n * torch.eye(n))
    )


def _rnn_weights(make, gates, hidden=H, inputs=C):
    return [
        make(gates * hidden, inputs),
        make(gates * hidden, hidden),
        make(gates * hidden),
        make(gates * hidden),
    ]


def _vf_rnn(make, gates, two_states):
    state = make(1, 2, H)
    hx = (state, make(1, 2, H)) if two_states else state
    return (make(L, 2, C), hx, _rnn_weights(make, gates), True, 1, 0.0, False, False, False), {}


def _geqrf(make):
    a, tau = torch.geqrf(torch.randn(3, 3))
    return make(tensor=a), make(tensor=tau)


def _lu(make):
    lu, pivots = torch.linalg.lu_factor(torch.randn(3, 3) + 3 * torch.eye(3))
    return make(tensor=lu), pivots


def _unpool(make, dims):
    x = torch.randn(1, 1, *([4] * dims))
    pool = torch.nn.functional.max_pool2d if dims == 2 else torch.nn.functional.max_pool3d
    out, indices = pool(x, 2, return_indices=True)
    return (make(tensor=out), indices, 2), {}


def _scaled_mm(make):
    a, b = make(16, 32), make(48, 32)
    one = torch.ones((), dtype=torch.float32)
    fp8 = torch.float8_e4m3fn
    return (a.to(fp8), b.to(fp8).t()), dict(scale_a=one, scale_b=one, out_dtype=a.dtype)


SAMPLES = {
    # -- lower precision ---------------------------------------------------------------------------
    "_convolution": lambda m: (
        (
            m(1, 2, 5, 5),
            m(3, 2, 3, 3),
            m(3),
            [1, 1],
            [0, 0],
            [1, 1],
            False,
            [0, 0],
            1,
            False,
            False,
            True,
            True,
        ),
        {},
    ),
    "conv1d": lambda m: ((m(1, 2, 8), m(3, 2, 3), m(3)), {}),
    "conv2d": lambda m: ((m(1, 2, 6, 6), m(3, 2, 3, 3), m(3)), {}),
    "conv3d": lambda m: ((m(1, 2, 4, 4, 4), m(3, 2, 2, 2, 2)), {}),
    "conv_tbc": lambda m: ((m(5, 1, 2), m(3, 2, 4), m(4), 1), {}),
    "conv_transpose1d": lambda m: ((m(1, 2, 5), m(2, 3, 3)), {}),
    "conv_transpose2d": lambda m: ((m(1, 2, 4, 4), m(2, 3, 3, 3)), {}),
    "conv_transpose3d": lambda m: ((m(1, 2, 3, 3, 3), m(2, 3, 2, 2, 2)), {}),
    "convolution": lambda m: (
        (m(1, 2, 5, 5), m(3, 2, 3, 3), None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1),
        {},
    ),
    "cudnn_convolution": lambda m: (
        (m(1, 2, 5, 5), m(3, 2, 3, 3), [0, 0], [1, 1], [1, 1], 1, False, False, True),
        {},
    ),
    "cudnn_convolution_transpose": lambda m: (
        (m(1, 2, 4, 4), m(2, 3, 3, 3), [0, 0], [0, 0], [1, 1], [1, 1], 1, False, False, True),
        {},
    ),
    "prelu": lambda m: ((m(2, 3, 4), m(3)), {}),
    "addmm": lambda m: ((m(3, 5), m(3, 4), m(4, 5)), {}),
    "addmv": lambda m: ((m(3), m(3, 4), m(4)), {}),
    "addr": lambda m: ((m(3, 4), m(3), m(4)), {}),
    "matmul": lambda m: ((m(3, 4), m(4, 5)), {}),
    "__matmul__": lambda m: ((m(3, 4), m(4, 5)), {}),
    "__rmatmul__": lambda m: ((m(3, 4), m(5, 3)), {}),
    "einsum": lambda m: (("ij,jk->ik", m(3, 4), m(4, 5)), {}),
    "mm": lambda m: ((m(3, 4), m(4, 5)), {}),
    "mv": lambda m: ((m(3, 4), m(4)), {}),
    "bmm": lambda m: ((m(2, 3, 4), m(2, 4, 5)), {}),
    "baddbmm": lambda m: ((m(2, 3, 5), m(2, 3, 4), m(2, 4, 5)), {}),
    "addbmm": lambda m: ((m(3, 5), m(2, 3, 4), m(2, 4, 5)), {}),
    "chain_matmul": lambda m: ((m(3, 4), m(4, 5), m(5, 2)), {}),
    "_addmm_activation": lambda m: ((m(3, 5), m(3, 4), m(4, 5)), {}),
    "lstm_cell": lambda m: ((m(2, C), (m(2, H), m(2, H)), *_rnn_weights(m, 4)), {}),
    "gru_cell": lambda m: ((m(2, C), m(2, H), *_rnn_weights(m, 3)), {}),
    "rnn_tanh_cell": lambda m: ((m(2, C), m(2, H), *_rnn_weights(m, 1)), {}),
    "rnn_relu_cell": lambda m: ((m(2, C), m(2, H), *_rnn_weights(m, 1)), {}),
    "linear": lambda m: ((m(2, 4), m(3, 4), m(3)), {}),
    "scaled_dot_product_attention": lambda m: ((m(1, 2, 4, 8), m(1, 2, 4, 8), m(1, 2, 4, 8)), {}),
    "_scaled_dot_product_flash_attention": lambda m: (
        (m(1, 2, 4, 8), m(1, 2, 4, 8), m(1, 2, 4, 8)),
        {},
    ),
    "_native_multi_head_attention": lambda m: (
        (m(2, 3, 8), m(2, 3, 8), m(2, 3, 8), 8, 2, m(24, 8), m(24), m(8, 8), m(8)),
        {},
    ),
    "vecdot": lambda m: ((m(3, 4), m(3, 4)), {}),
    "multi_dot": lambda m: (([m(3, 4), m(4, 5), m(5, 2)],), {}),
    "lstm": lambda m: _vf_rnn(m, 4, True),
    "gru": lambda m: _vf_rnn(m, 3, False),
    "rnn_tanh": lambda m: _vf_rnn(m, 1, False),
    "rnn_relu": lambda m: _vf_rnn(m, 1, False),
    # -- fp32 ----------------------------------------------------------------------------------------
    "acos": lambda m: ((m(3, 4, kind="unit"),), {}),
    "asin": lambda m: ((m(3, 4, kind="unit"),), {}),
    "cosh": lambda m: ((m(3, 4),), {}),
    "erfinv": lambda m: ((m(3, 4, kind="unit"),), {}),
    "exp": lambda m: ((m(3, 4),), {}),
    "expm1": lambda m: ((m(3, 4),), {}),
    "log": lambda m: ((m(3, 4, kind="positive"),), {}),
    "log10": lambda m: ((m(3, 4, kind="positive"),), {}),
    "log2": lambda m: ((m(3, 4, kind="positive"),), {}),
    "log1p": lambda m: ((m(3, 4, kind="positive"),), {}),
    "reciprocal": lambda m: ((m(3, 4, kind="positive"),), {}),
    "rsqrt": lambda m: ((m(3, 4, kind="positive"),), {}),
    "sinh": lambda m: ((m(3, 4),), {}),
    "tan": lambda m: ((m(3, 4, kind="unit"),), {}),
    "pow": lambda m: ((m(3, 4), 2.0), {}),
    "__pow__": lambda m: ((m(3, 4), 2.0), {}),
    "__rpow__": lambda m: ((m(3, 4), 2.0), {}),
    "polar": lambda m: ((m(3, kind="positive"), m(3)), {}),
    "layer_norm": lambda m: ((m(2, 5), [5]), {}),
    "native_layer_norm": lambda m: ((m(2, 5), [5], m(5), m(5), 1e-5), {}),
    "rms_norm": lambda m: ((m(2, 5), [5]), {}),
    "group_norm": lambda m: ((m(2, 4, 3), 2), {}),
    "norm": lambda m: ((m(3, 4),), {}),
    "frobenius_norm": lambda m: ((m(3, 4), [0, 1]), {}),
    "nuclear_norm": lambda m: ((m(3, 4),), {}),
    "renorm": lambda m: ((m(3, 4), 2, 0, 1.0), {}),
    "cosine_similarity": lambda m: ((m(3, 4), m(3, 4)), {}),
    "softmax": lambda m: ((m(3, 4), -1), {}),
    "log_softmax": lambda m: ((m(3, 4), -1), {}),
    "logsumexp": lambda m: ((m(3, 4), -1), {}),
    "sum": lambda m: ((m(3, 4),), {}),
    "prod": lambda m: ((m(3, 4),), {}),
    "cumsum": lambda m: ((m(3, 4), 0), {}),
    "cumprod": lambda m: ((m(3, 4), 0), {}),
    "std": lambda m: ((m(3, 4),), {}),
    "view_as_complex": lambda m: ((m(3, 2),), {}),
    "_scaled_mm": lambda m: _scaled_mm(m),
    "var": lambda m: ((m(3, 4),), {}),
    "dist": lambda m: ((m(3, 4), m(3, 4)), {}),
    "pdist": lambda m: ((m(4, 3),), {}),
    "cdist": lambda m: ((m(3, 4), m(2, 4)), {}),
    "trace": lambda m: ((m(3, 3),), {}),
    "quantile": lambda m: ((m(10), 0.5), {}),
    "nanquantile": lambda m: ((m(10), 0.5), {}),
    "poisson_nll_loss": lambda m: ((m(3, 4), m(3, 4, kind="positive")), {}),
    "cosine_embedding_loss": lambda m: ((m(3, 4), m(3, 4), m(3, kind="sign")), {}),
    "hinge_embedding_loss": lambda m: ((m(3, 4), m(3, 4, kind="sign")), {}),
    "kl_div": lambda m: ((m(3, 4).log_softmax(-1), m(3, 4).softmax(-1)), {}),
    "margin_ranking_loss": lambda m: ((m(3), m(3), m(3, kind="sign")), {}),
    "triplet_margin_loss": lambda m: ((m(3, 4), m(3, 4), m(3, 4)), {}),
    "binary_cross_entropy_with_logits": lambda m: ((m(3, 4), m(3, 4, kind="prob")), {}),
    "ctc_loss": lambda m: (
        (
            m(6, 2, 5).log_softmax(-1),
            torch.tensor([[1, 2], [3, 1]]),
            torch.tensor([6, 5]),
            torch.tensor([2, 2]),
        ),
        {},
    ),
    "stft": lambda m: ((m(64), 16), dict(window=torch.hann_window(16), return_complex=True)),
    "cholesky": lambda m: ((_spd(m),), {}),
    "cholesky_ex": lambda m: ((_spd(m),), {}),
    "cholesky_inverse": lambda m: ((_lower(m),), {}),
    "cholesky_solve": lambda m: ((m(3, 2), _lower(m)), {}),
    "inverse": lambda m: ((_well_conditioned(m),), {}),
    "inv": lambda m: ((_well_conditioned(m),), {}),
    "inv_ex": lambda m: ((_well_conditioned(m),), {}),
    "pinverse": lambda m: ((m(3, 4),), {}),
    "lu_solve": lambda m: ((m(3, 2), *_lu(m)), {}),
    "orgqr": lambda m: (_geqrf(m), {}),
    "householder_product": lambda m: (_geqrf(m), {}),
    "ormqr": lambda m: ((*_geqrf(m), m(3, 2)), {}),
    "geqrf": lambda m: ((m(3, 3),), {}),
    "qr": lambda m: ((m(3, 3),), {}),
    "svd": lambda m: ((m(3, 3),), {}),
    "triangular_solve": lambda m: ((m(3, 2), _well_conditioned(m).triu()), {}),
    "max_pool3d": lambda m: ((m(1, 1, 4, 4, 4), 2), {}),
    "fake_quantize_per_tensor_affine": lambda m: ((m(3, 4), 0.1, 0, 0, 255), {}),
    "interpolate": lambda m: ((m(1, 1, 4, 4),), dict(scale_factor=2)),
    "grid_sample": lambda m: (
        (m(1, 1, 4, 4), m(1, 3, 3, 2, kind="unit")),
        dict(align_corners=False),
    ),
    "softplus": lambda m: ((m(3, 4),), {}),
    "softmin": lambda m: ((m(3, 4), -1), {}),
    "gelu": lambda m: ((m(3, 4),), {}),
    "pad": lambda m: ((m(1, 2, 5), (2, 2), "reflect"), {}),
    "local_response_norm": lambda m: ((m(1, 4, 3, 3), 2), {}),
    "normalize": lambda m: ((m(3, 4),), {}),
    "cross_entropy": lambda m: ((m(3, 5), torch.tensor([0, 4, 2])), {}),
    "l1_loss": lambda m: ((m(3, 4), m(3, 4)), {}),
    "mse_loss": lambda m: ((m(3, 4), m(3, 4)), {}),
    "multilabel_margin_loss": lambda m: (
        (m(2, 4), torch.tensor([[3, 0, -1, 1], [0, 1, 2, -1]])),
        {},
    ),
    "multilabel_soft_margin_loss": lambda m: ((m(2, 4), m(2, 4, kind="prob").round()), {}),
    "multi_margin_loss": lambda m: ((m(2, 4), torch.tensor([1, 3])), {}),
    "nll_loss": lambda m: ((m(3, 5).log_softmax(-1), torch.tensor([0, 4, 2])), {}),
    "smooth_l1_loss": lambda m: ((m(3, 4), m(3, 4)), {}),
    "huber_loss": lambda m: ((m(3, 4), m(3, 4)), {}),
    "soft_margin_loss": lambda m: ((m(3, 4), m(3, 4, kind="sign")), {}),
    "avg_pool3d": lambda m: ((m(1, 1, 4, 4, 4), 2), {}),
    "max_unpool2d": lambda m: _unpool(m, 2),
    "max_unpool3d": lambda m: _unpool(m, 3),
    "adaptive_avg_pool3d": lambda m: ((m(1, 1, 4, 4, 4), 2), {}),
    "adaptive_max_pool3d": lambda m: ((m(1, 1, 4, 4, 4), 2), {}),
    "fractional_max_pool2d": lambda m: (
        (m(1, 1, 6, 6), 2),
        dict(output_size=3, _random_samples=torch.rand(1, 1, 2)),
    ),
    "fractional_max_pool3d": lambda m: (
        (m(1, 1, 6, 6, 6), 2),
        dict(output_size=3, _random_samples=torch.rand(1, 1, 3)),
    ),
    "cpu": lambda m: ((m(3, 4),), {}),
    "vector_norm": lambda m: ((m(3, 4),), {}),
    "matrix_norm": lambda m: ((m(3, 3),), {}),
    "cond": lambda m: ((_well_conditioned(m),), {}),
    "matrix_rank": lambda m: ((m(3, 3),), {}),
    "solve": lambda m: ((_well_conditioned(m), m(3, 2)), {}),
    "svdvals": lambda m: ((m(3, 3),), {}),
    "eigvals": lambda m: ((m(3, 3),), {}),
    "eigvalsh": lambda m: ((_spd(m),), {}),
    "tensorinv": lambda m: (
        (m(tensor=torch.randn(4, 2, 2) + torch.eye(4).reshape(4, 2, 2) * 3),),
        dict(ind=1),
    ),
    "tensorsolve": lambda m: ((m(tensor=torch.eye(6).reshape(2, 3, 6) * 2), m(2, 3)), {}),
    "eig": lambda m: ((m(3, 3),), {}),
    "eigh": lambda m: ((_spd(m),), {}),
    "lstsq": lambda m: ((m(4, 3), m(4, 2)), {}),
    "fft": lambda m: ((m(8),), {}),
    "ifft": lambda m: ((m(8),), {}),
    "fft2": lambda m: ((m(4, 4),), {}),
    "ifft2": lambda m: ((m(4, 4),), {}),
    "fftn": lambda m: ((m(4, 4),), {}),
    "ifftn": lambda m: ((m(4, 4),), {}),
    "rfft": lambda m: ((m(8),), {}),
    "rfft2": lambda m: ((m(4, 4),), {}),
    "rfftn": lambda m: ((m(4, 4),), {}),
    "ihfft": lambda m: ((m(8),), {}),
    # These take a complex input, which amp never casts; the real input form is their inverse's.
    "irfft": lambda m: ((m(8),), {}),
    "irfft2": lambda m: ((m(4, 4),), {}),
    "irfftn": lambda m: ((m(4, 4),), {}),
    "hfft": lambda m: ((m(8),), {}),
    # -- promote -------------------------------------------------------------------------------------
    "addcdiv": lambda m: ((m(3), m(3), m(3, kind="positive")), {}),
    "addcmul": lambda m: ((m(3), m(3), m(3)), {}),
    "atan2": lambda m: ((m(3), m(3)), {}),
    "bilinear": lambda m: ((m(2, 3), m(2, 4), m(5, 3, 4), m(5)), {}),
    "cross": lambda m: ((m(3, 3), m(3, 3)), dict(dim=1)),
    "dot": lambda m: ((m(4), m(4)), {}),
    "vdot": lambda m: ((m(4), m(4)), {}),
    "grid_sampler": lambda m: ((m(1, 1, 4, 4), m(1, 3, 3, 2, kind="unit"), 0, 0, False), {}),
    "index_put": lambda m: ((m(5), (torch.tensor([0, 3]),), m(2)), {}),
    "index_copy": lambda m: ((m(5, 3), 0, torch.tensor([1, 4]), m(2, 3)), {}),
    "scatter_add": lambda m: (
        (m(3, 4), 0, torch.tensor([[0, 1, 2, 0], [2, 1, 0, 1]]), m(2, 4)),
        {},
    ),
    "tensordot": lambda m: ((m(3, 4), m(4, 5)), dict(dims=1)),
    **{
        name: (lambda m: ((m(3, 4), m(3, 4)), {}))
        for name in (
            "add",
            "div",
            "mul",
            "eq",
            "equal",
            "ge",
            "gt",
            "le",
            "lt",
            "ne",
            "__add__",
            "__radd__",
            "__sub__",
            "__rsub__",
            "__mul__",
            "__rmul__",
            "__div__",
            "__rdiv__",
            "__truediv__",
            "__rtruediv__",
            "__eq__",
            "__ne__",
            "__ge__",
            "__gt__",
            "__le__",
            "__lt__",
        )
    },
    "cat": lambda m: (([m(2, 3), m(2, 3), m(1, 3)],), {}),
    "stack": lambda m: (([m(2, 3), m(2, 3)],), {}),
    # -- banned --------------------------------------------------------------------------------------
    "binary_cross_entropy": lambda m: ((m(3, 4, kind="prob"), m(3, 4, kind="prob")), {}),
}

# Where one namespace's signature differs from the others'.
NAMESPACE_SAMPLES = {
    ("torch", "poisson_nll_loss"): lambda m: (
        (m(3, 4), m(3, 4, kind="positive"), True, False, 1e-8, 1),
        {},
    ),
    ("torch", "cosine_embedding_loss"): lambda m: (
        (m(3, 4), m(3, 4), m(3, kind="sign"), 0.0, 1),
        {},
    ),
    ("torch", "hinge_embedding_loss"): lambda m: ((m(3, 4), m(3, 4, kind="sign"), 1.0, 1), {}),
    ("torch", "margin_ranking_loss"): lambda m: ((m(3), m(3), m(3, kind="sign"), 0.0, 1), {}),
    ("torch", "triplet_margin_loss"): lambda m: (
        (m(3, 4), m(3, 4), m(3, 4), 1.0, 2.0, 1e-6, False, 1),
        {},
    ),
    ("torch", "kl_div"): lambda m: ((m(3, 4).log_softmax(-1), m(3, 4).softmax(-1)), {}),
    ("torch.nn.functional", "kl_div"): lambda m: (
        (m(3, 4).log_softmax(-1), m(3, 4).softmax(-1)),
        dict(reduction="batchmean"),
    ),
    ("torch", "group_norm"): lambda m: ((m(2, 4, 3), 2), {}),
    ("torch", "max_pool3d"): lambda m: ((m(1, 1, 4, 4, 4), [2, 2, 2]), {}),
    ("torch.linalg", "norm"): lambda m: ((m(3, 4),), {}),
    ("torch.linalg", "qr"): lambda m: ((m(3, 3),), {}),
    ("torch.linalg", "svd"): lambda m: ((m(3, 3),), {}),
    ("torch.linalg", "cholesky"): lambda m: ((_spd(m),), {}),
    ("torch.fft", "irfft"): lambda m: ((m(8, kind="complex"),), {}),
    ("torch.fft", "irfft2"): lambda m: ((m(4, 4, kind="complex"),), {}),
    ("torch.fft", "irfftn"): lambda m: ((m(4, 4, kind="complex"),), {}),
    ("torch.fft", "hfft"): lambda m: ((m(8, kind="complex"),), {}),
}

# Entries that have no CPU kernel at all, whatever the dtype.
CUDA_ONLY = {
    ("torch", "cudnn_convolution"),
    ("torch", "cudnn_convolution_transpose"),
    ("torch", "_scaled_dot_product_flash_attention"),
}


# LAPACK-backed ops: torch's own results can differ in the last bit from call to call (MKL picks
# paths by memory alignment; seen with linalg.lstsq), so these compare with a tight tolerance.
LAPACK = {
    "lstsq",
    "pinverse",
    "svd",
    "svdvals",
    "qr",
    "eig",
    "eigvals",
    "eigh",
    "eigvalsh",
    "cholesky",
    "cholesky_ex",
    "cholesky_inverse",
    "cholesky_solve",
    "inverse",
    "inv",
    "inv_ex",
    "solve",
    "cond",
    "matrix_rank",
    "lu_solve",
    "triangular_solve",
    "geqrf",
    "orgqr",
    "ormqr",
    "householder_product",
    "tensorinv",
    "tensorsolve",
    "nuclear_norm",
    "matrix_norm",
}


# Samples whose tensors are already in the dtypes the op needs (FP8 operands, FP32 scales): a
# control call takes them as they are.
KEEP_DTYPES = {"_scaled_mm"}


def sample(entry, make):
    """(args, kwargs) for `entry` (an amp.lists.Entry)."""
    key = (entry.namespace, entry.name)
    builder = NAMESPACE_SAMPLES.get(key) or SAMPLES[entry.name]
    return builder(make)
