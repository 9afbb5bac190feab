"""An original checkpoint that stores MoE experts fused, seen one tensor per expert projection.

Some checkpoints keep the routed experts of a layer in two 3-D tensors (Qwen3-VL-MoE:
``mlp.experts.gate_up_proj`` and ``mlp.experts.down_proj``), either in the layout transformers 5
holds in memory (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``, what its
``save_pretrained`` writes) or transposed (``[E, H, 2I]`` and ``[E, I, H]``, the released
checkpoints, which transformers transposes while it loads them). msquant exports one Linear per
expert (``mlp.experts.3.gate_proj.weight [I, H]``, as msModelSlim does), so ``verify`` compares
each exported expert with its slice of the fused original: :func:`split_fused_experts`.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from msquant.model.moe.experts import FUSED_PARAMS, ROLE_PARAM, ROLES, expert_slice
from msquant.verify.tensors import TensorStore

__all__ = ["fused_layout", "split_fused_experts"]


def fused_layout(gate_up: tuple[int, ...], down: tuple[int, ...]) -> bool | None:
    """Whether fused experts of these shapes are stored transposed (``[E, H, 2I]`` /
    ``[E, I, H]``: True) or in the model's layout (``[E, 2I, H]`` / ``[E, H, I]``: False);
    None when the shapes are neither.

    The two tensors decide together, so even ``2I == H`` (a square ``gate_up_proj``) is not
    ambiguous: the model's layout needs ``gate_up[1] == 2 * down[2]`` and
    ``gate_up[2] == down[1]``, the transposed one ``gate_up[2] == 2 * down[1]`` and
    ``gate_up[1] == down[2]``; both at once would need ``I == 0``.
    """
    if len(gate_up) != 3 or len(down) != 3 or gate_up[0] != down[0] or 0 in down:
        return None
    if gate_up[1] == 2 * down[2] and gate_up[2] == down[1]:
        return False
    if gate_up[2] == 2 * down[1] and gate_up[1] == down[2]:
        return True
    return None


class _SplitExpertsStore(TensorStore):
    """``store`` with each fused experts pair replaced by per-expert Linear weights."""

    def __init__(self, store: TensorStore, fused: dict[str, bool]) -> None:
        """:param fused: experts module name -> whether its fused tensors are transposed."""
        infos = {k: v for k, v in store.infos.items() if not _fused_module_of(k, fused)}
        self._split: dict[str, tuple[str, int, str, bool]] = {}
        for module, transposed in fused.items():
            gate_up = store.infos[f"{module}.gate_up_proj"]
            num_experts, hidden = gate_up.shape[0], store.infos[f"{module}.down_proj"].shape[1]
            if transposed:
                hidden = gate_up.shape[1]
            inter = gate_up.shape[2 if transposed else 1] // 2
            for e in range(num_experts):
                for role in ROLES:
                    param = f"{module}.{ROLE_PARAM[role]}"
                    shape = (hidden, inter) if role == "down_proj" else (inter, hidden)
                    name = f"{module}.{e}.{role}.weight"
                    infos[name] = replace(store.infos[param], shape=shape)
                    self._split[name] = (param, e, role, transposed)
        super().__init__(store.directory, infos, store.files)
        self._handles = store._handles
        self._fused_infos = {k: v for k, v in store.infos.items() if k not in infos}
        self._cached: tuple[str, torch.Tensor] | None = None

    def get(self, name: str) -> torch.Tensor:
        """Load one tensor; a per-expert weight is cut out of its fused tensor (the last fused
        tensor read is kept, as experts are read one after the other)."""
        if name not in self._split:
            return super().get(name)
        param, expert, role, transposed = self._split[name]
        if self._cached is None or self._cached[0] != param:
            fused = TensorStore(self.directory, self._fused_infos, self.files)
            fused._handles = self._handles
            value = fused.get(param)
            self._cached = (param, value.transpose(1, 2) if transposed else value)
        return expert_slice(self._cached[1], expert, role).contiguous()

    def close(self) -> None:
        self._cached = None
        super().close()


def _fused_module_of(name: str, fused: dict[str, bool]) -> bool:
    module, _, leaf = name.rpartition(".")
    return leaf in FUSED_PARAMS and module in fused


def split_fused_experts(store: TensorStore) -> TensorStore:
    """``store`` where every module holding both ``gate_up_proj`` and ``down_proj`` as 3-D
    tensors of a fused experts layout (:func:`fused_layout`) lists and reads its experts as
    ``<module>.<e>.gate_proj.weight`` / ``up_proj`` / ``down_proj`` ``[out, in]`` instead;
    ``store`` itself when it holds none."""
    fused: dict[str, bool] = {}
    for name, info in store.infos.items():
        module, _, leaf = name.rpartition(".")
        down = store.infos.get(f"{module}.down_proj")
        if leaf != "gate_up_proj" or down is None:
            continue
        transposed = fused_layout(info.shape, down.shape)
        if transposed is not None:
            fused[module] = transposed
    return _SplitExpertsStore(store, fused) if fused else store
