"""A LoRA adapter active on every path: raw onnxruntime sessions and onnxruntime-genai's Generators.

Owns reading an ``.onnx_adapter`` file (onnxruntime's ``AdapterFormat``) and checking it against the decoder's
adapter inputs before any session opens (:func:`check_adapters`: the file, its format, every tensor's name,
element type and fixed dims; a package without adapter inputs refused), what a run with an adapter reads
(:func:`adapter_reads`: the file by content, so another adapter is another scope), :class:`Adapter`: the
tensors every raw pass is fed as the decoder's adapter inputs (the decoder's, the derived scoring graph's, the
cascade's and the shared-prefix graph's sessions, which keep them) and onnxruntime-genai's ``og.Adapters`` set
active on each Generator, switched to another adapter between runs on the same sessions (:meth:`Adapter.switch`);
and the line the commands that take no adapter say on such a package (:func:`warn_base_model`).
"""

from __future__ import annotations

import logging
from pathlib import Path

from ortevals.errors import OrtEvalsError, PackageError, first_line
from ortevals.install import import_ort
from ortevals.package.adapters import SUFFIX, AdapterSpec, adapter_inputs, adapter_specs
from ortevals.package.loader import ModelPackage
from ortevals.package.scope import Reads, file_digest

log = logging.getLogger(__name__)
_SAID: set[Path] = set()  # decoders warn_base_model spoke of: a run opened inside that command says nothing more


def read_tensors(spec: AdapterSpec) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The adapter file's tensors: name -> (element type as onnxruntime names it, shape); one line where the file
    is missing or not in onnxruntime's adapter format."""
    path = spec.path
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "not found"
        raise OrtEvalsError(f"adapter {path}: {what}; expected an {SUFFIX} file (Olive's generate-adapter writes "
                            "adapter_weights.onnx_adapter)")
    if path.suffix != SUFFIX:
        raise OrtEvalsError(f"adapter {path}: not an {SUFFIX} file (onnxruntime's adapter format; a peft folder or "
                            "safetensors file is converted by Olive's generate-adapter)")
    ort = import_ort()
    try:
        params = ort.AdapterFormat.read_adapter(str(path)).get_parameters()
    except Exception as e:  # onnxruntime's own types
        raise OrtEvalsError(f"adapter {path}: onnxruntime cannot read it as an {SUFFIX} file: {first_line(e)}") \
            from None
    return {name: (value.data_type().removeprefix("tensor(").removesuffix(")"), tuple(value.shape()))
            for name, value in params.items()}


def check_adapters(package: ModelPackage, specs: tuple[AdapterSpec, ...]) -> None:
    """Every adapter against the decoder's adapter inputs, before any session opens: one line at the first
    mismatch (a package without adapter inputs, a file onnxruntime cannot read, a tensor the decoder has no
    input for, one of another type or shape, an input the adapter leaves out)."""
    if not specs:
        return
    inputs = {name: (elem, dims) for name, elem, dims in adapter_inputs(package)}
    if not inputs:
        raise OrtEvalsError(f"adapter {specs[0].path}: {package.decoder.path} has no adapter inputs (LoRA weights "
                            "as optional inputs, as Olive's generate-adapter exports them); its LoRA, if any, is "
                            "merged into the weights: drop --adapter")
    for spec in specs:
        _check_one(spec, read_tensors(spec), inputs, package.decoder.path)


def _check_one(spec: AdapterSpec, tensors: dict, inputs: dict, decoder: Path) -> None:
    unknown = sorted(set(tensors) - set(inputs))
    if unknown:
        raise OrtEvalsError(f"adapter {spec.path}: {len(unknown)} tensor(s) are no adapter input of {decoder.name} "
                            f"({unknown[0]}); it was exported for another model")
    missing = sorted(set(inputs) - set(tensors))
    if missing:
        raise OrtEvalsError(f"adapter {spec.path}: no tensor for {len(missing)} of the {len(inputs)} adapter inputs "
                            f"of {decoder.name} ({missing[0]}); it was exported for another model")
    for name, (elem, shape) in tensors.items():
        want, dims = inputs[name]
        fits = len(shape) == len(dims) and all(isinstance(d, str) or d == s for d, s in zip(dims, shape))
        if elem != want or not fits:
            raise OrtEvalsError(f"adapter {spec.path}: {name} is {elem} {list(shape)} but {decoder.name} takes "
                                f"{want} {list(dims)}; it was exported for another model")


def run_adapter(package: ModelPackage, values: tuple[str, ...], media: bool = False) -> Adapter | None:
    """The run's adapter from the ``adapter`` option's values, checked (:func:`check_adapters`); None without one,
    with one warning line where the decoder has adapter inputs (the base weights are then what is scored).
    ``media``: the package has vision or speech models, whose paths run no adapter: refused."""
    specs = adapter_specs(values)
    if not specs:
        inputs = adapter_inputs(package)
        if inputs and package.decoder.path not in _SAID:
            log.warning("%s has %d LoRA adapter inputs and no --adapter was given: scoring the base model (its "
                        "adapter inputs at their empty defaults)", package.decoder.path, len(inputs))
        return None
    if media:
        raise OrtEvalsError(f"adapter {specs[0].path}: {package.root} has vision or speech models, and ortevals runs "
                            "adapters on text packages only")
    if len(specs) > 1:
        raise OrtEvalsError(f"adapter: {len(specs)} adapters given; one run scores one adapter (ortevals mmlu-pro "
                            "and run take --adapter once per adapter, each its own result over one loaded base)")
    check_adapters(package, specs)
    return Adapter(specs[0])


