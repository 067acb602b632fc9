"""Replicating a prefix's past KV across a batch, where the KV lives.

Owns one tiny ONNX graph, ``y = Expand(x, shape)``, run through IOBinding on
the session's own provider and device: a ``[1,H,T,D]`` OrtValue becomes
``[B,H,T,D]`` without a round trip through the host. GroupQueryAttention needs
the past of a batch as one contiguous tensor, so binding one OrtValue per row is
not an option. Host (numpy) past is repeated with ``np.repeat`` by the caller.
The sampler (engine/generate/rows/sampler.py) also keeps only some rows of a past (``Gather``
on axis 0: finished samples leave the batch) and cuts a past to its first
tokens (``Slice`` on axis 2: a shared prompt prefix), the same way.

Where the sampler keeps device KV in place (engine/generate/rows/kv.py ``DeviceKV``), the
same graphs write into buffers it already holds (``into``: a
:class:`~ortevals.runtime.buffers.KVView` bound by pointer), so nothing is
allocated: ``expand`` a prompt's row into an arena, ``copy`` a row forward
(``Identity``: a finished row leaves), ``fit`` a prefix into a buffer of
another capacity (``Slice`` then ``Pad`` on axis 2), and ``zero`` a new buffer
(``ConstantOfShape`` over its bytes: fresh device memory holds whatever was
there, and clearing it from the host would copy a buffer of zeros across).
One session per (op, element type, rank), made on first use (a hybrid decoder's recurrent state is
``[B, ...]`` of another rank than KV: it is replicated and gathered the same way, never cut).
"""

from __future__ import annotations

import numpy as np

from ortevals.install import import_ort
from ortevals.runtime.buffers import ONNX_TYPES, KVView
from ortevals.runtime.opening import create_session
from ortevals.runtime.providers import ProviderConfig


