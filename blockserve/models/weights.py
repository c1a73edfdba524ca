"""Checkpoint tensors onto a model's parameters: (name, tensor) pairs into a model built on the meta
device, as the family's `CheckpointLayout` (data, not code) says. It reads no files: models/loader.py
passes the tensors in as it reads them.

    checkpoint name ─► ignored? ─► renames ─► (our parameter, piece) ─► weight_loader ─► assembled ─► placed

    plain    model.norm.weight                                 ─► model.norm.weight
    fused    ….self_attn.{q,k,v}_proj.weight                   ─► ….self_attn.qkv_proj.weight   (dim 0, in order)
    experts  ….mlp.experts.{e}.{gate,up}_proj.weight           ─► ….mlp.experts.gate_up_proj    [E, 2I, H]
             ….mlp.experts.{e}.down_proj.weight                ─► ….mlp.experts.down_proj       [E, H, I]

A fused or stacked target is used only where the model has that parameter (Kimi's MLA `q_proj`
stays a `q_proj`); a name the model has is taken as it is (stacked experts may also arrive whole,
under transformers' state_dict names). A piece is (expert, part): expert None outside a stack.

Extension point — narrowing, e.g. tensor-parallel sharding: a parameter may carry an attribute
`weight_loader(tensor, *, part, expert) -> tensor`. It receives every full checkpoint tensor meant
for it (part, expert: its piece, None for a plain weight) and returns the tensor to copy in, e.g.
this rank's rows of it. The model declares that parameter at its own (narrowed) shape, which is
what the assembled result is checked against. Without the attribute a tensor is used as it is.

Each checkpoint tensor is moved to the Placement's device and dtype as it is read (sharing memory
with the checkpoint tensor when it is there already), so pieces are assembled there; with
`placement.keep_16bit_weights`, a bfloat16 or float16 tensor bound for a parameter that
models/half_linear.py's `keeps_16bit` names keeps its dtype. A parameter of an integer dtype (packed
quantized data, such as MXFP4 blocks and scales) takes a tensor of that dtype as it is.
Errors are ValueErrors: a mis-shaped weight at once;
otherwise one "checkpoint does not match" error naming the unexpected and the missing weights.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn

from blockserve.models.half_linear import HALF_DTYPES, keeps_16bit
from blockserve.models.placement import Placement


@dataclass(frozen=True)
class Fused:
    """Checkpoint projections `parts` (module names) concatenated along dim 0, in order, into our `target`."""

    target: str
    parts: tuple[str, ...]


QKV = Fused("qkv_proj", ("q_proj", "k_proj", "v_proj"))
GATE_UP = Fused("gate_up_proj", ("gate_proj", "up_proj"))
SWIGLU_EXPERTS = (GATE_UP, Fused("down_proj", ("down_proj",)))  # per expert, stacked as moe.Experts holds them


@dataclass(frozen=True)
class CheckpointLayout:
    """How a family's checkpoint names map onto its parameters (see the module docstring).

    renames: (regex, replacement) pairs applied in order to every name (re.sub).
    ignore: regexes (re.search) of checkpoint names that are not loaded, besides rotary tables.
    ignore_layers_past_config: `model.layers.N.*` with N >= num_hidden_layers is not loaded
    (DeepSeek's multi-token-prediction layer, as transformers ignores it).
    """

    fused: tuple[Fused, ...] = ()
    experts: tuple[Fused, ...] = ()  # per-expert `….experts.{e}.<part>.weight` -> `….experts.<target>`
    renames: tuple[tuple[str, str], ...] = ()
    ignore: tuple[str, ...] = ()
    ignore_layers_past_config: bool = False


_ROTARY_TABLE = re.compile(r"rotary_emb\.inv_freq$")  # saved by some checkpoints; ours is computed
_PER_EXPERT = re.compile(r"(.+\.experts)\.(\d+)\.([^.]+)\.weight")
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


@dataclass
class _Pieces:
    """What has arrived of one fused or stacked parameter; `template` names a piece's checkpoint
    weight from {e} and {part}."""

    group: Fused
    experts: int | None
    template: str
    tensors: dict[tuple[int | None, int], torch.Tensor] = field(default_factory=dict)

    def complete(self) -> bool:
        return len(self.tensors) == len(self.group.parts) * (self.experts or 1)

    def names(self, absent: bool = False) -> list[str]:
        return [self.template.format(e=e, part=part) for e in (range(self.experts) if self.experts else [None])
                for p, part in enumerate(self.group.parts) if not absent or (e, p) not in self.tensors]

    def assemble(self, target: str, shape: torch.Size) -> torch.Tensor:
        def parts(e: int | None) -> torch.Tensor:
            pieces = [self.tensors[e, p] for p in range(len(self.group.parts))]
            return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

        try:
            return parts(None) if self.experts is None else torch.stack([parts(e) for e in range(self.experts)])
        except RuntimeError:
            shapes = ", ".join(str(tuple(t.shape)) for t in self.tensors.values())
            raise ValueError(f"weights {self.names()[:3]}{' ...' if len(self.tensors) > 3 else ''} have shapes "
                             f"{shapes} that do not assemble into the {tuple(shape)} the model built from the "
                             f"config expects for {target}; does config.json match the checkpoint?") from None


class _Slot(NamedTuple):
    """Where one checkpoint weight goes: our parameter, and its piece of it (group None: all of it)."""

    target: str
    group: Fused | None = None
    expert: int | None = None
    part: int | None = None
    template: str = ""  # the checkpoint names of the pieces, from {e} and {part}


def load_checkpoint(model: nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]], layout: CheckpointLayout,
                    placement: Placement, *, num_layers: int, ignore_names: frozenset[str] = frozenset()) -> None:
    """Materialise every parameter of `model` from (checkpoint name, tensor) pairs as `layout` says;
    names in `ignore_names` (e.g. a tied lm_head) are skipped. See the module docstring."""
    params = dict(model.named_parameters())
    fused = {part: (group, i) for group in layout.fused for i, part in enumerate(group.parts)}
    experts = {part: (group, i) for group in layout.experts for i, part in enumerate(group.parts)}
    renames = [(re.compile(pattern), replacement) for pattern, replacement in layout.renames]
    ignored = [re.compile(pattern) for pattern in layout.ignore] + [_ROTARY_TABLE]
    pending: dict[str, _Pieces] = {}
    loaded: set[str] = set()
    unexpected: list[str] = []
    for name, tensor in named_tensors:
        layer = _LAYER.match(name)
        if (name in ignore_names or any(pattern.search(name) for pattern in ignored)
                or (layout.ignore_layers_past_config and layer and int(layer[1]) >= num_layers)):
            continue
        ours = name
        for pattern, replacement in renames:
            ours = pattern.sub(replacement, ours)
        slot = _slot_of(ours, params, fused, experts)
        if slot is None:
            unexpected.append(name)
            continue
        param = params[slot.target]
        narrow = getattr(param, "weight_loader", None)
        if narrow is not None:
            tensor = narrow(tensor, part=slot.part, expert=slot.expert)
        # Onto the device in the model's dtype (or its kept 16 bits) now, one tensor at a time: a fused
        # or stacked parameter is assembled there, never as a float32 copy on the host.
        tensor = tensor.to(device=placement.device, dtype=_stored_dtype(model, slot.target, tensor.dtype, placement))
        if slot.group is None:
            _place(model, slot.target, tensor, param.shape, f"weight {name}", placement)
            loaded.add(slot.target)
            continue
        pieces = pending.setdefault(slot.target, _Pieces(slot.group, None if slot.expert is None else param.shape[0],
                                                          slot.template))
        pieces.tensors[slot.expert, slot.part] = tensor
        if pieces.complete():
            what = f"the assembly of {pieces.names()[0]} … ({len(pieces.tensors)} weights)"
            _place(model, slot.target, pieces.assemble(slot.target, param.shape), param.shape, what, placement)
            loaded.add(slot.target)
            del pending[slot.target]
    missing = [n for target in params if target not in loaded
               for n in (pending[target].names(absent=True) if target in pending else _names_of(target, layout))]
    if unexpected or missing:
        raise ValueError(
            f"checkpoint does not match the {type(model).__name__} built from its config: "
            f"unexpected weights {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}, "
            f"missing weights {missing[:8]}{' ...' if len(missing) > 8 else ''}"
        )


def _slot_of(name: str, params: dict[str, nn.Parameter], fused: dict, experts: dict) -> _Slot | None:
    """Where checkpoint weight `name` (renamed) goes, or None when the model has no place for it."""
    match = _PER_EXPERT.fullmatch(name)
    if match and match[3] in experts:
        group, part = experts[match[3]]
        target, expert = f"{match[1]}.{group.target}", int(match[2])
        if target in params and expert < params[target].shape[0]:
            return _Slot(target, group, expert, part, f"{match[1]}.{{e}}.{{part}}.weight")
    if name in params:
        return _Slot(name)
    module, _, leaf = name.rpartition(".")
    parent, _, proj = module.rpartition(".")
    if proj in fused:
        group, part = fused[proj]
        target = f"{parent}.{group.target}.{leaf}"
        if target in params:
            return _Slot(target, group, None, part, f"{parent}.{{part}}.{leaf}")
    return None


def _names_of(target: str, layout: CheckpointLayout) -> list[str]:
    """The checkpoint names of a parameter none of whose pieces arrived."""
    module, _, leaf = target.rpartition(".")
    parent, _, ours = module.rpartition(".")
    group = next((g for g in layout.fused if g.target == ours), None)
    return [target] if group is None else [f"{parent}.{part}.{leaf}" for part in group.parts]


def _stored_dtype(model: nn.Module, target: str, dtype: torch.dtype, placement: Placement) -> torch.dtype:
    """The dtype parameter `target` holds a checkpoint tensor of `dtype` in (see the module docstring)."""
    declared = model.get_parameter(target).dtype
    if not declared.is_floating_point:  # packed quantized data (MXFP4 blocks and scales): kept as stored
        if dtype != declared:
            raise ValueError(f"weight {target} is packed {declared} data; the checkpoint gives {dtype}")
        return declared
    if placement.keep_16bit_weights and dtype in HALF_DTYPES:
        module_path, _, leaf = target.rpartition(".")
        if keeps_16bit(model.get_submodule(module_path), leaf):
            return dtype
    return placement.dtype


def _place(model: nn.Module, target: str, tensor: torch.Tensor, shape: torch.Size, what: str,
           placement: Placement) -> None:
    if tensor.shape != shape:
        raise ValueError(f"{what} has shape {tuple(tensor.shape)} but the model built from the config expects "
                         f"{tuple(shape)} for {target}; does config.json match the checkpoint?")
    module_path, _, leaf = target.rpartition(".")
    dtype = _stored_dtype(model, target, tensor.dtype, placement)
    weight = tensor.detach().to(device=placement.device, dtype=dtype).contiguous()
    setattr(model.get_submodule(module_path), leaf, nn.Parameter(weight, requires_grad=False))
