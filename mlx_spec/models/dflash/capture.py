"""The target's outputs at chosen decoder layers, recorded during its own
forward: the features a DFlash drafter reads, with no second forward.

:func:`attach_tap` swaps the class of each chosen decoder layer for a subclass
whose call records its output on a :class:`FeatureTap` (the same in-place
class swap as the GDN verify forward: parameters, their paths and every
attribute stay as they are, and the layer computes exactly what it did).
Every forward of the backbone, prefill chunks and verify passes alike, then
leaves the chosen layers' outputs on the tap; :meth:`FeatureTap.take` hands
them over concatenated in ``target_layer_ids`` order, ``[B, T, n * H]``.

Layer ``i``'s output is Hugging Face's ``hidden_states[i + 1]`` for every
layer but the last, whose entry there is after the final norm; drafters read
inner layers.
"""

from typing import Dict, List, Optional, Sequence

import mlx.core as mx

from .model import text_model

_TAPPED: Dict[type, type] = {}  # a layer class -> its recording subclass


def _tapped_class(cls: type) -> type:
    if cls not in _TAPPED:

        def __call__(self, *args, **kwargs):
            out = cls.__call__(self, *args, **kwargs)
            self._feature_tap.record(self._feature_slot, out)
            return out

        _TAPPED[cls] = type(f"Tapped{cls.__name__}", (cls,), {"__call__": __call__})
    return _TAPPED[cls]


class FeatureTap:
    """What the tapped layers output in the forwards since the last take."""

    def __init__(
        self, layer_ids: Sequence[int], width: int = 0, on_demand: bool = False
    ):
        self.layer_ids = tuple(layer_ids)
        self.width = width  # features a position: len(layer_ids) * hidden size
        # On demand: only forwards between begin() and take() are recorded,
        # so a forward no one takes (mlx-lm's own loop on the same model, a
        # reference run) leaves nothing behind to grow.
        self.on_demand = on_demand
        self.recording = not on_demand
        self._outputs: List[List[mx.array]] = [[] for _ in self.layer_ids]

    def record(self, slot: int, output: mx.array) -> None:
        if self.recording:
            self._outputs[slot].append(output)

    def begin(self) -> None:
        """Forget anything recorded and record the next forward."""
        self.clear()
        self.recording = True

    def take(self) -> Optional[mx.array]:
        """The recorded outputs [B, T, n * H] (lazy; T: every position of the
        forwards since the last take, in order), forgotten here; None when
        no forward ran."""
        outputs, self._outputs = self._outputs, [[] for _ in self.layer_ids]
        self.recording = not self.on_demand
        if not outputs[0]:
            return None
        per_layer = [mx.concatenate(parts, axis=1) for parts in outputs]
        return mx.concatenate(per_layer, axis=-1)

    def clear(self) -> None:
        self._outputs = [[] for _ in self.layer_ids]


def attach_tap(model, layer_ids: Sequence[int], on_demand: bool = False) -> FeatureTap:
    """Record the outputs of ``model``'s decoder layers ``layer_ids`` (in
    place; one tap per model: a second call replaces the first);
    ``on_demand``: only between ``begin()`` and ``take()``."""
    layers = text_model(model).model.layers
    bad = [i for i in layer_ids if not 0 <= i < len(layers)]
    if bad:
        raise ValueError(f"layer {bad[0]} is not one of the {len(layers)} layers")
    detach_tap(model)
    hidden = int(text_model(model).args.hidden_size)
    tap = FeatureTap(layer_ids, len(layer_ids) * hidden, on_demand)
    for slot, i in enumerate(layer_ids):
        layer = layers[i]
        layer.__class__ = _tapped_class(type(layer))
        layer._feature_tap = tap
        layer._feature_slot = slot
    # Where the decoder's target looks for it (core.target.feature_tap): a
    # plain attribute, outside the module tree, so never a parameter.
    object.__setattr__(model, "feature_tap", tap)
    return tap


def detach_tap(model) -> None:
    """Give the tapped layers of ``model`` their own class back."""
    originals = {tapped: cls for cls, tapped in _TAPPED.items()}
    for layer in text_model(model).model.layers:
        cls = originals.get(type(layer))
        if cls is not None:
            layer.__class__ = cls
            del layer._feature_tap, layer._feature_slot
    model.__dict__.pop("feature_tap", None)


def tap_of(model) -> Optional[FeatureTap]:
    """The tap attached to ``model``, if any."""
    for layer in text_model(model).model.layers:
        tap = getattr(layer, "_feature_tap", None)
        if tap is not None:
            return tap
    return None
