"""Host and device buffers for raw sessions: past KV, element types, sizes.

Owns :class:`KVCache` (one pass's present KV, and a hybrid decoder's recurrent state), the empty past of a first pass
(numpy on the host for numpy's dtypes, else an ``OrtValue`` of the graph's
element type where the session runs: numpy has no bfloat16), :class:`KVView`
(a contiguous block of a buffer where the session runs, bound by pointer, so
leading rows of an arena can be past and present of one pass) and
:func:`bind_shared`, element-type tables and byte sizes, bfloat16 logits as
float32, and zero-size inputs for optional multimodal embedding inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ortevals.errors import PackageError
from ortevals.install import import_ort
from ortevals.package.loader import KVSpec, ModelFile, ModelPackage
from ortevals.package.state import StateSpec


@dataclass(frozen=True)
class KVCache:
    """Present KV of a forward pass: one (key, value) pair per KV layer (``ModelPackage.kv`` order),
    ``[B, heads, T, head]``, and a hybrid decoder's recurrent/convolution state (``ModelPackage.states``
    order, ``[B, ...]``).

    ``length`` is the number of tokens it holds; windowed layers hold fewer. The states are those after
    exactly ``length`` tokens: unlike KV they can never be cut to a shorter prefix.
    """

    layers: tuple[tuple, ...]  # numpy arrays, or OrtValues left on the device by IOBinding
    length: int
    states: tuple = ()

    @property
    def nbytes(self) -> int:
        return sum(_nbytes(t) for pair in self.layers for t in pair) + sum(_nbytes(t) for t in self.states)

    def rows(self, fn) -> KVCache:
        """Every tensor (KV and state) through ``fn``, an operation on the batch dim only (rows repeated,
        gathered, stacked): the result holds the same tokens."""
        return KVCache(tuple(tuple(fn(t) for t in pair) for pair in self.layers), self.length,
                       tuple(fn(t) for t in self.states))


def _nbytes(t) -> int:
    if isinstance(t, (np.ndarray, KVView)):
        return t.nbytes
    if hasattr(t, "tensor_size_in_bytes"):  # OrtValue, onnxruntime >= 1.20
        return int(t.tensor_size_in_bytes())
    dtype = t.data_type().removeprefix("tensor(").removesuffix(")")
    return int(np.prod(t.shape())) * ITEMSIZE[ONNX_NAMES.get(dtype, dtype)]


# numpy dtype names (as ModelPackage reports them) -> ONNX TensorProto element type and size
ONNX_TYPES = {"float32": 1, "uint8": 2, "int8": 3, "int32": 6, "int64": 7, "bool": 9, "float16": 10, "float64": 11,
              "bfloat16": 16, "float8_e4m3fn": 17, "float8_e5m2": 19}
ITEMSIZE = {"float32": 4, "uint8": 1, "int8": 1, "int32": 4, "int64": 8, "bool": 1, "float16": 2, "float64": 8,
            "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}
ONNX_NAMES = {"float": "float32", "double": "float64"}  # OrtValue.data_type() spellings
ONNX_TYPE_NAMES = {v: k for k, v in ONNX_TYPES.items()}


def kv_bytes_per_token(package: ModelPackage) -> int:
    """All layers' K and V for one token (numpy has no bfloat16, so sizes come from the table)."""
    return specs_bytes_per_token(package.kv)


def specs_bytes_per_token(specs) -> int:
    """K and V of every layer in ``specs`` (:class:`KVSpec`) for one token, in bytes."""
    return sum(2 * s.kv_heads * s.head_size * ITEMSIZE[s.dtype] for s in specs)


NUMPY_NATIVE = frozenset({"float32", "float16", "float64", "int64", "int32", "int8", "uint8", "bool"})


@dataclass(frozen=True)
class KVView:
    """A contiguous ``shape`` block ``offset`` bytes into ``owner``, an OrtValue where the session runs.

    IOBinding binds it by pointer (``bind_input``/``bind_output`` with ``buffer_ptr``), so the leading
    rows of a larger arena can be one pass's past and present at once (GroupQueryAttention then writes
    the new tokens in place), and a row can be the source or target of a device copy. ``owner`` keeps
    the memory alive for as long as a view exists.
    """

    owner: object
    shape: tuple[int, ...]
    elem_type: int  # ONNX TensorProto element type
    device: str
    device_id: int = 0
    offset: int = 0

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * ITEMSIZE[ONNX_TYPE_NAMES[self.elem_type]]

    @property
    def ptr(self) -> int:
        return int(self.owner.data_ptr()) + self.offset

    def rows(self, start: int, stop: int) -> KVView:
        """Rows ``start:stop`` of a ``[B, ...]`` view (contiguous: the row is the outermost dim)."""
        row = self.nbytes // self.shape[0]
        return KVView(self.owner, (stop - start, *self.shape[1:]), self.elem_type, self.device, self.device_id,
                      self.offset + start * row)

    def bind_input(self, binding, name: str) -> None:
        binding.bind_input(name, self.device, self.device_id, self.elem_type, list(self.shape), self.ptr)

    def bind_output(self, binding, name: str) -> None:
        binding.bind_output(name, self.device, self.device_id, self.elem_type, list(self.shape), self.ptr)


# devices whose buffers are plain addresses, so a view may start inside one (DirectML's are opaque handles)
POINTER_DEVICES = frozenset({"cpu", "cuda"})


