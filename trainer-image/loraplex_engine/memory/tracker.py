"""Live storage bytes of every tensor torch creates, for real or fake tensors.

``LiveBytes`` is a ``TorchDispatchMode``: each op's outputs whose storage it has not seen
add ``untyped_storage().nbytes()``; a ``weakref.finalize`` on the storage subtracts them
when the storage dies (views share their base's storage, so they count once). Under
``FakeTensorMode`` nothing is allocated, yet the bytes are those a device would hold:
the planner runs the engine's own step this way (memory/planner.py). Not modelled: allocator
rounding and fragmentation, and workspace memory kernels take internally. Tensors made
outside the dispatcher (e.g. loaded from safetensors) count once ``track`` is called on
them or an op returns them.

Storage resized in place (``UntypedStorage.resize_``, which the dispatcher does not see:
FSDP2 frees and re-allocates its all-gather buffers that way) is counted with
``track_resize=True``, which wraps ``resize_`` while the mode is on, as torch's own
``torch.distributed._tools.mem_tracker.MemTracker`` does.

Each allocation is also tagged (``tag_of``: e.g. "logits" for vocabulary-sized tensors),
and ``phase`` names the part of the run under way; a phase's peak keeps the bytes of
each tag live at that moment.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch._subclasses import fake_tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

Tagger = Callable[[torch.Tensor], str]


@dataclass
class Peak:
    bytes: int = 0
    by_tag: dict[str, int] = field(default_factory=dict)


class LiveBytes(TorchDispatchMode):
    """Tracks live storage bytes; ``peaks[phase]`` the highest seen during each phase.

    ``fake_scalars``: under FakeTensorMode a tensor has no value, so reading one as a
    Python number (``float(loss)``, ``.item()``) fails; with this set such a read returns
    0 (False for bool). Meant for statistics; a branch on such a read takes the zero
    side (transformers' "is the mask all ones?" check then builds the attention mask a
    real unpadded batch would skip: a few MB per forward). Code whose shapes depend on a
    tensor's value cannot run under fake tensors at all.
    """

    def __init__(
        self, tag_of: Tagger | None = None, fake_scalars: bool = False, track_resize: bool = False
    ) -> None:
        super().__init__()
        self.tag_of = tag_of or (lambda t: "other")
        self.fake_scalars = fake_scalars
        self.track_resize = track_resize
        self._resize: Callable[..., None] | None = None
        self.tag_override: str | None = None  # set by ``tagging``
        self.live = 0
        self.by_tag: dict[str, int] = {}
        self.phase = "default"
        self.peaks: dict[str, Peak] = {}
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if self.fake_scalars and func is torch.ops.aten._local_scalar_dense.default:
            value = args[0]
            if isinstance(value, fake_tensor.FakeTensor) and value.constant is None:
                return _zero_of(value.dtype)
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.track(t)
        return out

    def __enter__(self) -> LiveBytes:
        if self.track_resize:
            self._resize = original = torch.UntypedStorage.resize_

            def resize_(storage: torch.UntypedStorage, size: int) -> None:
                original(storage, size)
                self._resized(storage)

            torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        if self._resize is not None:
            torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]
            self._resize = None
        super().__exit__(*exc)

    def track(self, t: torch.Tensor) -> None:
        """Count ``t``'s storage if new (also for tensors made before the mode). A
        ``DTensor`` (a sharded parameter) counts its local shard."""
        t = getattr(t, "_local_tensor", t)
        storage = t.untyped_storage()
        if storage in self._seen:
            return
        # [tag, bytes counted]: a resize updates the bytes, the finalizer drops them.
        record = [self.tag_override or self.tag_of(t), storage.nbytes()]
        self._seen[storage] = record
        self._add(record[0], record[1])
        weakref.finalize(storage, self._release, record)

    def _release(self, record: list) -> None:
        self._add(record[0], -record[1])

    def _resized(self, storage: torch.UntypedStorage) -> None:
        record = self._seen.get(storage)
        if record is not None and record[1] != storage.nbytes():
            delta, record[1] = storage.nbytes() - record[1], storage.nbytes()
            self._add(record[0], delta)

    def _add(self, tag: str, nbytes: int) -> None:
        self.live += nbytes
        self.by_tag[tag] = self.by_tag.get(tag, 0) + nbytes
        peak = self.peaks.setdefault(self.phase, Peak())
        if self.live > peak.bytes:
            peak.bytes, peak.by_tag = self.live, dict(self.by_tag)

    @contextmanager
    def tagging(self, tag: str) -> Iterator[None]:
        """Tag every storage first seen inside the block ``tag`` (e.g. the buffers a
        library allocates in one of its methods)."""
        before, self.tag_override = self.tag_override, tag
        try:
            yield
        finally:
            self.tag_override = before

    @contextmanager
    def in_phase(self, name: str) -> Iterator[Peak]:
        """Run a block as phase ``name``; its peak starts from what is live now."""
        before = self.phase
        self.phase = name
        peak = self.peaks[name] = Peak(self.live, dict(self.by_tag))
        try:
            yield peak
        finally:
            self.phase = before


def storage_bytes(tensors: Iterator[torch.Tensor] | list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors``; a ``DTensor`` (a parameter
    sharded by FSDP) counts this rank's shard, not the whole tensor."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = getattr(t, "_local_tensor", t).untyped_storage()
        seen[id(storage)] = storage.nbytes()
    return sum(seen.values())


def _zero_of(dtype: torch.dtype) -> bool | int | float:
    if dtype is torch.bool:
        return False
    return 0.0 if dtype.is_floating_point or dtype.is_complex else 0
