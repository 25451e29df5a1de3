"""A model's weights checked where the runner reads them, so damaged weights or a config that does not fit them are
refused in one line instead of decoding garbage with exit code 0.

Two checks, both at load (``Runner.from_pretrained``, ``Runner.from_model``): the config against the weights
(``layerskip_core.families.check_weights``: every layer's tensors there, no layers beyond ``num_hidden_layers``,
shapes the config's sizes give; the config's own fields are checked first, ``check_config``), and every floating
tensor for NaN or infinite values (``nonfinite_tensor``: one reduction a tensor, one host read in all). A folder's
scan is paid once: a clean result is recorded under the toolkit cache keyed by the folder's stamp
(``layerskip_core.models.folder_stamp``: the weights files' sizes and modification times, the config's hash), so a
later load of the same, unchanged folder skips it. A model object is scanned once per runner built on it.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch import Tensor

from infer.model.weights import strip_prefix
from layerskip_core import jsonfile
from layerskip_core.errors import UserError
from layerskip_core.families import ModelSpec, check_config, check_weights, loading_problem
from layerskip_core.models import checked_record, record_checked

DAMAGED = "the checkpoint is damaged (a bad download, a failed conversion or a diverged training): use another copy"
RECORD_MIN_BYTES = 16 * 2**20
"""Folders whose weights are smaller are scanned on every load (a scan of under a few ms: cheaper than its record)."""


def nonfinite_tensor(state: dict[str, Tensor]) -> str | None:
    """The name of the first floating tensor of ``state`` holding a NaN or an infinity, or None. Each tensor is summed
    in fp32 (any NaN or infinity makes its sum non-finite), all sums read at once; only where a sum is not finite are
    the tensors checked value by value (a finite sum can also overflow)."""
    floats = [(name, t) for name, t in state.items() if t.is_floating_point() and t.numel()]
    if not floats:
        return None
    sums = torch.stack([torch.sum(t, dtype=torch.float32) for _, t in floats])  # (n,) one pass over each tensor
    if bool(sums.isfinite().all()):
        return None
    return next((name for name, t in floats if not bool(t.isfinite().all())), None)


def check_state(state: dict[str, Tensor], config, where: str = "the model's weights") -> None:
    """Refuse a model object's weights (``state``, its state dict) that do not fit ``config`` or hold NaN or infinite
    values, in one line naming ``where``."""
    state = strip_prefix(state)
    spec = ModelSpec.from_config(config)
    check_weights(spec, {name: tuple(t.shape) for name, t in state.items()}, "the model's config", lambda _: where)
    bad = nonfinite_tensor(state)
    if bad is not None:
        raise UserError(f"{where}: tensor {bad!r} holds NaN or infinite values; decoding with it gives garbage: "
                        "load weights that are whole")


def load_checked(path: Path) -> tuple[object, dict[str, Tensor]]:
    """(config, state dict) of the HF folder ``path``, each checked: the config's fields, the weights against the
    config, the weights for NaN or infinite values (skipped when the folder's stamp was scanned clean before)."""
    config_file = path / "config.json"
    check_config(jsonfile.read(config_file, "model config file"), str(config_file))
    config = _auto_config(path)
    state, files = _read_weights(path)
    spec = ModelSpec.from_config(config, str(config_file))
    check_weights(spec, {name: tuple(t.shape) for name, t in state.items()}, str(config_file),
                  lambda name: files.get(name, str(path)))
    recorded = sum(t.numel() * t.element_size() for t in state.values()) >= RECORD_MIN_BYTES
    if not (recorded and checked_record(path).is_file()):
        start = time.perf_counter()
        bad = nonfinite_tensor(state)
        if bad is not None:
            raise UserError(f"{files.get(bad, path)}: tensor {bad!r} holds NaN or infinite values; {DAMAGED}")
        if recorded:
            record_checked(path, time.perf_counter() - start)
    return config, state


def _auto_config(path: Path):
    """transformers' config of the folder; what it refuses that ``check_config`` let through is one line too."""
    from transformers import AutoConfig  # here: a --help that imports drafters stays fast

    try:
        return AutoConfig.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - transformers' strict config validation raises its own error types
        why = " ".join(str(e).split())[:300]
        raise UserError(f"{path / 'config.json'}: transformers cannot read it ({type(e).__name__}: {why}); fix it, "
                        "or use the config.json the checkpoint was saved with") from None


def _read_weights(path: Path) -> tuple[dict[str, Tensor], dict[str, str]]:
    """(state dict with ``model.`` stripped, the file of each tensor) of a folder's safetensors files, or of its
    ``.bin`` checkpoint through transformers (whose loading report says which tensors did not fit)."""
    from safetensors.torch import load_file

    found = sorted(path.glob("*.safetensors"))
    state, files = {}, {}
    for f in found:
        part = strip_prefix(load_file(f))
        state.update(part)
        files.update(dict.fromkeys(part, str(f)))
    if found:
        return state, files
    return _read_bin(path), {}


def _read_bin(path: Path) -> dict[str, Tensor]:
    """A ``.bin`` checkpoint's state dict through transformers; tensors it found in the file and dropped (layers
    beyond the config's), did not find or found in another shape are refused, as ``check_weights`` refuses them in
    safetensors."""
    from transformers import AutoModelForCausalLM

    try:
        model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    except RuntimeError as e:  # tensors of another shape than the config's (transformers' report is above)
        raise UserError(f"{path}: its .bin weights do not fit its config.json ({' '.join(str(e).split())[:200]})") \
            from None
    problem = loading_problem(info)
    if problem is not None:
        raise UserError(f"{path}: its .bin weights do not fit its config.json ({problem}); fix the config, or use "
                        "the one the checkpoint was saved with")
    return strip_prefix(model.state_dict())