class Replicator:
    """``expand(value, batch)``: an OrtValue ``[1,...]`` → ``[batch,...]`` on ``device``."""

    def __init__(self, provider: ProviderConfig, device: str, device_id: int = 0) -> None:
        self.provider = provider
        self.device = device
        self.device_id = device_id
        self._sessions: dict[tuple[str, int, int], object] = {}

    def expand(self, value, batch: int, into: KVView | None = None):
        """value: OrtValue (or view) ``[1, ...]``; returns ``[batch, ...]`` on the same device (written
        into ``into`` when given)."""
        shape = list(_shape(value))
        if shape[0] != 1:
            raise ValueError(f"only a one-row past can be replicated, got shape {shape}")
        return self._run("Expand", value, np.asarray([batch, *shape[1:]], dtype=np.int64), into)

    def copy(self, value: KVView, into: KVView) -> None:
        """``into`` ← ``value`` (same shape, distinct memory), on the device."""
        if tuple(value.shape) != tuple(into.shape):
            raise ValueError(f"copy between shapes {value.shape} and {into.shape}")
        self._run("Identity", value, np.zeros(0, dtype=np.int64), into)

    def fit(self, value, length: int, into: KVView) -> None:
        """``into [B,H,T',D]`` ← the first ``length`` tokens of ``value [B,H,T,D]`` then zeros (T' >= length)."""
        self._run("Fit", value, np.asarray([length, into.shape[2] - length], dtype=np.int64), into)

    def zero(self, into: KVView) -> None:
        """Every byte of ``into`` set to 0 where it lives (0.0 in every float format): one ``ConstantOfShape``
        written by pointer, in 8-byte words where the view's address and size allow, so no host array of its
        size is made or copied."""
        wide = into.ptr % 8 == 0 and into.nbytes % 8 == 0
        width, elem_type = (8, ONNX_TYPES["int64"]) if wide else (1, ONNX_TYPES["uint8"])
        flat = KVView(into.owner, (into.nbytes // width,), elem_type, into.device, into.device_id, into.offset)
        session = self._session("Zero", elem_type, 1)
        binding = session.io_binding()
        binding.bind_cpu_input("arg", np.asarray(flat.shape, dtype=np.int64))
        flat.bind_output(binding, "y")
        session.run_with_iobinding(binding)

    def gather(self, value, rows) -> object:
        """value: OrtValue ``[B, ...]``; returns rows ``rows`` (in that order) as a new OrtValue."""
        return self._run("Gather", value, np.asarray(rows, dtype=np.int64))

    def narrow(self, value, length: int) -> object:
        """value: OrtValue ``[B,H,T,D]``; returns ``[B,H,:length,D]`` as a new OrtValue."""
        return self._run("Slice", value, np.asarray([0, length, 2], dtype=np.int64))

    def _run(self, op: str, value, arg: np.ndarray, into: KVView | None = None):
        elem_type = value.elem_type if isinstance(value, KVView) else value.element_type()
        session = self._session(op, elem_type, len(_shape(value)))
        binding = session.io_binding()
        if isinstance(value, KVView):
            value.bind_input(binding, "x")
        else:
            binding.bind_ortvalue_input("x", value)
        binding.bind_cpu_input("arg", arg)
        if into is None:
            binding.bind_output("y", self.device, self.device_id)
        else:
            into.bind_output(binding, "y")
        session.run_with_iobinding(binding)
        return into if into is not None else binding.get_outputs()[0]

    def _session(self, op: str, elem_type: int, rank: int = 4):
        if (op, elem_type, rank) not in self._sessions:
            self._sessions[op, elem_type, rank] = self._open(op, elem_type, rank)
        return self._sessions[op, elem_type, rank]

    def _open(self, op: str, elem_type: int, rank: int = 4):
        from onnx import TensorProto, helper  # only when a batch of prefix continuations is run

        ort = import_ort()
        x = [] if op == "Zero" else [
            helper.make_tensor_value_info("x", elem_type, ["one", *(f"x{i}" for i in range(1, rank))])]
        graph = helper.make_graph(
            _nodes(op, elem_type), f"past_{op.lower()}",
            [*x, helper.make_tensor_value_info("arg", TensorProto.INT64, [None])],
            [helper.make_tensor_value_info("y", elem_type, ["b", *(f"y{i}" for i in range(1, rank))])])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
        model.ir_version = 8  # readable by every onnxruntime ortevals supports

        def options(config: dict[str, str]):
            so = ort.SessionOptions()
            so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # Identity must stay a copy
            so.log_severity_level = 2
            so.intra_op_num_threads = 1
            for key, value in config.items():  # the CPU fallback refused on a device (runtime/placement.py)
                so.add_session_config_entry(key, value)
            return so

        return create_session(model.SerializeToString(), self.provider, options, {},
                              f"replicate_past {op} (built-in graph)")


def _nodes(op: str, elem_type: int) -> list:
    """Expand(x, arg=shape) · Gather(x, arg=rows, axis 0) · Slice(x, arg=[start, end, axis]) ·
    Identity(x) (arg unused) · Fit: Pad(Slice(x, 0:arg[0] on axis 2), arg[1] zeros after, axis 2) ·
    Zero: ConstantOfShape(arg=shape) of ``elem_type`` zeros (no x)."""
    from onnx import TensorProto, helper

    if op == "Zero":
        return [helper.make_node("ConstantOfShape", ["arg"], ["y"],
                                 value=helper.make_tensor("value", elem_type, [1], [0]))]
    if op == "Expand":
        return [helper.make_node("Expand", ["x", "arg"], ["y"])]
    if op == "Gather":
        return [helper.make_node("Gather", ["x", "arg"], ["y"], axis=0)]
    if op == "Identity":
        return [helper.make_node("Identity", ["x"], ["y"])]
    if op == "Fit":  # pads for all 4 axes (no Pad ``axes`` input: not every provider's kernel takes it)
        const = lambda name, v: helper.make_node(  # noqa: E731
            "Constant", [], [name], value=helper.make_tensor(name, TensorProto.INT64, [len(v)], v))
        return [const("zero", [0]), const("axis", [2]), const("begins", [0] * 6),
                helper.make_node("Split", ["arg"], ["end", "after"], axis=0, num_outputs=2),
                helper.make_node("Slice", ["x", "zero", "end", "axis"], ["head"]),
                helper.make_node("Concat", ["begins", "after", "zero"], ["pads"], axis=0),
                helper.make_node("Pad", ["head", "pads"], ["y"])]
    return [helper.make_node("Split", ["arg"], ["s", "e", "a"], axis=0, num_outputs=3),
            helper.make_node("Slice", ["x", "s", "e", "a"], ["y"])]


def _shape(value) -> tuple:
    return tuple(value.shape) if isinstance(value, KVView) else tuple(value.shape())
