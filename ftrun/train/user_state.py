"""The user's registered state (LR scheduler, EMA, counters, RNG): part of what catch-up ships and loads.

`UserState` holds name -> object with `state_dict()`/`load_state_dict()` (`FTJob.register_state`).
Its state dicts are split into flat tensors and a JSON skeleton, the two forms a catch-up snapshot
carries (it never pickles): every tensor is replaced by {"$t": "<key>"} and shipped under
"user.<name>.<path>"; dicts with non-string keys become {"$d": [[key, value], ...]} and tuples
{"$tuple": [...]}, so `unflatten(flatten(x)) == x` for every state dict made of tensors, dicts,
lists, tuples, str, int, float, bool and None. Anything else raises ValueError naming its path.

`UserState.hash()`: a fingerprint (ftrun.train.fingerprint) of the skeleton (canonical JSON) and every
tensor's dtype, shape and bytes, in key order: equal for equal state, so replicas can be compared step
by step (the step event's `user_state_hash`; `ftrun launch` reports `user_state_identical`).

`WithUserState` composes a rank's TrainState (model and optimizer, ftrun.train.state) with the
registered state: the user tensors under "user.", the skeleton under metadata["user"]; its catch-up
snapshot copies every tensor (`stable` names none: the user's code runs inside the step). Persistent
checkpoints take the registered objects directly (DcpCheckpointer's `extra`, entries "user.<name>").
Threading: the training loop's thread only.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable, Mapping

import torch

from ftrun.train.fingerprint import fingerprint, tensor_bytes
from ftrun.train.shard import like, local
from ftrun.train.state import TrainState, peer_shapes, taken_shapes

PREFIX = "user."
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]*$")
_TENSOR, _DICT, _TUPLE = "$t", "$d", "$tuple"


def flatten(value: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    """The JSON skeleton of `value`; its tensors go into `tensors` under keys starting with `path`."""
    if isinstance(value, torch.Tensor):
        if path in tensors:
            raise ValueError(f"{path}: two entries of the state dict flatten to the same name")
        tensors[path] = local(value).detach()  # a DTensor (FSDP2) ships its local shard
        return {_TENSOR: path}
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, tuple):
        return {_TUPLE: [flatten(v, f"{path}.{i}", tensors) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [flatten(v, f"{path}.{i}", tensors) for i, v in enumerate(value)]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and not {_TENSOR, _DICT, _TUPLE} & set(value):
            return {k: flatten(v, f"{path}.{k}", tensors) for k, v in value.items()}
        for k in value:
            if not isinstance(k, (bool, int, float, str)) and k is not None:
                raise ValueError(f"{path}: dict key {k!r} of type {type(k).__name__} is not JSON")
        return {_DICT: [[k, flatten(v, f"{path}.{k}", tensors)] for k, v in value.items()]}
    raise ValueError(f"{path}: a {type(value).__name__} is neither a tensor nor JSON (str, int, float, bool, "
                     "None, list, tuple, dict); registered state must be made of those")


def unflatten(skeleton: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """The inverse of `flatten`. Raises ValueError when a tensor the skeleton names is missing."""
    if isinstance(skeleton, list):
        return [unflatten(v, tensors) for v in skeleton]
    if isinstance(skeleton, dict):
        if set(skeleton) == {_TENSOR}:
            key = skeleton[_TENSOR]
            if key not in tensors:
                raise ValueError(f"registered state names tensor {key!r}, which the snapshot lacks")
            return tensors[key]
        if set(skeleton) == {_TUPLE}:
            return tuple(unflatten(v, tensors) for v in skeleton[_TUPLE])
        if set(skeleton) == {_DICT}:
            return {k: unflatten(v, tensors) for k, v in skeleton[_DICT]}
        return {k: unflatten(v, tensors) for k, v in skeleton.items()}
    return skeleton


def flatten_live(value: Any, path: str, out: dict[str, torch.Tensor]) -> None:
    """Like `flatten`, keeping the tensors as they are (DTensors too): the live entries to load into."""
    if isinstance(value, torch.Tensor):
        out[path] = value
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            flatten_live(v, f"{path}.{i}", out)
    elif isinstance(value, dict):
        for k, v in value.items():
            flatten_live(v, f"{path}.{k}", out)


class UserState:
    """The registered objects, in registration order."""

    def __init__(self) -> None:
        self.objects: dict[str, Any] = {}

    def register(self, name: str, obj: Any) -> None:
        """Raises ValueError for a bad or taken name, or an object without state_dict/load_state_dict."""
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"register_state: name {name!r} must match {_NAME.pattern}")
        if name in self.objects:
            raise ValueError(f"register_state: {name!r} is already registered")
        missing = [m for m in ("state_dict", "load_state_dict") if not callable(getattr(obj, m, None))]
        if missing:
            raise ValueError(f"register_state({name!r}): a {type(obj).__name__} has no {' or '.join(missing)}")
        self.objects[name] = obj

    def split(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """(tensors under "user.<name>...", {name: skeleton})."""
        tensors: dict[str, torch.Tensor] = {}
        skeleton = {name: flatten(obj.state_dict(), PREFIX + name, tensors) for name, obj in self.objects.items()}
        return tensors, skeleton

    def load(self, tensors: Mapping[str, torch.Tensor], skeleton: Mapping[str, Any]) -> None:
        """Load every registered object from a peer's split. Raises ValueError when the names differ."""
        if set(skeleton) != set(self.objects):
            raise ValueError(f"fetched registered state {sorted(skeleton)}, this replica registered "
                             f"{sorted(self.objects)}")
        live: dict[str, torch.Tensor] = {}
        for name, obj in self.objects.items():
            flatten_live(obj.state_dict(), PREFIX + name, live)
        # a copy: a torch state dict may keep the tensor it is given, and the fetch buffer is reused; on the
        # live entry's device (a GPU's); a local shard goes back into a DTensor like the live entry it replaces
        own = {k: like(live[k], v.to(local(live[k]).device, copy=True)) if k in live else v.clone()
               for k, v in tensors.items()}
        for name, obj in self.objects.items():
            obj.load_state_dict(unflatten(skeleton[name], own))

    def hash(self) -> str:
        tensors, skeleton = self.split()
        h = fingerprint(json.dumps(skeleton, sort_keys=True, allow_nan=True).encode())
        for key in sorted(tensors):
            t = tensors[key]
            h.update(f"{key}|{t.dtype}|{tuple(t.shape)}|".encode())
            h.update(tensor_bytes(t))
        return h.hexdigest()


