"""``ortevals diagnose --verify``: build the recommended package with the builder and measure it.

Owns building the recommendation with the onnxruntime-genai model builder from the checkpoint
(the command :mod:`ortevals.diagnose.recommend` prints, into ``<output>/recommended``), its real
size on disk, the check that the build reproduces the candidate outside the excluded nodes (every
initializer both graphs name holds the same bytes; if not, the candidate was built otherwise and
the prediction is for another package), and its measurements beside the prediction: token KL
against the same saved reference, and choice-KL and flips on the same questions.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ortevals.diagnose.int8 import split
from ortevals.diagnose.measure import ChoiceKL, TokenKL, choice_kl, choice_run, token_kl
from ortevals.diagnose.recommend import BuildSettings, builder_command, extra_options, target_options
from ortevals.package.graph import tensor_array
from ortevals.package.loader import ModelPackage


@dataclass(frozen=True)
class Verified:
    package: Path
    command: tuple[str, ...]
    size: int  # bytes of the built package's model files
    token: TokenKL
    recovered: float
    recovered_se: float
    same_weights: str  # one line: the build against the candidate outside the excluded nodes
    choice: ChoiceKL | None = None


def package_size(package: ModelPackage) -> int:
    """Bytes of the config, the decoder (and embedding) graphs and their data."""
    return sum(f.stat().st_size for f in package.model_files())


def build(settings: BuildSettings, nodes: tuple[str, ...], checkpoint: Path, out: Path, cache: Path) -> tuple[str, ...]:
    """Run the builder (the printed command, plus its cache folder); returns the command."""
    from ortevals.package.examples import build_genai_package

    build_genai_package(Path(checkpoint), out, settings.precision, cache / "builder-cache",
                        extra=extra_options(settings, nodes) or None, ep=settings.ep,
                        more=target_options(settings, nodes))
    return tuple(builder_command(settings, nodes, str(checkpoint), str(out)))


def same_weights(cand: ModelPackage, built: ModelPackage, changed: tuple[str, ...] = ()) -> str:
    """Whether every initializer both decoders name holds the same bytes (read one tensor at a time), those of the
    ``changed`` nodes (base names: the groups put at int8, whose weights keep their int4 names) left out."""
    import numpy as np
    import onnx

    from ortevals.runtime.roles import base_name

    graphs = [onnx.load(str(p.decoder.path), load_external_data=False).graph for p in (cand, built)]
    a, b = ({t.name: t for t in g.initializer} for g in graphs)
    moved = {i for g in graphs for n in g.node if base_name(n) in changed for i in n.input}
    shared = sorted((set(a) & set(b)) - moved)
    differ = [n for n in shared if not np.array_equal(tensor_array(a[n], cand.decoder.path.parent),
                                                      tensor_array(b[n], built.decoder.path.parent))]
    if not differ:
        return f"the build holds the candidate's {len(shared)} other weights bit for bit"
    return (f"{len(differ)} of the {len(shared)} weights both builds name differ from the candidate's (first: "
            f"{differ[0]}): the candidate was not built with these builder settings, so the prediction was made "
            "for another package; the measurement below is the one that counts")


def verify(bench, settings: BuildSettings, nodes: tuple[str, ...], checkpoint: Path, out: Path) -> Verified:
    """Build, check and measure the token KL of the recommendation (``bench``: the sensitivity stage's)."""
    command = build(settings, nodes, checkpoint, out, bench.cache)
    built = ModelPackage.load(out)
    tk = token_kl(out, bench.reference_file, bench.ep)
    rec, se = tk.recovered(bench.baseline)
    return Verified(out, command, package_size(built), tk, rec, se, same_weights(bench.cand, built, split(nodes)[1]))


def with_choice(v: Verified, ref_run, questions: int, data: str | None, ep: str | None) -> Verified:
    from dataclasses import replace

    return replace(v, choice=choice_kl(ref_run, choice_run(v.package, questions, data, ep, "verified")))
