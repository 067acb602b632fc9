"""The reference side of ``ortevals fidelity``: the saved file and the PyTorch model.

Owns the tokenizer hash, the reference file (numpy ``.npz``, read with
``allow_pickle=False``) and the PyTorch checkpoint as a logit source. torch
and transformers are imported inside :meth:`TorchSource.open` only (the
``torch`` extra); nothing else in ortevals imports them.

Reference file, one entry per name (N scored tokens, top-k of k):

==================  ===========  ==============================================
``format``          str          ``ortevals-fidelity-reference/1``
``reference``       str          what the reference was (path and kind)
``tokenizer_sha256`` str         :func:`tokenizer_hash` of the reference's tokenizer
``text_ids``        int32 [T]    the text's token ids the windows cover (no BOS)
``n_ctx``, ``bos_id``, ``n_windows``, ``n_scored``, ``vocab_size``   int64 scalars
``every``           int64        1: every position of a window scored (``--by-position``); absent: 0
``topk_ids``        int32 [N,k]  the reference's k most likely tokens, most likely first
``topk_logp``       float32 [N,k] their log-probs
``tail_logp``       float32 [N]  log of 1 − top-k mass (−inf when k = V)
``actual_logp``     float32 [N]  log-prob of the real next token
==================  ===========  ==============================================

Log-probs are float32, not float16: float16's spacing at a log-prob of −8 is
2⁻⁷ ≈ 0.008 nats, far above the 1e-6-nat KL that separates a faithful fp32
export from a broken one; float32's (≈ 5e-7 at −8, weighted by p ≈ 3e-4) keeps
the stored KL error near 1e-8. Per token that is 8k + 12 bytes (1,036 at
k = 128) before compression, against llama.cpp's 2·n_vocab (98,304 for a
49,152-token vocabulary).
"""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ortevals.errors import OrtEvalsError
from ortevals.fidelity.stats import RefTokens
from ortevals.fidelity.windows import WindowPlan
from ortevals.package.tokenizer import tokenizer_digest

log = logging.getLogger(__name__)
FORMAT = "ortevals-fidelity-reference/1"
ARRAYS = RefTokens.FIELDS
SCALARS = ("n_ctx", "bos_id", "n_windows", "n_scored", "vocab_size")


def tokenizer_hash(folder: Path) -> str:
    """sha256 of the folder's ``tokenizer.json``, re-serialized with sorted keys (formatting does not count).

    ``tokenizer.json`` holds the vocabulary, merges, normalizer and the
    post-processor that adds BOS. ``tokenizer_config.json`` is left out on
    purpose: the GenAI builder rewrites it (``model_max_length``, ``is_local``)
    without changing a single token id.
    """
    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        raise OrtEvalsError(f"{path}: not found; fidelity needs the tokenizer.json of both models")
    return tokenizer_digest(path)


