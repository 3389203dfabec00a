"""The one table of dtype names: what configs, checkpoints and the weight-update wire may say.

Names are torch's attribute names (`torch.bfloat16` is "bfloat16"). No torch import at module level:
the config and the CLI use these names without loading torch.
"""

from __future__ import annotations

MODEL_DTYPES = ("float32", "bfloat16", "float16")  # what `model.dtype` may be: training and serving
WIRE_DTYPES = (*MODEL_DTYPES, "float64", "int64", "int32", "int16", "int8", "uint8")  # any tensor of an update


def torch_dtype(name: str):
    """The torch dtype called `name` (one of WIRE_DTYPES); ValueError naming the choices otherwise."""
    if name not in WIRE_DTYPES:
        raise ValueError(f"dtype {name!r} is not one of {', '.join(WIRE_DTYPES)}")
    import torch

    return getattr(torch, name)


def dtype_name(dtype) -> str:
    """The table name of a torch dtype (`torch.bfloat16` -> "bfloat16")."""
    name = str(dtype).removeprefix("torch.")
    if name not in WIRE_DTYPES:
        raise ValueError(f"dtype {name!r} is not one of {', '.join(WIRE_DTYPES)}")
    return name
