"""A replica rank's trainable state as flat tensors + JSON metadata: what catch-up ships and loads.

`ReplicaState` is one rank's part of its replica: the whole model and optimizer under plain replication,
the rank's LOCAL shards under FSDP2 (a DTensor parameter, its optimizer state and its state_dict entry
contribute `to_local()`), so the same rank of two replicas exchange the same shards. The trainer only
uses the `TrainState` protocol; other layouts plug in their own class.

Names: "model.<state_dict key>" for parameters and buffers, "optim.<param fqn>.<state key>" for the
optimizer's tensor state. The optimizer's non-tensor per-parameter state and its param groups (LR, the
LR helper's base LR, betas, ...) travel in the metadata, which must be JSON (the snapshot never pickles);
a hyperparameter held as a one-element tensor (`lr=torch.tensor(1e-3)`, tensor betas: what a captured or
compiled optimizer step uses) travels as its number and is loaded back as a tensor like this rank's own
(dtype and device), so its kind never changes under a scheduler; a larger tensor there cannot be published.
On a GPU (FTConfig.device) `tensors()` are the device tensors (the catch-up snapshot copies them to host
memory) and a load copies the fetched host tensors onto the device: the model's in place, the optimizer's
through `Optimizer.load_state_dict`, which puts each state tensor on its parameter's device.
Loading puts the fetched values into the live tensors (parameters keep their identity, so the optimizer
still holds them; a shard is copied into the DTensor's local tensor, which FSDP2's all-gather reads): a
CPU parameter whose storage nothing else shares takes the fetched tensor as its data (no copy, 2.3 ->
0.6 ms for benchmarks/catchup_mlp_worker.py's MLP), any other is copied into; and it rebuilds
the optimizer state with `Optimizer.load_state_dict` (per-element state of a sharded parameter wrapped
back into a DTensor like it), so a healed rank's optimizer (step counters included) is bitwise the
source's. On a CPU the optimizer keeps the fetched tensors themselves, views into the fetch's buffer: no
copy on the joiner's critical path (benchmarks/catchup_launch.py's 33.6 MB of AdamW moments: a load took
18-48 ms with a clone, 2-10 ms without, in traced launches on 2 busy cores). Those views keep the whole
fetch buffer until the next heal replaces them (its model part is the adopted parameters' memory).

Threading: one task (the training loop) per instance.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Mapping, Protocol

import torch
import torch.optim.optimizer as optim_module

from ftrun.train.shard import is_dtensor, like, local

MODEL, OPTIM = "model.", "optim."


class TrainState(Protocol):
    def tensors(self) -> dict[str, torch.Tensor]:
        """The state to publish: name -> tensor (CPU or device; the snapshot copies it)."""

    def metadata(self) -> dict[str, Any]:
        """JSON-able state that is not tensors."""

    def stable(self) -> frozenset[str]:
        """The names in tensors() that nothing but the optimizer's step or a `load` changes (the trainer
        retires its catch-up snapshot before either, so the snapshot may serve them in place). Optional:
        a state without it is copied whole at every publish (`stable_names`)."""

    def peer_shapes(self) -> Callable[[], dict[str, torch.Tensor]]:
        """A function giving what a healthy peer publishes for this rank, as meta tensors of its names, dtypes
        and shapes (what a joiner's receive buffer is sized by, ahead of its fetch). It runs later, in another
        task, while the training loop steps and loads this state: what it needs of the live state is taken
        when peer_shapes() returns. Optional (`peer_shapes`)."""

    def load(self, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, Any]) -> None:
        """Replace this rank's state by a peer's. Raises ValueError if it does not fit this model.
        `tensors` are handed over: the state may keep them (the trainer's fetches are over a buffer of their
        own; one reused across fetches, ftrun.catchup.client's `buffer`, would be overwritten by the next)."""


class ReplicaState:
    """One rank's model and optimizer: whole tensors, or its local shards (see the module docstring)."""

    def __init__(self, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer
        fqn_of = {id(p): name for name, p in model.named_parameters()}
        params = [p for group in optimizer.param_groups for p in group["params"]]
        missing = [i for i, p in enumerate(params) if id(p) not in fqn_of]
        if missing:
            raise ValueError(f"optimizer params {missing} are not parameters of the model")
        self._fqns = [fqn_of[id(p)] for p in params]  # optimizer param index -> fqn
        self._params = params

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {MODEL + k: local(v).detach() for k, v in self.model.state_dict().items()}
        for index, state in self.optimizer.state_dict()["state"].items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    out[f"{OPTIM}{self._fqns[index]}.{key}"] = local(value).detach()
        return out

    def stable(self) -> frozenset[str]:
        """Parameters and the optimizer's state; not the model's buffers, which a forward may update (e.g.
        BatchNorm's running statistics), nor the weight of an embedding with max_norm, which its forward
        renormalizes in place."""
        renormed = {f"{MODEL}{path}{'.' if path else ''}weight" for path, m in self.model.named_modules()
                    if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.max_norm is not None}
        names = {MODEL + name for name, _ in self.model.named_parameters()} - renormed
        return frozenset(k for k in self.tensors() if k in names or k.startswith(OPTIM))

    def peer_shapes(self) -> Callable[[], dict[str, torch.Tensor]]:
        """tensors(), where the optimizer holds its state; before its first step (a restarted replica: a
        peer's optimizer has stepped) the state that step creates stands in as meta tensors, made by a
        throwaway step of the same optimizer class and groups over meta copies of the parameters (no
        memory, no change to this optimizer; not taken while global optimizer step hooks are registered,
        which would see it). An optimizer that cannot step on meta tensors (a fused one, a custom class)
        gives tensors() as they are: the receive buffer is then too small, and the fetch allocates its own.
        What the returned function reads is taken now (shapes, dtypes, copies of the param groups' values,
        `_copied`), so the throwaway step, the costly part, runs where it is called without touching this state."""
        taken = taken_shapes(self.tensors())
        if self.optimizer.state:
            return taken
        params = [(local(p).shape, local(p).dtype, p.requires_grad) for p in self._params]
        groups = [{k: _copied(v) for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        sizes = [len(g["params"]) for g in self.optimizer.param_groups]
        defaults = {k: _copied(v) for k, v in self.optimizer.defaults.items()}
        cls, fqns = type(self.optimizer), list(self._fqns)

        def with_first_step_state() -> dict[str, torch.Tensor]:
            out = taken()
            if getattr(optim_module, "_global_optimizer_pre_hooks", None) \
                    or getattr(optim_module, "_global_optimizer_post_hooks", None):
                return out
            metas = iter([_meta_param(*param) for param in params])
            meta_groups = [{**g, "params": [next(metas) for _ in range(n)]} for g, n in zip(groups, sizes)]
            try:
                state = _meta_step(cls, meta_groups, defaults)
            except Exception:  # only a size hint (see the docstring)
                return out
            for index, entries in state.items():
                for key, value in entries.items():
                    if isinstance(value, torch.Tensor):
                        out[f"{OPTIM}{fqns[index]}.{key}"] = value.detach()
            return out

        return with_first_step_state

    def metadata(self) -> dict[str, Any]:
        sd = self.optimizer.state_dict()
        scalars = {self._fqns[i]: {k: v for k, v in s.items() if not isinstance(v, torch.Tensor)}
                   for i, s in sd["state"].items()}
        groups = [{k: _group_value(v) for k, v in g.items() if k != "params"} for g in sd["param_groups"]]
        return {"optim_scalars": scalars, "param_groups": groups}

    def load(self, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, Any]) -> None:
        self._check_names(tensors)
        model_sd = {k[len(MODEL):]: v for k, v in tensors.items() if k.startswith(MODEL)}
        live = self.model.state_dict()
        if any(is_dtensor(v) for v in live.values()):
            with torch.no_grad():  # the state dict's DTensors alias the live shards: copy into them
                for key, value in live.items():
                    local(value).copy_(model_sd[key])
        else:
            del live  # its detached aliases would make every parameter look shared to _adopt
            self._adopt(model_sd)
            self.model.load_state_dict(model_sd, strict=True)  # copies into the rest (an adopted one is itself)
        self.optimizer.load_state_dict(self._optimizer_state_dict(tensors, metadata))

    def _adopt(self, model_sd: Mapping[str, torch.Tensor]) -> None:
        """Each CPU parameter takes its fetched tensor as its data (`param.data = fetched`: the Parameter
        keeps its identity, so the optimizer, hooks and references to the Parameter still hold) where the
        two match in device, dtype, shape and contiguity and nothing else shares the parameter's storage
        (`_sole_owner`: an alias such as `p.detach()` kept by user code, a view of a flat buffer, a
        snapshot lending it would go stale): no copy, and the fetch buffer's model part is used rather
        than kept beside the old storage. The rest is copied by the caller: buffers (a forward changes
        them in place), GPU parameters (the fetch is in host memory), shared or non-contiguous ones."""
        live = self.model.state_dict(keep_vars=True)
        for key, got in model_sd.items():
            param = live.get(key)
            if isinstance(param, torch.nn.Parameter) and param.device.type == got.device.type == "cpu" \
                    and param.dtype == got.dtype and param.shape == got.shape and param.is_contiguous() \
                    and got.is_contiguous() and _sole_owner(param):
                param.data = got

    def _check_names(self, tensors: Mapping[str, torch.Tensor]) -> None:
        own = {MODEL + k: local(v) for k, v in self.model.state_dict().items()}
        missing = sorted(set(own) - set(tensors))
        unknown = sorted(k for k in tensors if not k.startswith((MODEL, OPTIM)) or
                         (k.startswith(MODEL) and k not in own))
        if missing or unknown:
            raise ValueError(f"fetched state does not fit this model: missing {missing[:5]}, unknown {unknown[:5]}")
        for name, mine in own.items():
            got = tensors[name]
            if got.shape != mine.shape or got.dtype != mine.dtype:
                raise ValueError(f"{name}: fetched {got.dtype}{tuple(got.shape)}, "
                                 f"this model has {mine.dtype}{tuple(mine.shape)}")

    def _optimizer_state_dict(self, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, Any]) -> dict:
        index_of = {fqn: i for i, fqn in enumerate(self._fqns)}
        state: dict[int, dict[str, Any]] = {}
        for name, value in tensors.items():
            if name.startswith(OPTIM):
                fqn, _, key = name[len(OPTIM):].rpartition(".")
                if fqn not in index_of:
                    raise ValueError(f"fetched optimizer state {name!r} names no parameter of this model")
                param = self._params[index_of[fqn]]
                if value.shape == local(param).shape:  # a shard of per-element state (not a step counter)
                    value = like(param, value)
                state.setdefault(index_of[fqn], {})[key] = value
        for fqn, scalars in dict(metadata.get("optim_scalars", {})).items():
            if fqn not in index_of:
                raise ValueError(f"fetched optimizer scalars for {fqn!r}, not a parameter of this model")
            state.setdefault(index_of[fqn], {}).update(scalars)
        current = self.optimizer.state_dict()["param_groups"]
        fetched = list(metadata.get("param_groups", []))
        if len(fetched) != len(current):
            raise ValueError(f"fetched {len(fetched)} param groups, this optimizer has {len(current)}")
        groups = [_merge_group(mine, theirs) for mine, theirs in zip(current, fetched)]
        return {"state": state, "param_groups": groups}


def stable_names(state: Any) -> frozenset[str]:
    """`state.stable()`, or none for a TrainState that does not say (its snapshot copies every tensor)."""
    stable = getattr(state, "stable", None)
    return frozenset() if stable is None else frozenset(stable())


def _sole_owner(t: torch.Tensor) -> bool:
    """True when no other tensor shares `t`'s storage: not a view, the whole storage, and torch's storage
    use count no higher than a fresh tensor's (False where this torch lacks that count)."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None or t._base is not None or t.storage_offset() != 0:
        return False
    fresh = torch.empty(1)
    storage = t.untyped_storage()
    return storage.nbytes() == t.nbytes and use_count(storage._cdata) <= use_count(fresh.untyped_storage()._cdata)


def taken_shapes(tensors: Mapping[str, torch.Tensor]) -> Callable[[], dict[str, torch.Tensor]]:
    """A function giving meta tensors of the names, shapes and dtypes `tensors` have now, holding none of them
    (an alias of a parameter would keep `_sole_owner` from letting it adopt a fetched tensor)."""
    shapes = {name: (t.shape, t.dtype) for name, t in tensors.items()}
    return lambda: {name: torch.empty(shape, dtype=dtype, device="meta") for name, (shape, dtype) in shapes.items()}


def _copied(value: Any) -> Any:
    """A deep copy of a param group's value (the live optimizer may change it while a peer_shapes function runs),
    or the value itself where it cannot be copied (e.g. a process group): sizing is only a hint, and build's
    synchronous path must not fail on it."""
    try:
        return copy.deepcopy(value)
    except Exception:
        return value


def _meta_param(shape: torch.Size, dtype: torch.dtype, requires_grad: bool) -> torch.nn.Parameter:
    meta = torch.nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"), requires_grad=requires_grad)
    meta.grad = torch.zeros_like(meta)
    return meta


def _meta_step(cls: type, groups: list[dict], defaults: dict) -> dict:
    """The state dict's "state" after one step of a `cls` optimizer made over `groups`: from the groups
    alone (they hold every hyperparameter; AdamW takes no `decoupled_weight_decay` argument, say), else
    with the defaults as arguments too (an optimizer that needs them)."""
    try:
        throwaway = cls(groups)
    except TypeError:
        throwaway = cls(groups, **defaults)
    throwaway.step()
    return throwaway.state_dict()["state"]


def peer_shapes(state: Any) -> Callable[[], dict[str, torch.Tensor]]:
    """`state.peer_shapes()`, or `taken_shapes` of its tensors() for a TrainState that does not say."""
    shapes = getattr(state, "peer_shapes", None)
    return taken_shapes(state.tensors()) if shapes is None else shapes()


def _group_value(value: Any) -> Any:
    """A param group's value as JSON carries it: tuples as lists, a one-element tensor as its number."""
    if isinstance(value, (tuple, list)):
        return [_group_value(v) for v in value]
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_sparse:
        return value.item()
    return value  # anything else is left for the snapshot's JSON check to name


def _merge_group(mine: dict, theirs: Mapping[str, Any]) -> dict:
    """The fetched group's values with this optimizer's param indices, in the kinds this optimizer holds them:
    JSON lists back to tuples, numbers back to tensors where this rank's value is a tensor."""
    out = dict(mine)
    for key, value in theirs.items():
        out[key] = _like(mine[key], value) if key in mine else value
    return out


def _like(mine: Any, value: Any) -> Any:
    if isinstance(mine, torch.Tensor) and isinstance(value, (int, float)) and not isinstance(value, bool):
        return torch.full_like(mine, value)
    if isinstance(mine, (tuple, list)) and isinstance(value, list):
        return type(mine)(_like(m, v) for m, v in zip(mine, value)) if len(mine) == len(value) else type(mine)(value)
    return value