@dataclass(frozen=True)
class SavedReference:
    """A reference file in memory: its plan, text ids ``[T]`` and per-token :class:`RefTokens` ``[N]``."""

    path: Path
    description: str
    tokenizer_sha256: str
    plan: WindowPlan
    vocab_size: int
    text_ids: np.ndarray
    tokens: RefTokens

    def first(self, n: int) -> SavedReference:
        """The first ``n`` scored tokens (what a direct run with ``--tokens n`` scores)."""
        p = self.plan
        plan = WindowPlan(p.n_ctx, p.bos_id, -(-n // p.scored_per_window), n, p.every)
        tokens = RefTokens(*(getattr(self.tokens, f)[:n] for f in ARRAYS))
        return SavedReference(self.path, self.description, self.tokenizer_sha256, plan, self.vocab_size,
                              self.text_ids[:plan.n_windows * plan.text_per_window], tokens)

    def windows(self) -> Iterator[RefTokens]:
        """The stored statistics cut back into windows, in order."""
        start = 0
        for w in range(self.plan.n_windows):
            n = self.plan.scored_in(w)
            yield RefTokens(*(getattr(self.tokens, f)[start:start + n] for f in ARRAYS))
            start += n


def save_reference(path: Path, ref: SavedReference) -> int:
    """Write ``ref`` to ``path`` (atomically); returns the file's size in bytes."""
    from ortevals.files import atomic_write_bytes

    t = ref.tokens
    arrays = {"format": np.array(FORMAT), "reference": np.array(ref.description),
              "tokenizer_sha256": np.array(ref.tokenizer_sha256),
              "text_ids": np.asarray(ref.text_ids, np.int32),
              "topk_ids": np.asarray(t.topk_ids, np.int32), "topk_logp": np.asarray(t.topk_logp, np.float32),
              "tail_logp": np.asarray(t.tail_logp, np.float32), "actual_logp": np.asarray(t.actual_logp, np.float32)}
    p = ref.plan
    for name, value in zip(SCALARS, (p.n_ctx, p.bos_id, p.n_windows, p.n_scored, ref.vocab_size)):
        arrays[name] = np.array(value, np.int64)
    arrays["every"] = np.array(int(p.every), np.int64)
    buf = io.BytesIO()
    np.savez_compressed(buf, **arrays)
    atomic_write_bytes(Path(path), buf.getvalue())
    return buf.tell()


def load_reference(path: Path) -> SavedReference:
    """Read and check a reference file; every problem is one line naming the file."""
    path = Path(path)
    try:
        with np.load(path, allow_pickle=False) as z:
            data = {name: z[name] for name in z.files}
    except (OSError, ValueError) as e:
        raise OrtEvalsError(f"{path}: not an ortevals fidelity reference file ({e})") from None
    if str(data.get("format", "")) != FORMAT:
        raise OrtEvalsError(f"{path}: format {str(data.get('format', 'missing'))!r}; expected {FORMAT!r}")
    missing = [n for n in ("reference", "tokenizer_sha256", "text_ids", *ARRAYS, *SCALARS) if n not in data]
    if missing:
        raise OrtEvalsError(f"{path}: missing {', '.join(missing)}")
    n_ctx, bos, n_windows, n_scored, vocab = (int(data[n]) for n in SCALARS)
    plan = WindowPlan(n_ctx, bos, n_windows, n_scored, bool(int(data.get("every", 0))))
    tokens = RefTokens(*(data[n] for n in ARRAYS))
    shapes_ok = (tokens.topk_ids.shape == tokens.topk_logp.shape and tokens.topk_ids.ndim == 2
                 and all(len(getattr(tokens, n)) == n_scored for n in ARRAYS)
                 and n_scored == sum(plan.scored_in(w) for w in range(n_windows))
                 and len(data["text_ids"]) >= n_windows * plan.text_per_window)
    if not shapes_ok:
        raise OrtEvalsError(f"{path}: array shapes do not match n_scored={n_scored}, n_windows={n_windows}, "
                            f"n_ctx={n_ctx}; the file is damaged")
    return SavedReference(path, str(data["reference"]), str(data["tokenizer_sha256"]), plan, vocab,
                          data["text_ids"].astype(np.int64), tokens)


class TorchSource:
    """A transformers checkpoint folder (``config.json`` + weights) as a logit source, float32 on CPU."""

    def __init__(self, model, torch, folder: Path) -> None:
        self.model, self.torch, self.folder = model, torch, folder

    @classmethod
    def open(cls, folder: Path) -> TorchSource:
        try:
            import torch
            from transformers import AutoModelForCausalLM
        except ImportError:
            raise OrtEvalsError(f"{folder}: a PyTorch reference needs torch and transformers: "
                                "pip install 'ortevals[torch]'") from None
        try:
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        except Exception as e:  # transformers raises many kinds; name the folder
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise OrtEvalsError(f"{folder}: transformers could not load the checkpoint: {msg}") from None
        log.info("opened the PyTorch reference %s (%s)", folder, type(model).__name__)
        return cls(model, torch, Path(folder))

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.get_text_config().vocab_size)

    @property
    def max_positions(self) -> int | None:
        value = getattr(self.model.config.get_text_config(), "max_position_embeddings", None)
        return int(value) if value else None

    def __call__(self, ids: np.ndarray) -> np.ndarray:
        torch = self.torch
        with torch.inference_mode():
            out = self.model(torch.from_numpy(np.asarray(ids, np.int64))[None]).logits[0]
        return out.float().numpy()