def device_buffer(shape: tuple[int, ...], elem_type: int, device: str, device_id: int = 0) -> KVView:
    """A new (uninitialised) buffer of ``shape`` where the session runs, as a view of all of it."""
    owner = import_ort().OrtValue.ortvalue_from_shape_and_type(list(shape), elem_type, device, device_id)
    return KVView(owner, tuple(shape), elem_type, device, device_id)


def fill_nan(view: KVView) -> None:
    """Every element of ``view``'s whole buffer set to all-ones bits: NaN in every float format."""
    _set_bits(view.owner, ONNX_TYPE_NAMES[view.elem_type], ones=True)


def _set_bits(value, dtype: str, ones: bool) -> None:
    """Every bit of OrtValue ``value`` (element type ``dtype``) set to 1 or to 0, written from the host."""
    bits, shape = _BITS[ITEMSIZE[dtype]], value.shape()
    value.update_inplace(np.full(shape, np.iinfo(bits).max, dtype=bits) if ones else np.zeros(shape, dtype=bits))


def bind_shared(binding, input_name: str, output_name: str, tensor) -> None:
    """Bind one buffer as both a past input and its present output (GroupQueryAttention's shared
    past/present buffer): a host numpy array (wrapped, not copied) or a :class:`KVView`."""
    if isinstance(tensor, KVView):
        tensor.bind_input(binding, input_name)
        tensor.bind_output(binding, output_name)
        return
    value = import_ort().OrtValue.ortvalue_from_numpy(tensor)  # shares the host memory
    binding.bind_ortvalue_input(input_name, value)
    binding.bind_ortvalue_output(output_name, value)


def feeds_len(attention_mask: np.ndarray) -> int:
    """Tokens covered by a pass: the mask spans past + new tokens."""
    return int(attention_mask.shape[1])


def empty_past(spec: KVSpec, batch: int, device: str | None = None, device_id: int = 0, clear=None):
    """Past buffer ``[batch, kv_heads, window or 0, head_size]`` for a first pass.

    Zero length; for windowed layers a zero buffer of window capacity (its contents
    are ignored, but GQA refuses a smaller one). A numpy array on the host for
    numpy's dtypes without a device; otherwise an ``OrtValue`` of the graph's
    element type made where the session runs (numpy has no bfloat16), zeroed by
    ``clear(KVView)`` where given (runtime/replicate.py's ``zero``: on the device), else from the host.
    """
    shape = (batch, spec.kv_heads, spec.window or 0, spec.head_size)
    return _zeros(shape, spec.dtype, f"{spec.key_name}: past KV", device, device_id, clear)


_BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _zeros(shape: tuple, dtype, what: str, device: str | None, device_id: int, clear=None):
    """Zeros of ``shape``: numpy on the host for numpy's dtypes, else an ``OrtValue`` where the session runs
    (fresh device memory is not zeroed; all-zero bits are 0.0 in every float format), cleared by ``clear`` (a
    function of a :class:`KVView`) where given, else by a host array of zeros copied in."""
    if device is None and dtype in NUMPY_NATIVE:
        return np.zeros(shape, dtype=dtype)
    if dtype not in ONNX_TYPES:
        raise PackageError(f"{what} element type {dtype} is not supported")
    value = import_ort().OrtValue.ortvalue_from_shape_and_type(list(shape), ONNX_TYPES[dtype], device or "cpu",
                                                                device_id)
    if not all(shape):  # an empty past has no bits to clear
        return value
    if clear is not None:
        clear(KVView(value, tuple(shape), ONNX_TYPES[dtype], device or "cpu", device_id))
    else:
        _set_bits(value, dtype, ones=False)
    return value


def empty_state(spec: StateSpec, batch: int, device: str | None = None, device_id: int = 0, clear=None):
    """The zero recurrent/convolution state ``[batch, *spec.shape]`` of a first pass (what transformers and
    onnxruntime-genai start from): numpy on the host, else an ``OrtValue`` where the session runs (``clear``: as
    :func:`empty_past`)."""
    return _zeros((batch, *spec.shape), spec.dtype, f"{spec.name}: state", device, device_id, clear)


def host_float32(value) -> np.ndarray:
    """An OrtValue on the host as a numpy array; bfloat16 becomes float32 (exactly)."""
    if value.data_type() != "tensor(bfloat16)":
        return value.numpy()
    bits = np.empty(value.shape(), dtype=np.uint16)
    import_ort().OrtValue.ortvalue_from_numpy_with_onnx_type(bits, ONNX_TYPES["bfloat16"]).update_inplace(value)
    return (bits.astype(np.uint32) << 16).view(np.float32)  # bfloat16 is the top half of a float32


def empty_like_input(inp, cfg: ModelFile) -> np.ndarray:
    """A zero-size tensor for an optional multimodal input (no images in text tasks)."""
    dims = [d if isinstance(d, int) and d > 0 else 0 for d in inp.shape]
    if not dims:
        raise PackageError(f"{cfg.path}: embedding input {inp.name!r} is a scalar; ortevals cannot leave it empty")
    dtype = _ORT_TO_NP.get(inp.type)
    if dtype is None:
        raise PackageError(f"{cfg.path}: embedding input {inp.name!r} has unsupported type {inp.type}")
    return np.zeros(dims, dtype=dtype)


_ORT_TO_NP = {
    "tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64,
    "tensor(int32)": np.int32, "tensor(bool)": np.bool_, "tensor(uint8)": np.uint8,
}