def warn_base_model(package: ModelPackage, command: str) -> None:
    """One warning line where a command that takes no ``--adapter`` (``profile``, ``fidelity``, ``diagnose``) measures a
    package whose decoder has adapter inputs: the base model is what it measures."""
    inputs = adapter_inputs(package)
    if inputs and package.decoder.path not in _SAID:
        _SAID.add(package.decoder.path)
        log.warning("%s has %d LoRA adapter inputs; ortevals %s measures the base model (its adapter inputs at their "
                    "empty defaults) and takes no --adapter", package.decoder.path, len(inputs), command)


def adapter_reads(specs: tuple[AdapterSpec, ...]) -> list[Reads]:
    """What a run with adapters reads: each file by its content (package/scope.py's ``file_digest``), as a setting
    of the path rather than a file of the package: another adapter is another scope, and the same bytes under
    another name or folder the same one."""
    return [Reads(f"adapter {i}", (), {"content": file_digest(s.path)}, ("onnxruntime",)) for i, s in enumerate(specs)]


class Adapter:
    """One adapter's tensors, read once, fed to every raw pass as the decoder's adapter inputs; and onnxruntime-genai's
    ``og.Adapters`` set active on each Generator.

    Raw passes are fed the tensors themselves rather than ``RunOptions.add_active_adapter``: onnxruntime 1.32 applies
    active adapters in ``run`` but not in ``run_with_iobinding`` (the device, in-place, cascade and shared-prefix
    passes), which then runs the base weights without a word; as inputs they are what onnxruntime would feed.
    """

    def __init__(self, spec: AdapterSpec) -> None:
        self.spec = spec
        self._og = None  # (og.Model, og.Adapters, the names loaded into it) of the model it was loaded for
        self._feeds: dict[tuple[str, int], dict] = {}

    def switch(self, spec: AdapterSpec) -> None:
        """Another adapter of the same decoder (checked by the caller, :func:`check_adapters`) active from now on,
        the sessions kept: every feeds dict handed out (the runners hold them) takes its tensors in place, and
        onnxruntime-genai loads it beside the others at the next Generator."""
        if spec == self.spec:
            return
        self.spec = spec
        if ("cpu", 0) not in self._feeds:
            return  # no raw pass fed yet: read at the first one
        ort = import_ort()
        self._format = ort.AdapterFormat.read_adapter(str(spec.path))  # the values are views of it
        host = self._format.get_parameters()
        for key, feeds in self._feeds.items():
            new = host if key == ("cpu", 0) else {n: _on_device(ort, v, *key) for n, v in host.items()}
            feeds.clear()
            feeds.update(new)
        log.info("adapter %s (%s) active on the raw sessions", spec.name, spec.path)

    def feeds(self, device: str | None = None, device_id: int = 0) -> dict:
        """name -> OrtValue of every tensor, on the host or (``device``: the runner's KV device) copied there once."""
        ort = import_ort()
        key = (device or "cpu", device_id)
        if ("cpu", 0) not in self._feeds:
            self._format = ort.AdapterFormat.read_adapter(str(self.spec.path))  # the values are views of it
            self._feeds[("cpu", 0)] = self._format.get_parameters()
            log.info("adapter %s (%s) active on the raw sessions", self.spec.name, self.spec.path)
        if key not in self._feeds:
            self._feeds[key] = {n: _on_device(ort, v, *key) for n, v in self._feeds[("cpu", 0)].items()}
        return self._feeds[key]

    def activate(self, og, model, generator) -> None:
        """Set the adapter active on an onnxruntime-genai Generator of ``model`` (each adapter loaded once per
        model, under its name: names are unique within a run, package/adapters.py)."""
        if self._og is None or self._og[0] is not model:
            self._og = (model, og.Adapters(model), set())
        if self.spec.name not in self._og[2]:
            try:
                self._og[1].load(str(self.spec.path), self.spec.name)
            except Exception as e:  # og's RuntimeError
                raise PackageError(f"adapter {self.spec.path}: onnxruntime-genai could not load it: "
                                   f"{first_line(e)}") from None
            self._og[2].add(self.spec.name)
            log.info("adapter %s (%s) active on onnxruntime-genai", self.spec.name, self.spec.path)
        generator.set_active_adapter(self._og[1], self.spec.name)


def _on_device(ort, value, device: str, device_id: int):
    """A host OrtValue copied to ``device``; a type numpy cannot hold (bfloat16) stays on the host, where
    onnxruntime copies it to the session's device each pass."""
    try:
        return ort.OrtValue.ortvalue_from_numpy(value.numpy(), device, device_id)
    except Exception:  # noqa: BLE001 - numpy has no such type
        return value
