"""An outcome reward model (ORM) as an ONNX sequence classifier: ``--verifier PATH`` (issue 25).

Owns opening and running the classifier folder ``--verifier PATH`` names: ``model.onnx`` with
inputs ``input_ids`` and ``attention_mask`` (int64 ``[B, S]``) and a first output of the classifier's
logits (``[B]``, ``[B, 1]`` or ``[B, L]`` for L labels), the ``tokenizer.json`` beside it (Hugging Face
``tokenizers``; its post-processor adds what the model was trained with, as transformers' ``tokenizer(text)``
does) and, where present, its ``config.json``.

A score is a probability that the text is right (:class:`Head`), because the selectors sum and multiply
scores (weighted_maj@k, a PRM's ``prod``) as search-and-learn does with probabilities in [0, 1]: the
classifier's logits mapped as transformers' text-classification pipeline maps them (one label: sigmoid;
several: softmax, or sigmoid per label for ``problem_type: multi_label_classification``), then the
positive label's probability (a label named as one, else the second of two: ``LABEL_1``); a graph whose
output comes out of a Sigmoid or Softmax node, through any ops that only move or select values (``SHAPE_ONLY``:
``torch.sigmoid(logits).squeeze(-1)`` exports Sigmoid → Squeeze), is already a probability and is taken as it
is. The first text's output is checked against that reading: a probability outside [0, 1], or several labels'
"logits" that are already a probability vector (each in [0, 1], summing to 1), is a one-line error rather
than a score squashed twice. A regression head (``problem_type: regression``) has no probability and is a
one-line error.
Each text runs as its own unpadded row, so no padding convention of the exporter (which token a
classifier reads on a padded row) is assumed. Counts the tokens it runs (``tokens_run``) and the
weights it holds (``params``: package/graph.py's ``parameter_count`` on the proto the session is
opened from, so the file is read once) and what it reads (:func:`reward_reads`: the files its opener
names, the providers; the result store's scope of a ``--search`` run guided by it).
A folder that is not such a classifier is a one-line :class:`~ortevals.errors.PackageError`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ortevals.errors import PackageError, first_line
from ortevals.install import import_ort
from ortevals.package.graph import parameter_count
from ortevals.package.scope import Reads

INPUTS = ("input_ids", "attention_mask")
POSITIVE = frozenset({"positive", "pos", "correct", "right", "true", "yes", "good", "+", "label_1"})
MAPPINGS = ("sigmoid", "softmax", "as is")
# ops that move, select or re-type values without changing them: a Sigmoid's or Softmax's output through them
# is still a probability
SHAPE_ONLY = frozenset({"Squeeze", "Unsqueeze", "Reshape", "Flatten", "Identity", "Cast", "Gather",
                        "GatherElements", "GatherND", "Slice", "Transpose", "Expand", "Split"})


@dataclass(frozen=True)
class Head:
    """How a classifier's first output becomes the probability that a text is right."""

    mapping: str  # sigmoid | softmax | as is (the graph's output is a Sigmoid's or a Softmax's)
    label: int = 0  # which label's probability (several labels)
    labels: int | None = None  # how many labels the graph or config.json declares; None: unknown

    def describe(self) -> str:
        which = f" of label {self.label}" if (self.labels or 1) > 1 else ""
        return {"sigmoid": f"sigmoid of the classifier's logit{which}", "softmax": f"softmax probability{which}",
                "as is": f"the graph's own probability{which}"}[self.mapping]

    def probabilities(self, logits: np.ndarray, where: Path) -> float:
        """``logits`` (one sequence's first output) -> the positive label's probability."""
        from scipy.special import expit, softmax

        x = np.asarray(logits, dtype=np.float64).reshape(-1)
        if x.size != (self.labels or 1):
            raise PackageError(f"--verifier {where}: expected {self.labels or 1} logit(s) per sequence (the graph's "
                               f"output and config.json's id2label), got an output of {x.size}")
        if self.mapping == "as is":
            return float(x[self.label])
        return float((expit(x) if self.mapping == "sigmoid" else softmax(x))[self.label])

    def check(self, logits: np.ndarray, where: Path) -> None:
        """One sequence's first output against the mapping: a probability must lie in [0, 1]; logits of several
        labels that form a probability vector are the output of a softmax the graph walk did not see."""
        x = np.asarray(logits, dtype=np.float64).reshape(-1)
        if self.mapping == "as is" and not np.all((x >= 0) & (x <= 1)):
            raise PackageError(f"--verifier {where}: the first output comes from a Sigmoid or Softmax, so it should "
                               f"be a probability in [0, 1]; the first text gave {np.round(x, 4).tolist()}")
        if self.mapping != "as is" and x.size > 1 and np.all((x >= 0) & (x <= 1)) and abs(x.sum() - 1) < 1e-4:
            raise PackageError(f"--verifier {where}: the first output looks like probabilities already (the first "
                               f"text gave {np.round(x, 4).tolist()}, summing to 1), but no Sigmoid or Softmax "
                               "was found making it; expected the classifier's logits, or a graph ending in "
                               "Softmax (through shape-only ops)")