class WithUserState:
    """A TrainState plus the registered user state (module docstring)."""

    def __init__(self, base: TrainState, user: UserState) -> None:
        self.base, self.user = base, user

    def tensors(self) -> dict[str, torch.Tensor]:
        tensors, _ = self.user.split()
        return {**self.base.tensors(), **tensors}

    def stable(self) -> frozenset[str]:
        """Nothing: the user's loop runs its own code between a step's begin (the catch-up publish) and its
        opt.step() (the retire), and may change parameters or optimizer state in place there (SAM's ascent
        step, a weight clamp, an EMA swap for an evaluation); a snapshot serving them in place would serve
        those bytes, checksummed or not, instead of the state the step began with. So it copies them all."""
        return frozenset()

    def peer_shapes(self) -> Callable[[], dict[str, torch.Tensor]]:
        tensors, _ = self.user.split()
        base, user = peer_shapes(self.base), taken_shapes(tensors)
        return lambda: {**base(), **user()}

    def metadata(self) -> dict[str, Any]:
        _, skeleton = self.user.split()
        return {**self.base.metadata(), "user": skeleton}

    def load(self, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, Any]) -> None:
        base = {k: v for k, v in tensors.items() if not k.startswith(PREFIX)}
        user = {k: v for k, v in tensors.items() if k.startswith(PREFIX)}
        self.base.load(base, {k: v for k, v in metadata.items() if k != "user"})
        self.user.load(user, metadata.get("user") or {})
