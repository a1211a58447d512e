"""Casting policy for the RNN kernels that nn.RNN/LSTM/GRU and their cells call through `torch._VF`.

Data only: read by amp/lists/__init__.py. Patching these names on `torch._VF` makes every
recurrent module run in low precision under O1, with its FP32 weights cast (and cached) per call.
"""

__all__ = [
    "MODULE",
    "FP16_FUNCS",
    "FP32_FUNCS",
    "CASTS",
    "SEQUENCE_CASTS",
    "PROMOTED_BY_TORCH",
    "INPUT_DTYPE_FUNCS",
    "BANNED_FUNCS",
]

MODULE = "torch._VF"

FP16_FUNCS = (
    "lstm",
    "gru",
    "rnn_tanh",
    "rnn_relu",
    "lstm_cell",
    "gru_cell",
    "rnn_tanh_cell",
    "rnn_relu_cell",
)

FP32_FUNCS = ()

CASTS = ()

SEQUENCE_CASTS = ()

PROMOTED_BY_TORCH = ()

INPUT_DTYPE_FUNCS = ()

BANNED_FUNCS = ()