class RewardModel:
    """One ONNX sequence classifier and its tokenizer; :meth:`open` reads the folder, the constructor does no I/O."""

    def __init__(self, session, tokenizer, path: Path, params: int = 0, reads: Reads | None = None,
                 head: Head = Head("sigmoid")) -> None:
        self.session, self.tokenizer, self.path, self.params, self.head = session, tokenizer, path, params, head
        self.reads = reads or Reads("reward model")
        self.tokens_run = 0
        self.checked = False  # the first output checked against the head (Head.check)

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
        data, params, external, last_op, width = _read(model)
        ort = import_ort()
        try:
            session = ort.InferenceSession(data, providers=list(providers))
        except Exception as e:  # onnxruntime's Fail/InvalidGraph: one line
            raise PackageError(f"--verifier {model}: onnxruntime cannot open it ({str(e).splitlines()[0]})") from None
        names = [i.name for i in session.get_inputs()]
        if sorted(names) != sorted(INPUTS):
            raise PackageError(f"--verifier {model}: expected inputs {list(INPUTS)}, found {names}")
        head = classifier_head(root / "config.json", last_op, width)
        return cls(session, tokenizer, root, params, reward_reads(root, external, providers), head)

    def score(self, texts: Sequence[str]) -> np.ndarray:
        """``[N]`` float64: the probability that each text is right (:class:`Head`)."""
        out = np.empty(len(texts))
        for i, text in enumerate(texts):
            ids = np.asarray([self.tokenizer.encode(text).ids], dtype=np.int64)
            first = self.session.run(None, {"input_ids": ids, "attention_mask": np.ones_like(ids)})[0]
            if not self.checked:
                self.head.check(first, self.path / "model.onnx")
                self.checked = True
            out[i] = self.head.probabilities(first, self.path / "model.onnx")
            self.tokens_run += ids.shape[1]
        return out


def classifier_head(config: Path, last_op: str, width: int | None) -> Head:
    """The :class:`Head` of a classifier: ``config.json`` (``problem_type``, ``id2label``) where present, else the
    graph's first output (``width``: its last dimension when static; ``last_op``: the node that makes it)."""
    cfg = _config(config)
    labels = len(cfg["id2label"]) if isinstance(cfg.get("id2label"), dict) else width
    problem = cfg.get("problem_type")
    if problem == "regression":
        raise PackageError(f"--verifier {config}: problem_type is regression, whose score is not a probability; "
                           "expected a sequence classifier (one label: sigmoid; several: softmax), as weighted_maj@k "
                           "and a PRM's prod sum and multiply scores as probabilities")
    mapping = "as is" if last_op in ("Sigmoid", "Softmax") else \
        "sigmoid" if (labels or 1) == 1 or problem == "multi_label_classification" else "softmax"
    return Head(mapping, positive_label(cfg, labels, config), labels)


def positive_label(cfg: dict, labels: int | None, config: Path) -> int:
    """The label whose probability is the score: one label, the one; a label ``id2label`` names as right
    (``POSITIVE``); else the second of two (transformers' ``LABEL_1``); anything else is a one-line error."""
    if (labels or 1) == 1:
        return 0
    names = {int(k): str(v).strip().lower() for k, v in (cfg.get("id2label") or {}).items()}
    named = [i for i, n in sorted(names.items()) if n in POSITIVE]
    if len(named) == 1:
        return named[0]
    if labels == 2 and not named:
        return 1
    raise PackageError(f"--verifier {config}: {labels} labels ({names or 'no id2label'}) and not one of them named "
                       f"as the right answer's; expected one label, two, or a label named one of "
                       f"{', '.join(sorted(POSITIVE))}")


def _config(path: Path) -> dict:
    """``config.json`` of the classifier folder, ``{}`` where there is none; unreadable: a one-line error."""
    if not path.is_file():
        return {}
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise PackageError(f"--verifier {path}: not a readable JSON file ({first_line(e)})") from None
    if not isinstance(cfg, dict):
        raise PackageError(f"--verifier {path}: expected a JSON object, got {type(cfg).__name__}")
    return cfg


def reward_reads(root: Path, external: Sequence[Path], providers: Sequence[str]) -> Reads:
    """What :meth:`RewardModel.open` reads from ``root``: ``model.onnx``, its ``external`` data files,
    ``tokenizer.json``, ``config.json`` (absent or not: it decides the mapping to a probability); the providers
    it hands onnxruntime; scipy maps the logits."""
    return Reads("reward model", (root / "model.onnx", *sorted(external), root / "tokenizer.json",
                                  root / "config.json"), {"providers": list(providers)},
                 ("onnxruntime", "tokenizers", "scipy"))


def _making_op(graph, name: str) -> str:
    """The op that computes the values of ``name``: its producer, walked back through ``SHAPE_ONLY`` ops (their
    first input carries the values); "" for a graph input or initializer."""
    producer = {out: node for node in graph.node for out in node.output}
    seen = set()
    while name in producer and name not in seen:
        seen.add(name)
        node = producer[name]
        if node.op_type not in SHAPE_ONLY or not node.input:
            return node.op_type
        name = node.input[0]
    return ""


def _read(model: Path) -> tuple[bytes | str, int, set[Path], str, int | None]:
    """(what the session opens, the weights the graph holds, its external data files, the op that makes the first
    output, that output's last dimension when static): the file's bytes, parsed once; a model with external data
    opens from its path (its weights are not in the bytes: the parse is cheap)."""
    import onnx

    data = model.read_bytes()
    proto = onnx.ModelProto()
    try:
        proto.ParseFromString(data)
    except Exception as e:  # protobuf's DecodeError and others
        raise PackageError(f"--verifier {model}: not a readable ONNX model ({first_line(e)})") from None
    external = {model.parent / e.value for t in proto.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL
                for e in t.external_data if e.key == "location"}
    first = proto.graph.output[0] if proto.graph.output else None
    last_op = _making_op(proto.graph, first.name) if first is not None else ""
    dims = first.type.tensor_type.shape.dim if first is not None else ()
    width = dims[-1].dim_value if len(dims) >= 2 and dims[-1].HasField("dim_value") else None
    return (str(model) if external else data), parameter_count(proto.graph), external, last_op, width
