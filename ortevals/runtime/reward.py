"""An outcome reward model (ORM) as an ONNX sequence classifier: ``--verifier PATH`` (issue 25).

Owns opening and running the classifier folder ``--verifier PATH`` names: ``model.onnx`` with
inputs ``input_ids`` and ``attention_mask`` (int64 ``[B, S]``) and a first output of one score per
sequence (``[B, 1]`` or ``[B]``), and the ``tokenizer.json`` beside it (Hugging Face ``tokenizers``;
its post-processor adds what the model was trained with, as transformers' ``tokenizer(text)`` does).
Each text runs as its own unpadded row, so no padding convention of the exporter (which token a
classifier reads on a padded row) is assumed. Counts the tokens it runs (``tokens_run``) and the
weights it holds (``params``: package/graph.py's ``parameter_count`` on the proto the session is
opened from, so the file is read once) and what it reads (:func:`reward_reads`: the files its opener
names, the providers; the result store's scope of a ``--search`` run guided by it).
A folder that is not such a classifier is a one-line :class:`~ortevals.errors.PackageError`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ortevals.errors import PackageError, first_line
from ortevals.install import import_ort
from ortevals.package.graph import parameter_count
from ortevals.package.scope import Reads

INPUTS = ("input_ids", "attention_mask")


class RewardModel:
    """One ONNX sequence classifier and its tokenizer; :meth:`open` reads the folder, the constructor does no I/O."""

    def __init__(self, session, tokenizer, path: Path, params: int = 0, reads: Reads | None = None) -> None:
        self.session, self.tokenizer, self.path, self.params = session, tokenizer, path, params
        self.reads = reads or Reads("reward model")
        self.tokens_run = 0

    @classmethod
    def open(cls, path: str | Path, providers: Sequence[str] = ("CPUExecutionProvider",)) -> RewardModel:
        root = Path(path)
        model, tok = root / "model.onnx", root / "tokenizer.json"
        for f in (model, tok):
            if not f.is_file():
                raise PackageError(f"--verifier {root}: expected an ONNX sequence classifier folder with "
                                   f"model.onnx and tokenizer.json; {f.name} is missing")
        from tokenizers import Tokenizer

        try:
            tokenizer = Tokenizer.from_file(str(tok))
        except Exception as e:  # tokenizers raises its own Exception type
            raise PackageError(f"--verifier {tok}: not a tokenizers JSON file ({str(e).splitlines()[0]})") from None
        data, params, external = _read(model)
        ort = import_ort()
        try:
            session = ort.InferenceSession(data, providers=list(providers))
        except Exception as e:  # onnxruntime's Fail/InvalidGraph: one line
            raise PackageError(f"--verifier {model}: onnxruntime cannot open it ({str(e).splitlines()[0]})") from None
        names = [i.name for i in session.get_inputs()]
        if sorted(names) != sorted(INPUTS):
            raise PackageError(f"--verifier {model}: expected inputs {list(INPUTS)}, found {names}")
        return cls(session, tokenizer, root, params, reward_reads(root, external, providers))

    def score(self, texts: Sequence[str]) -> np.ndarray:
        """``[N]`` float64: the classifier's score of each text."""
        out = np.empty(len(texts))
        for i, text in enumerate(texts):
            ids = np.asarray([self.tokenizer.encode(text).ids], dtype=np.int64)
            first = self.session.run(None, {"input_ids": ids, "attention_mask": np.ones_like(ids)})[0]
            if first.size != 1:
                raise PackageError(f"--verifier {self.path / 'model.onnx'}: expected one score per sequence, "
                                   f"got an output of shape {list(first.shape)}")
            out[i] = float(first.reshape(-1)[0])
            self.tokens_run += ids.shape[1]
        return out


def reward_reads(root: Path, external: Sequence[Path], providers: Sequence[str]) -> Reads:
    """What :meth:`RewardModel.open` reads from ``root``: ``model.onnx``, its ``external`` data files,
    ``tokenizer.json``; the providers it hands onnxruntime."""
    return Reads("reward model", (root / "model.onnx", *sorted(external), root / "tokenizer.json"),
                 {"providers": list(providers)}, ("onnxruntime", "tokenizers"))


def _read(model: Path) -> tuple[bytes | str, int, set[Path]]:
    """(what the session opens, the weights the graph holds, its external data files): the file's bytes, parsed
    once; a model with external data opens from its path (its weights are not in the bytes: the parse is cheap)."""
    import onnx

    data = model.read_bytes()
    proto = onnx.ModelProto()
    try:
        proto.ParseFromString(data)
    except Exception as e:  # protobuf's DecodeError and others
        raise PackageError(f"--verifier {model}: not a readable ONNX model ({first_line(e)})") from None
    external = {model.parent / e.value for t in proto.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL
                for e in t.external_data if e.key == "location"}
    return (str(model) if external else data), parameter_count(proto.graph), external
